"""Step ranges such as "3,5" from flags (pure Python)."""

from __future__ import annotations


def parse_step_range(text: str) -> tuple[int, int]:
    """Parses "3,5" (steps 3 to 5) or "4" into a 1-based inclusive step range.

    Example:
        >>> parse_step_range("3,5")
        (3, 5)
    """
    parts = [part.strip() for part in str(text).split(",")]
    try:
        steps = [int(part) for part in parts]
    except ValueError:
        steps = []
    if len(steps) == 1:
        steps *= 2
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
        raise ValueError(
            f"A step range is 'FIRST,LAST' with 1 <= FIRST <= LAST, e.g. '3,5'. Received: {text!r}"
        )
    return steps[0], steps[1]
