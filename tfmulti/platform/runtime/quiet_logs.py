"""absl's INFO lines turned off for a while, and put back exactly as they were."""

from __future__ import annotations

import contextlib
import logging as standard_logging
from collections.abc import Iterator

from absl import logging


@contextlib.contextmanager
def warnings_only() -> Iterator[None]:
    """Logs only absl warnings and errors inside; afterwards, the verbosity flag, the absl
    logger's own level and the root logger's level are as before.

    absl sets the root logger's level when its handler is the root's (a script under
    `absl.app`), else its own logger's; restoring only the verbosity would pin an unset
    absl level, hiding INFO from handlers set up later (pytest's `caplog`), and restoring
    only the absl level would leave the root at WARNING (a script's INFO lines lost).
    """
    absl_logger, root = logging.get_absl_logger(), standard_logging.getLogger()
    levels = (absl_logger.level, root.level)
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        absl_logger.setLevel(levels[0])
        root.setLevel(levels[1])
