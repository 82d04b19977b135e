"""Plain-text tables for logs and reports (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[str]], columns: Sequence[str]) -> str:
    """Left-aligned columns, each as wide as its widest cell."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows, strict=True)]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (columns, *rows)
    )
