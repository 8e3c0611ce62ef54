"""TensorFlow for bertjax: CPU only, and quiet.

`import_tensorflow()` is the one way the project imports TensorFlow (data_pipeline, tokenization's
tensorflow-text path, TF1 checkpoint reading):

- Accelerators belong to JAX; TensorFlow only reads data. Every GPU and TPU is hidden from it
  (`tf.config.set_visible_devices([], ...)`), so it never reserves accelerator memory.
- TensorFlow's start-up noise stays out of the output: the oneDNN and CPU-instruction
  banners, "Could not find cuda drivers" and "failed call to cuInit" on machines without a
  GPU, and its C++ (absl) INFO and WARNING lines. `TF_CPP_MIN_LOG_LEVEL` is set to 2 unless
  the user has set it, and the lines TensorFlow writes while it is imported (some of which
  ignore that setting) are filtered by the same level: at 1, INFO lines; at 2 and above,
  WARNING lines and its CUDA errors as well. Anything else it writes is passed on.

To see everything TensorFlow says, run with `TF_CPP_MIN_LOG_LEVEL=0`.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

LOG_LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
DEFAULT_LOG_LEVEL = "2"

# A C++ log line: absl's `I0101 12:00:00.000000  1234 file.cc:1] ...` or TensorFlow's older
# `2024-01-01 12:00:00.000000: I tensorflow/...] ...` (I, W, E or F: the severity). Before
# absl's logging starts, its time field can read `00:00:1795366378.230761`.
_LOG_LINE = re.compile(r"(?:(?P<absl>[IWEF])\d{4} \d+:\d+:\d+\.\d+ +\d+ |"
                       r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: (?P<old>[IWEF]) )")
# Printed around INFO lines: absl's notice before its logging starts, and the second line of
# the CPU-instruction banner.
_INFO_EXTRA = re.compile(r"WARNING: All log messages before absl::InitializeLog|"
                         r"To enable the following instructions")
_CUDA = re.compile(r"cuInit|CUDA|cuda|cuDNN|cuFFT|cuBLAS|computation placer")

_devices_hidden = False


def log_level() -> int:
    """The TF_CPP_MIN_LOG_LEVEL in effect (0 shows everything); sets the default if unset."""
    value = os.environ.setdefault(LOG_LEVEL_VARIABLE, DEFAULT_LOG_LEVEL)
    try:
        return int(value)
    except ValueError:
        return 0  # a value TensorFlow does not understand: hide nothing


def is_noise(line: str, level: int) -> bool:
    """Whether a line TensorFlow writes while it starts is hidden at log level `level`."""
    if level >= 1 and _INFO_EXTRA.match(line):
        return True
    match = _LOG_LINE.match(line)
    if match is None:
        return False
    severity = match.group("absl") or match.group("old")
    return ((severity == "I" and level >= 1) or (severity == "W" and level >= 2)
            or (severity == "E" and level >= 2 and _CUDA.search(line) is not None))


def _hide_devices(tf) -> None:
    global _devices_hidden
    if _devices_hidden:
        return
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_visible_devices([], "TPU")
    except RuntimeError:  # TF already initialised its devices in this process
        pass
    _devices_hidden = True


def _import_filtered(level: int):
    """Imports TensorFlow and hides its devices while file descriptor 2 goes to a temporary
    file, then writes what is not noise to the real stderr (also when the import fails)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            _hide_devices(tf)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode("utf-8", errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not is_noise(line, level))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
    return tf


def import_tensorflow():
    """The `tensorflow` module, with every accelerator hidden from it (see module docstring)."""
    level = log_level()
    if "tensorflow" not in sys.modules and level > 0:
        return _import_filtered(level)
    import tensorflow as tf

    _hide_devices(tf)
    return tf


def import_tfds():
    """The `tensorflow_datasets` module, TensorFlow imported first as `import_tensorflow` does
    (TFDS would import it itself, with accelerators and its start-up noise). Every TFDS reader
    goes through here, so the task folders never import TensorFlow themselves."""
    import_tensorflow()
    import tensorflow_datasets as tfds

    return tfds
