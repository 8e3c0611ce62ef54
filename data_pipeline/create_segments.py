r"""Writes the examples of packed no-NSP pre-training: runs of whole sentences of one document.

  python -m data_pipeline.create_segments --input=data/demo_corpus.txt --vocab=data/demo_vocab \
      --output_dir=data/segments_128 --max_seq_length=128 --num_shards=4

Each example is `[CLS] sentences [SEP]` (segment 0), the sentences consecutive and from one
document (RoBERTa's DOC-SENTENCES); `--whole_sentences=false` cuts the text every
max_seq_length - 2 tokens instead. Shards are `part-SSSSS-of-NNNNN.tfrecord` in the reference
schema, unmasked (`next_sentence_labels` 0), plus `metadata.json`; shard s gets documents k
with k % num_shards == s and is shuffled with its own seed, so the output depends only on the
seed and the shard count. The command then prints the padding fraction of the examples one
per row and packed, for rows of --max_seq_length and of each --report_seq_len, e.g.

  packed N examples into M rows of 128: padding A% → B%

Training reads the examples packed several to a row (`data_pipeline.packed_input`, which
explains the packing; docs/pretraining.md has the figures). Writing imports no TensorFlow
(records are encoded by `tfrecords`), so spawned worker processes start fast; only the padding
report reads the data back through tf.data.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import numpy as np

from bertjax import cli, paths
from bertjax.errors import ConfigError, DataError
from data_pipeline import corpus, instances, metadata, packing, tfrecords
from data_pipeline import create_pretraining_data as cpd
from data_pipeline import shards as shards_lib

FORMAT = "bertjax-segments-v1"


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
            raise ConfigError(f"--max_seq_length must be >= 3, got {self.max_seq_length}")
        for name in ("num_shards", "num_workers", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")


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
    path = paths.join(cfg.output_dir, tfrecords.shard_name(shard, cfg.num_shards))
    with tfrecords.ShardWriter(path) as writer:
        for body in instances.shuffle_buffer(examples(), cfg.shuffle_buffer, rng):
            tokens = np.concatenate([[tokenizer.cls_id], body, [tokenizer.sep_id]])
            features = tfrecords.pad_example(tokens, np.zeros(len(tokens), np.int32), False,
                                             cfg.max_seq_length, None, 0)
            writer.write(tfrecords.serialize_example(features))
            counts["instances"] += 1
            counts["instance_tokens"] += len(tokens)
    return counts


def create_segments(cfg: SegmentsConfig, tokenizer_factory: Callable[[], object],
                    **metadata_extra) -> dict:
    """Writes all shards (in `num_workers` processes) and metadata.json; returns the metadata.

    tokenizer_factory: a picklable callable returning the tokenizer (called once per worker).
    """
    corpus.require_documents(cfg.input, cfg.input_format)  # before any file is written
    with shards_lib.output_directory(cfg.output_dir):
        start = time.perf_counter()
        tokenizer = tokenizer_factory()
        results = shards_lib.write_shards(create_segments_shard, cfg, range(cfg.num_shards),
                                          tokenizer, tokenizer_factory, cfg.num_workers)
        totals = {k: sum(c[k] for c in results.values()) for k in next(iter(results.values()))}
        if not totals["instances"]:
            raise DataError(f"{cfg.input}: no examples created from {totals['documents']} "
                            "documents (empty input?); no metadata written")
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
            **metadata.tokenizer_fields(tokenizer),
            "counts": totals,
            "shards": {tfrecords.shard_name(s, cfg.num_shards): c["instances"]
                       for s, c in sorted(results.items())},
            "seconds": round(time.perf_counter() - start, 3),
            **metadata_extra,
        }
        metadata.write(cfg.output_dir, meta)
    return meta


# ------------------------------------------------------------------------------------ the CLI


def main(f) -> None:
    if not paths.exists(f.vocab):
        raise ConfigError(f"--vocab: no such file or directory: {f.vocab}")
    cfg = SegmentsConfig(
        input=f.input, output_dir=f.output_dir, input_format=f.input_format,
        max_seq_length=f.max_seq_length, whole_sentences=f.whole_sentences,
        masked_lm_prob=f.masked_lm_prob, do_whole_word_mask=f.do_whole_word_mask,
        random_seed=f.random_seed, num_shards=f.num_shards, num_workers=f.num_workers,
        shuffle_buffer=f.shuffle_buffer)
    factory = functools.partial(cpd.load_tokenizer, f.vocab, f.do_lower_case)
    meta = create_segments(cfg, factory, vocab=f.vocab, do_lower_case=f.do_lower_case)
    c = meta["counts"]
    print(f"wrote {c['instances']} examples from {c['documents']} documents, "
          f"{c['text_bytes'] / 1e6:.2f} MB of text, in {meta['seconds']:.1f} s → {cfg.output_dir}")
    from data_pipeline.packed_input import padding_stats  # the reader: TensorFlow

    pattern = paths.join(cfg.output_dir, tfrecords.SHARD_PATTERN)
    for seq_len in sorted({cfg.max_seq_length, *f.report_seq_len}):
        if seq_len >= cfg.max_seq_length:
            print(padding_stats(pattern, seq_len=seq_len, num_open_rows=f.num_open_rows)
                  .summary())


def define_flags() -> None:
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
    cli.run_flags_command(main, define_flags)
