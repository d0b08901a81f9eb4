"""What ``calibrate_none`` changes on a small Llama block, on the CPU (no GPU timing).

    python packages/autoac/bench/calibrate_none_cpu.py --out packages/autoac/bench/results

For each region of a 4-layer block (dim 256, 4 heads, ffn 704, batch 2 x 256 tokens,
fp32): the bytes the planner prices it at un-checkpointed (the eager step's saves) and
the bytes its compiled graph saves (``price_compiled``); then the plans for budgets at
0.5, 0.75 and 0.9 of the way from the floor to the graph-priced peak of the
un-checkpointed plan, with and without the calibration: regions' modes and the
predicted added time (fused recomputation priced free, ``for_compiled_packing``).
Memory only: CPU times say nothing about a GPU step.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_autoac import Llama, llama_batch

from hyperrec import autoac
from hyperrec.autoac import runtime as rt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON result")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Llama(layers=4, dim=256, heads=4, ffn=704)
    x, cos, sin, _ = llama_batch(2, 256, 256, 4, "cpu", torch.float32, 0)

    def step(m: torch.nn.Module) -> torch.Tensor:
        return m(x, cos, sin).square().mean()

    kw = {"backend": args.backend}
    prof = rt.for_compiled_packing(
        autoac.profile(model, step, config=autoac.ProfileConfig(steps=1)), fused_recompute=True
    )
    whole = autoac.plan(prof, budget=1e18)
    h = rt.AutoAC(model, whole, profile_=prof, compiled=True, compile_kwargs=kw)
    saved = rt._graph_saves(h, step, 0)
    priced = rt.price_compiled(h, step, seed=0)
    h.remove()
    cal = rt.calibrate_none(prof, whole, saved)
    regions = []
    for rp, r in zip(whole.regions, cal.regions, strict=True):
        eager = rp.held_bytes - rp.input_bytes
        regions.append(
            {
                "region": rp.name,
                "eager_bytes": eager,
                "graph_bytes": saved.get(rp.name),
                "graph_over_eager": saved[rp.name] / eager if eager else None,
                "none_held": sorted({o.none_held for o in r.ops}),
            }
        )
    plans = []
    for frac in (0.5, 0.75, 0.9):
        b = whole.floor + frac * (priced.predicted_peak - whole.floor)
        row: dict = {"fraction": frac, "budget": int(b)}
        for name, p in (("eager_priced", prof), ("calibrated", cal)):
            pl = autoac.plan(p, budget=b)
            row[name] = {
                "modes": [r.mode for r in pl.regions],
                "added_ms": pl.added_s * 1e3,
                "predicted_peak": pl.predicted_peak,
            }
        plans.append(row)
    out = {
        "benchmark": "autoac_calibrate_none_cpu",
        "machine": {
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.machine(),
        },
        "backend": args.backend,
        "no_ac_predicted_eager": whole.predicted_peak,
        "no_ac_priced_from_graphs": priced.predicted_peak,
        "no_ac_predicted_calibrated": autoac.plan(cal, budget=1e18).predicted_peak,
        "floor": whole.floor,
        "regions": regions,
        "plans": plans,
    }
    dest = Path(args.out) / f"calibrate_none_cpu_{out['machine']['date'][:10]}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine",)}, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
