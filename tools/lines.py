"""Reading the `kind: key=value ...` lines the course's scripts print (`final:`, `epoch:`, `step:`), without
importing torch: the notebooks' kernels and the tests parse them; tools/course.py re-exports parse_lines."""

from __future__ import annotations

import re


def parse_lines(text: str, kind: str) -> list[dict]:
    """Every `kind: key=value ...` line of `text`, as a dict each; plain decimal numbers become int or float."""
    rows = []
    for ln in text.splitlines():
        if ln.startswith(f"{kind}: "):
            pairs = (pair.partition("=") for pair in ln[len(kind) + 2:].split())
            rows.append({key: _number_or_text(value) for key, _, value in pairs})
    return rows


def _number_or_text(value: str):
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return float(value) if re.fullmatch(r"-?\d+\.\d*|nan|-?inf", value) else value
