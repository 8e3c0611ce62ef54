"""`bertjax.Predictor`: predictions of a finished fine-tuning run as plain Python records, of
Python values, a file, or a file larger than memory a chunk at a time (each family's
`Task.input_chunks` cuts it where the one-shot reading would give each row the same input).

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax

from bertjax import paths
from bertjax.errors import ConfigError, DataError
from bertjax.serving.engine import Engine, padding_line
from bertjax.serving.runs import TrainedModel, load_export, load_workdir


class Predictor:
    """Predictions of a finished fine-tuning run, as plain Python records.

        predictor = bertjax.Predictor.from_workdir("runs/mrpc")
        predictor = bertjax.Predictor.from_export("hf/mrpc")  # convert to_hf of runs/mrpc
        predictor(["a sentence", ...])           # classification / regression
        predictor([("sentence a", "sentence b")])  # pairs
        predictor([("context", ["ending 1", ...])])  # multiple choice
        predictor([("question", "context")])     # SQuAD
        predictor([["EU", "rejects", "German", "call"]])  # tagging (or "EU rejects ...")

    Records: see each task's `records` (classification: {id, label, probabilities}).

    devices (optional): whole batches on each of these in turn (`DeviceTurns`), as the command
    runs on a machine with no accelerator: `jax.config.update("jax_num_cpu_devices", 2)` before
    JAX starts, then `devices=jax.devices()`; the same predictions, faster.
    """

    def __init__(self, trained: TrainedModel, batch_size: int | None = None,
                 devices: Sequence[jax.Device] | None = None):
        self.trained = trained
        self.engine = Engine(trained, batch_size, devices)
        self.task = trained.task
        self.last_padding = ""  # padding_line of the last call

    @classmethod
    def from_workdir(cls, workdir: str, batch_size: int | None = None,
                     dtype: str | None = None, devices: Sequence[jax.Device] | None = None
                     ) -> Predictor:
        return cls(load_workdir(workdir, dtype), batch_size, devices)

    @classmethod
    def from_export(cls, directory: str, batch_size: int | None = None,
                    dtype: str | None = None, devices: Sequence[jax.Device] | None = None
                    ) -> Predictor:
        """From `python -m bertjax.convert to_hf --input=WORKDIR --output=DIR`'s DIR."""
        return cls(load_export(directory, dtype), batch_size, devices)

    def _records(self, examples) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
        features, predictions, tokens = self.engine.run(examples)
        self.last_padding = padding_line(tokens)
        try:
            return features, predictions, self.task.records(predictions, features, examples)
        finally:
            self.task.release(examples)

    def __call__(self, items: list) -> list[dict[str, Any]]:
        return self._records(self.task.examples(list(items)))[2]

    def predict_file(self, path: str, fields: dict[str, Any] | None = None
                     ) -> tuple[list, list[dict[str, Any]], dict[str, float] | None]:
        """(examples, records, the task's metrics or None when the file has no gold labels)
        of a file of new rows; `fields` override the run's users'-files field names."""
        if not paths.exists(path):
            raise DataError(f"{path}: no such file")
        merged = {**dict(self.trained.config.get("data", {})),
                  **{k: v for k, v in (fields or {}).items() if v is not None}}
        paths.check_encoding(merged.get("encoding") or paths.DEFAULT_ENCODING, "--encoding")
        examples, labelled = self.task.read_inputs(path, merged)
        features, predictions, records = self._records(examples)
        metrics = self.task.metrics(predictions, features, "input") if labelled else None
        return examples, records, metrics

    def predict_stream(self, path: str, write, fields: dict[str, Any] | None = None,
                       chunk_rows: int = 10_000) -> int:
        """Predicts a file `chunk_rows` rows at a time (memory independent of its size) and
        calls `write(examples, records, labelled)` per chunk, in input order, with the
        records the one-shot `predict_file` gives those rows (ids numbered in the whole
        file). Every process must call this (the batches are collective); `write` runs on
        process 0 only. No metrics: they need every row at once. Returns the rows predicted."""
        import os
        import tempfile

        from bertjax.train import multihost

        if chunk_rows < 1:
            raise ConfigError(f"--chunk_rows={chunk_rows} must be positive")
        if not paths.exists(path):
            raise DataError(f"{path}: no such file")
        merged = {**dict(self.trained.config.get("data", {})),
                  **{k: v for k, v in (fields or {}).items() if v is not None}}
        paths.check_encoding(merged.get("encoding") or paths.DEFAULT_ENCODING, "--encoding")
        total, real, computed = 0, 0, 0
        with tempfile.TemporaryDirectory() as directory:
            for chunk, start in self.task.input_chunks(path, chunk_rows, merged, directory):
                # The chunks are written in UTF-8, whatever the input's encoding.
                examples, labelled = self.task.read_inputs(chunk, {**merged,
                                                                   "encoding": "utf-8"})
                features, predictions, tokens = self.engine.run(examples)
                try:
                    records = self.task.records(predictions, features, examples)
                finally:
                    self.task.release(examples)
                records = self.task.stream_records(records, start)
                multihost.write_from_main(functools.partial(write, examples, records,
                                                            labelled))
                total += len(records)
                real, computed = real + tokens["real"], computed + tokens["computed"]
                os.remove(chunk)  # the next chunk is written only once this one is done
        self.last_padding = padding_line({"real": real, "computed": computed})
        return total
