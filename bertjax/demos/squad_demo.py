r"""`make squad_demo`: fine-tune a BERT for extractive QA on ROPES (SQuAD v1.1 layout, from
`make ropes`) and print dev EM/F1 next to a trivial baseline.

  python -m bertjax.demos.squad_demo [--checkpoint=runs/demo/export] [--data_dir=data/ropes] \
      [--workdir=runs/squad_demo] [--num_epochs=3]

The checkpoint is the `make demo` pre-trained tiny BERT by default, or any converted model
(`python -m bertjax.convert from_hf|from_tf ...`). Windows are as long as the model allows (up
to 384 tokens). The baseline answers every question with its context's most frequent
capitalised phrase (ROPES stories name their alternatives: "Town A", "cup B", "Mike").
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

from absl import flags

from bertjax import cli

_CHECKPOINT = flags.DEFINE_string("checkpoint", "runs/demo/export",
                                  "bertjax checkpoint directory to fine-tune.")
_DATA = flags.DEFINE_string("data_dir", "data/ropes", "train.json and dev.json (SQuAD layout).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/squad_demo", "Fine-tuning workdir.")
_EPOCHS = flags.DEFINE_float("num_epochs", 3.0, "Epochs over the training questions.")
_LR = flags.DEFINE_float("learning_rate", 1e-4, "Peak learning rate (tiny models like more "
                         "than the paper's 5e-5).")

_PHRASE = re.compile(r"[A-Z][\w'’-]*(?:\s+(?:[A-Z][\w'’-]*|\d+))*")


def capitalised_baseline(context: str) -> str:
    """The context's most frequent capitalised phrase (the first on ties); "" if none."""
    phrases = collections.Counter(m.group() for m in _PHRASE.finditer(context))
    if not phrases:
        return ""
    return max(phrases, key=lambda p: (phrases[p], -context.index(p)))


def main(argv):
    del argv
    from bertjax.checkpoint_dir import load_config
    from bertjax.tasks.squad import metrics as squad_metrics
    from bertjax.tasks.squad.readers import read_squad_json

    train, dev = (os.path.join(_DATA.value, f"{s}.json") for s in ("train", "dev"))
    if not os.path.exists(dev):
        sys.exit(f"error: {dev} not found; run `make ropes` first")
    if not os.path.exists(os.path.join(_CHECKPOINT.value, "config.json")):
        sys.exit(f"error: --checkpoint={_CHECKPOINT.value} is not a bertjax checkpoint; run "
                 "`make demo` or convert a model (python -m bertjax.convert from_hf ...)")
    positions = load_config(_CHECKPOINT.value).max_position_embeddings
    seq = min(384, positions)
    args = [sys.executable, "-m", "bertjax.finetune", "--config=experiments/squad.py:files",
            f"--config.init_checkpoint={_CHECKPOINT.value}", f"--workdir={_WORKDIR.value}",
            f"--config.data.train={train}", f"--config.data.validation={dev}",
            f"--config.max_seq_length={seq}", f"--config.task.doc_stride={min(128, seq // 3)}",
            f"--config.train.num_epochs={_EPOCHS.value}",
            f"--config.optimizer.learning_rate={_LR.value}"]
    cli.run_command(args)
    with open(os.path.join(_WORKDIR.value, "results.json")) as f:
        best = json.load(f)["best"]
    examples = read_squad_json(dev)
    golds = {e.qas_id: [t for t, _ in e.answers] for e in examples}
    baseline = squad_metrics.evaluate({e.qas_id: capitalised_baseline(e.context)
                                       for e in examples}, golds)
    print(f"\nROPES extractive QA, dev set ({len(examples)} questions), windows of {seq} tokens:")
    print(f"  fine-tuned BERT                       EM {best['exact_match']:5.1f}  "
          f"F1 {best['f1']:5.1f}")
    print(f"  most frequent capitalised phrase      EM {baseline['exact_match']:5.1f}  "
          f"F1 {baseline['f1']:5.1f}")
    print(f"  predictions: {os.path.join(_WORKDIR.value, 'predictions.json')}")


if __name__ == "__main__":
    cli.run(main)
