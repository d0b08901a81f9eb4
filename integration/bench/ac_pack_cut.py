"""What packing alone cuts: ``train.ac_strategy=pack_all`` against no checkpointing.

For one preset, builds the trainer twice on the same device: without autoac, and with
``activation_checkpointing=autoac``, ``ac_strategy=pack_all`` and ``ac_formats`` (every
saved activation of the sequence layers kept packed where its class passed autoac's
gradient-error bound, nothing recomputed). For each it measures one forward + backward
of the probe batch (the heaviest of the first steps' batches, what autoac plans on;
``Trainer.step_memory``) after ``--warm`` training steps: what was held before the step (``base``), the peak, and
their difference (``step``: what the step allocated: activations, gradients,
workspaces), ``--repeats`` times. It also records autoac's plan: per layer, the bytes
held from forward to backward, packed against un-packed (``held`` / ``noac_held``).

The two cuts reported:

* ``step_cut``: no AC's step bytes over pack_all's: the whole step, including what
  packing cannot touch (gradients, the embeddings and heads outside the sequence
  layers, the working set of the layer being differentiated);
* ``layers_held_cut``: the regions' held bytes un-packed over packed (what the packed
  saves themselves shrink to): the sequence layers, and with ``--regions all`` the
  other modules called once per step too (``train.ac_regions``).

Held-out quality of the same variant is ``precision_quality.py --variant``'s job.

    python integration/bench/ac_pack_cut.py --out integration/results --device cuda --preset small
    python integration/bench/ac_pack_cut.py --out /tmp/x --preset micro            # CPU check
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hyperrec.integration import Trainer, get_preset, override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json


def _measure(preset, overrides: list[str], device: str, repeats: int, warm: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(override(preset, overrides), out_dir=tmp, device=device, progress=False)
        try:
            # Training steps first: the optimizers' states exist then; both variants are
            # measured in the state training runs in.
            for _ in range(warm):
                t.train_step()
            runs = [t.step_memory() for _ in range(repeats)]
            summary = t.autoac_summary()
        finally:
            t.close()
    # The trainer holds reference cycles: without a collection here its tables stay
    # allocated while the next variant is measured (0.67 GB of the `small` preset's
    # base on the GPU in a first version of this script).
    del t
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    out: dict = {"overrides": overrides, "runs": runs}
    for key in ("base_gb", "peak_gb", "step_gb"):
        out[key] = statistics.median(r[key] for r in runs)
    if summary is not None:
        regions = summary["regions"].values()
        out["autoac"] = summary
        out["layers_held_gb"] = sum(r["held_gb"] for r in regions)
        out["layers_noac_held_gb"] = sum(r["noac_held_gb"] for r in regions)
        out["packed_ops"] = sum(sum(r["packed"].values()) for r in regions)
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--formats", default="mxint8", help="train.ac_formats (comma-separated)")
    ap.add_argument("--regions", default="layers", choices=("layers", "all"),
                    help="train.ac_regions of the pack_all variant")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="measured steps per variant")
    ap.add_argument("--warm", type=int, default=2, help="training steps before measuring")
    ap.add_argument("--tag", default=None, help="appended to the output file's name")
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="SECTION.FIELD=VALUE for both variants")  # fmt: skip
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    preset = get_preset(args.preset)
    common = ["train.eval_every=0", "train.ckpt_every=0", *args.extra]
    pack = [*common, "train.activation_checkpointing=autoac", "train.ac_strategy=pack_all",
            f"train.ac_formats={args.formats}", f"train.ac_regions={args.regions}"]  # fmt: skip
    off = _measure(preset, common, args.device, args.repeats, args.warm)
    packed = _measure(preset, pack, args.device, args.repeats, args.warm)
    result = {
        "step_cut": off["step_gb"] / packed["step_gb"],
        "layers_held_cut": packed["layers_noac_held_gb"] / packed["layers_held_gb"],
        "peak_cut": off["peak_gb"] / packed["peak_gb"],
    }
    print(
        f"{args.preset} on {args.device}: step {off['step_gb']:.4f} -> {packed['step_gb']:.4f} GB "
        f"({result['step_cut']:.2f}x), regions held {packed['layers_noac_held_gb']:.4f} -> "
        f"{packed['layers_held_gb']:.4f} GB ({result['layers_held_cut']:.2f}x), "
        f"{packed['packed_ops']} op outputs packed",
        flush=True,
    )
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    out = {
        "benchmark": "autoac pack_all in the trainer: what packing alone cuts",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "device": args.device,
            "gpu": gpu,
        },
        "preset": args.preset,
        "formats": args.formats,
        "regions": args.regions,
        "warm_steps": args.warm,
        "no_ac": off,
        "pack_all": packed,
        **result,
    }
    tag = ("" if args.regions == "layers" else "_all_regions") + (
        f"_{args.tag}" if args.tag else ""
    )
    return write_json(args.out, f"ac_pack_cut_{args.preset}_{args.device}_{out['date']}{tag}", out)


if __name__ == "__main__":
    main()
