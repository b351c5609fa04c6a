"""What the report's sections share (report.py, report_sections.py): reading the raw
results a bench_all.sh work directory holds, picking a round's record, and writing
numbers and "which side is ahead" sentences the same way in every table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_kv(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def ratio_sentence(metric: str, a_name: str, a: float | None, b_name: str, b: float | None,
                   higher_is_better: bool, unit: str = "", nd: int = 1) -> str:
    """'<metric>: <winner> ahead by R x (<value> vs <value> <unit>)'."""
    if a is None or b is None or a <= 0 or b <= 0:
        return f"{metric}: not comparable ({a_name} {_f(a, nd)}, {b_name} {_f(b, nd)})"
    a_wins = a > b if higher_is_better else a < b
    if a == b:
        return f"{metric}: level ({_f(a, nd)}{' ' + unit if unit else ''} each)"
    w, wv, l, lv = (a_name, a, b_name, b) if a_wins else (b_name, b, a_name, a)
    r = wv / lv if higher_is_better else lv / wv
    u = f" {unit}" if unit else ""
    return f"{metric}: {w} ahead by {r:.2f}x ({_f(wv, nd)} vs {_f(lv, nd)}{u})"


def _round(recs: list[dict[str, Any]], name_start: str | None) -> dict[str, Any] | None:
    """The record of one round: None for a single-round run, else the round whose name starts so."""
    for r in recs:
        rn = r.get("round")
        if name_start is None and rn is None:
            return r
        if name_start is not None and rn and rn.startswith(name_start):
            return r
    return recs[-1] if recs and name_start is None else None


def _failed_requests(recs: Iterable[dict[str, Any] | None]) -> str:
    n = sum(int(r.get("failed") or 0) for r in recs if r)
    return f" **{n} requests failed** (left out of every statistic)." if n else ""


def _shortest_lengths(args: dict[str, Any]) -> tuple[int, int]:
    """The shortest input and output lengths bench.serving's random dataset draws."""
    ratio = args["random_range_ratio"]
    return (max(1, int(args["random_input_len"] * ratio)), max(1, int(args["random_output_len"] * ratio)))
