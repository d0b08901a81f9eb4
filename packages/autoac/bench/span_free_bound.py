"""How fast could any plan be at full AC's peak, whatever its regions?

For the models of ``bench_autoac.py`` (HSTU tower, Llama-like blocks): measure no AC and
full AC (eager, every layer checkpointed), profile the fully checkpointed step with
layers as regions, then at budgets from full AC's measured peak towards no AC's report

* ``autoac.span_free_bound``: no keep / pack / recompute plan within the budget, with
  any regions (finer spans, per-op), adds less than ``lower_bound_ms`` in the profile's
  prices; ``speedup_bound`` (``SpanFreeBound.speedup_bound`` with the measured no AC and
  full AC steps) is the matching bound on its speed over full AC, re-priced to the
  measured recompute cost (an estimate: it assumes the profile's prices scale alike);
* the planner's plan with layers as regions (``--spans``: two spans per layer), its
  predicted added time and its own lower bound (which covers plans of those regions
  only), and its measured step (keep / recompute plans at every budget, packed ones at
  full AC's peak);

Usage::

    python span_free_bound.py --out DIR             # one GPU, about 2 minutes
    python span_free_bound.py --out DIR --spans     # the same with two spans per layer
    python span_free_bound.py --out DIR --smoke     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_autoac as ba

from hyperrec import autoac


def run(case: ba.Case, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    warm, steps = (1, 2) if args.smoke else (2, 5)
    noac = ba.measure(case, warmup=warm, steps=steps)
    undo = ba.full_ac(case.model)
    try:
        full = ba.measure(case, warmup=warm, steps=steps)
    finally:
        undo()
    lo, hi = full["peak_bytes"], noac["peak_bytes"]
    log(
        f"  no AC {noac['time_ms_median']:.1f} ms at {hi / 2**30:.2f} GiB, full AC "
        f"{full['time_ms_median']:.1f} ms at {lo / 2**30:.2f} GiB"
    )
    formats = tuple(f for f in args.formats.split(",") if f)
    pcfg = autoac.ProfileConfig(
        steps=2 if args.smoke else 3,
        formats=formats,
        min_pack_bytes=4096 if args.smoke else 1 << 20,
        max_grad_error=args.max_grad_error,
    )
    t0 = time.monotonic()
    layers = list(case.model.layers)
    regions = [s for layer in layers for s in layer.spans()] if args.spans else layers
    prof = autoac.profile(case.model, case.step_fn(0), regions=regions, config=pcfg)
    profile_s = time.monotonic() - t0
    free = autoac.plan(prof, budget=1e18)
    # measured recompute per profiled second (what speedup_bound re-prices with)
    scale = (full["time_ms_median"] - noac["time_ms_median"]) / (free.full_recompute_s * 1e3)
    rows = []
    for f in args.fractions:
        b = lo + f * (hi - lo)
        for fm in ((), formats):
            bd = autoac.span_free_bound(prof, b, formats=fm)
            p = autoac.plan(prof, budget=max(b, free.floor), config=autoac.PlanConfig(formats=fm))
            lb_ms = bd.lower_bound_s * 1e3
            # None where the baselines' timing contradicts itself (full AC measured faster
            # than no AC: host noise, seen on a loaded 2-core CPU in the smoke run)
            speedup = (
                bd.speedup_bound(noac["time_ms_median"] / 1e3, full["time_ms_median"] / 1e3)
                if full["time_ms_median"] >= noac["time_ms_median"]
                else None
            )
            row = {
                "budget_fraction": f,
                "budget_bytes": int(b),
                "formats": list(fm),
                "bound": bd.to_dict(),
                "lower_bound_ms": lb_ms if math.isfinite(lb_ms) else None,
                "speedup_bound": speedup,
                "plan_added_ms": p.added_s * 1e3,
                "plan_lower_bound_ms": (
                    p.lower_bound_s * 1e3 if math.isfinite(p.lower_bound_s) else None
                ),
                "plan_predicted_peak": p.predicted_peak,
                "plan_packed": p.packed,
            }
            if f == 0.0 or not fm:
                handle = autoac.apply_plan(case.model, p)
                try:
                    row["plan_measured"] = ba.measure(case, warmup=warm, steps=steps)
                finally:
                    handle.remove()
                gc.collect()
            rows.append(row)
            log(
                f"  budget {f:4.2f} formats {','.join(fm) or '-':6}: any regions adds >= "
                f"{lb_ms:.1f} ms (full recompute {bd.full_recompute_s * 1e3:.1f}), so runs at "
                f"most {'?' if speedup is None else f'{speedup:.3f}'}x full AC; "
                f"region plan adds {p.added_s * 1e3:.1f} ms"
                + (
                    f", measured {row['plan_measured']['time_ms_median']:.1f} ms"
                    if "plan_measured" in row
                    else ""
                )
            )
    return {
        "no_ac": noac,
        "full_ac": full,
        "profile_s": round(profile_s, 2),
        "full_recompute_ms": free.full_recompute_s * 1e3,
        "profile_step_ms": prof.step_s * 1e3,
        "resident_bytes": prof.resident_bytes,
        "floor_predicted": free.floor,
        "no_ac_predicted": free.no_ac_peak,
        "measured_per_profiled_recompute": scale,
        "points": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON result")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--models", default="hstu,llama")
    ap.add_argument("--formats", default="mxint8")
    ap.add_argument("--max-grad-error", type=float, default=0.03)
    ap.add_argument(
        "--spans",
        action="store_true",
        help="regions are two spans per layer (HSTU: projection / attention and output; "
        "Llama: attention / MLP) instead of whole layers",
    )
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5])
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke on the CPU")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = ba.SIZES["smoke" if args.smoke else "full"]
    t_start = time.monotonic()
    out: dict[str, Any] = {
        "benchmark": "autoac span-free bound",
        "mode": "smoke" if args.smoke else "full",
        "device": device,
        "dtype": str(dtype),
        "formats": args.formats,
        "regions": "two spans per layer" if args.spans else "layers",
        "sizes": {},
        "models": {},
    }
    for name in [m for m in args.models.split(",") if m]:
        print(f"[{name}] {sizes[name]}", flush=True)
        out["sizes"][name] = sizes[name]
        case = ba.Case(name, sizes[name], device, dtype, pool=3)
        out["models"][name] = run(case, args, lambda m: print(m, flush=True))
        del case
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    tag = "smoke" if args.smoke else torch.cuda.get_device_name().split()[1].lower()
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    name = f"span_free_bound{'_spans' if args.spans else ''}_{tag}_{stamp}.json"
    dest = ba.write_out(Path(args.out) / name, out)
    print(f"wrote {dest}", flush=True)


if __name__ == "__main__":
    main()
