"""Longer histories in the same memory: what ``train.activation_checkpointing=autoac``
buys at a fixed peak.

For one preset, the peak of a step without checkpointing at the preset's history lengths
is the budget. Each longer-history variant (``data.max_seqlen`` and ``data.seqlen_scale``
multiplied by a factor) is planned by autoac under that budget when its floor (every
sequence layer recomputed) fits, and trained for ``--steps`` steps; the script records
the plan's predicted and measured peak (autoac's verification step), the median step
time and the same variant's own no-checkpointing peak. Variants whose floor is above the
budget are reported as not fitting. Peaks are what autoac counts: the CUDA allocator on a
GPU, live tensor storages on the CPU.

    python integration/bench/ac_same_memory.py --out integration/results             # CPU, tiny
    python integration/bench/ac_same_memory.py --out DIR --device cuda --preset gem --factors 2
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hyperrec.integration import Trainer, get_preset, override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json


def _summary(preset, overrides: list[str], budget_gb: float, device: str) -> dict:
    ov = [*overrides, "train.activation_checkpointing=autoac", f"train.ac_budget_gb={budget_gb}"]
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(override(preset, ov), out_dir=tmp, device=device, progress=False)
        try:
            return t.autoac_summary()
        finally:
            t.close()


def _train(preset, overrides: list[str], device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(override(preset, overrides), out_dir=tmp, device=device, progress=False)
        try:
            summary = t.autoac_summary()
            metrics = t.fit(plot=False).metrics
        finally:
            t.close()
    times = [s for s in metrics["history"]["step_time_s"] if s is not None][1:]
    return {"autoac": summary, "step_s_median": statistics.median(times), "steps": len(times) + 1}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--factors", type=float, nargs="+", default=[1.5, 2.0, 3.0, 4.0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="SECTION.FIELD=VALUE for every run")  # fmt: skip
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    common = [f"train.steps={args.steps}", "train.eval_every=0", "train.ckpt_every=0", *args.extra]
    # A budget far above the step: autoac keeps everything and reports the no-AC peak.
    unlimited = (
        1e3
        if args.device == "cpu"
        else 0.9 * torch.cuda.get_device_properties(0).total_memory / 1e9
    )
    base = _summary(preset, common, unlimited, args.device)
    budget = base["no_ac_peak_gb"]
    rows = [{"factor": 1.0, "max_seqlen": preset.data.max_seqlen,
             "seqlen_scale": preset.data.seqlen_scale, "no_ac_peak_gb": budget,
             "floor_gb": base["floor_gb"]}]  # fmt: skip
    rows[0].update(_train(preset, common, args.device))
    print(f"budget (no-AC peak at the preset's histories): {budget * 1e3:.2f} MB", flush=True)
    for f in args.factors:
        ov = [*common, f"data.max_seqlen={round(preset.data.max_seqlen * f)}",
              f"data.seqlen_scale={preset.data.seqlen_scale * f}"]  # fmt: skip
        own = _summary(preset, ov, unlimited, args.device)
        row = {"factor": f, "max_seqlen": round(preset.data.max_seqlen * f),
               "seqlen_scale": preset.data.seqlen_scale * f, "no_ac_peak_gb": own["no_ac_peak_gb"],
               "floor_gb": own["floor_gb"]}  # fmt: skip
        if own["floor_gb"] > budget:
            row["fits"] = False
        else:
            row["fits"] = True
            row.update(_train(preset, [*ov, "train.activation_checkpointing=autoac",
                                       f"train.ac_budget_gb={budget}"], args.device))  # fmt: skip
        rows.append(row)
        v = (row.get("autoac") or {}).get("verification") or {}
        print(f"x{f:g}: no-AC peak {row['no_ac_peak_gb'] * 1e3:.2f} MB, floor "
              f"{row['floor_gb'] * 1e3:.2f} MB, fits {row['fits']}, measured peak "
              f"{(v.get('measured_peak') or 0) / 1e6:.2f} MB, step "
              f"{row.get('step_s_median', float('nan')) * 1e3:.1f} ms", flush=True)  # fmt: skip
    out = {
        "benchmark": "autoac in the trainer: longer histories under the no-AC peak of the preset's",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": torch.get_num_threads(),
            "device": args.device,
        },  # fmt: skip
        "preset": args.preset,
        "overrides": common,
        "budget_gb": budget,
        "rows": rows,
    }
    return write_json(args.out, f"ac_same_memory_{args.preset}_{args.device}_{out['date']}", out)


if __name__ == "__main__":
    main()
