"""Matched-peak table of a ``bench_autoac.py --curve`` result (markdown on stdout).

    python packages/autoac/bench/curve_table.py packages/autoac/bench/results/h100_curve_hstu_2026-12-07.json

One row per peer point of the curve (torch's compiled ``activation_memory_budget``
fractions, compiled no AC, eager full AC), sorted by the peer's measured peak; one column
group per autoac variant some run measured (``autoac_apply_compiled[_fused|_quant]@<peer>``):
its measured peak, median step time and the peer's time over autoac's (above 1: autoac
faster). A ratio is starred where autoac's measured peak exceeds the peer's, so that it
is not a like-for-like win. With several files (repeated runs of one model), each ratio
cell gives the range over the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GIB = 2.0**30

#: (method prefix, column title)
VARIANTS: tuple[tuple[str, str], ...] = (
    ("autoac_apply_compiled", "autoac, eager-priced recompute"),
    ("autoac_apply_compiled_fused", "autoac, fused-priced recompute"),
    ("autoac_apply_compiled_quant", "autoac, MXINT8 saves, eager-priced"),
    ("autoac_apply_compiled_fused_quant", "autoac, MXINT8 saves, fused-priced"),
    ("autoac_apply_compiled_fused_calib", "autoac, fused-priced, calibrate_none"),
    ("autoac_apply_compiled_fused_search", "autoac, torch's partitioner searched"),
)


def _points(result: dict[str, Any], model: str) -> dict[str, dict[str, Any]]:
    pts = result["models"][model].get("points", [])
    return {p["method"]: p for p in pts if p.get("peak_bytes") and p.get("time_ms_median")}


def _peers(points: dict[str, dict[str, Any]]) -> list[str]:
    """The points some autoac variant was matched to, by measured peak."""
    matched = {p.get("matched") for p in points.values() if p.get("matched")}
    return sorted((m for m in matched if m in points), key=lambda m: points[m]["peak_bytes"])


def _cell(values: list[tuple[float, bool]]) -> str:
    lo, hi = f"{min(v for v, _ in values):.2f}", f"{max(v for v, _ in values):.2f}"
    star = "*" if any(over for _, over in values) else ""
    return f"{lo}x{star}" if lo == hi else f"{lo}-{hi}x{star}"


def table(results: list[dict[str, Any]], model: str) -> str:
    """Markdown table of ``model`` over ``results`` (one or more runs of the curve)."""
    runs = [_points(r, model) for r in results if model in r.get("models", {})]
    if not runs:
        raise SystemExit(f"no result has model {model!r}")
    # only the variants some run measured: a column of "not measured" says nothing
    variants = [
        (prefix, title)
        for prefix, title in VARIANTS
        if any(m.startswith(prefix + "@") for r in runs for m in r)
    ]
    head = ["peer (measured peak GiB, ms)"]
    for _, title in variants:
        head.append(f"{title}: peak GiB, ms, peer / autoac")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for peer in _peers(runs[0]):
        ref = runs[0][peer]
        row = [f"{peer} ({ref['peak_bytes'] / GIB:.2f}, {ref['time_ms_median']:.1f})"]
        for prefix, _ in variants:
            name = f"{prefix}@{peer}"
            got = [(r[name], r[peer]) for r in runs if name in r and peer in r]
            if not got:
                row.append("not measured")
                continue
            ratios = [
                (p["time_ms_median"] / a["time_ms_median"], a["peak_bytes"] > p["peak_bytes"])
                for a, p in got
            ]
            a0 = got[0][0]
            row.append(f"{a0['peak_bytes'] / GIB:.2f}, {a0['time_ms_median']:.1f}, {_cell(ratios)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench_autoac.py --curve JSONs (one model's runs)")
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.results]
    models = sorted({m for r in results for m in r.get("models", {})})
    for model in models:
        print(f"### {model}\n")
        print(table(results, model))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
