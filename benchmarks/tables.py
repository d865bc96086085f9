"""Markdown tables of the benchmarks' results: one row per side, an error row for a side
that failed (its error's tail), so that one broken side never hides the others."""

from __future__ import annotations

from collections.abc import Callable, Mapping


def side_table(title: str, columns: list[str], sides: Mapping[str, dict],
               cells: Callable[[dict], list], error_chars: int = 120) -> list[str]:
    """`### title`, a header of `columns` (the first names the side), and a row per side:
    `cells(result)`, or the tail of `result["error"]`."""
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name, result in sides.items():
        if "error" in result:
            lines.append(f"| {name} | error: {result['error'][-error_chars:]!r} |")
            continue
        lines.append(f"| {name} | " + " | ".join(str(c) for c in cells(result)) + " |")
    return lines + [""]
