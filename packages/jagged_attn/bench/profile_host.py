"""Where the host time of a public call goes, per ``validate`` mode (Python profiler).

``bench_validate.py`` says how much longer the default call (``validate=True``) takes than
``validate=False`` when every call brings a new offsets object; this says where the
difference is spent. For each case and mode it

* times ``--calls`` calls back to back without a profiler (host time per call: the calls
  are host-bound at these sizes; the GPU queue is drained at the end and its wait counted);
* runs the same calls under ``cProfile`` and keeps, per function, the calls and the
  exclusive time per public call;

and writes the functions whose exclusive time differs most between the default and
``validate=False`` (``--top``), with both modes' figures. Modes alternate over ``--rounds``
rounds so a drift of the host's speed does not land on one mode.

    python bench/profile_host.py --out DIR                 # GPU, ~1 minute
    python bench/profile_host.py --out DIR --smoke         # CPU interpreter, tiny
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))

from bench_validate import CASES as VALIDATE_CASES  # noqa: E402
from bench_validate import SMOKE as VALIDATE_SMOKE  # noqa: E402
from bench_validate import _call, case_inputs  # noqa: E402

# bench_validate's short host-bound cases
CASES = [VALIDATE_CASES[i] for i in (1, 3, 4)]
SMOKE = VALIDATE_SMOKE[:1]
MODES = (False, True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host_us(fn, calls: int, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def _profile(fn, calls: int, device: str) -> dict[str, tuple[float, float]]:
    """function -> (calls per public call, exclusive microseconds per public call)."""
    prof = cProfile.Profile()
    _sync(device)
    prof.enable()
    for _ in range(calls):
        fn()
    _sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out = {}
    for (file, line, func), (_cc, ncalls, tottime, _ct, _callers) in stats.items():
        where = f"{Path(file).name}:{line}({func})" if file != "~" else func
        out[where] = (ncalls / calls, tottime / calls * 1e6)
    return out


def run_case(case, device: str, calls: int, rounds: int, top: int) -> dict:
    kind, q, k, v, off, max_len, targets = case_inputs(case, device)
    fns = {m: (lambda m=m: _call(kind, q, k, v, off.clone(), max_len, targets, m)) for m in MODES}
    for m in MODES:  # compile, fill the caches
        for _ in range(3):
            fns[m]()
    host: dict[str, list[float]] = {str(m): [] for m in MODES}
    profs: dict[str, list[dict]] = {str(m): [] for m in MODES}
    for r in range(rounds):
        for m in MODES[r % 2 :] + MODES[: r % 2]:
            host[str(m)].append(_host_us(fns[m], calls, device))
            profs[str(m)].append(_profile(fns[m], calls, device))

    def merged(m: str) -> dict[str, tuple[float, float]]:
        keys = set().union(*profs[m])
        return {
            key: (
                statistics.median(p.get(key, (0.0, 0.0))[0] for p in profs[m]),
                statistics.median(p.get(key, (0.0, 0.0))[1] for p in profs[m]),
            )
            for key in keys
        }

    on, off_ = merged("True"), merged("False")
    diffs = []
    for key in set(on) | set(off_):
        a, b = on.get(key, (0.0, 0.0)), off_.get(key, (0.0, 0.0))
        diffs.append((a[1] - b[1], key, a, b))
    diffs.sort(key=lambda d: -abs(d[0]))
    ratios = [a / b for a, b in zip(host["True"], host["False"])]
    return {
        "name": case[0],
        "tokens": int(q.shape[0]),
        "host_us": {m: statistics.median(v) for m, v in host.items()},
        "host_us_rounds": host,
        "default_over_none": statistics.median(ratios),
        "profiled_total_us": {
            m: sum(t for _, t in d.values()) for m, d in (("True", on), ("False", off_))
        },
        "top_differences": [
            {
                "function": key,
                "default_us": round(a[1], 3),
                "none_us": round(b[1], 3),
                "default_calls": round(a[0], 3),
                "none_calls": round(b[0], 3),
            }
            for _, key, a, b in diffs[:top]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny case on the CPU interpreter")
    ap.add_argument("--calls", type=int, default=None, help="calls per measurement")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    cases = SMOKE if args.smoke else CASES
    calls = args.calls or (5 if args.smoke else 300)
    rows = []
    for case in cases:
        row = run_case(case, device, calls, args.rounds, args.top)
        rows.append(row)
        print(f"{row['name']}: host/call default {row['host_us']['True']:.1f} us, "
              f"none {row['host_us']['False']:.1f} us, ratio {row['default_over_none']:.3f}")  # fmt: skip
        for d in row["top_differences"][:12]:
            print(f"   {d['default_us'] - d['none_us']:+8.2f} us  {d['function']}"
                  f"  (calls {d['default_calls']:.1f} / {d['none_calls']:.1f})")  # fmt: skip
    machine = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "profile_host_smoke.json" if args.smoke else "profile_host.json"
    (out / name).write_text(json.dumps({"machine": machine, "calls": calls, "cases": rows},
                                       indent=1))  # fmt: skip
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
