"""The main shared by the data_pipeline commands: absl flags, --help, one-line errors.

Each command module defines its flags in a function (never at import: modules imported
together, e.g. by pytest, must not compete for absl's global flag names) and a `main` that
reads them, and ends with

    if __name__ == "__main__":
        cli.run(main, define_flags)

`python -m data_pipeline.<command> --help` prints the module's docstring (its usage) and its
flags. Bad input stops with one line, `error: <message>`, and exit status 1: an unknown or
missing flag, a bad flag value, and every `bertjax.errors.BertjaxError` (e.g. `DataError`,
naming the file and line) or ValueError (a setting out of range, naming the --flag) that the
command raises.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app, flags

from bertjax.errors import BertjaxError


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, failing with one `error: ...` line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:  # several missing flags: one message line each
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        sys.exit(f"error: {message} (--help lists the flags)")


def run(main: Callable[[flags.FlagValues], None], define_flags: Callable[[], None]) -> None:
    """Defines the flags, parses sys.argv and calls main(flags.FLAGS) (see module docstring)."""
    define_flags()

    def app_main(argv: list[str]) -> None:
        if len(argv) > 1:
            sys.exit(f"error: unexpected arguments {argv[1:]}; flags are --name=value")
        try:
            main(flags.FLAGS)
        except (BertjaxError, ValueError) as e:
            sys.exit(f"error: {e}")

    app.run(app_main, flags_parser=parse_flags)
