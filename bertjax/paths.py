"""Paths a user gives (flags, config fields): local, or remote (`gs://`, and the other schemes
etils.epath knows, through TensorFlow's file systems when TensorFlow is installed).

Drop-in replacements for the os / glob / open calls that readers and writers make on such
paths. A local path goes to Python's own functions, exactly as before; a remote one goes
through `etils.epath`. Remote text files are UTF-8 (a BOM is dropped with "utf-8-sig").

Users' text files are read through `open_text`, `read_text`, `text_lines` or `jsonl_records`:
in UTF-8 unless they name another encoding, and a byte that is not of that encoding stops with
one line naming file, line, byte and column (`decoding_error`), not a UnicodeDecodeError.
"""

from __future__ import annotations

import builtins
import codecs
import glob as _glob
import io
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import IO

from etils import epath

from bertjax.errors import ConfigError, DataError

_MAGIC = re.compile(r"[*?\[]")


def is_remote(path) -> bool:
    return "://" in os.fspath(path)


def exists(path) -> bool:
    return epath.Path(path).exists() if is_remote(path) else os.path.exists(path)


def isfile(path) -> bool:
    return epath.Path(path).is_file() if is_remote(path) else os.path.isfile(path)


def isdir(path) -> bool:
    return epath.Path(path).is_dir() if is_remote(path) else os.path.isdir(path)


def getsize(path) -> int:
    return epath.Path(path).stat().length if is_remote(path) else os.path.getsize(path)


def join(path, *parts) -> str:
    return str(epath.Path(path).joinpath(*parts)) if is_remote(path) else os.path.join(path,
                                                                                      *parts)


def dirname(path) -> str:
    if not is_remote(path):
        return os.path.dirname(path)
    scheme, rest = os.fspath(path).split("://", 1)
    return f"{scheme}://{rest.rsplit('/', 1)[0]}" if "/" in rest else f"{scheme}://{rest}"


def makedirs(path, flag: str = "") -> None:
    """Creates directory `path` and its parents; a file in the way is one DataError line
    (naming `flag`, the option that gave the path, where there is one)."""
    if is_remote(path):
        epath.Path(path).mkdir(parents=True, exist_ok=True)
        return
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        where = f"{flag}={path}" if flag else str(path)
        raise DataError(f"{where}: a file is in the way (it or a parent is a file, not a "
                        "directory); give a directory") from None


def glob(pattern: str) -> list[str]:
    """Sorted paths matching a glob pattern (`gs://bucket/data/*.tfrecord` too)."""
    if not is_remote(pattern):
        return sorted(_glob.glob(pattern))
    scheme, rest = pattern.split("://", 1)
    parts = rest.split("/")
    # The fixed directory before the first part with a wildcard, globbed from there.
    fixed = next((i for i, part in enumerate(parts) if _MAGIC.search(part)), len(parts))
    if fixed == len(parts):
        return [pattern] if exists(pattern) else []
    base = epath.Path(f"{scheme}://" + "/".join(parts[:fixed]))
    return sorted(str(p) for p in base.glob("/".join(parts[fixed:])))


def open(path, mode: str = "r", encoding: str | None = None,  # noqa: A001 (the builtin's name)
         newline: str | None = None) -> IO:
    """builtins.open for local paths; for remote ones, the same modes through epath."""
    if not is_remote(path):
        return builtins.open(path, mode, encoding=encoding, newline=newline)
    if "r" in mode:
        if "b" in mode:
            return epath.Path(path).open(mode)  # streamed
        # Decoded here, so that encoding (utf-8-sig) and newline ("" for csv) mean what they
        # mean for local files.
        data = epath.Path(path).read_bytes().decode(encoding or "utf-8")
        return io.StringIO(data, newline=newline)
    initial = epath.Path(path).read_bytes() if "a" in mode and exists(path) else b""
    return (_BytesUpload if "b" in mode else _TextUpload)(path, initial)


def read_json_object(path, error: type[Exception], name: str | None = None) -> dict:
    """The JSON object in the file at `path` (local or remote). Anything else raises
    `error("NAME: invalid JSON (why)")` or `error("NAME: expected a JSON object, got list")`;
    NAME is `name` (e.g. "--input DIR/config.json") or the path."""
    name = name or str(path)
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except json.JSONDecodeError as e:
        raise error(f"{name}: invalid JSON ({e})") from None
    except UnicodeDecodeError:
        raise error(f"{name}: invalid JSON (not UTF-8)") from None
    if not isinstance(value, dict):
        raise error(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Users' text files: one decoding path

DEFAULT_ENCODING = "utf-8"
# Where a user names another encoding, for the hint of a decoding error.
ENCODING_OPTIONS = "--config.data.encoding=latin-1 (predict: --encoding=latin-1)"


def check_encoding(encoding, field: str) -> str:
    """`encoding` when Python has a codec of that name; otherwise ConfigError naming `field`."""
    try:
        codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise ConfigError(f"{field}={encoding!r} is not an encoding Python knows (e.g. utf-8, "
                          "latin-1, cp1252)") from None
    return encoding


def _codec(encoding: str) -> str:
    # UTF-8 files written by Windows tools start with a BOM; it is not part of the text.
    return "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding


def decoding_error(path, line: int, error: UnicodeDecodeError, encoding: str,
                   hint: str | None = ENCODING_OPTIONS) -> str:
    """The one line for a byte of `path` that is not `encoding`: "PATH:LINE: invalid UTF-8
    (byte 0xe9 at column 4); save the file as UTF-8 or give its encoding, e.g. HINT".
    `error` comes from decoding that line's bytes (its column is counted in characters)."""
    name = "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding
    data = error.object
    where = (f"byte 0x{data[error.start]:02x} at column "
             f"{len(data[:error.start].decode(_codec(encoding), 'replace')) + 1}"
             if error.start < len(data) else error.reason)
    fix = f"; save the file as UTF-8 or give its encoding, e.g. {hint}" if hint else (
        "; save the file as UTF-8")
    return f"{path}:{line}: invalid {name} ({where}){fix}"


def text_lines(path, encoding: str = DEFAULT_ENCODING, error: type[Exception] = DataError,
               hint: str | None = ENCODING_OPTIONS) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line with its newline) of a text file (local or remote,
    streamed); a byte that is not `encoding` raises `error(decoding_error(...))`."""
    decoder = codecs.getincrementaldecoder(_codec(encoding))()
    number, raw = 0, b""
    with open(path, "rb") as f:  # a remote path's epath open() is a context manager
        for number, raw in enumerate(f, 1):
            try:
                yield number, decoder.decode(raw)
            except UnicodeDecodeError as e:
                raise error(decoding_error(path, number, e, encoding, hint)) from None
        try:
            decoder.decode(b"", final=True)  # a multi-byte character cut at the end
        except UnicodeDecodeError as e:
            cut = e
            try:  # the last line alone, for the error's column in it
                raw.decode(_codec(encoding))
            except UnicodeDecodeError as in_line:
                cut = in_line
            raise error(decoding_error(path, number, cut, encoding, hint)) from None


def check_text(path, encoding: str = DEFAULT_ENCODING,
               hint: str | None = ENCODING_OPTIONS) -> None:
    """One streamed pass over `path`: DataError(decoding_error(...)) at its first line that is
    not `encoding` (before work that a bad line would waste, or to name the line)."""
    for _ in text_lines(path, encoding, DataError, hint):
        pass


def _decoding_failed(path, encoding: str, hint: str | None, e: UnicodeDecodeError) -> DataError:
    # The text layer decodes blocks of bytes, so its error has no line: the file is decoded
    # again line by line (only on this path) to name it.
    try:
        check_text(path, encoding, hint)
    except DataError as named:
        return named
    return DataError(f"{path}: invalid {encoding} ({e.reason})")


class TextFile:
    """A text file opened by `open_text`: the methods readers use (iteration, read, readline),
    a decoding error turned into one line naming the file and line."""

    def __init__(self, path, file: IO, encoding: str, hint: str | None):
        self.path, self._file, self.encoding, self._hint = path, file, encoding, hint

    def _error(self, e: UnicodeDecodeError) -> DataError:
        return _decoding_failed(self.path, self.encoding, self._hint, e)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._file)
        except UnicodeDecodeError as e:
            raise self._error(e) from None

    def read(self, size: int = -1) -> str:
        try:
            return self._file.read(size)
        except UnicodeDecodeError as e:
            raise self._error(e) from None

    def readline(self, size: int = -1) -> str:
        try:
            return self._file.readline(size)
        except UnicodeDecodeError as e:
            raise self._error(e) from None

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TextFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_text(path, encoding: str = DEFAULT_ENCODING, newline: str | None = None,
              hint: str | None = ENCODING_OPTIONS) -> TextFile:
    """A user's text file (local or remote) for reading, in `encoding` (UTF-8: a BOM is
    dropped); OSError as open() raises it, a byte that is not `encoding` as one DataError
    line (decoding_error; `hint`: the option that names another encoding)."""
    check_encoding(encoding, "encoding")
    try:
        file = open(path, "r", encoding=_codec(encoding), newline=newline)
    except UnicodeDecodeError as e:  # a remote file is decoded whole when opened
        raise _decoding_failed(path, encoding, hint, e) from None
    return TextFile(path, file, encoding, hint)


def read_text(path, encoding: str = DEFAULT_ENCODING,
              hint: str | None = ENCODING_OPTIONS) -> str:
    """The whole text of a user's file (open_text's decoding and errors)."""
    with open_text(path, encoding, hint=hint) as f:
        return f.read()


def jsonl_records(path, error: type[Exception], encoding: str = DEFAULT_ENCODING,
                  hint: str | None = ENCODING_OPTIONS) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line of a JSON-lines file (local or
    remote, streamed); a missing file, a byte that is not `encoding`, a line that is not JSON
    or not an object raises `error("PATH[:LINE]: why")`."""
    lines = text_lines(path, encoding, error, hint)
    try:
        first = next(lines, None)
    except OSError as e:
        raise error(f"{path}: {e.strerror or e}") from None
    for number, text in itertools.chain([first] if first else [], lines):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{number}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise error(f"{path}:{number}: expected a JSON object per line, got "
                        f"{type(record).__name__}")
        yield number, record


class _Upload:
    """A file opened for writing on a remote store: a full in-memory file (every method of
    io's), written as one object on close, as object stores write them anyway."""

    def __init__(self, path, initial: bytes):
        super().__init__()
        self.path = path
        if initial:
            self.write(initial if isinstance(self, io.BytesIO) else initial.decode("utf-8"))

    def close(self) -> None:
        if not self.closed:
            value = self.getvalue()
            epath.Path(self.path).write_bytes(value.encode("utf-8") if isinstance(value, str)
                                              else value)
        super().close()


class _TextUpload(_Upload, io.StringIO):
    pass


class _BytesUpload(_Upload, io.BytesIO):
    pass
