"""Flag parsing that reports a bad flag in one line, without a traceback."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable

from absl import app, flags

from tfmulti.errors import Terminated
from tfmulti.flags.help import install_help_flags
from tfmulti.platform.launching.sigterm import sigterm_raises_terminated
from tfmulti.platform.runtime.quick_exit import end_without_teardown, exit_code_will_be


def parse_flags_or_exit(
    argv: list[str], usage: str | None = None, module: str = "__main__", title: str = "options"
) -> list[str]:
    """Parses `argv` into absl's FLAGS; on error prints one line and exits with 2.

    `--help` lists the flag groups and `module`'s own flags (see `install_help_flags`).
    """
    install_help_flags(usage, module, title)
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        message = str(error).replace("\n", " ")
        if message.startswith("flags ") and ": --" in message:
            # A multi-flag check: its own message names the flags; drop absl's list of
            # every value it read.
            message = message[message.index(": --") + 2 :]
        print(f"{os.path.basename(argv[0])}: error: {message}", file=sys.stderr)
        sys.exit(2)


def run_script(
    main: Callable[[list[str]], None],
    user_errors: tuple[type, ...],
    usage: str | None = None,
    module: str = "__main__",
    title: str = "options",
    runs_children: bool = False,
) -> None:
    """Runs `main` with absl, turning any of `user_errors` into one line and an exit code.

    The code is the error's `exit_code` attribute if it has one (a preemption's
    "restart me"), else 1. A program that loaded TensorFlow ends without the interpreter's
    teardown (`quick_exit`): about 2 s less per run, and nothing open is lost.

    Args:
        main: the script's main function.
        user_errors: exception types that mean bad input, not a bug.
        usage: the text `--help` starts with (default: `__main__`'s docstring).
        module: the module whose own flags `--help` lists after the flag groups.
        title: the heading of those flags.
        runs_children: `main` runs other programs: SIGTERM raises `Terminated` (one line,
            exit 143), so the child running is killed and temporary files are removed.
    """
    if runs_children:
        user_errors = (*user_errors, Terminated)

    def guarded_main(argv):
        try:
            with sigterm_raises_terminated() if runs_children else contextlib.nullcontext():
                main(argv)
        except user_errors as error:
            print(f"{os.path.basename(argv[0])}: error: {error}", file=sys.stderr)
            sys.exit(getattr(error, "exit_code", 1))

    parser = functools.partial(parse_flags_or_exit, usage=usage, module=module, title=title)
    end_without_teardown()
    try:
        app.run(guarded_main, flags_parser=parser)
    except SystemExit as exit_request:
        exit_code_will_be(exit_request.code)
        raise
