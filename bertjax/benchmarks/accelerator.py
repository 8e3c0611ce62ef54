r"""One table on whatever accelerator JAX finds (CPU, GPU or TPU): bertjax's train and predict
steps beside transformers' (PyTorch) on the same device, shapes and synthetic batches.

  python -m bertjax.benchmarks.accelerator [--quick] [--models=base,large] [--steps=10] \
      [--output=DIR]

Rows, for each model: pre-training steps at the paper's two phase shapes (128 tokens with 20
masked predictions, 512 with 80), a fine-tuning step of a sequence classifier at 128 tokens,
and a prediction batch (forward only) at 128 tokens. Both sides compute in bf16 with float32
parameters (transformers: `torch.autocast`, its SDPA attention), with the paper's dropout 0.1
and AdamW clipped at 1.0 (bertjax: its pre-training and fine-tuning optimizers). Per row:
step ms, sequences/s, MFU (model FLOPs of bertjax/train/flops.py over the step time, against
the device's bf16 peak, flops.PEAK_BF16_TFLOPS), device memory, and the attention path
bertjax ran (models/attention.py: `attention_path`); for transformers its sequences/s, then
bertjax's ratio to it. The batch is the row's own, halved until bertjax's step fits; the
transformers step runs at the same batch (halved again if it alone runs out of memory).

No TensorFlow is needed: the batches are random token ids. Without torch and transformers
the bertjax columns are printed alone. On a CPU the models are the small presets (a check
that everything runs, not a measurement of interest); --quick runs one model with fewer steps
(about a minute); on a GPU the full run adds rows with the attention paths `auto` does not take
there yet (GPU_CANDIDATES). --output writes the table as accelerator.md and accelerator.json
there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np
from absl import flags

from bertjax import cli
from bertjax.models import BertConfig, BertForPreTraining, architecture
from bertjax.models.classification import BertForSequenceClassification
from bertjax.models.kernels.attention import attention_path
from bertjax.tasks import classification_loss, pretraining
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from bertjax.train.flops import peak_flops_per_device
from bertjax.train.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    kind: str  # pretrain | finetune | predict
    seq_len: int
    predictions: int = 0  # masked-LM predictions per sequence (pre-training rows)


ROWS = (Row("pre-train 128/20", "pretrain", 128, 20), Row("pre-train 512/80", "pretrain", 512, 80),
        Row("fine-tune 128", "finetune", 128), Row("predict 128", "predict", 128))
# Sequences per step on one accelerator (halved until they fit), and on a CPU.
BATCHES = {"base": (256, 64, 64, 512), "large": (128, 32, 32, 256)}
CPU_BATCHES = (16, 4, 16, 32)
DROPOUT = 0.1
LABELS = 2
# On a GPU, rows again with attention paths `auto` does not take there yet, so that a measured
# run shows whether it should: cuDNN's fused attention (no dropout: prediction) and this
# project's Pallas kernels with the dropout inside (models/dropout_attention_gpu.py).
GPU_CANDIDATES = ((3, "cudnn"), (0, "flash"), (1, "flash"))


def batch_of(row: Row, cfg: BertConfig, batch_size: int) -> dict[str, np.ndarray]:
    """Random token ids [batch, seq], full rows (no padding); pre-training rows also have sorted
    masked positions and NSP labels, fine-tuning rows class labels."""
    r = np.random.default_rng(0)
    ids = r.integers(5, cfg.vocab_size, (batch_size, row.seq_len)).astype(np.int32)
    batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": np.ones_like(ids)}
    if row.kind == "pretrain":
        positions = np.sort(np.stack([r.choice(np.arange(1, row.seq_len), row.predictions,
                                               replace=False) for _ in range(batch_size)]), 1)
        batch.update(masked_lm_positions=positions.astype(np.int32),
                     masked_lm_ids=np.take_along_axis(ids, positions, 1),
                     masked_lm_weights=np.ones(positions.shape, np.float32),
                     next_sentence_labels=r.integers(0, 2, batch_size).astype(np.int32))
    else:
        batch["labels"] = r.integers(0, LABELS, batch_size).astype(np.int32)
    return batch


def model_flops(row: Row, cfg: BertConfig) -> float:
    """Model FLOPs per sequence: 3 × forward for a train step (bertjax/train/flops.py)."""
    if row.kind == "pretrain":
        return 3.0 * architecture(cfg).forward_flops(cfg, row.seq_len, row.predictions)
    forward = architecture(cfg).forward_flops(cfg, row.seq_len, 0, pooled_only=True)
    return forward * (3.0 if row.kind == "finetune" else 1.0)


def bertjax_step(row: Row, cfg: BertConfig, batch: dict) -> tuple[Callable[[], None], float]:
    """(a call running one step on the batch, the compiled step's device bytes): one device,
    the train step of bertjax/train/step.py (state donated) or the jitted forward pass."""
    mesh = sharding_lib.make_mesh({"data": 1}, jax.devices()[:1])
    rules = cli.load_config("experiments/pretrain.py:tiny").logical_axis_rules
    if row.kind == "pretrain":
        model = BertForPreTraining(cfg)
        init, loss = pretraining.step_fns(model)
        optimizer = cli.load_config("experiments/pretrain.py:base").optimizer
    else:
        model = BertForSequenceClassification(cfg, LABELS)
        init, loss = classifier_fns(model)
        optimizer = cli.load_config("experiments/glue.py:sst2").optimizer
    if row.kind == "predict":
        params = jax.jit(lambda key: nn.unbox(init(key)))(jax.random.key(0))
        forward = jax.jit(lambda p, b: model.apply({"params": p}, b["input_ids"],
                                                   b["segment_ids"], b["input_mask"]))
        compiled = forward.lower(params, batch).compile()
        return (lambda: jax.block_until_ready(compiled(params, batch))), device_bytes(compiled)
    with optimizer.unlocked():
        optimizer.warmup_steps = 10
    tx, schedule = make_optimizer(optimizer, 10_000)
    _, state_sharding = step_lib.state_shardings(init, tx, mesh, rules)
    state = step_lib.create_train_state(init, tx, jax.random.key(0), state_sharding)
    step = step_lib.jit_train_step(loss, tx, schedule, state_sharding,
                                   sharding_lib.batch_sharding(mesh, rules), rules=rules)
    compiled = step.lower(state, batch).compile()
    holder = [state]

    def run():
        holder[0], metrics = compiled(holder[0], batch)
        jax.block_until_ready(metrics)

    return run, device_bytes(compiled)


def classifier_fns(model: BertForSequenceClassification):
    """(init_params(rng), loss_fn(params, batch, rng, denominators=None)) of a classifier, as
    pretraining.step_fns gives them for pre-training."""
    def init(rng):
        ids = jax.numpy.zeros((1, 8), jax.numpy.int32)
        return model.init(rng, ids, ids, ids)["params"]

    def loss(params, batch, rng, denominators=None):
        kwargs = {} if rng is None else {"deterministic": False, "rngs": {"dropout": rng}}
        logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                             batch["input_mask"], **kwargs)
        return classification_loss(logits, batch["labels"])

    return init, loss


def device_bytes(compiled) -> float:
    """Arguments, outputs not aliased to them and temporaries of a compiled step."""
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes)


def torch_step(row: Row, cfg: BertConfig, batch: dict) -> Callable[[], None] | None:
    """One step of transformers' BertForPreTraining / BertForSequenceClassification (SDPA
    attention, bf16 autocast, float32 params, AdamW clipped at 1.0) on the device JAX uses
    where torch has it (CUDA), else the CPU; None without torch and transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    hf_config = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, hidden_act="gelu",
        hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT,
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size, num_labels=LABELS, attn_implementation="sdpa")
    torch.manual_seed(0)
    cls = (transformers.BertForPreTraining if row.kind == "pretrain"
           else transformers.BertForSequenceClassification)
    model = cls(hf_config).to(device)
    tensor = {k: torch.as_tensor(v, dtype=torch.long, device=device) for k, v in batch.items()}
    inputs = dict(input_ids=tensor["input_ids"], token_type_ids=tensor["segment_ids"],
                  attention_mask=tensor["input_mask"])
    if row.kind == "pretrain":
        labels = np.full(batch["input_ids"].shape, -100, np.int64)
        np.put_along_axis(labels, batch["masked_lm_positions"], batch["masked_lm_ids"], 1)
        inputs.update(labels=torch.as_tensor(labels, device=device),
                      next_sentence_label=tensor["next_sentence_labels"])
    elif row.kind == "finetune":
        inputs["labels"] = tensor["labels"]
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if row.kind == "predict":
        model.eval()

        def predict():
            with torch.no_grad(), autocast:
                model(**inputs).logits.float().cpu()
            sync()

        return predict
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused=device == "cuda")

    def train():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sync()

    return train


def out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def seconds_per_step(run: Callable[[], None], steps: int) -> float:
    """Median seconds of `steps` calls, after two warm-up calls."""
    run()
    run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_row(row: Row, preset: str, batch_size: int, steps: int,
                attention_impl: str = "auto") -> dict:
    """One row: bertjax at the largest of batch_size, /2, /4, ... that fits, transformers at the
    same (or, out of memory alone, a smaller) batch."""
    cfg = BertConfig.from_preset(preset, dtype="bfloat16", hidden_dropout_prob=DROPOUT,
                                 attention_dropout_prob=DROPOUT, attention_impl=attention_impl)
    while True:
        try:
            run, memory = bertjax_step(row, cfg, batch_of(row, cfg, batch_size))
            seconds = seconds_per_step(run, steps)
            break
        except jax.errors.JaxRuntimeError as e:
            if not out_of_memory(e) or batch_size == 1:
                raise
            batch_size //= 2
    peak = peak_flops_per_device(jax.devices()[0].device_kind)
    flops = model_flops(row, cfg)
    name = row.name if attention_impl == "auto" else f"{row.name}, {attention_impl}"
    result = dict(model=preset, row=name, batch=batch_size, step_ms=seconds * 1e3,
                  seq_per_s=batch_size / seconds, device_gib=memory / 2**30,
                  mfu=flops * batch_size / seconds / peak if peak else None,
                  attention=attention_path(cfg, row.kind != "predict",
                                           jax.default_backend()),
                  torch_batch=None, torch_seq_per_s=None)
    torch_batch = batch_size
    while torch_batch:
        try:
            run = torch_step(row, cfg, batch_of(row, cfg, torch_batch))
            if run is None:
                break
            result.update(torch_batch=torch_batch,
                          torch_seq_per_s=torch_batch / seconds_per_step(run, steps))
            break
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not out_of_memory(e):
                raise
            torch_batch //= 2
    return result


def table(results: list[dict], device: str) -> list[str]:
    """The Markdown table of `results`."""
    lines = [f"bertjax vs transformers on {device}: bf16 compute, float32 params, dropout "
             f"{DROPOUT}, synthetic batches; MFU against the device's bf16 peak", "",
             "| model | step | batch | ms/step | seq/s | MFU | GiB | attention | "
             "transformers seq/s | ratio |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        theirs = r["torch_seq_per_s"]
        other = f" (batch {r['torch_batch']})" if theirs and r["torch_batch"] != r["batch"] else ""
        lines.append(
            f"| {r['model']} | {r['row']} | {r['batch']} | {r['step_ms']:.1f} | "
            f"{r['seq_per_s']:,.1f} | {mfu} | {r['device_gib']:.2f} | {r['attention']} | "
            + (f"{theirs:,.1f}{other} | {r['seq_per_s'] / theirs:.2f}x |" if theirs
               else "(no torch) | – |"))
    return lines


def main(argv):
    del argv
    f = flags.FLAGS
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    models = f.models or (["mini", "small"] if on_cpu else ["base", "large"])
    if f.quick and not f.models:
        models = models[:1]
    steps = f.steps or (3 if f.quick else 10)
    candidates = GPU_CANDIDATES if device.platform == "gpu" and not f.quick else ()
    name = f"{device.platform} ({device.device_kind})"
    print(f"Benchmark on {name}: models {', '.join(models)}, {steps} timed steps a row",
          flush=True)
    results = []
    for preset in models:
        batches = CPU_BATCHES if on_cpu else BATCHES.get(preset, BATCHES["base"])
        for row, batch_size in zip(ROWS, batches, strict=True):
            start = time.perf_counter()
            results.append(measure_row(row, preset, batch_size, steps))
            print(f"  {preset} {row.name}: done in {time.perf_counter() - start:.0f} s",
                  flush=True)
        for index, impl in candidates:
            row = ROWS[index]
            try:
                results.append(measure_row(row, preset, batches[index], steps, impl))
            except Exception as e:  # an untried path: its failure is a finding, not the end
                print(f"  {preset} {row.name} with attention_impl={impl} failed: "
                      f"{' '.join(str(e).split())[:300]}", flush=True)
    lines = table(results, name)
    print("\n".join(lines), flush=True)
    if f.output:
        os.makedirs(f.output, exist_ok=True)
        with open(os.path.join(f.output, "accelerator.md"), "w") as out:
            out.write("\n".join(lines) + "\n")
        with open(os.path.join(f.output, "accelerator.json"), "w") as out:
            json.dump({"device": name, "rows": results}, out, indent=2)


def define_flags() -> None:
    """The command's flags, defined when it runs (tests import this module beside others)."""
    flags.DEFINE_bool("quick", False, "One model, fewer steps, no candidate attention rows "
                      "(about a minute).")
    flags.DEFINE_list("models", None, "Model presets (default: base,large on an accelerator, "
                      "mini,small on a CPU).")
    flags.DEFINE_integer("steps", None, "Timed steps per row (default 10; --quick 3).")
    flags.DEFINE_string("output", None, "Also write accelerator.md and accelerator.json to "
                        "this directory.")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
