r"""Speed and memory of bertjax's design choices, each against its baseline in the same process.

  python -m bertjax.benchmarks.model [--preset=mini] [--batch_size=16] [--repeats=5]

1. MLM logits only at the masked positions vs. at every position (the baseline): train-step
   time and compiled temporary memory.
2. Attention through `jax.nn.dot_product_attention` vs. the einsum path (baseline).
3. Compile time of a BERT-base train step with `nn.scan` over layers vs. unrolled (baseline).
4. A full pre-training step (forward, backward, optimizer update) at seq 128 for the mini and
   base presets, against Hugging Face transformers' PyTorch BertForPreTraining + AdamW
   (baseline) on the same shapes and device: float32 for both, then bf16 compute (bertjax:
   `model.dtype=bfloat16`, float32 params and accumulation; PyTorch: `torch.autocast`). Skipped
   when torch is not installed. A model's four steps run in turn (so drifts in the machine's
   speed hit them alike), `repeats` rounds; times are medians.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from bertjax import cli
from bertjax.benchmarks import interleaved_median_seconds
from bertjax.models import BertConfig, BertForPreTraining, pretraining_loss
from bertjax.tasks import pretraining
from bertjax.train import step as step_lib

_PRESET = flags.DEFINE_string("preset", "mini", "Model preset for the runtime comparisons.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions (after one warm-up).")


def _batch(cfg, batch_size, seq_len, positions):
    r = np.random.default_rng(0)
    ids = r.integers(5, cfg.vocab_size, (batch_size, seq_len)).astype(np.int32)
    return {
        "input_ids": ids,
        "segment_ids": np.zeros_like(ids),
        "input_mask": np.ones_like(ids),
        "masked_lm_positions": positions,
        "masked_lm_ids": np.take_along_axis(ids, positions, 1),
        "masked_lm_weights": np.ones(positions.shape, np.float32),
        "next_sentence_labels": np.zeros(batch_size, np.int32),
    }


def _time(fn, *args, repeats):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def _grad_fn(model):
    def loss(params, batch):
        out = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                          batch["input_mask"], batch["masked_lm_positions"])
        return pretraining_loss(out, batch)[0]
    return jax.jit(jax.grad(loss))


def bench_mlm_gather(cfg, batch_size, repeats):
    seq_len, max_predictions = 128, 20
    model = BertForPreTraining(cfg)
    params = jax.jit(lambda k: nn.unbox(pretraining.init_params(model, k)))(jax.random.key(0))
    r = np.random.default_rng(1)
    masked = np.stack([r.choice(seq_len, max_predictions, replace=False)
                       for _ in range(batch_size)]).astype(np.int32)
    every = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)).copy()
    rows = []
    grad = _grad_fn(model)
    for name, positions in (("every position (baseline)", every), ("masked positions", masked)):
        batch = _batch(cfg, batch_size, seq_len, positions)
        seconds = _time(grad, params, batch, repeats=repeats)
        memory = grad.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        rows.append((name, seconds, memory))
    return rows


def bench_attention(cfg, batch_size, repeats):
    seq_len = 512
    ids = jnp.asarray(np.random.default_rng(2).integers(5, cfg.vocab_size, (batch_size, seq_len)),
                      jnp.int32)
    positions = jnp.zeros((batch_size, 1), jnp.int32)
    rows = []
    params = None
    for name, impl in (("einsum (baseline)", "einsum"), ("dot_product_attention", "xla")):
        model = BertForPreTraining(BertConfig(**{**cfg.to_dict(), "attention_impl": impl}))
        if params is None:
            params = nn.unbox(pretraining.init_params(model, jax.random.key(0)))
        forward = jax.jit(lambda p, m=model: m.apply({"params": p}, ids, None, jnp.ones_like(ids),
                                                     positions)["mlm_logits"])
        rows.append((name, _time(forward, params, repeats=repeats), None))
    return rows


def bench_compile(batch_size):
    from bertjax.train.optimizer import make_optimizer

    rows = []
    for name, scan in (("base unrolled (baseline)", False), ("base nn.scan", True)):
        config = cli.load_config("experiments/pretrain.py:base")
        config.model.scan_layers = scan
        config.model.dtype = "bfloat16"
        cfg = BertConfig.from_dict(config.model)
        model = BertForPreTraining(cfg)
        tx, schedule = make_optimizer(config.optimizer, 1000)
        init, loss = pretraining.step_fns(model)
        abstract, _ = step_lib.state_shardings(
            init, tx, jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                        ("data", "fsdp", "tensor")), config.logical_axis_rules)
        step = jax.jit(lambda s, b, f=loss, t=tx, sc=schedule: step_lib.train_step(
            s, b, loss_fn=f, tx=t, schedule=sc))
        start = time.perf_counter()
        step.lower(abstract, pretraining.batch_spec(batch_size, 128, 20)).compile()
        rows.append((name, time.perf_counter() - start, None))
    return rows


def _synthetic_batch(cfg, batch_size, seq_len, max_predictions):
    r = np.random.default_rng(0)
    positions = np.stack([np.sort(r.choice(np.arange(1, seq_len), max_predictions, replace=False))
                          for _ in range(batch_size)]).astype(np.int32)
    return _batch(cfg, batch_size, seq_len, positions)


def bertjax_train_step(cfg, batch_size, seq_len, max_predictions):
    """A callable running one jitted train step (bert_adamw, compute in cfg.dtype), one device."""
    from bertjax.train import sharding as sharding_lib
    from bertjax.train.optimizer import make_optimizer

    config = cli.load_config("experiments/pretrain.py:tiny")
    model = BertForPreTraining(cfg)
    tx, schedule = make_optimizer(config.optimizer, 1000)
    mesh = sharding_lib.make_mesh({"data": 1}, jax.devices()[:1])
    init, loss = pretraining.step_fns(model)
    _, state_sharding = step_lib.state_shardings(init, tx, mesh, config.logical_axis_rules)
    state = step_lib.create_train_state(init, tx, jax.random.PRNGKey(0), state_sharding)
    step = step_lib.jit_train_step(loss, tx, schedule, state_sharding,
                                   sharding_lib.batch_sharding(mesh, config.logical_axis_rules),
                                   rules=config.logical_axis_rules)
    batch = _synthetic_batch(cfg, batch_size, seq_len, max_predictions)
    holder = [state]

    def run():
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics)

    return run


def torch_train_step(cfg, batch_size, seq_len, max_predictions, autocast=False):
    """A callable running one step of transformers' BertForPreTraining + torch.optim.AdamW
    with gradient clipping at 1.0 (as bertjax), or None without torch.

    autocast: bf16 compute through `torch.autocast("cpu")` (float32 params), else float32."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    hf_config = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, hidden_act="gelu",
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size)
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(hf_config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    batch = _synthetic_batch(cfg, batch_size, seq_len, max_predictions)
    labels = np.full((batch_size, seq_len), -100, np.int64)
    np.put_along_axis(labels, batch["masked_lm_positions"], batch["masked_lm_ids"], 1)
    inputs = dict(
        input_ids=torch.as_tensor(batch["input_ids"], dtype=torch.long),
        token_type_ids=torch.as_tensor(batch["segment_ids"], dtype=torch.long),
        attention_mask=torch.as_tensor(batch["input_mask"], dtype=torch.long),
        labels=torch.as_tensor(labels),
        next_sentence_label=torch.as_tensor(batch["next_sentence_labels"], dtype=torch.long))

    def run():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return run


def bench_train_step_vs_torch(repeats):
    print("\n4. Full train step (forward + backward + AdamW), seq 128, 20 predictions; a model's "
          "four steps run in turn, medians")
    print(f"  {'model':<6} {'batch':>5} {'framework':<26} {'compute':<9} {'steps/s':>8} "
          f"{'seq/s':>7} {'tokens/s':>9} {'vs torch f32':>13} {'vs torch bf16':>14}")
    torch_name, jax_name = "HF transformers (PyTorch)", "bertjax (JAX, jit)"
    for preset, batch_size in (("mini", 32), ("base", 8)):
        f32 = BertConfig.from_preset(preset, dtype="float32")
        bf16 = BertConfig.from_preset(preset, dtype="bfloat16")
        steps = {
            (torch_name, "float32"): torch_train_step(f32, batch_size, 128, 20),
            (torch_name, "bf16"): torch_train_step(f32, batch_size, 128, 20, autocast=True),
            (jax_name, "float32"): bertjax_train_step(f32, batch_size, 128, 20),
            (jax_name, "bf16"): bertjax_train_step(bf16, batch_size, 128, 20),
        }
        seconds = interleaved_median_seconds(
            {key: step for key, step in steps.items() if step is not None}, repeats)
        baselines = (seconds.get((torch_name, "float32")), seconds.get((torch_name, "bf16")))
        for (name, compute), step in steps.items():
            if step is None:
                print(f"  {preset:<6} {batch_size:>5} {name:<26} {compute:<9} (no torch)")
                continue
            s = seconds[(name, compute)]
            f32_ratio, bf16_ratio = (f"{b / s:.2f}x" if b else "-" for b in baselines)
            print(f"  {preset:<6} {batch_size:>5} {name:<26} {compute:<9} {1 / s:>8.2f} "
                  f"{batch_size / s:>7.1f} {batch_size * 128 / s:>9.0f} {f32_ratio:>13} "
                  f"{bf16_ratio:>14}")


def print_table(title, unit, rows):
    baseline = rows[0][1]
    print(f"\n{title}")
    print(f"  {'variant':<28} {unit:>12} {'speed-up':>9} {'temp memory':>12}")
    for name, seconds, memory in rows:
        mem = f"{memory / 2**20:,.0f} MiB" if memory is not None else "-"
        value = seconds * 1000 if unit == "ms" else seconds
        print(f"  {name:<28} {value:>12.1f} {baseline / seconds:>8.2f}x {mem:>12}")


def main(argv):
    del argv
    cfg = BertConfig.from_preset(_PRESET.value, dtype="float32")
    device = jax.devices()[0]
    print(f"bertjax benchmark on {device.platform} ({device.device_kind}), preset "
          f"{_PRESET.value}, batch {_BATCH.value}, {_REPEATS.value} repeats")
    print_table("1. MLM head: train-step gradient, seq 128, 20 predictions", "ms",
                bench_mlm_gather(cfg, _BATCH.value, _REPEATS.value))
    print_table("2. Attention: forward pass, seq 512", "ms",
                bench_attention(cfg, _BATCH.value, _REPEATS.value))
    print_table("3. Compile time of the BERT-base train step", "s", bench_compile(_BATCH.value))
    bench_train_step_vs_torch(_REPEATS.value)


if __name__ == "__main__":
    cli.run(main)
