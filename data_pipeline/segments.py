"""Writes the examples of packed no-NSP pre-training: runs of whole sentences of one document.

`python -m data_pipeline.packed_input` is the command (it also reads them back, packed); the
writer lives here, apart from the tf.data reader, so that it imports no TensorFlow: called from
Python, its spawned workers load only this module's light imports. (Under the `-m` command,
spawn re-imports the main module in each worker, so there they still load TensorFlow.)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable

import numpy as np

from data_pipeline import corpus, instances, packing, tfrecords
from data_pipeline import create_pretraining_data as cpd
from data_pipeline import masking as masking_lib

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
