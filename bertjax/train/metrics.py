"""Training metrics: TensorBoard event files + `metrics.jsonl`, throughput/MFU, progress line.

TensorBoard events are written with the `tensorboard` package's own writer. That writer does
its file I/O through TensorFlow when TensorFlow is installed (seconds of import and its
start-up noise, in every fine-tuning run); for a local workdir, unless TensorFlow is already
loaded, it is pointed at TensorBoard's own TensorFlow-free file layer instead (remote workdirs,
e.g. gs://, keep TensorFlow's file systems).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import types
from typing import Any

import jax
from etils import epath

from bertjax.errors import TrainingError
from bertjax.train import multihost


class MetricsWriter:
    """Writes scalars to TensorBoard (`workdir/tensorboard/<split>`) and `workdir/metrics.jsonl`.

    Only process 0 writes. Each `write` is one JSON line: {"step": ..., "split": ..., name: value}.
    A line left half-written by a crash (a full disk) is cut off before the next append; a
    transient error is retried with backoff (multihost.with_retries), and a failed write raises
    one TrainingError naming the file.

    Both files are written at once on a local disk. On an object store (gs://) an append
    rewrites the whole object, so there they are written at most every `flush_seconds` (and at
    `close`): the training loop does not wait on a growing upload at every log step.
    """

    def __init__(self, workdir: str, enabled: bool | None = None,
                 flush_seconds: float | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.workdir = epath.Path(workdir)
        if flush_seconds is None:
            flush_seconds = 60.0 if "://" in str(workdir) else 0.0
        self.flush_seconds = flush_seconds
        self._writers: dict[str, Any] = {}
        self._lines: list[str] = []  # metrics.jsonl lines not written yet
        self._flushed = -math.inf  # time.monotonic() of the last flush

    def _event_writer(self, split: str):
        if split not in self._writers:
            if "://" not in str(self.workdir) and "tensorflow" not in sys.modules:
                # tensorboard.compat uses its stub when this module exists.
                sys.modules.setdefault("tensorboard.compat.notf",
                                       types.ModuleType("tensorboard.compat.notf"))
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            logdir = self.workdir / "tensorboard" / split
            logdir.mkdir(parents=True, exist_ok=True)
            self._writers[split] = EventFileWriter(str(logdir))
        return self._writers[split]

    def write(self, step: int, metrics: dict[str, float], split: str = "train") -> None:
        if not self.enabled:
            return
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = {k: float(v) for k, v in metrics.items()}
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        try:
            self._event_writer(split).add_event(
                event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
        except OSError as e:
            raise self._error(e) from None
        self._lines.append(json.dumps({"step": int(step), "split": split, **values}) + "\n")
        if time.monotonic() - self._flushed >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Writes what `write` has buffered (TensorBoard events and metrics.jsonl lines)."""
        if not self.enabled:
            return
        try:
            for writer in self._writers.values():
                writer.flush()
            if self._lines:
                multihost.with_retries(self._append, f"writing {self.workdir}/metrics.jsonl")
                self._lines = []
        except OSError as e:
            raise self._error(e) from None
        self._flushed = time.monotonic()

    def _append(self) -> None:
        """Appends the buffered lines to metrics.jsonl, after cutting off a line that an
        earlier attempt (or run) left half-written: safe to repeat."""
        path = self.workdir / "metrics.jsonl"
        _cut_partial_line(path)
        with path.open("a") as f:
            f.write("".join(self._lines))

    def _error(self, e: OSError) -> TrainingError:
        return TrainingError(f"writing metrics to {self.workdir} failed ({e.strerror or e}); "
                             "the checkpoints saved so far are kept")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            for writer in self._writers.values():
                writer.close()


def _cut_partial_line(path: epath.Path) -> None:
    """Drops a last line without its newline (a write cut short) from a local file."""
    if "://" in str(path) or not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
        f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)


class Throughput:
    """Steps/s, sequences/s, tokens/s, model TFLOP/s per device and MFU since the last call."""

    def __init__(self, flops_per_sequence: float, peak_flops_per_device: float | None):
        self.flops_per_sequence = flops_per_sequence
        self.peak = peak_flops_per_device
        self._time = time.perf_counter()
        self._step = None

    def reset(self, step: int) -> None:
        self._time, self._step = time.perf_counter(), step

    def measure(self, step: int, batch_size: int, seq_len: int) -> dict[str, float]:
        now = time.perf_counter()
        if self._step is None or step <= self._step:
            self.reset(step)
            return {}
        steps = step - self._step
        seconds = now - self._time
        self.reset(step)
        sequences = steps * batch_size / seconds
        flops_per_device = sequences * self.flops_per_sequence / jax.device_count()
        out = {
            "steps_per_second": steps / seconds,
            "sequences_per_second": sequences,
            "tokens_per_second": sequences * seq_len,
        }
        if self.flops_per_sequence:
            out["model_tflops_per_device"] = flops_per_device / 1e12
        if self.peak and self.flops_per_sequence:
            out["mfu"] = flops_per_device / self.peak
        return out


def progress_line(step: int, total: int, metrics: dict[str, float], elapsed: float,
                  steps_per_second: float | None) -> str:
    """`step 1200/10000 (12.0%) loss 6.31 mlm_acc 0.142 lr 1.2e-04 3.1 steps/s ETA 0:47:10`."""
    parts = [f"step {step}/{total} ({100.0 * step / max(total, 1):.1f}%)"]
    for key, label, fmt in (("loss", "loss", ".4f"), ("mlm_accuracy", "mlm_acc", ".3f"),
                            ("nsp_accuracy", "nsp_acc", ".3f"), ("learning_rate", "lr", ".2e")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:{fmt}}")
    if steps_per_second:
        eta = int((total - step) / steps_per_second)
        parts.append(f"{steps_per_second:.2f} steps/s ETA {eta // 3600}:{eta % 3600 // 60:02d}:"
                     f"{eta % 60:02d}")
    parts.append(f"elapsed {int(elapsed)}s")
    return " | ".join(parts)
