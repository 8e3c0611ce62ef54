"""Pre-training parity rows: bertjax's objectives against transformers on bertjax's own batches.

Data: a generated corpus (topic-consistent sentences, learnable), a vocabulary of its words,
TFRecords from the real writers (`create_pretraining_data` for sentence pairs,
`create_segments` for packed rows), read by the trainer's reader
(`bertjax.tasks.pretraining.input.make_input_fn`), batches kept as NumPy and fed to both sides.

Jobs:
  pretraining_mlm_nsp: MLM + NSP against BertForPreTraining (transformers sums the two losses
    the same way); phase 1 at seq 64, then phase 2 at seq 128 with the same optimizer state and
    global schedule. One run, two rows (each phase's steps).
  pretraining_mlm: No NSP. transformers cannot pack, so each packed batch is unpacked into one
    example per row (`unpack`) and compared with BertForMaskedLM; a second row trains bertjax
    on the packed batches against bertjax on their unpacked copies (the per-prediction mean,
    hence every step, must be the same).
  pretraining_ltr: the left-to-right LM (causal attention, next-token targets) on unpacked
    rows against BertLMHeadModel(is_decoder=True) with its own shifted next-token loss.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
from collections.abc import Callable

import ml_collections
import numpy as np

from bertjax.errors import DataError
from bertjax.parity import harness

BATCH = 8
PHASE1 = (64, 10)  # (seq_len, max_predictions)
PHASE2 = (128, 20)
PACKED = (128, 20)
PHASE1_SHARE = 2 / 3  # of the steps, before the switch to PHASE2
LR = 1e-3

_TOPICS = {
    "river": ("boat", "bank", "water", "fish", "bridge", "stone", "shore", "reed"),
    "kitchen": ("bread", "oven", "salt", "knife", "pan", "flour", "table", "cook"),
    "sky": ("cloud", "star", "moon", "wind", "bird", "rain", "sun", "storm"),
    "school": ("teacher", "book", "pupil", "desk", "lesson", "chalk", "class", "pen"),
}
_VERBS = ("sees", "moves", "holds", "finds", "likes", "covers", "follows", "meets")
_ADJECTIVES = ("old", "small", "green", "quiet", "heavy", "bright", "cold", "round")
_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def write_corpus(path: pathlib.Path, num_docs: int = 160, seed: int = 0) -> list[str]:
    """Documents of 4..9 sentences, each on one topic ("the old boat sees a bank near the
    water ."), a blank line between documents; returns the words used."""
    r = random.Random(seed)
    lines = []
    for _ in range(num_docs):
        nouns = _TOPICS[r.choice(sorted(_TOPICS))]
        for _ in range(r.randint(4, 9)):
            a, b, c = (r.choice(nouns) for _ in range(3))
            words = ["the", r.choice(_ADJECTIVES), a, r.choice(_VERBS), "a", b]
            if r.random() < 0.5:
                words += ["near", "the", c]
            lines.append(" ".join(words + ["."]))
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sorted({w for line in lines for w in line.split()})


def prepare_data(workdir: pathlib.Path) -> dict[str, str]:
    """Corpus, vocab.txt and the TFRecords of every job under `workdir` (kept between runs),
    written by the data_pipeline commands. Returns {"vocab", "pairs_64", "pairs_128",
    "segments"} paths / patterns."""
    import sys

    from bertjax import cli

    workdir.mkdir(parents=True, exist_ok=True)
    corpus, vocab = workdir / "corpus.txt", workdir / "vocab.txt"
    words = write_corpus(corpus)
    vocab.write_text("\n".join(_SPECIALS + tuple(words)) + "\n", encoding="utf-8")
    common = [f"--input={corpus}", f"--vocab={vocab}", "--do_lower_case=true",
              "--shuffle_buffer=1000"]
    out = {"vocab": str(vocab)}
    for seq_len, predictions in (PHASE1, PHASE2):
        directory = workdir / f"pairs_{seq_len}"
        if not (directory / "metadata.json").exists():
            cli.run_command([sys.executable, "-m", "data_pipeline.create_pretraining_data",
                             *common, f"--output_dir={directory}",
                             f"--max_seq_length={seq_len}",
                             f"--max_predictions_per_seq={predictions}", "--dupe_factor=2"])
        out[f"pairs_{seq_len}"] = str(directory / "part-*")
    directory = workdir / "segments"
    if not (directory / "metadata.json").exists():
        # 32-token examples so that several share a 128-token row.
        cli.run_command([sys.executable, "-m", "data_pipeline.create_segments", *common,
                         f"--output_dir={directory}", "--max_seq_length=32"])
    out["segments"] = str(directory / "part-*")
    return out


def input_config(vocab_size: int, objective: str) -> ml_collections.ConfigDict:
    """The fields of a pre-training config that the trainer's reader reads."""
    return ml_collections.ConfigDict(dict(
        seed=0, objective=objective, model=dict(vocab_size=vocab_size),
        masking=dict(dynamic=True, masked_lm_prob=0.15, whole_word=False, mask=0.8, same=0.1,
                     random=0.1),
        packing=dict(enabled=objective != "mlm_nsp", num_open_rows=8, block_size=256)))


def read_batches(config, pattern: str, seq_len: int, predictions: int, num: int
                 ) -> list[dict[str, np.ndarray]]:
    """`num` global batches of BATCH rows from the trainer's reader."""
    from bertjax.tasks.pretraining.input import make_input_fn
    from bertjax.tasks.pretraining.rules import Phase

    phase = Phase("parity", 0, num, seq_len, predictions, pattern, "")
    batches = make_input_fn(config)(phase, BATCH)
    return [{k: np.asarray(v) for k, v in next(batches).items()} for _ in range(num)]


def unpack(batch: dict[str, np.ndarray], rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """Packed rows → one example per row (position 0 onwards), `rows` rows (the rest padding).

    batch: input_ids, input_mask, segment_ids, packing_ids [b, seq] and, when masked,
    masked_lm_positions/ids/weights [b, p] (positions move with their example). Returns the
    same keys with [rows, seq_len] and [rows, p]; packing_ids 1 on real tokens.
    """
    masked = "masked_lm_positions" in batch
    seq = batch["input_ids"].shape[1]
    out = {k: np.zeros((rows, seq_len if v.shape[1:] == (seq,) else v.shape[1]), v.dtype)
           for k, v in batch.items()}
    n = 0
    for r in range(batch["input_ids"].shape[0]):
        ids = batch["packing_ids"][r]
        for example in [k for k in np.unique(ids) if k > 0]:
            where = np.flatnonzero(ids == example)
            start, length = where[0], len(where)
            if n == rows or length > seq_len:
                raise DataError(f"unpack: more than {rows} examples in a batch, or one longer "
                                f"than {seq_len} tokens")
            for key in ("input_ids", "input_mask", "segment_ids"):
                out[key][n, :length] = batch[key][r, where]
            out["packing_ids"][n, :length] = 1
            if masked:
                real = batch["masked_lm_weights"][r] > 0
                pos = batch["masked_lm_positions"][r]
                inside = real & (pos >= start) & (pos < start + length)
                k = int(inside.sum())
                out["masked_lm_positions"][n, :k] = pos[inside] - start
                out["masked_lm_ids"][n, :k] = batch["masked_lm_ids"][r, inside]
                out["masked_lm_weights"][n, :k] = 1.0
            n += 1
    return out


def examples_per_batch(batch: dict[str, np.ndarray]) -> int:
    return sum(len([k for k in np.unique(row) if k > 0]) for row in batch["packing_ids"])


def longest_example(batch: dict[str, np.ndarray]) -> int:
    ids = batch["packing_ids"]
    return max(int(np.sum(row == k)) for row in ids for k in np.unique(row) if k > 0)


# ---------------------------------------------------------------------------------------------
# transformers' losses (its own loss terms, from `labels`)


def _mlm_labels(batch):
    """[b, seq] labels: the original token at each real masked position, -100 elsewhere."""
    import torch

    labels = torch.full_like(batch["input_ids"], -100)
    rows = torch.arange(labels.shape[0])[:, None].expand_as(batch["masked_lm_positions"])
    real = batch["masked_lm_weights"] > 0
    labels[rows[real], batch["masked_lm_positions"][real]] = batch["masked_lm_ids"][real]
    return labels


def _inputs(batch) -> dict:
    return dict(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                token_type_ids=batch["segment_ids"])


def hf_pretraining_loss(model, batch) -> dict:
    """BertForPreTraining's loss (MLM + NSP) with each term computed again from its logits."""
    import torch.nn.functional as F

    labels = _mlm_labels(batch)
    out = model(**_inputs(batch), labels=labels,
                next_sentence_label=batch["next_sentence_labels"].reshape(-1))
    logits = out.prediction_logits
    mlm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                          ignore_index=-100)
    nsp = F.cross_entropy(out.seq_relationship_logits, batch["next_sentence_labels"].reshape(-1))
    return {"loss": out.loss, "mlm_loss": mlm, "nsp_loss": nsp}


def hf_masked_lm_loss(model, batch) -> dict:
    out = model(**_inputs(batch), labels=_mlm_labels(batch))
    return {"loss": out.loss, "mlm_loss": out.loss}


def hf_causal_lm_loss(model, batch) -> dict:
    """BertLMHeadModel's next-token loss: labels are the tokens, padding ignored; transformers
    shifts them itself."""
    labels = batch["input_ids"].masked_fill(batch["input_mask"] == 0, -100)
    out = model(**_inputs(batch), labels=labels)
    return {"loss": out.loss, "mlm_loss": out.loss}


# ---------------------------------------------------------------------------------------------
# Jobs


@dataclasses.dataclass
class Side:
    """What both trainers need for one comparison."""

    config: object  # BertConfig
    params: object
    loss_fn: Callable  # bertjax's
    architecture: str
    hf_loss: Callable
    hf_overrides: dict = dataclasses.field(default_factory=dict)


def _model_side(vocab_size: int, objective: str) -> Side:
    import flax.linen as nn
    import jax

    from bertjax.models import BertForPreTraining
    from bertjax.tasks.pretraining.objective import init_params, step_fns

    ltr = objective == "ltr"
    config = harness.small_config(vocab_size, causal=ltr)
    model = BertForPreTraining(config)
    params = jax.tree.map(np.asarray, nn.unbox(init_params(model, jax.random.key(0))))
    _, loss_fn = step_fns(model, nsp_weight=1.0 if objective == "mlm_nsp" else 0.0,
                          packed=objective != "mlm_nsp", ltr=ltr)
    architecture, hf_loss, overrides = {
        "mlm_nsp": ("BertForPreTraining", hf_pretraining_loss, {}),
        "mlm": ("BertForMaskedLM", hf_masked_lm_loss, {}),
        "ltr": ("BertLMHeadModel", hf_causal_lm_loss, {"is_decoder": True}),
    }[objective]
    return Side(config, params, loss_fn, architecture, hf_loss, overrides)


def default_optimizer(steps: int):
    return harness.optimizer_config(learning_rate=LR, warmup_steps=max(1, steps // 10))


def param_tolerance(optimizer, history) -> float:
    """Half of what a weight decay wrongly applied to LayerNorm would move its gains (about
    1): weight_decay × the sum of the learning rates used. The loss alone cannot see that
    slip (a relative loss change of ~1e-6 over 20 steps)."""
    return 0.5 * float(optimizer.weight_decay) * float(np.sum(history["learning_rate"]))


def compare(side: Side, batches, steps: int, optimizer=None):
    """(ours, theirs, param_rel_diff, param_tolerance) after training both sides on
    `batches`."""
    optimizer = optimizer or default_optimizer(steps)
    ours, final = harness.train_bertjax(side.params, side.loss_fn, optimizer, batches, steps)
    model = harness.torch_model(side.architecture, side.config, side.params,
                                **side.hf_overrides)
    theirs, state = harness.train_torch(model, batches, side.hf_loss, optimizer, steps)
    return (ours, theirs, harness.param_rel_diff(side.config, final, side.architecture, state),
            param_tolerance(optimizer, theirs))


def _keys(history, keys):
    return {k: history[k] for k in keys}


def _slice(history, keys, start, end):
    return {k: history[k][start:end] for k in keys}


def run_mlm_nsp(steps: int, workdir: pathlib.Path, optimizer=None) -> list[harness.Row]:
    data = prepare_data(workdir)
    vocab_size = len(pathlib.Path(data["vocab"]).read_text().split("\n")) - 1
    config = input_config(vocab_size, "mlm_nsp")
    switch = max(1, round(steps * PHASE1_SHARE)) if steps > 1 else steps
    batches = (read_batches(config, data["pairs_64"], *PHASE1, switch)
               + read_batches(config, data["pairs_128"], *PHASE2, steps - switch))
    side = _model_side(vocab_size, "mlm_nsp")
    ours, theirs, diffs, tolerance = compare(side, batches, steps, optimizer)
    keys = ("loss", "mlm_loss", "nsp_loss")
    reference = "transformers BertForPreTraining + torch.optim.AdamW"
    rows = [harness.Row(f"MLM+NSP phase 1 (seq {PHASE1[0]}, steps 0..{switch})", reference,
                        _slice(ours, keys, 0, switch), _slice(theirs, keys, 0, switch))]
    if steps > switch:
        rows.append(harness.Row(
            f"MLM+NSP phase 2 (seq {PHASE2[0]}, steps {switch}..{steps}, same optimizer "
            "state and schedule)", reference, _slice(ours, keys, switch, steps),
            _slice(theirs, keys, switch, steps), param_rel_diff=diffs,
            param_tolerance=tolerance))
    else:
        rows[0].param_rel_diff, rows[0].param_tolerance = diffs, tolerance
    return rows


def _packed_batches(steps: int, workdir: pathlib.Path, objective: str):
    data = prepare_data(workdir)
    vocab_size = len(pathlib.Path(data["vocab"]).read_text().split("\n")) - 1
    seq_len, predictions = PACKED
    packed = read_batches(input_config(vocab_size, objective), data["segments"], seq_len,
                          predictions, steps)
    # One shape for every unpacked batch: one compile per side.
    rows = max(examples_per_batch(b) for b in packed)
    length = max(longest_example(b) for b in packed)
    return vocab_size, packed, [unpack(b, rows, length) for b in packed]


def run_mlm(steps: int, workdir: pathlib.Path, optimizer=None) -> list[harness.Row]:
    vocab_size, packed, unpacked = _packed_batches(steps, workdir, "mlm")
    side = _model_side(vocab_size, "mlm")
    ours, theirs, diffs, tolerance = compare(side, unpacked, steps, optimizer)
    keys = ("loss",)
    optimizer = optimizer or default_optimizer(steps)
    ours_packed, final_packed = harness.train_bertjax(side.params, side.loss_fn, optimizer,
                                                      packed, steps)
    _, final_unpacked = harness.train_bertjax(side.params, side.loss_fn, optimizer, unpacked,
                                              steps)
    self_diffs = harness.param_rel_diff(
        side.config, final_packed, "BertForMaskedLM",
        _hf_state(side.config, final_unpacked, "BertForMaskedLM"))
    return [
        harness.Row(f"No NSP (MLM only), one example per row (unpacked {PACKED[0]}-token rows)",
                    "transformers BertForMaskedLM + torch.optim.AdamW",
                    _keys(ours, keys), _keys(theirs, keys), param_rel_diff=diffs,
                    param_tolerance=tolerance),
        harness.Row(f"No NSP: packed rows = the same examples unpacked (seq {PACKED[0]})",
                    "bertjax on the unpacked rows", _keys(ours_packed, keys), _keys(ours, keys),
                    param_rel_diff=self_diffs, param_tolerance=tolerance),
    ]


def _hf_state(config, params, architecture):
    from bertjax.convert.huggingface import export_hf_tensors

    return export_hf_tensors(config, params, architecture, "float32")


def run_ltr(steps: int, workdir: pathlib.Path, optimizer=None) -> list[harness.Row]:
    vocab_size, _, unpacked = _packed_batches(steps, workdir, "ltr")
    side = _model_side(vocab_size, "ltr")
    ours, theirs, diffs, tolerance = compare(side, unpacked, steps, optimizer)
    return [harness.Row(f"left-to-right LM, one example per row (unpacked {PACKED[0]}-token rows)",
                        "transformers BertLMHeadModel(is_decoder) + torch.optim.AdamW",
                        _keys(ours, ("loss",)), _keys(theirs, ("loss",)), param_rel_diff=diffs,
                        param_tolerance=tolerance)]


JOBS: dict[str, Callable[[int, pathlib.Path], list[harness.Row]]] = {
    "pretraining_mlm_nsp": run_mlm_nsp,
    "pretraining_mlm": run_mlm,
    "pretraining_ltr": run_ltr,
}
