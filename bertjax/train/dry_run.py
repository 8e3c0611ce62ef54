"""`--dry_run`: parameter table, FLOPs and per-device memory of the compiled train step.

Everything is computed on abstract shapes (`jax.eval_shape`, ahead-of-time `lower().compile()`),
so nothing model-sized is allocated, and an out-of-memory configuration is caught up front.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import numpy as np

from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib


def parameter_table(params: Any) -> list[tuple[str, int]]:
    """[(module path, count)] for bert/embeddings, bert/encoder, bert/pooler and each head."""
    counts: dict[str, int] = {}
    for path, leaf in flax.traverse_util.flatten_dict(params).items():
        key = "/".join(path[:2]) if path[0] == "bert" else path[0]
        counts[key] = counts.get(key, 0) + int(np.prod(leaf.shape))
    return sorted(counts.items(), key=lambda kv: (not kv[0].startswith("bert"), kv[0]))


def run(job, config, print_fn=print) -> dict[str, Any]:
    """Reports (and returns) parameter counts, FLOPs and compiled memory for each stage of
    `job` (a pre-training phase, a fine-tuning run: see bertjax/train/loop.py)."""
    tx, schedule = job.optimizer()
    mesh = sharding_lib.make_mesh(config.mesh)
    abstract_state, state_sharding = step_lib.state_shardings(
        job.init_params, tx, mesh, config.logical_axis_rules
    )

    table = parameter_table(abstract_state.params)
    total = sum(n for _, n in table)
    bert_total = sum(n for name, n in table if name.startswith("bert/"))
    print_fn(f"Parameters of {type(job.model).__name__} ({config.get('preset', 'custom')}):")
    for name, n in table:
        print_fn(f"  {name:<20} {n:>14,}")
    print_fn(f"  {'bert (BertModel)':<20} {bert_total:>14,}")
    print_fn(f"  {'total':<20} {total:>14,}")

    batch_size = job.batch_size
    devices = mesh.devices.size
    print_fn(
        f"Mesh {dict(mesh.shape)} on {devices} x {jax.devices()[0].device_kind}; "
        f"global batch {batch_size}; compute dtype {job.model_config.dtype}"
    )
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    train_step = step_lib.jit_train_step(job.loss, tx, schedule, state_sharding, batch_sharding,
                                         job.grad_accum_steps)
    stages = {}
    header = (
        f"  {'stage':<8} {'seq':>5} {'preds':>5} {'GFLOP/seq':>10} {'XLA GFLOP/seq':>14} "
        f"{'args GiB':>9} {'temp GiB':>9} {'total GiB/device':>17}"
    )
    print_fn("Train step per stage (FLOPs: forward + backward; memory: per device):")
    print_fn(header)
    for stage in job.stages:
        # Masked-LM predictions per sequence (0 for fine-tuning heads).
        positions = stage.batch_spec.get("masked_lm_positions")
        preds = positions.shape[1] if positions is not None else 0
        compiled = train_step.lower(abstract_state, stage.batch_spec).compile()
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        # XLA counts a scanned loop body once, so its figure is only meaningful unrolled.
        xla_flops = None
        if cost and not job.model_config.scan_layers:
            xla_flops = float(cost.get("flops", 0.0)) * devices / batch_size
        flops = stage.flops_per_example
        args = memory.argument_size_in_bytes
        temp = memory.temp_size_in_bytes
        total_bytes = args + memory.output_size_in_bytes - memory.alias_size_in_bytes + temp
        gib = 1024.0**3
        stages[stage.name] = dict(
            seq_len=stage.tokens_per_example,
            max_predictions=preds,
            flops_per_sequence=flops,
            xla_flops_per_sequence=xla_flops,
            argument_bytes=args,
            temp_bytes=temp,
            total_bytes=total_bytes,
        )
        print_fn(
            f"  {stage.name:<8} {stage.tokens_per_example:>5} {preds:>5} {flops / 1e9:>10.2f} "
            f"{'n/a' if xla_flops is None else f'{xla_flops / 1e9:.2f}':>14} "
            f"{args / gib:>9.3f} {temp / gib:>9.3f} "
            f"{total_bytes / gib:>17.3f}"
        )
    return {"parameters": dict(table), "total": total, "bert_total": bert_total,
            "phases": stages}
