"""Contextual features of text lines from a pre-trained BERT, in the reference
extract_features.py's JSON format (`python -m bertjax.extract_features`; the feature-based
approach of the paper's Sec. 5.3 uses the same layers).

Input: one example a line, `text` or `text_a ||| text_b`. Output: one JSON object a line:
  {"linex_index": i, "features": [{"token": "[CLS]", "layers": [{"index": -1, "values": [...]},
                                                               ...]}, ...]}
Layer indices count encoder layers as the reference does: 0 = first layer's output, -1 = last;
values are rounded to 6 decimals. A ModernBERT checkpoint works the same way
(`bertjax.models.heads.hidden_states`): its last layer is its final-normed output,
ModernBertModel's (and transformers' hidden_states[-1]).

Lines are read a window of WINDOW_BATCHES batches at a time (memory independent of the file's
size), sorted into the fine-tuning engine's length buckets
(16, 32, ..., max_seq_length: `data_pipeline.finetune_data.bucket_lengths`) and run in
fixed-shape batches [batch_size, bucket length] through one jit-compiled function (one
compilation per bucket; a bucket's last batch is padded) on the prediction engine's runner
(sharded over the data-parallel devices, or whole batches on CPU devices in turn), then
written in input order.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import paths
from bertjax.models import ModelConfig, architecture, heads
from bertjax.train import multihost

# Lines sorted into buckets together: enough that most batches are full, few enough that a
# window's features stay small.
WINDOW_BATCHES = 16

# The reference's pattern: with the greedy left group, a line with several " ||| " splits at
# the last one. Kept as is so both read odd inputs alike.
_PAIR = re.compile(r"^(.*) \|\|\| (.*)$")


def parse_line(line: str) -> tuple[str, str | None]:
    """`text` → (text, None); `text_a ||| text_b` → (text_a, text_b)."""
    line = line.strip()
    match = _PAIR.match(line)
    return (match.group(1), match.group(2)) if match else (line, None)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """"-1,-2" → [-1, -2]; each must address one of the `num_layers` encoder layers."""
    try:
        layers = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--layers={spec!r} must be comma-separated integers") from None
    for layer in layers:
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"--layers={spec}: layer {layer} does not exist in a "
                             f"{num_layers}-layer model (use {-num_layers}..{num_layers - 1})")
    return layers


class FeatureExtractor:
    """Runs texts through BERT and returns the reference JSON objects.

    The prediction engine's runner (bertjax/serving/engine.py): batches sharded over the
    data-parallel devices of every process (each process feeds its share of a batch, and every
    process gets the features), or with `devices`, whole batches on each of them in turn. The
    next batch is dispatched before a batch's features are turned into JSON.
    `self.compute` is the jitted function params, batch ([batch, seq] ids/segments/mask) →
    [batch, len(layers), seq, hidden] float32.
    """

    def __init__(self, config: ModelConfig, params: Any, tokenizer: Any, layers: Sequence[int],
                 max_seq_length: int, batch_size: int,
                 devices: Sequence[jax.Device] | None = None):
        from bertjax.serving.engine import (
            DATA_PARALLEL_MESH,
            DATA_PARALLEL_RULES,
            runner_and_params,
        )

        if max_seq_length > config.max_position_embeddings:
            raise ValueError(f"--max_seq_length={max_seq_length} exceeds the model's "
                             f"max_position_embeddings={config.max_position_embeddings}")
        if batch_size < 1:
            raise ValueError(f"--batch_size={batch_size} must be positive")
        self.config, self.tokenizer = config, tokenizer
        self.layers = list(layers)
        self.max_seq_length, self.batch_size = max_seq_length, batch_size
        self.tokens = {"real": 0, "computed": 0}
        ids = jnp.zeros((1, 2), jnp.int32)
        record = architecture(config)
        model, init_inputs = record.encoder(config), record.encoder_args(ids, ids, ids)
        group = record.encoder_group  # the encoder of pre-training params, or itself
        self.runner, self.params = runner_and_params(
            model, init_inputs, params[group] if group in params else params,
            DATA_PARALLEL_MESH, DATA_PARALLEL_RULES, batch_size, devices)
        # hidden_states[0] is the embedding output; the reference's layer i is index i + 1.
        rows = np.array([layer % config.num_layers + 1 for layer in self.layers])

        def compute(params, batch):
            states = heads.hidden_states(config, params, batch["input_ids"],
                                         batch["segment_ids"], batch["input_mask"])
            selected = states[rows]  # [n_layers, batch, seq, hidden]
            return jnp.swapaxes(selected, 0, 1).astype(jnp.float32)

        self.compute = jax.jit(compute)

    def _batches(self, encodings, members: np.ndarray, length: int
                 ) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of the fixed [batch_size, length] batches of `members` (their
        encodings fit in `length` tokens), with "row": the member's index (-1: filler)."""
        from data_pipeline.hosts import host_rows

        mine = host_rows(self.batch_size, jax.process_index(), jax.process_count())
        for first in range(0, len(members), self.batch_size):
            rows = members[first:first + self.batch_size]
            shape = (self.batch_size, length)
            batch = {k: np.zeros(shape, np.int32)
                     for k in ("input_ids", "segment_ids", "input_mask")}
            batch["row"] = np.full(self.batch_size, -1, np.int32)
            for r, i in enumerate(rows):
                enc = encodings[i]
                batch["input_ids"][r] = enc.input_ids[:length]
                batch["segment_ids"][r] = enc.segment_ids[:length]
                batch["input_mask"][r] = enc.input_mask[:length]
                batch["row"][r] = i
            yield {k: v[mine] for k, v in batch.items()}

    def __call__(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        """One reference JSON object per input line, in order. self.tokens counts the "real"
        and "computed" token positions (padding waste)."""
        from data_pipeline.finetune_data import assign_buckets, bucket_lengths

        buckets = bucket_lengths(self.max_seq_length, min(16, self.max_seq_length))
        index = 0
        for window in _chunks(lines, self.batch_size * WINDOW_BATCHES):
            pairs = [parse_line(line) for line in window]
            encodings = self.tokenizer.encode_batch(
                [a for a, _ in pairs], [b for _, b in pairs], max_seq_length=self.max_seq_length)
            assignment = assign_buckets(np.array([sum(e.input_mask) for e in encodings]),
                                        buckets)
            batches = (batch for bucket, length in enumerate(buckets)
                       for batch in self._batches(encodings, np.flatnonzero(assignment == bucket),
                                                  length))
            out: list[dict[str, Any] | None] = [None] * len(window)
            for batch, values in self.runner.run(self.compute, self.params, batches):
                self.tokens["real"] += int(batch["input_mask"].sum())
                self.tokens["computed"] += batch["input_mask"].size
                for r, i in enumerate(batch["row"]):
                    if i >= 0:
                        out[i] = self._example(index + int(i), encodings[i], values[r])
            index += len(window)
            yield from out

    def _example(self, index: int, enc, values: np.ndarray) -> dict[str, Any]:
        """values: [n_layers, seq, hidden] for one example."""
        length = int(sum(enc.input_mask))
        rounded = np.round(values[:, :length].astype(np.float64), 6)
        features = []
        for position, token in enumerate(enc.tokens[:length]):
            features.append({
                "token": token,
                "layers": [{"index": layer, "values": rounded[k, position].tolist()}
                           for k, layer in enumerate(self.layers)],
            })
        return {"linex_index": index, "features": features}


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run(checkpoint: str, input_file: str, output_file: str, layers: str = "-1,-2,-3,-4",
        max_seq_length: int = 128, batch_size: int = 32,
        do_lower_case: bool | None = None, devices: Sequence[jax.Device] | None = None,
        encoding: str = paths.DEFAULT_ENCODING) -> int:
    """Writes `output_file`; returns the number of examples. devices: whole batches on each in
    turn (FeatureExtractor), instead of sharded over every device. encoding: the input's."""
    from bertjax.checkpoint_dir import load_pretrained

    # The files first: a missing input or output directory must not cost a model load.
    out_dir = os.path.dirname(output_file) or "."
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output_file={output_file}: no such directory {out_dir}")
    if not os.path.isfile(input_file):
        raise ValueError(f"--input_file={input_file}: no such file")
    paths.check_encoding(encoding, "--encoding")
    paths.check_text(input_file, encoding, _HINT)  # a bad byte must not cost a model load
    config, params, tokenizer = load_pretrained(checkpoint, do_lower_case=do_lower_case)
    extractor = FeatureExtractor(config, params, tokenizer, parse_layers(layers, config.num_layers),
                                 max_seq_length, batch_size, devices)
    if not multihost.is_main():
        # On a multi-host run every process computes its share of each batch (and receives
        # every feature), and process 0 writes them.
        with _open(input_file, "--input_file", encoding=encoding) as source:
            for _ in extractor(line.rstrip("\n") for line in source):
                pass
    return multihost.write_from_main(
        lambda: _write(extractor, input_file, output_file, encoding))


_HINT = "--encoding=latin-1"  # the command's option naming another encoding


def _open(path: str, flag: str, mode: str = "r", encoding: str = paths.DEFAULT_ENCODING):
    try:
        if mode == "r":
            return paths.open_text(path, encoding, hint=_HINT)
        return paths.open(path, mode, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag}={path}: {e.strerror}") from None


def _write(extractor: FeatureExtractor, input_file: str, output_file: str,
           encoding: str = paths.DEFAULT_ENCODING) -> int:
    """Streams the features of `input_file` into `output_file`; returns the example count."""
    count = 0
    with _open(input_file, "--input_file", encoding=encoding) as source, \
            _open(output_file, "--output_file", "w") as sink:
        # The reference reads until EOF, so a trailing newline adds no example.
        for example in extractor(line.rstrip("\n") for line in source):
            sink.write(json.dumps(example) + "\n")
            count += 1
    return count
