r"""Packed pre-training input for training without next sentence prediction, through tf.data.

What a no-NSP user needs. RoBERTa (Liu et al., 2019, §4.2) found that dropping NSP helps once
the pair format goes too: its best inputs are *full sentences* — each example a run of
contiguous whole sentences filling up to the row — either crossing document boundaries
("FULL-SENTENCES", rows always full, but attention mixes documents) or staying inside one
document ("DOC-SENTENCES", slightly better, but a document's last example is short, so rows
are padded or the batch size varies). Packing gives both at once: the examples are
DOC-SENTENCES (whole sentences of one document, `[CLS] sentences [SEP]`, segment 0), and
several of them share a row with `packing_ids`, so attention never crosses examples (the model
makes the mask block-diagonal and restarts position ids) while rows stay as full as
FULL-SENTENCES rows. NSP pairs are a poorer input (half of them glue a random other
document's text to A), though they can be packed too.

1. Data: `python -m data_pipeline.packed_input` writes such examples as TFRecords in the
   reference schema (unmasked, `next_sentence_labels` 0) plus `metadata.json`:

     python -m data_pipeline.packed_input --input=data/demo_corpus.txt --vocab=data/demo_vocab \
         --output_dir=data/segments_128 --max_seq_length=128 --num_shards=4

   then prints the padding fraction before and after packing. A sentence that no longer fits
   starts the next example, which leaves a gap of about half a sentence per example;
   `--whole_sentences=false` cuts the text every max_seq_length - 2 tokens instead (sentences
   may straddle two examples, as the reference generator's random truncation also does), so
   only a document's last example is short. BBC demo corpus (2,225 articles), padding
   unpacked → packed, 8 open rows:

     examples                        rows of 128       128-token examples in rows of 512
     whole sentences (default)       18.1% → 13.4%     79.5% → 5.5%
     --whole_sentences=false         10.6% →  3.9%     77.6% → 1.6%
     create_pretraining_data pairs   13.8% →  5.1%

   Unmasked pair data of `create_pretraining_data --masking=dynamic` is read too (each pair
   one example, NSP labels ignored). Records may be shorter than the rows (128-token
   examples packed into 512-token rows). Pre-masked (static) data is refused: rows are
   masked after packing.
2. Reading (`make_packed_dataset`): this host's files (sorted, every `process_count`-th, as
   `pretraining_input.make_dataset`) → shuffle file order → repeat → interleave → shuffle
   records → parse → pack (first fit over `num_open_rows` open rows, the rows and order of
   `packing.pack_examples`, as a `tf.data` scan: the open rows are part of the iterator state;
   `num_packers` such pipelines over disjoint files run in parallel) → batch → mask each
   packed row (the `masking.mask_batch_tf` rules, keyed by (seed, batch number): a fresh mask
   every epoch) → prefetch. Deterministic for a seed; `InputIterator`
   saves and restores the position, open rows and shuffle buffers included.

   Masking runs over a whole row: 15% of its real tokens (capped at max_predictions: use 20
   for 128-token rows and 80 for 512, which a full row needs). Every example ends with [SEP],
   which is never masked, so a whole word never spans two examples.

Batches (`[batch]` = the per-host batch size; no next_sentence_labels):
  input_ids, input_mask, segment_ids: [batch, seq] int32
  packing_ids: [batch, seq] int32, 1, 2, ... for the examples of a row, 0 for padding
  masked_lm_positions, masked_lm_ids: [batch, max_predictions] int32
  masked_lm_weights: [batch, max_predictions] float32
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from data_pipeline import corpus, instances, packing, tfrecords
from data_pipeline import create_pretraining_data as cpd
from data_pipeline import masking as masking_lib
from data_pipeline.masking import MaskingConfig
from data_pipeline.pretraining_input import InputIterator, host_files, masking_from_metadata

try:  # accelerators belong to JAX; TF only reads data
    tf.config.set_visible_devices([], "GPU")
    tf.config.set_visible_devices([], "TPU")
except RuntimeError:  # TF already initialised its devices in this process
    pass

__all__ = ["InputIterator", "SegmentsConfig", "create_segments", "make_packed_dataset",
           "masking_from_metadata", "pack_dataset", "packed_rows", "padding_stats"]

FORMAT = "bertjax-segments-v1"
_PARSE_BLOCK = 256  # records parsed together (one parse op per block, not per record)


# ------------------------------------------------------------------------------------ writing


@dataclasses.dataclass(frozen=True)
class SegmentsConfig:
    """Settings of `create_segments` (flags of the same names)."""

    input: str
    output_dir: str
    input_format: str = "reference"
    max_seq_length: int = 128
    whole_sentences: bool = True  # False: cut every max_seq_length - 2 tokens
    masked_lm_prob: float = 0.15  # recorded for the reader's dynamic masking
    do_whole_word_mask: bool = False
    random_seed: int = 12345
    num_shards: int = 1
    num_workers: int = 1
    shuffle_buffer: int = 10000

    def __post_init__(self):
        if self.max_seq_length < 3:
            raise ValueError(f"--max_seq_length must be >= 3, got {self.max_seq_length}")
        for name in ("num_shards", "num_workers", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


def create_segments_shard(cfg: SegmentsConfig, shard: int, tokenizer) -> dict:
    """Writes shard `shard` (documents k with k % num_shards == shard); returns its counts."""
    counts = dict.fromkeys(("documents", "sentences", "tokens", "text_bytes", "instances",
                            "instance_tokens"), 0)
    docs = corpus.iter_documents(cfg.input, cfg.input_format, shard, cfg.num_shards)
    max_tokens = cfg.max_seq_length - 2  # room for [CLS] and [SEP]

    def examples():
        for sentences in cpd.tokenize_documents(docs, tokenizer, counts):
            yield from packing.segments_from_document(sentences, max_tokens,
                                                      cfg.whole_sentences)

    # Consecutive examples of a document would otherwise sit side by side in the file.
    rng = np.random.default_rng([cfg.random_seed, shard, cfg.num_shards])
    path = os.path.join(cfg.output_dir, tfrecords.shard_name(shard, cfg.num_shards))
    with tfrecords.ShardWriter(path) as writer:
        for body in instances.shuffle_buffer(examples(), cfg.shuffle_buffer, rng):
            tokens = np.concatenate([[tokenizer.cls_id], body, [tokenizer.sep_id]])
            features = tfrecords.pad_example(tokens, np.zeros(len(tokens), np.int32), False,
                                             cfg.max_seq_length, None, 0)
            writer.write(tfrecords.serialize_example(features))
            counts["instances"] += 1
            counts["instance_tokens"] += len(tokens)
    return counts


def _worker(args) -> tuple[int, dict]:
    cfg, shard, tokenizer_factory = args
    return shard, create_segments_shard(cfg, shard, tokenizer_factory())


def create_segments(cfg: SegmentsConfig, tokenizer_factory: Callable[[], object],
                    **metadata_extra) -> dict:
    """Writes all shards (in `num_workers` processes) and metadata.json; returns the metadata.

    tokenizer_factory: a picklable callable returning the tokenizer (called once per worker).
    """
    os.makedirs(cfg.output_dir, exist_ok=True)
    start = time.perf_counter()
    tokenizer = tokenizer_factory()
    shards = list(range(cfg.num_shards))
    if cfg.num_workers == 1 or len(shards) == 1:
        results = {s: create_segments_shard(cfg, s, tokenizer) for s in shards}
    else:  # spawn, not fork: TensorFlow's threads do not survive a fork
        with multiprocessing.get_context("spawn").Pool(min(cfg.num_workers, len(shards))) as pool:
            results = dict(pool.imap_unordered(
                _worker, [(cfg, s, tokenizer_factory) for s in shards]))
    totals = {k: sum(c[k] for c in results.values()) for k in next(iter(results.values()))}
    if not totals["instances"]:
        raise ValueError(f"{cfg.input}: no examples created from {totals['documents']} "
                         "documents (empty input?); no metadata written")
    vocab_tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    meta = {
        "format": FORMAT,
        "masking": "dynamic",  # unmasked: readable by make_dataset(masking=...) as well
        "max_seq_length": cfg.max_seq_length,
        "whole_sentences": cfg.whole_sentences,
        "masked_lm_prob": cfg.masked_lm_prob,
        "do_whole_word_mask": cfg.do_whole_word_mask,
        "random_seed": cfg.random_seed,
        "num_shards": cfg.num_shards,
        "shuffle_buffer": cfg.shuffle_buffer,
        "input": cfg.input,
        "input_format": cfg.input_format,
        "vocab_hash": tfrecords.vocab_hash(vocab_tokens),
        "vocab_size": tokenizer.vocab_size,
        "mask_id": tokenizer.mask_id,
        "special_ids": sorted(int(i) for i in tokenizer.special_ids),
        "continuation_bits": masking_lib.encode_flags(masking_lib.continuation_flags(tokenizer)),
        "counts": totals,
        "shards": {tfrecords.shard_name(s, cfg.num_shards): c["instances"]
                   for s, c in sorted(results.items())},
        "seconds": round(time.perf_counter() - start, 3),
        **metadata_extra,
    }
    tfrecords.write_json_atomic(
        os.path.join(cfg.output_dir, f"{tfrecords.METADATA_PREFIX}.json"), meta)
    return meta


# ------------------------------------------------------------------------------------ packing


def _pack_step(seq_len: int, num_open_rows: int, max_examples: int):
    """The scan function of `pack_dataset`: adds one example (or flushes), maybe emits a row.

    State: input_ids / segment_ids / packing_ids [rows, seq_len] of the open rows, oldest
    first; lengths, counts [rows] (tokens, examples); n_open []. An example goes into the first
    open row it fits; when none fits and all rows are open, the oldest row is emitted (rows
    shift up) and the example starts a new row — `packing.pack_examples`' rule.
    """
    rows = tf.range(num_open_rows)
    positions = tf.range(seq_len)

    def step(state, ex):
        ids, segs, pids, lengths, counts, n_open = state
        n, flush = ex["length"], ex["flush"]
        fits = (rows < n_open) & (lengths + n <= seq_len) & (counts < max_examples)
        any_fit = tf.reduce_any(fits)
        first_fit = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
        emit = tf.where(flush, n_open > 0, ~any_fit & (n_open == num_open_rows))
        row = {"input_ids": ids[0], "segment_ids": segs[0], "packing_ids": pids[0]}

        def shift(x):  # drops the emitted oldest row
            return tf.where(emit, tf.concat([x[1:], tf.zeros_like(x[:1])], 0), x)

        ids, segs, pids, lengths, counts = map(shift, (ids, segs, pids, lengths, counts))
        n_open -= tf.cast(emit, tf.int32)
        insert = ~flush
        target = tf.where(any_fit, first_fit, n_open)
        n_open += tf.cast(insert & ~any_fit, tf.int32)
        # The example goes at offset `lengths[target]`: a roll keeps it contiguous, and what
        # wraps around is padding since offset + n <= seq_len.
        offset = tf.gather(lengths, target)
        real = tf.cast(positions < n, tf.int32)
        here = tf.cast((rows == target) & insert, tf.int32)  # [rows] one-hot
        place = lambda x: here[:, None] * tf.roll(x * real, offset, 0)[None, :]
        ids += place(ex["input_ids"])
        segs += place(ex["segment_ids"])
        pids += place(real * (tf.gather(counts, target) + 1))
        lengths += here * n
        counts += here
        return (ids, segs, pids, lengths, counts, n_open), (emit, row)

    return step


def pack_dataset(examples: tf.data.Dataset, seq_len: int, *, num_open_rows: int = 8,
                 max_examples_per_row: int | None = None,
                 flush: bool = True) -> tf.data.Dataset:
    """Packs a stream of examples into rows of seq_len (see module docstring).

    examples: elements {"input_ids": [seq_len] int32, "segment_ids": [seq_len] int32,
      "length": [] int32} with the example's `length` real tokens first, 1 <= length <= seq_len.
    flush: emit the still-open rows when `examples` ends (finite data; an endless stream never
      ends). Returns rows {input_ids, segment_ids, packing_ids, input_mask: [seq_len] int32},
      the rows of `packing.pack_examples` in its order.
    """
    if num_open_rows < 1:
        raise ValueError(f"num_open_rows must be >= 1, got {num_open_rows}")
    max_examples = seq_len if max_examples_per_row is None else max_examples_per_row
    ds = examples.map(lambda ex: {**ex, "flush": tf.constant(False)})
    if flush:
        sentinel = {"input_ids": tf.zeros([seq_len], tf.int32),
                    "segment_ids": tf.zeros([seq_len], tf.int32),
                    "length": tf.constant(0, tf.int32), "flush": tf.constant(True)}
        ds = ds.concatenate(tf.data.Dataset.from_tensors(sentinel).repeat(num_open_rows))
    zeros = tf.zeros([num_open_rows, seq_len], tf.int32)
    initial = (zeros, zeros, zeros, tf.zeros([num_open_rows], tf.int32),
               tf.zeros([num_open_rows], tf.int32), tf.constant(0, tf.int32))
    ds = ds.scan(initial, _pack_step(seq_len, num_open_rows, max_examples))
    ds = ds.filter(lambda emit, row: emit)
    return ds.map(lambda emit, row: {**row, "input_mask": tf.cast(row["packing_ids"] > 0,
                                                                  tf.int32)})


# ------------------------------------------------------------------------------------ reading


def record_length(file_pattern: str, seq_len: int,
                  masking_cfg: MaskingConfig | None = None) -> int:
    """The records' max_seq_length from metadata.json, checked against the packed rows."""
    found = tfrecords.read_metadata(file_pattern)
    if found is None:
        raise ValueError(f"{file_pattern}: no metadata*.json beside the files; packing reads "
                         "unmasked data written by `python -m data_pipeline.packed_input` or "
                         "`create_pretraining_data --masking=dynamic`")
    path, meta = found
    if meta.get("masking", "static") != "dynamic":
        raise ValueError(f"{path}: masking is {meta.get('masking', 'static')!r}; packed rows are "
                         "masked after packing, so the records must be unmasked ('dynamic')")
    length = meta.get("max_seq_length")
    if not isinstance(length, int) or not 0 < length <= seq_len:
        raise ValueError(f"{path}: max_seq_length is {length}; records must fit the packed rows "
                         f"(seq_len={seq_len})")
    if masking_cfg is not None and meta.get("vocab_size") not in (None, masking_cfg.vocab_size):
        raise ValueError(f"{path}: vocab_size is {meta.get('vocab_size')} but the masking config "
                         f"has vocab_size={masking_cfg.vocab_size}")
    return length


def _examples(serialized: tf.data.Dataset, record_len: int, seq_len: int) -> tf.data.Dataset:
    """Serialized records → {input_ids, segment_ids: [seq_len], length: []}, empty ones dropped."""
    spec = tfrecords.feature_spec(record_len, 0, masked=False)
    del spec["next_sentence_labels"]  # no NSP: the label is never read

    def parse(block):
        parsed = tf.io.parse_example(block, spec)
        pad = [[0, 0], [0, seq_len - record_len]]
        return {
            "input_ids": tf.pad(tf.cast(parsed["input_ids"], tf.int32), pad),
            "segment_ids": tf.pad(tf.cast(parsed["segment_ids"], tf.int32), pad),
            # Records hold their real tokens first (reference layout).
            "length": tf.reduce_sum(tf.cast(parsed["input_mask"], tf.int32), axis=1),
        }

    ds = serialized.batch(_PARSE_BLOCK).map(parse, num_parallel_calls=tf.data.AUTOTUNE,
                                            deterministic=True).unbatch()
    return ds.filter(lambda ex: ex["length"] > 0)


def packed_rows(file_pattern: str, *, seq_len: int, seed: int = 0, shuffle: bool = True,
                repeat: bool = True, process_index: int = 0, process_count: int = 1,
                num_open_rows: int = 8, max_examples_per_row: int | None = None,
                num_packers: int = 1, shuffle_buffer: int = 10_000, cycle_length: int = 8,
                masking_cfg: MaskingConfig | None = None) -> tf.data.Dataset:
    """Unmasked packed rows of this host's share of the data: {input_ids, input_mask,
    segment_ids, packing_ids: [seq_len] int32}.

    num_packers: independent packers, each over every num_packers-th of this host's files and
    running in its own thread; rows are taken from them in turn. A packer handles ~7,000
    examples/s (tf.data runs its scan one example at a time), so use several when one host
    needs more.
    """
    record_len = record_length(file_pattern, seq_len, masking_cfg)
    files = host_files(file_pattern, process_index, process_count)
    if num_packers < 1:
        raise ValueError(f"num_packers must be >= 1, got {num_packers}")
    groups = min(num_packers, len(files))
    packers = []
    for p in range(groups):
        ds = tf.data.Dataset.from_tensor_slices(files[p::groups])
        if shuffle:
            ds = ds.shuffle(len(files), seed=seed + 2 * p, reshuffle_each_iteration=True)
        if repeat:
            ds = ds.repeat()
        ds = ds.interleave(tf.data.TFRecordDataset,
                           cycle_length=min(cycle_length, len(files[p::groups])), block_length=1,
                           num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if shuffle:
            ds = ds.shuffle(shuffle_buffer, seed=seed + 2 * p + 1, reshuffle_each_iteration=True)
        packers.append(pack_dataset(_examples(ds, record_len, seq_len), seq_len,
                                    num_open_rows=num_open_rows,
                                    max_examples_per_row=max_examples_per_row,
                                    flush=not repeat))
    if groups == 1:
        return packers[0]
    # prefetch: each packer fills rows in a thread of its own. Taking rows in a fixed turn
    # keeps the stream deterministic; a packer that runs out (finite data) is skipped.
    return tf.data.Dataset.choose_from_datasets(
        [d.prefetch(64) for d in packers], tf.data.Dataset.range(groups).repeat(),
        stop_on_empty_dataset=False)


def make_packed_dataset(file_pattern: str, *, seq_len: int, batch_size: int,
                        masking: MaskingConfig, seed: int = 0, shuffle: bool = True,
                        repeat: bool = True, process_index: int = 0, process_count: int = 1,
                        num_open_rows: int = 8, max_examples_per_row: int | None = None,
                        num_packers: int = 1, shuffle_buffer: int = 10_000,
                        cycle_length: int = 8) -> tf.data.Dataset:
    """Masked batches of packed rows (see module docstring for the features).

    masking: the dynamic-masking config (`masking_from_metadata`); its max_predictions is the
    per-row number of predictions. Wrap in `InputIterator` for a checkpointable position.
    """
    ds = packed_rows(file_pattern, seq_len=seq_len, seed=seed, shuffle=shuffle, repeat=repeat,
                     process_index=process_index, process_count=process_count,
                     num_open_rows=num_open_rows, max_examples_per_row=max_examples_per_row,
                     num_packers=num_packers, shuffle_buffer=shuffle_buffer,
                     cycle_length=cycle_length, masking_cfg=masking)
    ds = ds.batch(batch_size, drop_remainder=True)

    def mask(index, batch):
        key = tf.stack([tf.cast(seed, tf.int64), index])
        batch.update(masking_lib.mask_batch_tf(batch["input_ids"], batch["input_mask"], masking,
                                               key))
        return batch

    ds = ds.enumerate().map(mask, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def padding_stats(file_pattern: str, *, seq_len: int, num_open_rows: int = 8,
                  max_examples_per_row: int | None = None) -> packing.PackingStats:
    """Padding fraction before (one example per row) and after packing, over one pass."""
    stats = packing.PackingStats(seq_len)
    rows = packed_rows(file_pattern, seq_len=seq_len, shuffle=False, repeat=False,
                       num_open_rows=num_open_rows, max_examples_per_row=max_examples_per_row)
    for block in rows.batch(1024).as_numpy_iterator():
        stats.add_rows(block["packing_ids"])
    return stats


# ------------------------------------------------------------------------------------ the CLI


def main(argv):
    del argv
    from absl import flags

    f = flags.FLAGS
    if not os.path.exists(f.vocab):
        raise SystemExit(f"--vocab: no such file or directory: {f.vocab}")
    try:
        cfg = SegmentsConfig(
            input=f.input, output_dir=f.output_dir, input_format=f.input_format,
            max_seq_length=f.max_seq_length, whole_sentences=f.whole_sentences,
            masked_lm_prob=f.masked_lm_prob,
            do_whole_word_mask=f.do_whole_word_mask, random_seed=f.random_seed,
            num_shards=f.num_shards, num_workers=f.num_workers, shuffle_buffer=f.shuffle_buffer)
        factory = functools.partial(cpd.load_tokenizer, f.vocab, f.do_lower_case)
        meta = create_segments(cfg, factory, vocab=f.vocab, do_lower_case=f.do_lower_case)
    except (corpus.CorpusError, ValueError) as e:
        raise SystemExit(str(e)) from None
    c = meta["counts"]
    print(f"wrote {c['instances']} examples from {c['documents']} documents, "
          f"{c['text_bytes'] / 1e6:.2f} MB of text, in {meta['seconds']:.1f} s → {cfg.output_dir}")
    pattern = os.path.join(cfg.output_dir, tfrecords.SHARD_PATTERN)
    for seq_len in sorted({cfg.max_seq_length, *f.report_seq_len}):
        if seq_len >= cfg.max_seq_length:
            print(padding_stats(pattern, seq_len=seq_len, num_open_rows=f.num_open_rows)
                  .summary())


def _define_flags():
    from absl import flags

    flags.DEFINE_string("input", None, "Input files: comma-separated files, globs, directories, "
                        "or tfds:NAME[:SPLIT[:FEATURE]].", required=True)
    flags.DEFINE_enum("input_format", "reference", ["reference", "plain", "jsonl", "tfds"],
                      "As in create_pretraining_data.")
    flags.DEFINE_string("output_dir", None, "Directory for the TFRecord shards.", required=True)
    flags.DEFINE_string("vocab", None, "vocab.txt, SentencePiece .model or tokenizer directory.",
                        required=True)
    flags.DEFINE_boolean("do_lower_case", None, "Lower-case input (default: tokenizer config).")
    flags.DEFINE_integer("max_seq_length", 128, "Longest example, [CLS] and [SEP] included.")
    flags.DEFINE_boolean("whole_sentences", True, "Examples end at sentence ends (RoBERTa's "
                         "DOC-SENTENCES); false: cut the text every max_seq_length - 2 tokens.")
    flags.DEFINE_float("masked_lm_prob", 0.15, "Masking rate recorded for the reader.")
    flags.DEFINE_boolean("do_whole_word_mask", False, "Whole-word masking, for the reader.")
    flags.DEFINE_integer("random_seed", 12345, "Seed of the output shuffle.")
    flags.DEFINE_integer("num_shards", 1, "Output shards (also the unit of parallelism).")
    flags.DEFINE_integer("num_workers", 1, "Worker processes.")
    flags.DEFINE_integer("shuffle_buffer", 10000, "Examples shuffled before writing.")
    flags.DEFINE_integer("num_open_rows", 8, "Open rows of the packer (for the report).")
    flags.DEFINE_multi_integer("report_seq_len", [], "Also report padding for these row lengths.")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
