"""The errors a user can cause, in one place. Every command catches `BertjaxError` and prints
its message as one `error: ...` line; the message names the file, field or flag at fault.

    ConfigError      a config field or flag is wrong (names `config.a.b` or `--flag`)
    DataError        an input file is wrong (names the file, line or record, and the field)
    CheckpointError  a checkpoint directory is missing, unreadable or does not fit the model
    TrainingError    training cannot continue (a diverged loss); says what was kept

Each is also a ValueError (TrainingError a RuntimeError), so code that caught those before
still does.
"""

from __future__ import annotations


class BertjaxError(Exception):
    """Base of the errors that commands report as one line."""


class ConfigError(BertjaxError, ValueError):
    """A config field or command-line flag is invalid; the message names it."""


class DataError(BertjaxError, ValueError):
    """Bad input data; the message names the file (and line or record) and the field."""


class CheckpointError(BertjaxError, ValueError):
    """A checkpoint (training state or a bertjax checkpoint directory) cannot be used."""


class TrainingError(BertjaxError, RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); the message says what was kept."""
