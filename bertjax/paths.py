"""Paths a user gives (flags, config fields): local, or remote (`gs://`, and the other schemes
etils.epath knows, through TensorFlow's file systems when TensorFlow is installed).

Drop-in replacements for the os / glob / open calls that readers and writers make on such
paths. A local path goes to Python's own functions, exactly as before; a remote one goes
through `etils.epath`. Remote text files are UTF-8 (a BOM is dropped with "utf-8-sig").
"""

from __future__ import annotations

import builtins
import glob as _glob
import io
import json
import os
import re
from collections.abc import Iterator
from typing import IO

from etils import epath

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


def makedirs(path) -> None:
    if is_remote(path):
        epath.Path(path).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


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


def jsonl_records(path, error: type[Exception]) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line of a JSON-lines file (local or
    remote); a missing file, bad UTF-8, a line that is not JSON or not an object raises
    `error("PATH[:LINE]: why")`."""
    try:
        handle = open(path, "rb")
    except OSError as e:
        raise error(f"{path}: {e.strerror or e}") from None
    with handle as f:  # a remote path's epath open() is a context manager, not the file
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path}:{number}: invalid UTF-8 ({e.reason})") from None
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
