"""absl's INFO lines turned off for a while, and put back exactly as they were."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from absl import logging


@contextlib.contextmanager
def warnings_only() -> Iterator[None]:
    """Logs only absl warnings and errors inside; restores the absl logger's own level
    after (not the verbosity it reported, which would pin an unset level to WARNING and
    hide INFO from handlers set up later, such as pytest's `caplog`)."""
    absl_logger = logging.get_absl_logger()
    level = absl_logger.level
    logging.set_verbosity(logging.WARNING)
    try:
        yield
    finally:
        absl_logger.setLevel(level)
