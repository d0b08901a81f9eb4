"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source export.

Input: the CSV of ``ncu -i REPORT --page source --csv --print-source sass`` (a report
taken with ``--section SourceCounters --section WarpStateStats``). Output (JSON, and a
short table on stdout): the warp-stall samples by reason over the whole kernel, and for
each tile loop (the smallest range closed by a backward branch that holds at least 16
MUFU ops and a warpgroup MMA, as in ``compile_gluon.py``) its share of the samples, its
reasons and its ``--top`` instructions with their two main reasons. Needs no GPU.

    ncu --section SourceCounters --section WarpStateStats --launch-skip 3 --launch-count 1 \\
        --kernel-name regex:jagged_fwd_kernel -o fwd python ...
    ncu -i fwd.ncu-rep --page source --csv --print-source sass > fwd_sass.csv
    python bench/ncu_stalls.py fwd_sass.csv --out results/ncu_stalls.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
from pathlib import Path


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: Path) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(path.open()))
    try:
        hi = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    except StopIteration:
        raise SystemExit(
            f"{path}: no 'Address'/'Source' header: not a --page source export"
        ) from None
    hdr = rows[hi]
    return hdr, [r for r in rows[hi + 1 :] if len(r) == len(hdr)]


def tile_loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """Innermost (address range) loops with >= 16 MUFU ops and a GMMA, in address order."""
    found = set()
    for a, t in ins:
        m = re.search(r"\bBRA 0x([0-9a-f]+)", t)
        if not m:
            continue
        lo = int(m.group(1), 16)
        if lo >= a:
            continue
        body = [x for x in ins if lo <= x[0] <= a]
        if sum("MUFU." in x[1] for x in body) >= 16 and any("GMMA" in x[1] for x in body):
            found.add((lo, a))
    # smallest first, skipping ranges that overlap a chosen one (a wait's retry block far
    # below the loop branches back into it and spans more than the loop)
    chosen: list[tuple[int, int]] = []
    for lo, hi in sorted(found, key=lambda p: p[1] - p[0]):
        if all(hi < c_lo or lo > c_hi for c_lo, c_hi in chosen):
            chosen.append((lo, hi))
    return sorted(chosen)


def summarise(hdr: list[str], data: list[list[str]], top: int) -> dict:
    a_col, s_col = hdr.index("Address"), hdr.index("Source")
    t_col = hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, c in enumerate(hdr) if c.startswith("stall_") and "Not Issued" not in c]
    ins = [(int(r[a_col], 16), r[s_col].strip()) for r in data]
    total = sum(_num(r[t_col]) for r in data)

    def by_reason(rows: list[list[str]]) -> dict[str, float]:
        agg: collections.Counter[str] = collections.Counter()
        for r in rows:
            for i in reasons:
                agg[hdr[i]] += _num(r[i])
        s = sum(agg.values()) or 1.0
        return {k: round(100 * v / s, 1) for k, v in agg.most_common() if v}

    out = {"total_samples": total, "reasons_pct": by_reason(data), "loops": []}
    base = min(a for a, _ in ins)
    for lo, hi in tile_loops(ins):
        rows = [r for (a, _), r in zip(ins, data, strict=True) if lo <= a <= hi]
        samples = sum(_num(r[t_col]) for r in rows)
        ranked = sorted(rows, key=lambda r: -_num(r[t_col]))[:top]
        out["loops"].append({
            "range": [hex(lo - base), hex(hi - base)],
            "instructions": len(rows),
            "samples_pct_of_kernel": round(100 * samples / total, 1),
            "reasons_pct": by_reason(rows),
            "top": [{
                "offset": hex(int(r[a_col], 16) - base),
                "sass": r[s_col].strip(),
                "samples_pct_of_loop": round(100 * _num(r[t_col]) / samples, 1),
                "reasons": sorted(((hdr[i], _num(r[i])) for i in reasons if _num(r[i])),
                                  key=lambda z: -z[1])[:2],
            } for r in ranked],
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    hdr, data = load(args.csv)
    rep = summarise(hdr, data, args.top)
    print(f"{rep['total_samples']:.0f} samples; reasons: {rep['reasons_pct']}")
    for loop in rep["loops"]:
        print(f"loop {loop['range']}: {loop['instructions']} instructions, "
              f"{loop['samples_pct_of_kernel']}% of samples; {loop['reasons_pct']}")  # fmt: skip
        for t in loop["top"]:
            print(f"  {t['offset']:>7} {t['samples_pct_of_loop']:5.1f}% {t['sass'][:58]:58s} "
                  f"{t['reasons']}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"source": args.csv.name, **rep}, indent=1) + "\n")


if __name__ == "__main__":
    main()
