"""Output of the `pdgate` command: an aligned table for people, JSON for scripts (`--json`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["cell", "emit", "table"]


def cell(value: Any) -> str:
    """One table cell: None as '-', floats short, booleans as yes/no."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows under upper-case headers, each column as wide as its widest cell."""
    cells = [[c.upper() for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def emit(output: str, data: Any, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """What a listing command prints: `data` as JSON, or `rows` as a table."""
    if output == "json":
        return json.dumps(data, indent=2, sort_keys=True, default=str)
    return table(rows, columns) if rows else "(none)"
