r"""`make modern_demo`: the ModernBERT recipe beside BERT's on the `make demo` corpus, at equal
training FLOPs, scored on the same held-out masked tokens.

  python -m bertjax.demos.modern_demo [--data_dir=data/demo] [--workdir=runs/modern_demo]

1. Reads what `make demo` prepared (held-out split, 8,000-piece WordPiece vocabulary, BERT's
   sentence-pair TFRecords) and writes whole-document segments of 128 tokens of the same
   training and held-out documents (`python -m data_pipeline.create_segments`).
2. Pre-trains the demo's BERT (`experiments/pretrain_demo.py`, MLM 40% + NSP on pairs, 64
   then 256 tokens) keeping a checkpoint every 250 steps.
3. Pre-trains a ModernBERT of the same width, depth and feed-forward parameters with its
   recipe (`experiments/pretrain_demo.py:modern`) for the steps that spend the same training
   FLOPs (bertjax.train.flops, model FLOPs of forward + backward).
4. Scores every checkpoint of both on one set of held-out batches: packed 128-token rows of
   the held-out documents, 15% of the tokens masked (80/10/10) with a fixed seed, attention
   within each document. Writes runs/modern_demo/comparison.json and the plot
   docs/images/modern_demo.png (accuracy against training FLOPs).

Finished steps are skipped on a second run (delete the workdir to redo them).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from bertjax import cli

_DATA = flags.DEFINE_string("data_dir", "data/demo", "What `make demo` prepared.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/modern_demo", "Where both runs are written.")
_PLOT = flags.DEFINE_string("plot", "docs/images/modern_demo.png", "The plot's path.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 20, "Held-out batches of 64 rows.")
BERT_CONFIG, MODERN_CONFIG = "experiments/pretrain_demo.py", "experiments/pretrain_demo.py:modern"
EVAL_SEQ, EVAL_PREDICTIONS, EVAL_MASKING = 128, 20, 0.15


def _data(pattern: str) -> str:
    return pattern.replace("data/demo", _DATA.value)


def training_flops(config) -> list[tuple[int, float]]:
    """[(step, training FLOPs spent by the end of it)] for every step of a run's config."""
    from bertjax.tasks.pretraining.rules import plan_phases
    from bertjax.train import configs, flops

    model = configs.resolve_model_config(config.model)
    out, total = [], 0.0
    for phase in plan_phases(config):
        theta = {"global_rope_theta": phase.global_rope_theta} if phase.global_rope_theta else {}
        cfg = model if not theta else type(model).from_dict({**model.to_dict(), **theta})
        per_step = phase.batch_size * flops.train_flops_per_sequence(
            cfg, phase.seq_len, phase.max_predictions)
        for step in range(phase.start + 1, phase.end + 1):
            total += per_step
            out.append((step, total))
    return out


def equal_flops_steps(budget: float, config) -> tuple[int, int]:
    """(phase-1 steps, phase-2 steps) of the modern config that spend `budget` FLOPs, phase 2
    keeping its share of the steps (4%)."""
    from bertjax.tasks.pretraining.rules import plan_phases
    from bertjax.train import configs, flops

    model = configs.resolve_model_config(config.model)
    first, second = plan_phases(config)
    share = (second.end - second.start) / config.train.num_train_steps
    per_step = [p.batch_size * flops.train_flops_per_sequence(model, p.seq_len, p.max_predictions)
                for p in (first, second)]
    steps = budget / ((1 - share) * per_step[0] + share * per_step[1])
    two = round(share * steps)
    return round(steps) - two, two


def held_out_batches(vocab: str, pattern: str, n: int) -> list[dict]:
    """n batches of 64 packed rows of the held-out segments, 15% masked, fixed seed."""
    from bertjax.tasks.pretraining.input import make_input_fn
    from bertjax.tasks.pretraining.rules import plan_phases

    config = cli.load_config(MODERN_CONFIG)
    config.vocab = vocab
    config.masking.masked_lm_prob = EVAL_MASKING
    config.phases.phase1.update(eval_data=pattern, seq_len=EVAL_SEQ,
                                max_predictions=EVAL_PREDICTIONS)
    phase = plan_phases(config)[0]
    batches = make_input_fn(config)(phase, 64, split="eval")
    return [next(batches) for _ in range(n)]


def score(workdir: str, batches: list[dict]) -> dict[int, float]:
    """Held-out MLM accuracy of every checkpoint of a pre-training run: {step: accuracy}."""
    import jax

    from bertjax.models import pretraining_model
    from bertjax.tasks.pretraining.objective import eval_sums
    from bertjax.train import checkpoints, configs

    with open(os.path.join(workdir, "run_config.json")) as f:
        model = pretraining_model(configs.resolve_model_config(json.load(f)["model"]))
    sums = jax.jit(lambda params, batch: eval_sums(params, batch, model=model, nsp_weight=0.0,
                                                   packed=True))
    out = {}
    root = checkpoints.checkpoints_dir(workdir)
    for step in sorted(int(d.name) for d in root.iterdir() if d.name.isdigit()):
        params = checkpoints.read_params(workdir, step)
        correct = weight = 0.0
        for batch in batches:
            result = sums(params, batch)
            correct += float(result["mlm_correct"])
            weight += float(result["mlm_weight"])
        out[step] = correct / weight
    return out


def plot(curves: dict[str, list[tuple[float, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in curves.items():
        ax.plot([x / 1e15 for x, _ in points], [y for _, y in points], marker="o", label=label)
    ax.set_xlabel("training FLOPs (PFLOP, model FLOPs of forward + backward)")
    ax.set_ylabel("held-out MLM accuracy (15% masked)")
    ax.set_title("make modern_demo: same corpus, vocabulary and compute")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    python, data, workdir = sys.executable, _DATA.value, _WORKDIR.value
    vocab = f"{data}/vocab/vocab.txt"
    texts = {"train": f"{data}/corpus_train.txt", "eval": f"{data}/corpus_eval.txt"}
    if not all(os.path.exists(p) for p in (vocab, *texts.values())):
        sys.exit(f"error: {data} lacks the demo's data; run `make demo` first")
    for split, text in texts.items():
        out = f"{data}/segments_{split}_{EVAL_SEQ}"
        if not os.path.exists(out):
            cli.run_command([python, "-m", "data_pipeline.create_segments", f"--input={text}",
                             f"--vocab={vocab}", f"--output_dir={out}",
                             f"--max_seq_length={EVAL_SEQ}", "--num_shards=2"])

    bert_dir, modern_dir = f"{workdir}/bert", f"{workdir}/modern"
    bert = cli.load_config(BERT_CONFIG)
    overrides = {"vocab": vocab, "checkpoint.every_steps": 250, "checkpoint.max_to_keep": 20}
    for name in sorted(bert.phases):
        for field in ("data", "eval_data"):
            overrides[f"phases.{name}.{field}"] = _data(bert.phases[name][field])
    cli.run_command([python, "-m", "bertjax.pretrain", f"--config={BERT_CONFIG}",
                     f"--workdir={bert_dir}", *[f"--config.{k}={v}" for k, v in overrides.items()]])
    bert.update_from_flattened_dict(overrides)
    vocab_size(bert)
    bert_flops = dict(training_flops(bert))

    modern = cli.load_config(MODERN_CONFIG)
    modern.vocab = vocab
    vocab_size(modern)
    one, two = equal_flops_steps(bert_flops[max(bert_flops)], modern)
    overrides = {"vocab": vocab, "train.num_train_steps": one + two, "phases.phase1.steps": one,
                 "phases.phase2.steps": two, "optimizer.decay_steps": two}
    for name in sorted(modern.phases):
        for field in ("data", "eval_data"):
            overrides[f"phases.{name}.{field}"] = _data(modern.phases[name][field])
    cli.run_command([python, "-m", "bertjax.pretrain", f"--config={MODERN_CONFIG}",
                     f"--workdir={modern_dir}",
                     *[f"--config.{k}={v}" for k, v in overrides.items()]])
    modern.update_from_flattened_dict(overrides)
    modern_flops = dict(training_flops(modern))

    batches = held_out_batches(vocab, f"{data}/segments_eval_{EVAL_SEQ}/*.tfrecord",
                               _EVAL_BATCHES.value)
    results = {}
    for label, run, run_flops in (("BERT recipe", bert_dir, bert_flops),
                                  ("ModernBERT recipe", modern_dir, modern_flops)):
        accuracy = score(run, batches)
        results[label] = [{"step": s, "flops": run_flops[s], "mlm_accuracy": a}
                          for s, a in accuracy.items()]
    with open(f"{workdir}/comparison.json", "w") as f:
        json.dump(results, f, indent=2)
    plot({k: [(r["flops"], r["mlm_accuracy"]) for r in v] for k, v in results.items()},
         _PLOT.value)
    print(f"\nHeld-out MLM accuracy, {EVAL_SEQ}-token rows of held-out documents, "
          f"{EVAL_MASKING:.0%} masked ({_EVAL_BATCHES.value} x 64 rows):")
    for label, rows in results.items():
        last = rows[-1]
        print(f"  {label:<18} step {last['step']:>5}  {last['flops'] / 1e15:7.2f} PFLOP  "
              f"accuracy {last['mlm_accuracy']:.3f}")
    print(f"Plot: {_PLOT.value}; figures: {workdir}/comparison.json")


def vocab_size(config) -> None:
    """config.model's vocabulary size (and a ModernBERT's special ids) from config.vocab, as
    the run sets them."""
    from bertjax.tasks.pretraining import checks

    checks.resolve(config, log=lambda _: None)


if __name__ == "__main__":
    cli.run(main)
