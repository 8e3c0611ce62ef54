"""TFRecord shards in the reference schema, written and read without TensorFlow.

Reference features (all int64 in the file except masked_lm_weights, float):
  input_ids, input_mask, segment_ids [seq]; masked_lm_positions, masked_lm_ids,
  masked_lm_weights [max_predictions]; next_sentence_labels [1] (0 = IsNext, 1 = NotNext).
Unmasked (dynamic-masking) records carry only input_ids, input_mask, segment_ids and
next_sentence_labels. (The readers' parsing spec is `pretraining_input.feature_spec`; the
metadata.json written beside the shards is `data_pipeline.metadata`.)

Shards are written under a temporary name and renamed when complete, so a crash never leaves a
partial file that matches `part-*.tfrecord`; the metadata is written last the same way.

Reading side (`frames`, `first_problem`, `first_record`): the framing checked record by record,
so a reader can name the file and byte offset of a truncated or corrupted record (tf.data
names neither); `example_features` decodes a tf.train.Example without TensorFlow (the checks
that run before training).
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct

import google_crc32c
import numpy as np
from etils import epath

from bertjax import paths

SHARD_PATTERN = "part-*.tfrecord"


def shard_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}.tfrecord"


def pad_example(tokens: np.ndarray, segment_ids: np.ndarray, is_random_next: bool,
                seq_len: int, masked: tuple[np.ndarray, np.ndarray] | None,
                max_predictions: int) -> dict[str, np.ndarray]:
    """Pads one instance to the reference shapes.

    tokens, segment_ids: [n] with n <= seq_len; masked: (positions [k], labels [k]) or None.
    Returns NumPy arrays: input_ids/input_mask/segment_ids [seq_len] int64,
    masked_lm_* [max_predictions], next_sentence_labels [1].
    """
    n = len(tokens)
    if n > seq_len:
        raise ValueError(f"instance of {n} tokens longer than max_seq_length {seq_len}")
    out = {
        "input_ids": np.zeros(seq_len, np.int64),
        "input_mask": np.zeros(seq_len, np.int64),
        "segment_ids": np.zeros(seq_len, np.int64),
        "next_sentence_labels": np.array([int(is_random_next)], np.int64),
    }
    out["input_ids"][:n] = tokens
    out["input_mask"][:n] = 1
    out["segment_ids"][:n] = segment_ids
    if masked is not None:
        positions, labels = masked
        k = len(positions)
        out["masked_lm_positions"] = np.zeros(max_predictions, np.int64)
        out["masked_lm_ids"] = np.zeros(max_predictions, np.int64)
        out["masked_lm_weights"] = np.zeros(max_predictions, np.float32)
        out["masked_lm_positions"][:k] = positions
        out["masked_lm_ids"][:k] = labels
        out["masked_lm_weights"][:k] = 1.0
    return out


# ---------------------------------------------------------------------------------------------
# TensorFlow-free writing. Worker processes only write records, and importing TensorFlow costs
# them seconds of start-up and hundreds of MB each, so the `tf.train.Example` protobuf and the
# TFRecord framing are encoded here directly (tests compare the bytes with TensorFlow's own).
#
# Protobuf wire format used (https://protobuf.dev/programming-guides/encoding/):
#   Example  { Features features = 1; }
#   Features { map<string, Feature> feature = 1; }  entries: { string key = 1; Feature value = 2; }
#   Feature  { FloatList float_list = 2; Int64List int64_list = 3; }  (a oneof)
#   FloatList/Int64List { repeated float/int64 value = 1 [packed]; }
# A length-delimited field is (field_number << 3 | 2), varint(len), bytes. Packed int64 values
# are varints (negative numbers as their 64-bit two's complement: 10 bytes); packed floats are
# little-endian float32. Map entries are written in sorted key order, as TensorFlow's
# `SerializeToString(deterministic=True)` does, so every process writes identical bytes.

_CRC_MASK_DELTA = 0xA282EAD8


def _varint(n: int) -> bytes:
    """Varint bytes of a non-negative Python int (tags and lengths)."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def varint_rows(values: np.ndarray) -> list[bytes]:
    """Packed varint bytes of each row of an integer array.

    values: [rows, n] integers (int64 range; negatives as two's complement) → `rows` byte strings.
    """
    v = np.ascontiguousarray(values).astype(np.int64).view(np.uint64)
    rows, n = v.shape
    if v.size == 0:
        return [b""] * rows
    top = int(v.max())
    if top < 0x80:  # every value one byte: the byte is the value (masks, labels, ...)
        flat, row_bytes = v.astype(np.uint8).tobytes(), np.full(rows, n)
    else:
        width = (top.bit_length() + 6) // 7  # bytes of the longest varint
        if top < 1 << 32:  # token ids: 32-bit arithmetic is several times faster
            v = v.astype(np.uint32)
        out = np.empty((rows, n, width), np.uint8)
        keep = np.empty((rows, n, width), bool)
        for k in range(width):
            part = v >> v.dtype.type(7 * k)  # the value without its first k groups
            more = part >= 0x80
            out[..., k] = (part & v.dtype.type(0x7F)) | (more.view(np.uint8) << 7)
            keep[..., k] = part > 0 if k else True  # byte k exists iff value >= 2**(7k)
        flat, row_bytes = out[keep].tobytes(), keep.sum(axis=(1, 2))
    ends = np.cumsum(row_bytes).tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]


@functools.lru_cache(maxsize=4096)
def _entry_prefix(name: str, kind: int, packed_len: int) -> bytes:
    """Bytes of a `Features.feature` map entry that precede its packed values.

    entry = 1:{ 1:name, 2:Feature{ kind:List{ 1:packed } } }; everything before `packed`
    depends only on (name, kind, len(packed)), so it is built once per distinct length.
    """
    value_list = _field(1, b"\0" * packed_len) if packed_len else b""  # empty field: omitted
    entry = _field(1, name.encode("utf-8")) + _field(2, _field(kind, value_list))
    return _field(1, entry)[:-packed_len or None]


def serialize_examples(features: dict[str, np.ndarray]) -> list[bytes]:
    """`tf.train.Example` bytes of a batch, without TensorFlow.

    features: name → [batch, n_name] array (float → FloatList as float32, anything else →
    Int64List). Returns `batch` serialized Examples, byte-identical to TensorFlow's
    `SerializeToString(deterministic=True)`.
    """
    names = sorted(features)
    batch = len(features[names[0]]) if names else 0
    entries = []  # per feature: [batch] serialized map entries
    for name in names:
        value = np.asarray(features[name])
        if value.ndim != 2 or len(value) != batch:
            raise ValueError(f"feature {name!r}: expected [{batch}, n] values, got {value.shape}")
        if value.dtype.kind == "f":
            payloads = [row.tobytes() for row in value.astype("<f4")]
            kind = 2  # Feature.float_list
        else:
            payloads = varint_rows(value)
            kind = 3  # Feature.int64_list
        entries.append([_entry_prefix(name, kind, len(p)) + p for p in payloads])
    out = []
    for row in zip(*entries):
        body = b"".join(row)
        out.append(b"\n" + _varint(len(body)) + body)  # Example.features (field 1)
    return out


def serialize_example(features: dict[str, np.ndarray]) -> bytes:
    """tf.train.Example bytes of a dict of 1-D arrays (float arrays → FloatList)."""
    if not features:
        return b"\n\0"  # an empty (but present) Features message
    return serialize_examples({k: np.asarray(v)[None] for k, v in features.items()})[0]


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC32C rotated right by 15 bits plus a constant (mod 2**32)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def tfrecord_frame(record: bytes) -> bytes:
    """One TFRecord: uint64 length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(record))
    return b"".join((length, struct.pack("<I", masked_crc32c(length)), record,
                     struct.pack("<I", masked_crc32c(record))))


class ShardWriter:
    """Writes one TFRecord shard whole or not at all: locally `<path>.tmp` while writing,
    renamed on close; on an object store (gs://) streamed to the object itself, which appears
    only when the upload completes, and deleted again if the writer is aborted."""

    def __init__(self, path: str):
        self.path = path
        self._remote = paths.is_remote(path)
        self._tmp = path if self._remote else path + ".tmp"
        self._files = contextlib.ExitStack()
        # epath's own writer: streamed (a resumable upload on GCS), not held in memory.
        self._file = self._files.enter_context(
            epath.Path(path).open("wb") if self._remote else open(self._tmp, "wb"))
        self.count = 0

    def write(self, serialized: bytes) -> None:
        self._file.write(tfrecord_frame(serialized))
        self.count += 1

    def write_many(self, records: list[bytes]) -> None:
        self._file.write(b"".join(map(tfrecord_frame, records)))
        self.count += len(records)

    def close(self) -> None:
        self._files.close()
        if not self._remote:
            os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._files.close()
        if paths.exists(self._tmp):
            epath.Path(self._tmp).unlink()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


# ---------------------------------------------------------------------------------------------
# Checking the framing when reading.


class FramingError(ValueError):
    """A TFRecord file's framing is broken at `offset` (bytes from the start)."""

    def __init__(self, offset: int, problem: str):
        super().__init__(f"{problem} at byte {offset}")
        self.offset = offset


def frames(f):
    """Yields (offset, record bytes) of an open binary TFRecord file, checking both checksums;
    raises FramingError at the first truncated or corrupted record."""
    offset = 0
    while True:
        header = f.read(12)
        if not header:
            return
        if len(header) < 12:
            raise FramingError(offset, "truncated record (the file ends inside its header)")
        (length,), (length_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
        if masked_crc32c(header[:8]) != length_crc:
            raise FramingError(offset, "corrupted record (length checksum mismatch; not a "
                                       "TFRecord file?)")
        data = f.read(length)
        footer = f.read(4)
        if len(data) < length or len(footer) < 4:
            missing = length + 4 - len(data) - len(footer)
            raise FramingError(offset, f"truncated record (the file ends {missing} bytes early)")
        if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
            raise FramingError(offset, "corrupted record (data checksum mismatch)")
        yield offset, data
        offset += 16 + length


def first_problem(path: str) -> str | None:
    """'truncated record ... at byte N' or 'corrupted record ... at byte N' for the first bad
    record of a TFRecord file; None when every record checks out."""
    with paths.open(path, "rb") as f:
        try:
            for _ in frames(f):
                pass
        except FramingError as e:
            return str(e)
    return None


def first_record(path: str) -> bytes:
    """The first record of a TFRecord file, its framing checked (FramingError otherwise)."""
    with paths.open(path, "rb") as f:
        for _, data in frames(f):
            return data
    raise FramingError(0, "no record")


# ------------------------------------------------------------- decoding, without TensorFlow


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of a protobuf message; value: int or bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
            if pos > len(data):
                raise ValueError("truncated field")
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def example_features(record: bytes) -> dict[str, list]:
    """{name: values} of a serialized tf.train.Example (int64 and float lists; bytes lists as
    their count), decoded without TensorFlow."""
    features = {}
    for _, _, feats in (f for f in _fields(record) if f[0] == 1):
        for _, _, entry in (f for f in _fields(feats) if f[0] == 1):
            name, values = "", []
            for number, _, value in _fields(entry):
                if number == 1:
                    name = value.decode("utf-8", "replace")
                elif number == 2:
                    for kind, _, lst in _fields(value):
                        for _, wire, v in _fields(lst):
                            if kind == 3 and wire == 2:  # packed int64
                                pos = 0
                                while pos < len(v):
                                    n, pos = _read_varint(v, pos)
                                    values.append(n - (1 << 64) if n >= 1 << 63 else n)
                            elif kind == 3:
                                values.append(v)
                            elif kind == 2 and wire == 2:
                                values.extend(struct.unpack(f"<{len(v) // 4}f", v))
                            elif kind == 2:
                                values.append(struct.unpack("<f", v)[0])
                            else:
                                values.append(v)
            features[name] = values
    return features
