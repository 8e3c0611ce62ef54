"""Shared command-line plumbing: flag parsing that fails with one clear line."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from absl import flags


def _offending_flag(message: str, argv: Sequence[str]) -> str | None:
    """The --config.* argument that an ml_collections error message refers to, if any."""
    names = re.findall(r"'(\w+)'", message)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg.split("=", 1)[0][len("--config."):].split(".")
        if any(name in path for name in names):
            return arg
    return None


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl flags parser for app.run: any bad flag or config override exits with one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"error: {e}")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # ml_collections reports unknown fields and bad values as plain exceptions.
        message = " ".join(str(e).replace("\\n", " ").strip("'\"").split())
        culprit = _offending_flag(message, argv)
        where = f"{culprit}: " if culprit else ""
        sys.exit(f"error: bad config override {where}{message}")
