r"""Inference speed: a sequence classifier's and a SQuAD span head's predictions on a realistic
length mix.

  python -m bertjax.benchmarks.inference [--preset=mini] [--batch_size=8] [--repeats=3]

Rows: the Rotten Tomatoes dev sentences (data/rotten_tomatoes/dev.jsonl from `make
rotten_tomatoes`; tokenized with the `make demo` vocabulary when it exists, otherwise their
lengths are estimated from the words) through the classifier at max_seq_length 128, and
SQuAD-like windows (question + context lengths drawn like SQuAD's: most windows far shorter
than 384) through the SQuAD task's span head at 384. Variants, float32 on the same CPU, the
same rows in the same order:

  bertjax, length buckets   the prediction engine (bertjax/serving/engine.py): the task's
                            unshuffled batches (the prediction plan of
                            data_pipeline/finetune_data.py: lengths 16, 24, ..., 64, 80, ...,
                            max_seq_length, `batch_size` rows at 128 and longer, 2, 4, ...
                            times as many at 64, 32, ...; SQuAD windows too) through the jitted
                            head; on a CPU, as `python -m bertjax.predict` runs it: the CPU
                            split into one device per core (at most 4), whole batches on each
                            in turn
  bertjax, buckets, 1 device
                            the same on one undivided CPU device (when the CPU was split)
  bertjax, padded to max    the same with one bucket, max_seq_length (every row padded)
  transformers, batch N     BertForSequenceClassification / BertForQuestionAnswering (PyTorch,
                            eval, no_grad), batches of N rows in input order padded to their
                            longest row, as its padding collator does, at N = batch_size and
                            64; skipped without torch
  ceiling                   no engine's bound: the rows' own forward FLOPs
                            (bertjax/train/flops.py, no padding, the classifier's final layer
                            for [CLS] alone) at the rate of the model's FFN matmul measured
                            here, as if softmax, layer norms, GELU and every other op were
                            free; a ratio to transformers above this one is out of reach at
                            float32 on this machine

Sequences/s are the median of `repeats` passes over all rows after a first pass (the jitted
shapes compiled, nothing read from a compilation cache), the variants' passes taking turns;
the padding waste is the share of token positions computed that are padding; "first pass" is
the seconds of that first pass, what a command's first run over the rows costs. Run it on a
quiet machine: the figures are only comparable within one run.
"""

from __future__ import annotations

import functools
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags

from bertjax import cli, runtime
from bertjax.benchmarks import interleaved_median_seconds
from bertjax.models import BertConfig, architecture

_PRESET = flags.DEFINE_string("preset", "mini", "Model preset.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per batch (bertjax: at the longest "
                             "length; more when shorter).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes over the rows.")
_ROWS = flags.DEFINE_integer("max_rows", 1000, "At most this many rows per set.")
_SETS = flags.DEFINE_multi_enum("sets", ["rt", "squad"], ["rt", "squad"],
                                "Row sets: Rotten Tomatoes dev, SQuAD-like windows.")
RT_DEV = "data/rotten_tomatoes/dev.jsonl"
DEMO_VOCAB = "data/demo/vocab"


def rt_lengths(max_rows: int) -> np.ndarray:
    """Token counts ([CLS] text [SEP]) of the Rotten Tomatoes dev sentences, cut at 128."""
    if not os.path.exists(RT_DEV):
        print(f"({RT_DEV} not found, `make rotten_tomatoes`: lengths drawn like its sentences)")
        return np.clip(np.random.default_rng(0).lognormal(3.3, 0.5, max_rows), 4, 128).astype(int)
    with open(RT_DEV, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:max_rows]
    if os.path.exists(os.path.join(DEMO_VOCAB, "vocab.txt")):
        from bertjax.tokenization import load_tokenizer

        tokenizer = load_tokenizer(DEMO_VOCAB)
        counts = [len(tokenizer.tokenize(t)) for t in texts]
    else:  # about 1.3 WordPieces a whitespace word, punctuation included
        counts = [int(1.3 * len(t.split())) for t in texts]
    return np.minimum(np.array(counts) + 2, 128)


def squad_lengths(max_rows: int) -> np.ndarray:
    """Window lengths at 384: a ~11-token question plus a context of ~150 tokens (long tail),
    a window holding at most 384 tokens (longer contexts give several windows)."""
    rng = np.random.default_rng(1)
    contexts = rng.lognormal(4.9, 0.45, max_rows).astype(int)
    questions = rng.integers(6, 20, max_rows)
    return np.minimum(contexts + questions + 3, 384)


def token_rows(lengths: np.ndarray, vocab_size: int) -> list[np.ndarray]:
    """Random token ids, one [length] int32 row per length."""
    rng = np.random.default_rng(2)
    return [rng.integers(5, vocab_size, n).astype(np.int32) for n in lengths]


def classifier_set(rows: list[np.ndarray], max_len: int, bucketed: bool):
    """(the files classifier, its Features of `rows`)."""
    from bertjax.tasks.classification.task import SequenceTask
    from data_pipeline.finetune_data import Features, bucket_lengths

    task = SequenceTask(ml_collections.ConfigDict({
        "min_bucket_length": 16 if bucketed else max_len, "train": {"batch_size": 8},
        "task": {"family": "files", "name": "classification"}}))
    task.restore({"kind": "classification", "labels": ["0", "1"], "metric_names": ["accuracy"]})
    task.buckets = bucket_lengths(max_len, task.min_bucket_length)
    sequences = [np.stack([r, np.zeros_like(r), np.ones_like(r)])[None] for r in rows]
    return task, Features(sequences, np.zeros(len(rows), np.int32), False)


def squad_set(rows: list[np.ndarray], max_len: int, bucketed: bool):
    """(the SQuAD task, SquadFeatures of windows holding `rows`): its span head and its
    windows' batches (max_len wide, their own lengths bucketed); no answers to post-process."""
    from bertjax.tasks.squad.features import SquadFeatures
    from bertjax.tasks.squad.task import SquadTask

    task = SquadTask(ml_collections.ConfigDict({
        "min_bucket_length": 16 if bucketed else max_len,
        "task": {"version_2": False, "doc_stride": 128, "max_query_length": 64,
                 "n_best_size": 20, "max_answer_length": 30}}))
    n = len(rows)
    ids = np.zeros((n, max_len), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    mask = (ids > 0).astype(np.int32)
    zeros = np.zeros(n, np.int32)
    features = SquadFeatures([], ids, np.zeros_like(ids), mask, zeros, zeros,
                             np.arange(n, dtype=np.int32), zeros, zeros, zeros,
                             mask.astype(bool), [], zeros)
    return task, features


def engine_pass(task, features, cfg: BertConfig, params, batch_size: int,
                devices: list[jax.Device] | None):
    """(a callable predicting every row once with the task's jitted head, the padding counts
    of its last pass): whole batches on `devices` in turn (as `python -m bertjax.predict` on a
    CPU), or without devices, sharded over a data-parallel mesh."""
    from bertjax.serving.engine import DATA_PARALLEL_MESH, DATA_PARALLEL_RULES, runner_and_params
    from bertjax.tasks.base import _predict, predict_rows

    model = task.model(cfg)
    runner, placed = runner_and_params(model, task.init_inputs(), params, DATA_PARALLEL_MESH,
                                       DATA_PARALLEL_RULES, batch_size, devices)
    predict = jax.jit(functools.partial(_predict, task=task, model=model))
    tokens = {}

    def run():
        tokens.clear()
        tokens.update(real=0, computed=0)
        predict_rows(task, predict, placed, features, batch_size, runner, tokens)

    return run, tokens


def torch_pass(cfg: BertConfig, rows: list[np.ndarray], batch_size: int, head: str):
    """A callable predicting every row with transformers' `head` class
    (BertForSequenceClassification, BertForQuestionAnswering), batches in input order padded
    to their longest row; None without torch."""
    try:
        import torch
        import transformers
    except ImportError:
        return None, {}
    torch.manual_seed(0)
    hf = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, num_labels=2)
    model = getattr(transformers, head)(hf).eval()
    tokens = {}

    def run():
        tokens.update(real=0, computed=0)
        with torch.no_grad():
            for first in range(0, len(rows), batch_size):
                batch = rows[first:first + batch_size]
                ids = np.zeros((len(batch), max(len(r) for r in batch)), np.int64)
                mask = np.zeros_like(ids)
                for i, r in enumerate(batch):
                    ids[i, :len(r)], mask[i, :len(r)] = r, 1
                tokens["real"] += int(mask.sum())
                tokens["computed"] += mask.size
                model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))

    return run, tokens


def matmul_rate(cfg: BertConfig, repeats: int = 10) -> float:
    """FLOP/s of the model's FFN matmul ([4096, hidden] × [hidden, intermediate], float32) on
    the default device: the best of `repeats` timed calls."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4096, cfg.hidden_size), np.float32)
    w = rng.standard_normal((cfg.hidden_size, cfg.intermediate_size), np.float32)
    x, w = jax.device_put(x), jax.device_put(w)
    matmul = jax.jit(jnp.matmul)
    matmul(x, w).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x, w).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.shape[0] * x.shape[1] * w.shape[1] / best


def ceiling_seconds(cfg: BertConfig, rows: list[np.ndarray], pooled_only: bool,
                    rate: float) -> float:
    """Seconds to compute the forward FLOPs of `rows`, unpadded, at `rate` FLOP/s."""
    flops = sum(architecture(cfg).forward_flops(cfg, len(r), 0, pooled_only) for r in rows)
    return flops / rate


def main(argv):
    del argv
    from data_pipeline.finetune_data import bucket_lengths, prediction_buckets

    split = runtime.split_cpu()  # as `python -m bertjax.predict` does, before JAX starts
    jax.config.update("jax_enable_compilation_cache", False)  # first passes compile
    devices = jax.devices()
    print(f"inference benchmark on {devices[0].platform} ({devices[0].device_kind}, "
          f"{len(devices)} device(s){', whole batches in turn' if split else ''}), preset "
          f"{_PRESET.value}, float32, batch {_BATCH.value}, median of {_REPEATS.value}")
    print(f"  {'rows':<30} {'variant':<26} {'seq/s':>8} {'padding':>8} {'vs transformers':>16} "
          f"{'first pass':>11}")
    sets = {"rt": ("Rotten Tomatoes dev, max 128", rt_lengths, 128, classifier_set,
                   "BertForSequenceClassification", True),
            "squad": ("SQuAD-like windows, max 384", squad_lengths, 384, squad_set,
                      "BertForQuestionAnswering", False)}
    for name, lengths_of, max_len, make_set, head, pooled_only in (sets[k] for k in _SETS.value):
        cfg = BertConfig.from_preset(_PRESET.value, dtype="float32",
                                     max_position_embeddings=max(512, max_len))
        rows = token_rows(lengths_of(_ROWS.value), cfg.vocab_size)
        variants, params = {}, None
        turns = devices if split else None
        engines = [("bertjax, length buckets", True, turns),
                   ("bertjax, padded to max", False, turns)]
        if split:  # the same engine on one undivided CPU device
            engines.insert(1, ("bertjax, buckets, 1 device", True, devices[:1]))
        for variant, bucketed, on in engines:
            task, features = make_set(rows, max_len, bucketed)
            if params is None:  # the same weights for all
                params = jax.device_get(nn.unbox(jax.jit(task.model(cfg).init)(
                    jax.random.key(0), *task.init_inputs())["params"]))
            variants[variant] = engine_pass(task, features, cfg, params, _BATCH.value, on)
        print(f"  (buckets {prediction_buckets(bucket_lengths(max_len, 16))})")
        for batch in sorted({_BATCH.value, 64}):
            variants[f"transformers, batch {batch}"] = torch_pass(cfg, rows, batch, head)
        # The passes take turns (the warm-up pass compiles every bucket's shape).
        first: dict[str, float] = {}
        seconds = interleaved_median_seconds(
            {k: run for k, (run, _) in variants.items() if run is not None}, _REPEATS.value,
            first)
        rate = matmul_rate(cfg)
        print(f"  (FFN matmul: {rate / 1e9:.1f} GFLOP/s)")
        seconds["ceiling"] = ceiling_seconds(cfg, rows, pooled_only, rate)
        variants["ceiling"] = (None, {"real": 1, "computed": 1})  # a row of its own: no padding
        # The ratio is to transformers' faster batch size.
        baseline = min((v for k, v in seconds.items() if k.startswith("transformers")),
                       default=None)
        for variant, (_, tokens) in variants.items():
            if variant not in seconds:
                print(f"  {name:<30} {variant:<26} (no torch)")
                continue
            waste = 1 - tokens["real"] / max(tokens["computed"], 1)
            ratio = f"{baseline / seconds[variant]:.2f}x" if baseline else "-"
            once = f"{first[variant]:.2f} s" if variant in first else "-"
            print(f"  {name:<30} {variant:<26} {len(rows) / seconds[variant]:>8.1f} "
                  f"{100 * waste:>7.1f}% {ratio:>16} {once:>11}", flush=True)


if __name__ == "__main__":
    cli.run(main)
