"""Compute-path rows: bertjax against itself, the default path as the reference.

The default path is `harness.small_config` with 4 heads (attention_impl "auto", which on CPU
with dropout 0 is jax.nn.dot_product_attention's XLA implementation; remat "none"; unrolled
layers; one device; no gradient accumulation). Every other path trains the same weights on the
same pre-training batches (MLM + NSP, bertjax's synthetic input with a varying number of real
predictions per row) with the same optimizer, and its per-step losses and final parameters are
compared with the default's:

- attention_impl "einsum"; remat_policy "full" and "dots"; scan_layers (params stacked on a
  leading layers axis: the initial weights are stacked, the final ones unstacked to compare);
- gradient accumulation: grad_accum_steps=k on the same global batch, with micro-batches of
  equal and of different numbers of real predictions (the step normalises every micro-batch
  by the global batch's denominators, so both equal one big batch);
- the data / fsdp / tensor meshes over 4 devices. A CPU process has one device unless
  XLA_FLAGS carries --xla_force_host_platform_device_count before jax starts, so with fewer
  than 4 devices these runs go to a subprocess that sets it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bertjax.parity import optimizers as opt_rows

MESH_DEVICES = 4
MESHES = {"data": {"data": 4}, "fsdp": {"fsdp": 4}, "tensor": {"tensor": 4},
          "data+fsdp+tensor": {"data": 2, "fsdp": 1, "tensor": 2}}
# experiments/common.py's LOGICAL_AXIS_RULES (the library does not import experiments/).
LOGICAL_AXIS_RULES = (
    ("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"),
    ("heads", "tensor"), ("kv", None), ("length", None), ("layers", None), ("classes", None),
    ("embed_out", None),
)
ACCUM_STEPS = 4
# harness.small_config with 4 heads, so that the heads split over tensor = 4.
MODEL = {"num_heads": 4}
KEYS = ("loss", "mlm_loss", "nsp_loss", "grad_norm")
DEFAULT = "bertjax default path (attention auto, remat none, unrolled, 1 device, no accum.)"


def optimizer(steps: int):
    """The pre-training recipe's optimizer (bert_adamw, reference schedule, clip 1.0)."""
    from bertjax.parity import harness

    return harness.optimizer_config(name="bert_adamw", schedule="reference",
                                    learning_rate=1e-3, warmup_steps=max(1, steps // 10))


def batches(steps: int, equal_predictions: bool = False) -> list[dict[str, np.ndarray]]:
    """[batch 8, seq 64] MLM + NSP batches; equal_predictions: every row has all its
    predictions real (weight 1), else 5..10 real ones per row."""
    out = opt_rows.pretraining_batches(steps)
    if equal_predictions:
        out = [dict(b, masked_lm_weights=np.ones_like(b["masked_lm_weights"]))
               for b in out]
    return out


def initial_params(boxed: bool = False):
    """The default model's initial params (unrolled layout), boxed or unboxed."""
    import flax.linen as nn
    import jax

    from bertjax.models import BertForPreTraining
    from bertjax.parity import harness
    from bertjax.tasks import pretraining

    params = pretraining.init_params(
        BertForPreTraining(harness.small_config(opt_rows.VOCAB, **MODEL)), jax.random.key(0))
    return params if boxed else jax.device_get(nn.unbox(params))


def train(steps: int, *, model: Mapping[str, Any] | None = None, grad_accum_steps: int = 1,
          mesh_sizes: Mapping[str, int] | None = None, equal_predictions: bool = False
          ) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """bertjax's real train step on `steps` batches along one path.

    model: BertConfig overrides; mesh_sizes: {data, fsdp, tensor} over the first
    prod(sizes) devices, params sharded by their logical axes. Returns (history, final params
    by transformers name, as harness.param_rel_diff names them).
    """
    import jax

    from bertjax.convert.huggingface import export_hf_tensors
    from bertjax.models import BertForPreTraining, layout
    from bertjax.parity import harness
    from bertjax.tasks import pretraining
    from bertjax.train import sharding as sharding_lib

    config = harness.small_config(opt_rows.VOCAB, **dict(MODEL, **dict(model or {})))
    mesh = rules = None
    if mesh_sizes:
        n = int(np.prod(list(mesh_sizes.values())))
        mesh = sharding_lib.make_mesh(mesh_sizes, jax.devices()[:n])
        rules = LOGICAL_AXIS_RULES
        params = initial_params(boxed=True)
    else:
        params = layout.to_layout(initial_params(), config.scan_layers)
    _, loss_fn = pretraining.step_fns(BertForPreTraining(config))
    history, final = harness.train_bertjax(
        params, loss_fn, optimizer(steps), batches(steps, equal_predictions), steps,
        grad_accum_steps=grad_accum_steps,
        denominators=functools.partial(pretraining.loss_denominators, packed=False),
        mesh=mesh, rules=rules)
    unrolled = dataclasses.replace(config, scan_layers=False)
    return ({k: history[k] for k in KEYS},
            export_hf_tensors(unrolled, layout.unstack_layers(final), "BertForPreTraining",
                              "float32"))


@functools.lru_cache(maxsize=4)
def reference(steps: int, equal_predictions: bool = False):
    """The default path's (history, final params), computed once per process."""
    return train(steps, equal_predictions=equal_predictions)


def param_rel_diff(ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray]
                   ) -> dict[str, float]:
    """{tensor: max|ours - theirs| / max|theirs|} (harness.Row.max_param_diff leaves out the
    gradient-free key biases)."""
    return {name: float(np.max(np.abs(np.asarray(ours[name], np.float64) - b))
                        / max(float(np.max(np.abs(b))), 1e-30))
            for name, b in ((n, np.asarray(t, np.float64)) for n, t in theirs.items())}


def make_row(job: str, steps: int, ours, *, equal_predictions: bool = False, note: str = ""):
    from bertjax.parity import harness

    theirs = reference(steps, equal_predictions)
    return harness.Row(job=job, reference=DEFAULT, ours=dict(ours[0]), theirs=dict(theirs[0]),
                       param_rel_diff=param_rel_diff(ours[1], theirs[1]), note=note)


# ---------------------------------------------------------------------------------------------
# Jobs


def attention_rows(steps: int, workdir: pathlib.Path) -> list:
    return [make_row("path: attention_impl einsum", steps,
                     train(steps, model={"attention_impl": "einsum"}))]


def remat_rows(steps: int, workdir: pathlib.Path) -> list:
    return [make_row(f"path: remat_policy {policy}", steps,
                     train(steps, model={"remat_policy": policy}))
            for policy in ("full", "dots")]


def scan_rows(steps: int, workdir: pathlib.Path) -> list:
    return [make_row("path: scan_layers (params unstacked to compare)", steps,
                     train(steps, model={"scan_layers": True}))]


def accumulation_rows(steps: int, workdir: pathlib.Path) -> list:
    k = ACCUM_STEPS
    return [
        make_row(f"path: grad_accum_steps={k}, equal predictions per micro-batch", steps,
                 train(steps, grad_accum_steps=k, equal_predictions=True),
                 equal_predictions=True),
        make_row(f"path: grad_accum_steps={k}, 5..10 predictions per row", steps,
                 train(steps, grad_accum_steps=k),
                 note=("micro-batches of different weight: the step sums their shares of the "
                       "global batch's normalisers (the job's denominators)")),
    ]


def mesh_rows(steps: int, workdir: pathlib.Path) -> list:
    results = mesh_histories(steps, workdir)
    return [make_row(f"path: mesh {name} ({_mesh_text(MESHES[name])}, {MESH_DEVICES} CPU "
                     "devices)", steps, results[name]) for name in MESHES]


def _mesh_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{axis} {n}" for axis, n in sizes.items())


JOBS: dict[str, Callable[[int, pathlib.Path], list]] = {
    "paths_attention": attention_rows,
    "paths_remat": remat_rows,
    "paths_scan": scan_rows,
    "paths_accumulation": accumulation_rows,
    "paths_mesh": mesh_rows,
}


# ---------------------------------------------------------------------------------------------
# Meshes: in-process with >= 4 devices, else in a subprocess that forces 4 CPU devices


def mesh_histories(steps: int, workdir: pathlib.Path | None = None,
                   names: Sequence[str] = tuple(MESHES)) -> dict[str, tuple]:
    """{mesh name: (history, flat final params)} for the meshes `names`."""
    import jax

    if jax.device_count() >= MESH_DEVICES:
        return {name: train(steps, mesh_sizes=MESHES[name]) for name in names}
    scratch = pathlib.Path(workdir) if workdir else pathlib.Path(tempfile.mkdtemp())
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / "mesh_histories.npz"
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"{flags} --xla_force_host_platform_device_count={MESH_DEVICES}").strip())
    code = ("from bertjax.parity import paths; "
            f"paths.mesh_worker({steps}, {str(out)!r}, {list(names)!r})")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=os.getcwd())
    if done.returncode != 0:
        raise RuntimeError(f"the {MESH_DEVICES}-device mesh subprocess failed:\n"
                           f"{done.stderr[-3000:]}")
    return load_histories(out)


def mesh_worker(steps: int, out: str, names: Sequence[str]) -> None:
    """In the subprocess: train every mesh in `names`, save to `out` (npz)."""
    save_histories(out, {name: train(steps, mesh_sizes=MESHES[name]) for name in names})


def save_histories(path: str, results: Mapping[str, tuple]) -> None:
    arrays = {"index": np.asarray(json.dumps(
        {name: {"history": history} for name, (history, _) in results.items()}))}
    for i, (_, params) in enumerate(results.values()):
        for tensor, value in params.items():
            arrays[f"{i}|{tensor}"] = value
    np.savez(path, **arrays)


def load_histories(path) -> dict[str, tuple]:
    with np.load(path) as data:
        index = json.loads(str(data["index"]))
        results = {}
        for i, name in enumerate(index):
            params = {key.split("|", 1)[1]: data[key] for key in data.files
                      if key.startswith(f"{i}|")}
            results[name] = (index[name]["history"], params)
    return results
