r"""Throughput of the pre-training data pipeline on the demo corpus.

  python -m bertjax.benchmarks.pretraining_input [--corpus=data/demo_corpus.txt] [--vocab=DIR]

1. create_pretraining_data: MB of raw text/s and instances/s with 1 and 2 workers (128 tokens,
   dupe_factor 5, 8 shards, static masking): wall-clock rates (worker start-up included), the
   speed-up of 2 workers over 1, and the rate per core (the shards' own CPU time, so machine
   load does not count). Raw text is counted once, whatever the dupe_factor. "cores busy" is
   the shards' CPU time over the wall time: below 2 with 2 workers, the machine is shared.
2. The tf.data reader: sequences/s at 128/20 and 512/80, batch 256, static records and dynamic
   masking: wall-clock, and per CPU-second of the process (all its threads: the rate per core).
   The "packed" rows: `packed_input.make_packed_dataset` (dynamic masking) over the 128-token
   whole-sentence examples of `python -m data_pipeline.create_segments`, packed into rows of
   128 and 512: packed rows/s (each holding one example at 128, ~4.4 at 512).

Needs the demo corpus (`make corpus`); without --vocab a WordPiece vocabulary of 8,000 pieces
is trained on the corpus with `python -m bertjax.tokenization train` into data/demo_vocab.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from bertjax import cli
from bertjax.errors import DataError


def _tokenizer(vocab):
    from bertjax.tokenization import load_tokenizer

    return load_tokenizer(vocab)


def bench_creation(corpus_path, vocab, workdir, workers, seq_len=128, max_pred=20,
                   masking="static", num_shards=8, dupe_factor=5):
    import functools

    from data_pipeline import create_pretraining_data as cpd

    out = os.path.join(workdir, f"create_{seq_len}_{workers}_{masking}_{dupe_factor}")
    cfg = cpd.CreateConfig(input=corpus_path, output_dir=out, max_seq_length=seq_len,
                           max_predictions_per_seq=max_pred, dupe_factor=dupe_factor,
                           masking=masking, num_shards=num_shards, num_workers=workers)
    start = time.perf_counter()
    meta = cpd.create_pretraining_data(cfg, functools.partial(_tokenizer, vocab))
    seconds = time.perf_counter() - start
    return out, meta, seconds


def bench_reader(pattern, seq_len, max_pred, dynamic, batches=40, batch_size=256):
    """(sequences/s wall-clock, sequences per CPU-second of this process)."""
    from data_pipeline import pretraining_input as pi

    masking = pi.masking_from_metadata(pattern, max_predictions=max_pred) if dynamic else None
    it = pi.InputIterator(pi.make_dataset(pattern, seq_len=seq_len, max_predictions=max_pred,
                                          batch_size=batch_size, masking=masking))
    return _rates(it, batches, batch_size)


def _rates(it, batches, batch_size):
    """(rows/s wall-clock, rows per CPU-second of this process) over `batches` batches."""
    for _ in range(5):
        next(it)  # fill the shuffle buffer, warm up
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(it)
    rows = batches * batch_size
    return rows / (time.perf_counter() - start), rows / (time.process_time() - cpu)


def make_segments(corpus_path, vocab, workdir):
    """Writes the 128-token whole-sentence examples of create_segments; returns their pattern."""
    import functools

    from data_pipeline import create_segments as cs

    out = os.path.join(workdir, "segments_128")
    cs.create_segments(cs.SegmentsConfig(input=corpus_path, output_dir=out, num_shards=4,
                                         num_workers=2), functools.partial(_tokenizer, vocab))
    return os.path.join(out, "part-*")


def bench_packed_reader(pattern, seq_len, max_pred, batches=40, batch_size=256):
    """(packed rows/s wall-clock, packed rows per CPU-second of this process)."""
    from data_pipeline import packed_input as pk

    masking = pk.masking_from_metadata(pattern, max_predictions=max_pred)
    it = pk.InputIterator(pk.make_packed_dataset(pattern, seq_len=seq_len,
                                                 batch_size=batch_size, masking=masking))
    return _rates(it, batches, batch_size)


def main(args) -> None:
    if not os.path.exists(args.corpus):
        raise DataError(f"{args.corpus}: not found (run `make corpus`)")
    vocab = args.vocab or "data/demo_vocab"
    if not os.path.exists(vocab):
        subprocess.run([sys.executable, "-m", "bertjax.tokenization", "train",
                        f"--input={args.corpus}", "--vocab_size=8000", "--lowercase",
                        f"--output={vocab}"], check=True)
    workdir = tempfile.mkdtemp(prefix="bertjax_data_bench_")
    try:
        print(f"create_pretraining_data on {args.corpus} (128 tokens, static masking, "
              f"dupe_factor {args.dupe_factor}, {args.num_shards} shards)")
        print(f"{'workers':>8} {'wall s':>8} {'MB/s':>8} {'inst/s':>9} {'speed-up':>9} "
              f"{'MB/s/core':>10} {'inst/s/core':>12} {'cores busy':>11}")
        one_worker = None
        for workers in (1, 2):
            _, meta, seconds = bench_creation(args.corpus, vocab, workdir, workers,
                                              num_shards=args.num_shards,
                                              dupe_factor=args.dupe_factor)
            c = meta["counts"]
            mb = c["text_bytes"] / 1e6
            one_worker = one_worker or seconds
            # Per core: the shards' own CPU time (worker start-up and machine load excluded).
            print(f"{workers:>8} {seconds:>8.1f} {mb / seconds:>8.2f} "
                  f"{c['instances'] / seconds:>9.0f} {one_worker / seconds:>8.2f}x "
                  f"{mb / c['cpu_seconds']:>10.2f} {c['instances'] / c['cpu_seconds']:>12.0f} "
                  f"{c['cpu_seconds'] / seconds:>11.2f}")
        print("\ntf.data reader, batch 256: sequences/s (wall) and per CPU-second (per core)")
        print(f"{'phase':>14} {'static':>10} {'/core':>8} {'dynamic':>10} {'/core':>8}")
        for seq_len, max_pred in ((128, 20), (512, 80)):
            rates = []
            for masking in ("static", "dynamic"):
                data, _, _ = bench_creation(args.corpus, vocab, workdir, 2, seq_len, max_pred,
                                            masking, num_shards=4, dupe_factor=1)
                rates += bench_reader(os.path.join(data, "part-*"), seq_len, max_pred,
                                      masking == "dynamic")
            print(f"{f'{seq_len}/{max_pred}':>14} {rates[0]:>10.0f} {rates[1]:>8.0f} "
                  f"{rates[2]:>10.0f} {rates[3]:>8.0f}")
        segments = make_segments(args.corpus, vocab, workdir)
        for seq_len, max_pred in ((128, 20), (512, 80)):
            wall, core = bench_packed_reader(segments, seq_len, max_pred)
            print(f"{f'packed {seq_len}/{max_pred}':>14} {'-':>10} {'-':>8} {wall:>10.0f} "
                  f"{core:>8.0f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("corpus", "data/demo_corpus.txt", "Reference-format corpus.")
    flags.DEFINE_string("vocab", None, "Tokenizer; default: data/demo_vocab (trained if absent).")
    flags.DEFINE_integer("dupe_factor", 5, "create_pretraining_data --dupe_factor.")
    flags.DEFINE_integer("num_shards", 8, "create_pretraining_data --num_shards.")


if __name__ == "__main__":
    cli.run_flags_command(main, define_flags)
