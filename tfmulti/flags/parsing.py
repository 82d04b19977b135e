"""Flag parsing that reports a bad flag in one line, without a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import app, flags


def parse_flags_or_exit(argv: list[str]) -> list[str]:
    """Parses `argv` into absl's FLAGS; on error prints one line and exits with 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        print(f"{os.path.basename(argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)


def run_script(main: Callable[[list[str]], None], user_errors: tuple[type, ...]) -> None:
    """Runs `main` with absl, turning any of `user_errors` into one line and an exit code.

    The code is the error's `exit_code` attribute if it has one (a preemption's
    "restart me"), else 1.

    Args:
        main: the script's main function.
        user_errors: exception types that mean bad input, not a bug.
    """

    def guarded_main(argv):
        try:
            main(argv)
        except user_errors as error:
            print(f"{os.path.basename(argv[0])}: error: {error}", file=sys.stderr)
            sys.exit(getattr(error, "exit_code", 1))

    app.run(guarded_main, flags_parser=parse_flags_or_exit)
