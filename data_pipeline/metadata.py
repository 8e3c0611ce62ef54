"""metadata.json, written beside TFRecord shards: writing, reading and checking it.

The writers (`create_pretraining_data`, `create_segments`) record how the shards were made:
their settings, the counts, and what the readers need without a tokenizer — the vocabulary's
hash and size, the [MASK] id, the special ids and which ids continue a word
(`tokenizer_fields`). A run split over machines writes one file per task,
`metadata-TTTTT-of-NNNNN.json`; otherwise `metadata.json`. The file is written last and
atomically, so its presence means the shards are complete.

The readers (`pretraining_input.make_dataset`, `packed_input.make_packed_dataset`) read it
back (`read`), check their request against it (`check_pretraining`, `check_packing`: a wrong
sequence length or masking mode stops with one line naming the file), and build the dynamic
masking config from it (`masking_from_metadata`). Data without metadata (prepared for
google-research/bert) is pre-masked reference data.

TensorFlow-free: the writers' worker processes import this module.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from bertjax import paths
from bertjax.errors import DataError
from data_pipeline import masking as masking_lib
from data_pipeline.masking import MaskingConfig

METADATA_PREFIX = "metadata"


# ---------------------------------------------------------------------------------- writing


def file_name(task_index: int = 0, num_tasks: int = 1) -> str:
    """metadata.json, or metadata-TTTTT-of-NNNNN.json for one of several tasks."""
    if num_tasks == 1:
        return f"{METADATA_PREFIX}.json"
    return f"{METADATA_PREFIX}-{task_index:05d}-of-{num_tasks:05d}.json"


def vocab_hash(tokens: list[str]) -> str:
    """sha256 of the vocabulary in id order (one token per line) — identifies any tokenizer."""
    return hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()


def tokenizer_fields(tokenizer) -> dict:
    """What the readers need of the tokenizer: vocab_hash, vocab_size, mask_id, special_ids
    and continuation_bits (the ids that continue a word, for whole-word masking)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    return {
        "vocab_hash": vocab_hash(tokens),
        "vocab_size": tokenizer.vocab_size,
        "mask_id": tokenizer.mask_id,
        "special_ids": sorted(int(i) for i in tokenizer.special_ids),
        "continuation_bits": masking_lib.encode_flags(masking_lib.continuation_flags(tokenizer)),
    }


def write_json_atomic(path: str, obj: dict) -> None:
    """Writes `obj` as sorted, indented JSON to `<path>.tmp`, then renames it to `path` (on an
    object store, gs://, the object is written whole at once)."""
    text = json.dumps(obj, indent=1, sort_keys=True) + "\n"
    if paths.is_remote(path):
        with paths.open(path, "w") as f:
            f.write(text)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write(output_dir: str, meta: dict, task_index: int = 0, num_tasks: int = 1) -> str:
    """Writes the metadata of `output_dir`'s shards (atomically); returns its path."""
    path = paths.join(output_dir, file_name(task_index, num_tasks))
    write_json_atomic(path, meta)
    return path


# ---------------------------------------------------------------------------------- reading


def metadata_files(file_pattern: str) -> list[str]:
    """The metadata*.json files in the directory of a shard pattern (may be empty)."""
    directory = paths.dirname(file_pattern) or "."
    return paths.glob(paths.join(glob.escape(directory), METADATA_PREFIX + "*.json"))


def read(file_pattern: str) -> tuple[str, dict] | None:
    """(path, metadata) of the data at `file_pattern`, or None when there is none."""
    files = metadata_files(file_pattern)
    if not files:
        return None
    return files[0], paths.read_json_object(files[0], DataError)


# --------------------------------------------------------------------------------- checking


def check_pretraining(file_pattern: str, seq_len: int, max_predictions: int,
                      masking: MaskingConfig | None) -> bool:
    """Checks a `make_dataset` request against the metadata; returns whether the records
    carry static masks (data without metadata: reference data, always pre-masked)."""
    found = read(file_pattern)
    if found is None:
        return True
    path, meta = found
    if meta.get("max_seq_length") != seq_len:
        raise DataError(f"{path}: max_seq_length is {meta.get('max_seq_length')} but the reader "
                        f"was asked for seq_len={seq_len}")
    static = meta.get("masking", "static") == "static"
    if static and masking is None and meta.get("max_predictions_per_seq") != max_predictions:
        raise DataError(f"{path}: max_predictions_per_seq is "
                        f"{meta.get('max_predictions_per_seq')} but the reader was asked for "
                        f"max_predictions={max_predictions}")
    if not static and masking is None:
        raise DataError(f"{path}: masking is 'dynamic' (records have no masks); pass "
                        "masking=MaskingConfig (e.g. masking_from_metadata)")
    _check_vocab_size(path, meta, masking)
    return static


def check_packing(file_pattern: str, seq_len: int, masking: MaskingConfig | None = None) -> int:
    """The records' max_seq_length, checked for packing into rows of `seq_len`: the records
    must be unmasked ('dynamic') and fit the rows."""
    found = read(file_pattern)
    if found is None:
        raise DataError(f"{file_pattern}: no metadata*.json beside the files; packing reads "
                        "unmasked data written by `python -m data_pipeline.create_segments` or "
                        "`create_pretraining_data --masking=dynamic`")
    path, meta = found
    if meta.get("masking", "static") != "dynamic":
        raise DataError(f"{path}: masking is {meta.get('masking', 'static')!r}; packed rows are "
                        "masked after packing, so the records must be unmasked ('dynamic')")
    length = meta.get("max_seq_length")
    if not isinstance(length, int) or not 0 < length <= seq_len:
        raise DataError(f"{path}: max_seq_length is {length}; records must fit the packed rows "
                        f"(seq_len={seq_len})")
    _check_vocab_size(path, meta, masking)
    return length


def _check_vocab_size(path: str, meta: dict, masking: MaskingConfig | None) -> None:
    if masking is not None and meta.get("vocab_size") not in (None, masking.vocab_size):
        raise DataError(f"{path}: vocab_size is {meta.get('vocab_size')} but the masking config "
                        f"has vocab_size={masking.vocab_size}")


def masking_from_metadata(file_pattern: str, *, max_predictions: int,
                          masked_lm_prob: float | None = None,
                          whole_word: bool | None = None,
                          mix=masking_lib.DEFAULT_MIX) -> MaskingConfig:
    """The dynamic-masking config of data written by create_pretraining_data or
    create_segments (no tokenizer needed: vocab size, [MASK], special ids and continuation
    flags are in the metadata); masked_lm_prob and whole_word default to the recorded ones;
    mix: the (mask, same, random) shares."""
    found = read(file_pattern)
    if found is None:
        raise DataError(f"{file_pattern}: no metadata*.json beside the files")
    path, meta = found
    try:
        return MaskingConfig(
            max_predictions=max_predictions,
            vocab_size=meta["vocab_size"],
            mask_id=meta["mask_id"],
            special_ids=tuple(meta["special_ids"]),
            masked_lm_prob=meta["masked_lm_prob"] if masked_lm_prob is None else masked_lm_prob,
            whole_word=meta["do_whole_word_mask"] if whole_word is None else whole_word,
            continuation=masking_lib.decode_flags(meta["continuation_bits"], meta["vocab_size"]),
            mix=tuple(mix),
        )
    except KeyError as e:
        raise DataError(f"{path}: missing field {e.args[0]!r}") from None
