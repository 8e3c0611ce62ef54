r"""Sentence embeddings: `predict embed` against sentence-transformers' encode, and the
contrastive training step with global negatives.

  python -m bertjax.benchmarks.embedding [--rows=1000] [--repeats=3] [--batch_size=64]
      [--mining_rows=1000000] [--mining_anchors=1000] [--noencode --notrain_step
      --nopacked_step] [--packed_pairs=32]

The model: a sentence-transformers directory written here (random weights of
all-MiniLM-L6-v2's shape: 6 layers, 384 wide, mean pooling then normalised; a WordPiece
vocabulary of 8,000 trained on the rows' corpus), converted with `bertjax.convert from_hf`.
Rows: the first `rows` sentences of data/demo_corpus.txt (`make corpus`). float32, the same
CPU, the same rows in the same order:

  bertjax Embedder          `python -m bertjax.predict embed`'s path and default batches: the
                            prediction engine's length buckets, the CPU split into one device
                            per core (at most 4), whole batches on each in turn
  sentence-transformers     SentenceTransformer.encode (PyTorch, batch_size rows, its own
                            length sort), normalised the same way

The training step (bertjax's jitted train step in a subprocess with 4 CPU devices, data
parallel; 64 pairs at 64 tokens, dropout 0.1, AdamW): the in-batch-negatives loss over the
global batch (every device's rows are every anchor's negatives) and its cached mode
(GradCache, 16 rows a chunk), against the same step with a loss of each pair alone (the
cosine loss: no row sees another; the baseline, what the global negatives cost).

Packed texts (config.data.pack, bertjax/tasks/embedding/packed.py; in a subprocess, one CPU
device, as a fine-tuning run on a CPU): the train step on `packed_pairs` (question, passage)
pairs of a skewed length mix (questions of 12-20 tokens, passages of 150-250, max_seq_length
256; 4 layers, 128 wide, float32, dropout 0.1, AdamW, the in-batch-negatives loss): bertjax's
unpacked rows (each row's texts padded to its longest, the batch to its length bucket) and
packed rows, against sentence-transformers' step on the same token ids and model (a
transformers BertModel of the same sizes with mean pooling, its collator's padding of each
column to its longest, MultipleNegativesRankingLoss, AdamW, PyTorch on every core): tokens
computed, step ms, and each step's speed as a multiple of sentence-transformers'.

Hard-negative mining (bertjax/tasks/embedding/mining.py, in a subprocess, the CPU split into
devices as `predict mine` splits it, the search sharded over them): `mining_anchors` anchors
against a corpus of `mining_rows` random float32 vectors of 384 (1,000,000 of them: 1.5 GB),
3 negatives, relative margin 0.05. Its wall time, and its peak RSS (ru_maxrss) against the
corpus's own bytes and against what one [anchors, corpus] float32 score matrix would take:
the search scores a chunk of the corpus at a time, so the peak stays near the corpus's size.

Sentences/s are the median of `repeats` passes after a first pass (compiles); run it on a
quiet machine, the figures are comparable within one run only.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
import types

import numpy as np
from absl import flags

from bertjax import cli, runtime
from bertjax.benchmarks import interleaved_median_seconds

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512)


def define_flags() -> None:
    flags.DEFINE_integer("rows", 1000, "Sentences embedded.")
    flags.DEFINE_integer("repeats", 3, "Timed passes.")
    flags.DEFINE_integer("batch_size", 64, "sentence-transformers' rows per batch (bertjax "
                         "batches as `predict embed` does by default).")
    flags.DEFINE_string("corpus", "data/demo_corpus.txt", "Sentences, one a line.")
    flags.DEFINE_bool("encode", True, "Time the sentence vectors against "
                      "sentence-transformers.")
    flags.DEFINE_bool("train_step", True, "Also time the training step on 4 CPU devices.")
    flags.DEFINE_bool("packed_step", True, "Also time the train step of packed texts against "
                      "unpacked rows and sentence-transformers.")
    flags.DEFINE_integer("packed_pairs", 32, "Pairs of the packed-step measurement's batch.")
    flags.DEFINE_integer("mining_rows", 1_000_000, "Corpus vectors of the hard-negative "
                         "mining measurement (0: none).")
    flags.DEFINE_integer("mining_anchors", 1000, "Anchors of the mining measurement.")


def read_rows(path: str, count: int) -> list[str]:
    if not os.path.exists(path):
        sys.exit(f"error: {path} does not exist; run `make corpus` first")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(line.strip())
            if len(rows) == count:
                break
    return rows


def write_model(directory: str, sentences: list[str]) -> str:
    """A random all-MiniLM-L6-v2-shaped sentence-transformers directory; returns it."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from bertjax.tokenization.train import train_wordpiece

    hf = os.path.join(directory, "hf")
    os.makedirs(hf)
    vocab = train_wordpiece(sentences, 8000)
    with open(os.path.join(hf, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(vocab), **MINILM)
    transformers.BertModel(config).save_pretrained(hf)
    transformers.BertTokenizerFast(os.path.join(hf, "vocab.txt"),
                                   do_lower_case=True).save_pretrained(hf)
    encoder = models.Transformer(hf, max_seq_length=128)
    pooling = models.Pooling(encoder.get_word_embedding_dimension(), "mean")
    st = os.path.join(directory, "st")
    SentenceTransformer(modules=[encoder, pooling, models.Normalize()], device="cpu").save(st)
    return st


def convert(st: str, output: str) -> None:
    """`python -m bertjax.convert from_hf --input=ST --output=OUTPUT`, its report silenced."""
    from bertjax.convert.__main__ import from_hf

    args = types.SimpleNamespace(input=st, output=output, vocab=None, do_lower_case=None,
                                 seed=0, overwrite=False)
    with contextlib.redirect_stdout(io.StringIO()):
        from_hf(args)


def encode_table(rows: list[str], batch_size: int, repeats: int) -> None:
    import jax
    import torch
    from sentence_transformers import SentenceTransformer

    from bertjax.serving.embedder import Embedder

    with tempfile.TemporaryDirectory() as directory:
        st = write_model(directory, rows)
        checkpoint = os.path.join(directory, "ckpt")
        convert(st, checkpoint)
        devices = jax.devices() if len(jax.devices()) > 1 else None  # main split the CPU
        # The rows `python -m bertjax.predict embed` batches by default (on a CPU, 8 at 128
        # tokens, more at shorter lengths).
        embedder = Embedder.from_checkpoint(checkpoint, 128, dtype="float32", devices=devices)
        reference = SentenceTransformer(st, device="cpu")
        torch.set_num_threads(os.cpu_count() or 1)

        def ours():
            return embedder(rows)

        def theirs():
            with torch.inference_mode():
                return reference.encode(rows, batch_size=batch_size, convert_to_numpy=True)

        gap = float(np.max(np.abs(ours() - theirs())))
        first: dict[str, float] = {}
        seconds = interleaved_median_seconds({"bertjax": ours, "st": theirs}, repeats, first)
    where = f"{len(devices)} CPU devices in turn" if devices else "1 CPU device"
    print(f"Sentence vectors of {len(rows)} sentences (MiniLM-L6 shape, mean pooling, "
          f"normalised, float32, max 128 tokens; largest |difference| {gap:.1e}):")
    print(f"  {'variant':<40} {'sentences/s':>12} {'first pass s':>13} {'ratio':>6}")
    base = len(rows) / seconds["st"]
    for name, label in (("bertjax", f"bertjax Embedder ({where})"),
                        ("st", f"sentence-transformers encode (batch {batch_size})")):
        rate = len(rows) / seconds[name]
        print(f"  {label:<40} {rate:>12.1f} {first[name]:>13.1f} {rate / base:>6.2f}")


TRAIN_SCRIPT = r"""
import functools, json
import jax, numpy as np
from bertjax.benchmarks import interleaved_median_seconds
from bertjax.models import BertConfig
from bertjax.tasks import get_task
from bertjax.train import sharding as sharding_lib, step as step_lib
from bertjax.train.optimizer import make_optimizer
from experiments import embedding

BATCH, SEQ = 64, 64
model_config = BertConfig(vocab_size=8000, hidden_size=384, num_layers=6, num_heads=12,
                          intermediate_size=1536, max_position_embeddings=512)
rng = np.random.default_rng(0)
ids = rng.integers(5, 8000, size=(BATCH, 2, SEQ)).astype(np.int32)
mask = (np.arange(SEQ)[None, None] < rng.integers(8, SEQ + 1, size=(BATCH, 2, 1))).astype(
    np.int32)
host_batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask,
              "labels": rng.uniform(-1, 1, BATCH).astype(np.float32),
              "weights": np.ones(BATCH, np.float32)}

def variant(kind, loss, chunk):
    config = embedding.get_config(kind)
    config.train.batch_size = BATCH
    config.task.update(loss=loss, cache_chunk_rows=chunk)
    task = get_task(config)
    model = task.model(model_config)
    mesh = sharding_lib.make_mesh(config.mesh)
    rules = config.logical_axis_rules
    init = lambda key: model.init(key, *task.init_inputs())["params"]

    def loss_fn(params, batch, key, denominators=None):
        vectors = task.outputs(model, params, batch, deterministic=False,
                               rngs={"dropout": key})
        return task.loss(vectors, batch, denominators)

    config.optimizer.warmup_steps = 100
    tx, schedule = make_optimizer(config.optimizer, 1000)
    _, shardings = step_lib.state_shardings(init, tx, mesh, rules)
    state = step_lib.create_train_state(init, tx, jax.random.key(0), shardings)
    batch_sharding = sharding_lib.batch_sharding(mesh, rules)
    batch = jax.device_put(host_batch, batch_sharding)
    step = step_lib.jit_train_step(loss_fn, tx, schedule, shardings, batch_sharding,
                                   denominators=task.denominators, rules=rules)
    holder = [state]

    def run():
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics)
    return run

steps = {"pairs": variant("scored", "cosine", 0), "global": variant("pairs", "in_batch", 0),
         "cached": variant("pairs", "in_batch", 16)}
first = {}
seconds = interleaved_median_seconds(steps, REPEATS, first)
print(json.dumps({"seconds": seconds, "first": first}))
"""


def train_table(repeats: int) -> None:
    import json
    import subprocess

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    script = TRAIN_SCRIPT.replace("REPEATS", str(repeats))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True)
    if result.returncode:
        sys.exit(f"error: the training-step benchmark failed: {result.stderr[-2000:]}")
    timing = json.loads(result.stdout.strip().splitlines()[-1])
    seconds, first = timing["seconds"], timing["first"]
    print("Contrastive training step, 4 CPU devices (data parallel), 64 pairs at 64 tokens, "
          "MiniLM-L6 shape, float32, AdamW:")
    print(f"  {'variant':<52} {'pairs/s':>8} {'step ms':>8} {'compile s':>9} {'ratio':>6}")
    labels = {"pairs": "each pair alone (cosine loss; baseline)",
              "global": "in-batch negatives over the global batch of 64",
              "cached": "the same, cached (GradCache, 16-row chunks)"}
    for name in ("pairs", "global", "cached"):
        print(f"  {labels[name]:<52} {64 / seconds[name]:>8.1f} {1000 * seconds[name]:>8.1f} "
              f"{first[name]:>9.1f} {seconds['pairs'] / seconds[name]:>6.2f}")


PACKED_SCRIPT = r"""
import json, os, sys, tempfile
import jax, numpy as np
from bertjax.benchmarks import interleaved_median_seconds
from bertjax.models import BertConfig
from bertjax.tasks import base
from bertjax.tasks.embedding.task import EmbeddingFeatures, EmbeddingTask
from bertjax.train import sharding as sharding_lib, step as step_lib
from bertjax.train.optimizer import make_optimizer
from experiments import embedding

PAIRS, REPEATS, SEQ, VOCAB = int(sys.argv[1]), int(sys.argv[2]), 256, 8000
SIZES = dict(hidden_size=128, num_layers=4, num_heads=2, intermediate_size=512)
rng = np.random.default_rng(0)

def text(low, high):
    ids = rng.integers(5, VOCAB, int(rng.integers(low, high + 1)))
    ids[0], ids[-1] = 2, 3
    return ids

pairs = [(text(12, 20), text(150, 250)) for _ in range(PAIRS)]
sequences = []
for texts in pairs:  # EmbeddingTask.encode's rows: the texts padded to the longest
    row = np.zeros((2, 3, max(map(len, texts))), np.int32)
    for c, ids in enumerate(texts):
        row[c, 0, :len(ids)], row[c, 2, :len(ids)] = ids, 1
    sequences.append(row)
features = EmbeddingFeatures(sequences, np.zeros(PAIRS, np.float32), True)
model_config = BertConfig(vocab_size=VOCAB, max_position_embeddings=512, **SIZES)

def bertjax_step(pack):
    config = embedding.get_config("pairs")
    config.data.pack, config.max_seq_length, config.train.batch_size = pack, SEQ, PAIRS
    config.task.update(pooling="mean", normalize="false")
    task = EmbeddingTask(config)
    task.buckets, task.columns = task.bucket_lengths(SEQ), 2  # what encode / read set
    host_batch = next(iter(task.batches(features, PAIRS, shuffle=True)))
    model = task.model(model_config)
    mesh = sharding_lib.make_mesh(config.mesh)
    rules = config.logical_axis_rules
    init = lambda key: model.init(key, *task.init_inputs())["params"]
    loss_fn = lambda params, batch, key, denominators=None: base._loss(
        params, batch, key, denominators, task=task, model=model)
    config.optimizer.warmup_steps = 100
    tx, schedule = make_optimizer(config.optimizer, 1000)
    _, shardings = step_lib.state_shardings(init, tx, mesh, rules)
    holder = [step_lib.create_train_state(init, tx, jax.random.key(0), shardings)]
    batch_sharding = sharding_lib.batch_sharding(mesh, rules)
    batch = jax.device_put(host_batch, batch_sharding)
    step = step_lib.jit_train_step(loss_fn, tx, schedule, shardings, batch_sharding,
                                   denominators=task.denominators, rules=rules)

    def run():
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics)
    return run, int(host_batch["input_ids"].size)

def st_step():
    import torch, transformers
    from sentence_transformers import SentenceTransformer, losses, models

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp()
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                          + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    transformers.BertTokenizerFast(os.path.join(directory, "vocab.txt")).save_pretrained(
        directory)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=SIZES["hidden_size"],
        num_hidden_layers=SIZES["num_layers"], num_attention_heads=SIZES["num_heads"],
        intermediate_size=SIZES["intermediate_size"], max_position_embeddings=512)
    ).save_pretrained(directory)
    encoder = models.Transformer(directory, max_seq_length=SEQ)
    model = SentenceTransformer(modules=[encoder, models.Pooling(
        encoder.get_word_embedding_dimension(), "mean")], device="cpu")
    model.train()
    loss = losses.MultipleNegativesRankingLoss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    columns = []
    for c in range(2):  # its collator: each column padded to its own longest text
        longest = max(len(p[c]) for p in pairs)
        ids = torch.zeros((PAIRS, longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(pairs):
            ids[i, :len(p[c])], mask[i, :len(p[c])] = torch.from_numpy(p[c]), 1
        columns.append({"input_ids": ids, "attention_mask": mask,
                        "token_type_ids": torch.zeros_like(ids)})

    def run():
        loss(columns, None).backward()
        optimizer.step()
        optimizer.zero_grad()
    return run, sum(int(c["input_ids"].numel()) for c in columns)

steps, tokens = {}, {}
for name, make in (("padded", lambda: bertjax_step(False)), ("packed", lambda: bertjax_step(True)),
                   ("st", st_step)):
    try:
        steps[name], tokens[name] = make()
    except ImportError:  # sentence-transformers is not installed: bertjax's two alone
        pass
first = {}
seconds = interleaved_median_seconds(steps, REPEATS, first)
print(json.dumps({"seconds": seconds, "first": first, "tokens": tokens}))
"""


def packed_table(pairs: int, repeats: int) -> None:
    import json
    import subprocess

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    result = subprocess.run([sys.executable, "-c", PACKED_SCRIPT, str(pairs), str(repeats)],
                            env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"error: the packed-step benchmark failed: {result.stderr[-2000:]}")
    timing = json.loads(result.stdout.strip().splitlines()[-1])
    seconds, first, tokens = timing["seconds"], timing["first"], timing["tokens"]
    print(f"Contrastive train step of {pairs} (question, passage) pairs, questions 12-20 "
          "tokens, passages 150-250, max 256; 4 layers, 128 wide, float32, dropout 0.1, AdamW; "
          "1 CPU device:")
    print(f"  {'variant':<52} {'tokens':>7} {'step ms':>8} {'first s':>8} {'speed':>6}")
    labels = {"padded": "bertjax, unpacked rows (config.data.pack=False)",
              "packed": "bertjax, packed texts (config.data.pack=True)",
              "st": "sentence-transformers, MultipleNegativesRankingLoss"}
    base = seconds.get("st", seconds["padded"])
    for name in labels:
        if name in seconds:
            print(f"  {labels[name]:<52} {tokens[name]:>7} {1000 * seconds[name]:>8.1f} "
                  f"{first[name]:>8.1f} {base / seconds[name]:>6.2f}")
    print("  (speed: a multiple of sentence-transformers' step where it is installed, else of "
          "the unpacked step's)")


MINING_SCRIPT = r"""
import json, resource, sys, time
from bertjax import runtime
runtime.split_cpu()  # as `python -m bertjax.predict mine`, before JAX starts
import jax, numpy as np
from jax.sharding import Mesh
from bertjax.tasks.embedding import mining

def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

rows, anchors = int(sys.argv[1]), int(sys.argv[2])
jax.numpy.zeros(1).block_until_ready()  # the backend started: its memory is not the search's
before = peak_rss()
rng = np.random.default_rng(0)
corpus = rng.standard_normal((rows, 384), dtype=np.float32)
queries = corpus[:anchors] + rng.standard_normal((anchors, 384), dtype=np.float32)
loaded = peak_rss()
mesh = Mesh(np.array(jax.devices()), ("corpus",))
start = time.perf_counter()
mined = mining.mine_hard_negatives(queries, corpus, [[i] for i in range(anchors)], 3,
                                   relative_margin=0.05, mesh=mesh)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "before": before, "loaded": loaded, "peak": peak_rss(),
                  "corpus": corpus.nbytes, "devices": len(jax.devices()),
                  "complete": int(mined.complete.sum())}))
"""


def mining_table(rows: int, anchors: int) -> None:
    import json
    import subprocess

    result = subprocess.run([sys.executable, "-c", MINING_SCRIPT, str(rows), str(anchors)],
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"error: the mining benchmark failed: {result.stderr[-2000:]}")
    m = json.loads(result.stdout.strip().splitlines()[-1])
    gb = 1e9
    matrix = anchors * rows * 4  # one float32 score per (anchor, corpus row)
    print(f"Hard-negative mining: {anchors} anchors over {rows} x 384 float32 vectors "
          f"({m['corpus'] / gb:.2f} GB), 3 negatives, relative margin 0.05, exact search on "
          f"{m['devices']} CPU device(s):")
    print(f"  {'wall s':>7} {'peak RSS GB':>12} {'above the vectors GB':>21} "
          f"{'[anchors, corpus] matrix GB':>28} {'anchors mined':>14}")
    print(f"  {m['seconds']:>7.1f} {m['peak'] / gb:>12.2f} {(m['peak'] - m['loaded']) / gb:>21.2f} "
          f"{matrix / gb:>28.2f} {m['complete']:>14}")
    print(f"  (before the vectors: {m['before'] / gb:.2f} GB; with them {m['loaded'] / gb:.2f} "
          "GB: the search adds what is above them)")


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    runtime.split_cpu()  # as `python -m bertjax.predict` does, before JAX starts
    start = time.time()
    if f.encode:
        encode_table(read_rows(f.corpus, f.rows), f.batch_size, f.repeats)
    if f.train_step:
        train_table(f.repeats)
    if f.packed_step:
        packed_table(f.packed_pairs, f.repeats)
    if f.mining_rows:
        mining_table(f.mining_rows, f.mining_anchors)
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    cli.run(main, define_flags)
