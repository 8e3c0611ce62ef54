r"""Creates BERT pre-training data: documents → NSP sentence pairs → (masked) TFRecord shards.

  python -m data_pipeline.create_pretraining_data --input=data/demo_corpus.txt \
      --output_dir=data/pretrain_128 --vocab=VOCAB --max_seq_length=128 \
      --max_predictions_per_seq=20 --dupe_factor=5 --num_shards=4 --num_workers=2

The reference flags (`--input --vocab --do_lower_case --max_seq_length
--max_predictions_per_seq --masked_lm_prob --short_seq_prob --dupe_factor --do_whole_word_mask
--random_seed`) mean what they mean in google-research/bert. Additions:

- `--masking=dynamic` (default) writes pairs without masks; the tf.data reader masks them
  afresh every epoch (`data_pipeline.pretraining_input.make_dataset(masking=...)`).
  `--masking=static` writes the reference's pre-masked records.
- `--num_shards`: output shards; shard s gets documents k with k % num_shards == s and its own
  RNG stream seeded by (random_seed, s, num_shards), so output depends only on the seed and the
  shard count. `--num_workers` processes shards in parallel; `--task_index/--num_tasks` split
  the shards over machines (task t writes shards s with s % num_tasks == t).
- `--pool_size` documents are held per shard (NotNext partners come from that pool) and
  `--shuffle_buffer` instances before writing: memory is bounded whatever the corpus size.

Writes `part-SSSSS-of-NNNNN.tfrecord` and `metadata.json` (settings, vocab hash, counts).
Creation never imports TensorFlow (records are encoded by `tfrecords`), so a worker starts in
well under a second; instances are masked and encoded WRITE_BATCH at a time with NumPy.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from absl import logging

from bertjax import cli, paths
from bertjax.errors import ConfigError, DataError
from data_pipeline import corpus, instances, masking, metadata, tfrecords
from data_pipeline import shards as shards_lib

FORMAT = "bertjax-pretraining-v1"
# Instances masked and encoded together (vectorised); part of the output's definition, since
# the masking random stream is drawn batch by batch.
WRITE_BATCH = 256


@dataclasses.dataclass(frozen=True)
class CreateConfig:
    input: str
    output_dir: str
    input_format: str = "reference"
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    do_whole_word_mask: bool = False
    random_seed: int = 12345
    masking: str = "dynamic"  # or "static"
    masking_mix: tuple[float, float, float] = (0.8, 0.1, 0.1)  # static: mask, same, random
    num_shards: int = 1
    num_workers: int = 1
    task_index: int = 0
    num_tasks: int = 1
    pool_size: int = 1000
    shuffle_buffer: int = 10000

    def __post_init__(self):
        if self.masking not in ("static", "dynamic"):
            raise ConfigError(f"--masking must be 'static' or 'dynamic', got {self.masking!r}")
        masking.check_mix(self.masking_mix, names=("--mask_prob", "--same_prob", "--random_prob"))
        for name in ("num_shards", "num_workers", "num_tasks", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.task_index < self.num_tasks:
            raise ConfigError(
                f"--task_index must be in [0, {self.num_tasks}), got {self.task_index}")
        if self.max_predictions_per_seq > self.max_seq_length:
            raise ConfigError("--max_predictions_per_seq cannot exceed --max_seq_length")
        self.pair_config()  # validates the pair settings

    def pair_config(self) -> instances.PairConfig:
        return instances.PairConfig(self.max_seq_length, self.short_seq_prob, self.dupe_factor,
                                    self.pool_size)

    def masking_config(self, tokenizer) -> masking.MaskingConfig:
        return masking.MaskingConfig.from_tokenizer(
            tokenizer, max_predictions=self.max_predictions_per_seq,
            masked_lm_prob=self.masked_lm_prob, whole_word=self.do_whole_word_mask,
            mix=self.masking_mix)

    def shards(self) -> list[int]:
        """Output shards this task writes."""
        return list(range(self.task_index, self.num_shards, self.num_tasks))


def tokenize_documents(documents: Iterable[list[str]], tokenizer, counts: dict,
                       max_tokens: int | None = None) -> Iterator[list[np.ndarray]]:
    """Sentences → arrays of token ids (empty sentences dropped); counts text and tokens, and
    the sentences longer than `max_tokens` (an instance can use only that many of them)."""
    # The WordPiece tokenizer caches ids per word: skip the token strings when it can.
    to_ids = getattr(tokenizer, "tokenize_to_ids_batch", None)
    for doc in documents:
        if to_ids is not None:
            ids = to_ids(doc)
        else:
            ids = map(tokenizer.convert_tokens_to_ids, tokenizer.tokenize_batch(doc))
        sentences = [np.array(s, np.int32) for s in ids if s]
        counts["documents"] += 1
        counts["text_bytes"] += len("".join(doc).encode("utf-8"))
        counts["sentences"] += len(sentences)
        counts["tokens"] += sum(map(len, sentences))
        if max_tokens:
            long = [len(s) for s in sentences if len(s) > max_tokens]
            counts["long_sentences"] += len(long)
            counts["long_sentence_tokens"] += sum(long)
        yield sentences


def shard_rngs(cfg: CreateConfig, shard: int) -> tuple[np.random.Generator, ...]:
    """Independent streams for pairs, output shuffle and masking, keyed by (seed, shard, count).

    Separate streams keep the pairs identical between static and dynamic masking runs.
    """
    seq = np.random.SeedSequence([cfg.random_seed, shard, cfg.num_shards])
    return tuple(np.random.default_rng(s) for s in seq.spawn(3))


def batches(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of `size` items (the last may be shorter)."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def pad_instances(chunk: list[instances.Instance], seq_len: int):
    """[batch, seq_len] int32 tokens and segment ids (zero-padded) and [batch] lengths."""
    lengths = np.array([len(inst.tokens) for inst in chunk], np.int64)
    if lengths.max(initial=0) > seq_len:
        raise ValueError(f"instance of {lengths.max()} tokens longer than max_seq_length "
                         f"{seq_len}")
    tokens = np.zeros((len(chunk), seq_len), np.int32)
    segments = np.zeros((len(chunk), seq_len), np.int32)
    for row, inst in enumerate(chunk):
        tokens[row, :len(inst.tokens)] = inst.tokens
        segments[row, :len(inst.tokens)] = inst.segment_ids
    return tokens, segments, lengths


def example_features(tokens: np.ndarray, segments: np.ndarray, lengths: np.ndarray,
                     is_random_next: np.ndarray, masked=None) -> dict[str, np.ndarray]:
    """Reference features of a batch (see tfrecords); masked: (positions, labels, counts)."""
    seq_len = tokens.shape[1]
    features = {
        "input_ids": tokens,
        "input_mask": (np.arange(seq_len) < lengths[:, None]).astype(np.int32),
        "segment_ids": segments,
        "next_sentence_labels": np.asarray(is_random_next, np.int32)[:, None],
    }
    if masked is not None:
        positions, labels, counts = masked
        features["masked_lm_positions"] = positions
        features["masked_lm_ids"] = labels
        features["masked_lm_weights"] = (
            np.arange(positions.shape[1]) < counts[:, None]).astype(np.float32)
    return features


def create_shard(cfg: CreateConfig, shard: int, tokenizer) -> dict:
    """Writes shard `shard`; returns its counts (cpu_seconds: this shard's own CPU time).

    Instances are masked, encoded and written WRITE_BATCH at a time (vectorised NumPy); the
    masking stream depends only on the seed and the shard, so output does too.
    """
    cpu_start = time.process_time()
    counts = dict.fromkeys(("documents", "sentences", "tokens", "text_bytes", "instances",
                            "not_next", "instance_tokens", "masked_lm_predictions",
                            "long_sentences", "long_sentence_tokens"), 0)
    pair_rng, shuffle_rng, mask_rng = shard_rngs(cfg, shard)
    docs = corpus.iter_documents(cfg.input, cfg.input_format, shard, cfg.num_shards)
    sentences = tokenize_documents(docs, tokenizer, counts, cfg.max_seq_length - 3)
    stream = instances.generate_instances(sentences, cfg.pair_config(), tokenizer.cls_id,
                                          tokenizer.sep_id, pair_rng)
    stream = instances.shuffle_buffer(stream, cfg.shuffle_buffer, shuffle_rng)
    mcfg = cfg.masking_config(tokenizer) if cfg.masking == "static" else None
    if mcfg is not None:
        tables = (mcfg.special_table(), mcfg.continuation_table(), mcfg.replacement_ids())
    path = paths.join(cfg.output_dir, tfrecords.shard_name(shard, cfg.num_shards))
    with tfrecords.ShardWriter(path) as writer:
        for chunk in batches(stream, WRITE_BATCH):
            tokens, segments, lengths = pad_instances(chunk, cfg.max_seq_length)
            nsp = np.array([inst.is_random_next for inst in chunk], bool)
            masked = None
            if mcfg is not None:
                tokens, positions, labels, n_masked = masking.mask_batch(
                    tokens, lengths, mcfg, mask_rng, *tables)
                masked = (positions, labels, n_masked)
                counts["masked_lm_predictions"] += int(n_masked.sum())
            writer.write_many(tfrecords.serialize_examples(
                example_features(tokens, segments, lengths, nsp, masked)))
            counts["instances"] += len(chunk)
            counts["not_next"] += int(nsp.sum())
            counts["instance_tokens"] += int(lengths.sum())
    counts["cpu_seconds"] = round(time.process_time() - cpu_start, 3)
    return counts


def build_metadata(cfg: CreateConfig, tokenizer, shard_counts: dict[int, dict], seconds: float,
                   vocab: str | None = None, do_lower_case: bool | None = None) -> dict:
    """The metadata.json of a run: settings, tokenizer fields, counts (see `metadata`)."""
    keys = next(iter(shard_counts.values()))
    totals = {k: round(sum(c[k] for c in shard_counts.values()), 3) for k in keys}
    return {
        "format": FORMAT,
        "masking": cfg.masking,
        "max_seq_length": cfg.max_seq_length,
        "max_predictions_per_seq": cfg.max_predictions_per_seq,
        "masked_lm_prob": cfg.masked_lm_prob,
        "masking_mix": list(cfg.masking_mix),
        "short_seq_prob": cfg.short_seq_prob,
        "dupe_factor": cfg.dupe_factor,
        "do_whole_word_mask": cfg.do_whole_word_mask,
        "random_seed": cfg.random_seed,
        "num_shards": cfg.num_shards,
        "task_index": cfg.task_index,
        "num_tasks": cfg.num_tasks,
        "pool_size": cfg.pool_size,
        "shuffle_buffer": cfg.shuffle_buffer,
        "input": cfg.input,
        "input_format": cfg.input_format,
        "vocab": vocab,
        "do_lower_case": do_lower_case,
        **metadata.tokenizer_fields(tokenizer),
        "counts": totals,
        "shards": {tfrecords.shard_name(s, cfg.num_shards): c["instances"]
                   for s, c in sorted(shard_counts.items())},
        "seconds": round(seconds, 3),
    }


def create_pretraining_data(cfg: CreateConfig, tokenizer_factory: Callable[[], object],
                            **metadata_extra) -> dict:
    """Writes this task's shards (in `num_workers` processes) and the metadata; returns it.

    tokenizer_factory: a picklable callable returning the tokenizer (called once per worker).
    """
    # Before any file is written; NotNext partners come from another document.
    corpus.require_documents(cfg.input, cfg.input_format, minimum=2,
                             needed_for="for sentence pairs (NotNext takes another document)")
    with shards_lib.output_directory(cfg.output_dir, cfg.num_tasks == 1):
        start = time.perf_counter()
        tokenizer = tokenizer_factory()
        results = shards_lib.write_shards(create_shard, cfg, cfg.shards(), tokenizer,
                                          tokenizer_factory, cfg.num_workers)
        if not sum(c["instances"] for c in results.values()):
            docs = sum(c["documents"] for c in results.values())
            raise DataError(f"{cfg.input}: no instances created from {docs} documents "
                            "(empty input?); no metadata written")
        meta = build_metadata(cfg, tokenizer, results, time.perf_counter() - start,
                              **metadata_extra)
        metadata.write(cfg.output_dir, meta, cfg.task_index, cfg.num_tasks)
    warn_partial_use(cfg, meta["counts"])
    return meta


def warn_partial_use(cfg: CreateConfig, counts: dict) -> str | None:
    """Warns (and returns the line) when sentences are longer than an instance can hold, e.g.
    a whole document on one line of a `reference` file: only a small share of them is used."""
    n, tokens = counts.get("long_sentences", 0), counts.get("long_sentence_tokens", 0)
    if not n:
        return None
    limit = cfg.max_seq_length - 3
    used = min(1.0, n * limit / tokens)  # an instance holds `limit` tokens of one sentence
    hint = (" (a document on a single line? --input_format=plain splits sentences)"
            if tokens / n > 2 * limit else "")
    line = (f"{cfg.input}: {n} sentence(s) longer than {limit} tokens, {tokens / n:.0f} on "
            f"average{hint}; an instance holds {limit} tokens of one, so each of the "
            f"{cfg.dupe_factor} "
            f"passes (--dupe_factor) uses at most {used:.1%} of their {tokens} tokens "
            f"({tokens / max(counts['tokens'], 1):.1%} of the corpus)")
    logging.warning("%s", line)
    return line


def load_tokenizer(vocab: str, do_lower_case: bool | None):
    """A picklable tokenizer factory for worker processes (with functools.partial)."""
    from bertjax import tokenization

    return tokenization.load_tokenizer(vocab, do_lower_case=do_lower_case)


def main(f) -> None:
    if not paths.exists(f.vocab):
        raise ConfigError(f"--vocab: no such file or directory: {f.vocab}")
    cfg = CreateConfig(
        input=f.input, output_dir=f.output_dir, input_format=f.input_format,
        max_seq_length=f.max_seq_length, max_predictions_per_seq=f.max_predictions_per_seq,
        masked_lm_prob=f.masked_lm_prob, short_seq_prob=f.short_seq_prob,
        dupe_factor=f.dupe_factor, do_whole_word_mask=f.do_whole_word_mask,
        random_seed=f.random_seed, masking=f.masking,
        masking_mix=(f.mask_prob, f.same_prob, f.random_prob), num_shards=f.num_shards,
        num_workers=f.num_workers, task_index=f.task_index, num_tasks=f.num_tasks,
        pool_size=f.pool_size, shuffle_buffer=f.shuffle_buffer)
    factory = functools.partial(load_tokenizer, f.vocab, f.do_lower_case)
    meta = create_pretraining_data(cfg, factory, vocab=f.vocab, do_lower_case=f.do_lower_case)
    c = meta["counts"]
    print(f"wrote {c['instances']} instances ({c['not_next'] / max(1, c['instances']):.1%} "
          f"NotNext) from {c['documents']} documents, {c['text_bytes'] / 1e6:.2f} MB of text, "
          f"in {meta['seconds']:.1f} s: {c['instances'] / meta['seconds']:.0f} instances/s, "
          f"{c['text_bytes'] / 1e6 / meta['seconds']:.2f} MB/s → {cfg.output_dir}")


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("input", None, "Input files: comma-separated files, globs, directories, "
                        "or tfds:NAME[:SPLIT[:FEATURE]].", required=True)
    flags.DEFINE_enum("input_format", "reference", ["reference", "plain", "jsonl", "tfds"],
                      "reference: a sentence per line, blank line between documents; plain: a "
                      "file per document; jsonl: {'text': ...} per line; tfds: dataset name.")
    flags.DEFINE_string("output_dir", None, "Directory for the TFRecord shards.", required=True)
    flags.DEFINE_string("vocab", None, "vocab.txt, SentencePiece .model or tokenizer directory.",
                        required=True)
    flags.DEFINE_boolean("do_lower_case", None, "Lower-case input (default: tokenizer config).")
    flags.DEFINE_integer("max_seq_length", 128, "Maximum sequence length.")
    flags.DEFINE_integer("max_predictions_per_seq", 20, "Maximum masked LM predictions.")
    flags.DEFINE_float("masked_lm_prob", 0.15, "Fraction of tokens to mask.")
    flags.DEFINE_float("short_seq_prob", 0.1, "Probability of a shorter target length.")
    flags.DEFINE_integer("dupe_factor", 10, "Passes over each document.")
    flags.DEFINE_boolean("do_whole_word_mask", False, "Mask whole words.")
    flags.DEFINE_integer("random_seed", 12345, "Random seed.")
    flags.DEFINE_enum("masking", "dynamic", ["dynamic", "static"],
                      "dynamic: write pairs, mask in tf.data every epoch; static: pre-mask.")
    # Static masking's mix of the chosen words (the paper's Table 8); dynamic masking takes
    # its mix from the pre-training config (config.masking.mask/same/random).
    flags.DEFINE_float("mask_prob", 0.8, "Share of chosen words replaced by [MASK].")
    flags.DEFINE_float("same_prob", 0.1, "Share of chosen words left unchanged.")
    flags.DEFINE_float("random_prob", 0.1, "Share of chosen words replaced by a random token.")
    flags.DEFINE_integer("num_shards", 1, "Output shards (also the unit of parallelism).")
    flags.DEFINE_integer("num_workers", 1, "Worker processes.")
    flags.DEFINE_integer("task_index", 0, "This machine's task (shards s % num_tasks).")
    flags.DEFINE_integer("num_tasks", 1, "Machines splitting the shards.")
    flags.DEFINE_integer("pool_size", 1000, "Documents held per shard (NotNext partners).")
    flags.DEFINE_integer("shuffle_buffer", 10000, "Instances shuffled before writing.")


if __name__ == "__main__":
    cli.run_flags_command(main, define_flags)
