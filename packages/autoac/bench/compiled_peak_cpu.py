"""Where the compiled peak prediction errs, measured on the CPU (Inductor).

On the CPU :func:`hyperrec.autoac.measure_step` tracks live storages with a dispatch
mode, under which compiled code runs eagerly; so the CPU tests never measured what a
compiled plan allocates. Here the step runs compiled and its peak is read from the
CPU allocator's allocation and free events (``torch.profiler`` with
``profile_memory=True``, exact timestamps): the bytes the step allocated at its peak and
at the end of the forward (held for the backward), plus the profile's resident bytes
(parameters, inputs) so that they compare with the planner's prediction.

For each model, for torch's ``activation_memory_budget`` at each ``--fractions`` (every
layer compiled with the knob, as ``bench_autoac.py`` does), then
``autoac.apply(compile=True)`` asked for that point's measured peak (fused pricing, no
packing, no verification step: its CPU measurement would run eagerly), it records the
predicted peak and the predicted bytes held when the backward starts (the plan's live
bytes there, priced from the compiled graphs) against the measured ones, and the
plan's modes and added time. Timing on a CPU says nothing about a GPU; none is reported.

    python bench/compiled_peak_cpu.py --out bench/results   # about 4 minutes, 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_autoac import HSTUTower, Llama, hstu_batch, llama_batch, torch_budget

from hyperrec import autoac
from hyperrec.autoac._backward_mem import allocation_peak, module_backward_bytes
from hyperrec.autoac.model import _backward_span

GIB = 2**30

# Small enough for 2 cores in fp32, large enough that activations dominate the peak.
SIZES = {
    "hstu": dict(layers=4, dim=1024, heads=8, head_dim=128, b=2, n=1024),
    "llama": dict(layers=4, dim=512, heads=8, ffn=1408, b=2, t=1024),
}


def build(name: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    s = SIZES[name]
    torch.manual_seed(0)
    if name == "hstu":
        model: torch.nn.Module = HSTUTower(s["layers"], s["dim"], s["heads"], s["head_dim"])
        x, mask, _ = hstu_batch(s["b"], s["n"], s["dim"], "cpu", torch.float32, 0)
        return model, lambda m: m(x, mask).float().square().mean()
    model = Llama(s["layers"], s["dim"], s["heads"], s["ffn"])
    inputs = llama_batch(s["b"], s["t"], s["dim"], s["heads"], "cpu", torch.float32, 0)[:-1]
    return model, lambda m: m(*inputs).float().square().mean()


def measure(model: torch.nn.Module, step: Callable, resident: int) -> dict[str, float]:
    """Peak of one step and bytes held when its forward ended, in GiB, resident included
    (after one step to compile)."""

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    step(model).backward()
    clear()
    peak, _ = allocation_peak(lambda: step(model).backward())
    clear()
    kept: list[torch.Tensor] = []
    _, held = allocation_peak(lambda: kept.append(step(model)))
    kept.clear()
    return {"peak_gib": (peak + resident) / GIB, "held_gib": (held + resident) / GIB}


def run_model(name: str, fractions: list[float], log: Callable[[str], None]) -> dict[str, Any]:
    model, step = build(name)
    prof = autoac.profile(
        model, step, regions=list(model.layers), config=autoac.ProfileConfig(cost="flops")
    )
    resident = prof.resident_bytes
    # the last position of the forward: the plan's live bytes there are what it holds
    bwd = int(np.argmax(np.asarray(prof.phase) != 0)) - 1
    rows = []
    for frac in fractions:
        undo = torch_budget(model, frac, "inductor")
        peer = measure(model, step, resident)
        undo()
        row: dict[str, Any] = {"fraction": frac, "torch": peer}
        for calib in (False, True):
            torch._dynamo.reset()
            h = autoac.apply(
                model,
                budget=int(peer["peak_gib"] * GIB),
                step_fn=step,
                profile_=prof,
                compile=True,
                verify=False,
                calibrate_none=calib,
                plan_config=autoac.PlanConfig(formats=()),
            )
            p = h.plan
            assert p.live is not None
            got = measure(model, step, resident)
            names = [f"layers.{i}" for i in range(len(model.layers))]
            ws = module_backward_bytes(model, lambda: step(model).backward(), names)
            for q in model.parameters():
                q.grad = None
            ws_meas = [ws.get(n, float("nan")) / GIB for n in names]
            h.remove()
            torch._dynamo.reset()
            pred = {"peak_gib": p.predicted_peak / GIB, "held_gib": float(p.live[bwd]) / GIB}
            v = {
                "measured": got,
                "predicted": pred,
                "added_ms_flops": p.added_s * 1e3,
                "modes": "".join(r.mode[0] for r in p.regions),
                "overhang_predicted_gib": pred["peak_gib"] - pred["held_gib"],
                "overhang_measured_gib": got["peak_gib"] - got["held_gib"],
                "peak_ratio": got["peak_gib"] / pred["peak_gib"],
                "region_backward_working_set_gib": {
                    "measured": ws_meas,
                    "predicted": _predicted_working_sets(prof, p.live),
                },
            }
            row["autoac_calibrate_none" if calib else "autoac"] = v
            log(
                f"[{name}] torch {frac}: peak {peer['peak_gib']:.3f} held {peer['held_gib']:.3f} | "
                f"autoac{' calibrated' if calib else ''} {v['modes']}: predicted "
                f"{pred['peak_gib']:.3f} (held {pred['held_gib']:.3f}), measured "
                f"{got['peak_gib']:.3f} (held {got['held_gib']:.3f}), added {p.added_s * 1e3:.1f} "
                "ms (FLOP-priced); backward working sets measured "
                + " ".join(f"{w:.3f}" for w in ws_meas)
                + ", predicted "
                + " ".join(f"{w:.3f}" for w in v["region_backward_working_set_gib"]["predicted"])
            )
        rows.append(row)
    return {"sizes": SIZES[name], "resident_gib": resident / GIB, "points": rows}


def _predicted_working_sets(prof: Any, live: np.ndarray) -> list[float]:
    """Per region: the plan's largest live bytes over its backward (the planner's span),
    beyond the live bytes just before it, GiB."""
    out = []
    for r in prof.regions:
        span = _backward_span(prof, r)
        if span is None:
            out.append(float("nan"))
            continue
        a, b = span
        out.append(float(live[a:b].max() - live[a - 1]) / GIB)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON result")
    ap.add_argument("--models", default="hstu,llama")
    ap.add_argument("--fractions", default="1,0.75,0.5")
    args = ap.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    if any(not 0.0 <= f <= 1.0 for f in fractions):
        raise SystemExit(f"--fractions: each in [0, 1], got {fractions}")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    out: dict[str, Any] = {
        "benchmark": "compiled_peak_cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "dtype": "float32",
        "models": {},
    }
    for name in args.models.split(","):
        out["models"][name] = run_model(name, fractions, lambda s: print(s, flush=True))
    os.makedirs(args.out, exist_ok=True)
    dest = os.path.join(args.out, f"compiled_peak_cpu_{out['date']}.json")
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
