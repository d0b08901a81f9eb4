"""``hyperrec-train`` / ``python -m hyperrec.integration.train``: train a preset.

Examples::

    hyperrec-train                                  # the tiny preset on this machine
    hyperrec-train --preset small --steps 200 --set model.dim=64
    hyperrec-train --resume runs/tiny-20260101-120000
    torchrun --nproc_per_node 2 -m hyperrec.integration.train --preset tiny

Prints where the metrics JSON and the PNG plot were written. Exit status 2 on a bad
configuration or argument (the message names the field).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from hyperrec.integration.config import PRESETS, get_preset, override
from hyperrec.integration.trainer import Trainer

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    presets = "; ".join(f"{n}: {PRESETS[n]().description}" for n in PRESETS)
    p = argparse.ArgumentParser(
        prog="hyperrec-train",
        description=f"Train the GEM-style model on synthetic data. Presets: {presets}.",
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="default: tiny")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set model.dim=64 --set train.lr=1e-3",
    )
    p.add_argument("--out", help="run directory (default: runs/<preset>-<timestamp>/)")
    p.add_argument("--resume", help="checkpoint or run directory to resume from")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--ckpt-every", type=int, help="override train.ckpt_every (0: never)")
    p.add_argument("--eval-every", type=int, help="override train.eval_every (0: at the end)")
    p.add_argument(
        "--stop-after", type=int, help="stop after this step as if interrupted (resume demo)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _fmt(x: object) -> str:
    return f"{x:.4f}" if isinstance(x, float) and math.isfinite(x) else "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = build_parser().parse_args(argv)
    sets = list(args.set)
    for flag, key in (
        (args.steps, "train.steps"),
        (args.ckpt_every, "train.ckpt_every"),
        (args.eval_every, "train.eval_every"),
    ):
        if flag is not None:
            sets.append(f"{key}={flag}")
    try:
        preset = override(get_preset(args.preset), sets)
        trainer = Trainer(
            preset,
            out_dir=args.out,
            resume=args.resume,
            device=args.device,
            progress=not args.quiet,
        )
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"hyperrec-train: error: {err}", file=sys.stderr)
        return 2
    try:
        result = trainer.fit(stop_after=args.stop_after, plot=not args.no_plot)
    finally:
        trainer.close()
    if not result.metrics:
        return 0
    m = result.metrics
    lines = [
        f"{'stopped' if result.interrupted else 'trained'} {m['steps_completed']} steps "
        f"({m['requests_trained']:,} requests) in {m['train_time_s']:.1f} s of training, "
        f"{m['mean_samples_per_s'] or 0:,.0f} requests/s over {m['world_size']} rank(s) "
        f"on {m['device']}",
    ]
    if m["final"]:
        f, b = m["final"], m["baselines"]
        lines += [
            f"held-out CTR AUC {_fmt(f['ctr_auc'])} "
            f"(popularity {_fmt(b['popularity']['ctr_auc'])}, "
            f"ground truth {_fmt(b['ground_truth']['ctr_auc'])}); "
            f"CVR AUC {_fmt(f['cvr_auc'])} (popularity {_fmt(b['popularity']['cvr_auc'])}); "
            f"CTR NE {_fmt(f['ctr_ne'])}",
        ]
    lines.append(f"metrics: {result.metrics_path}")
    if result.plot_path:
        lines.append(f"plot:    {result.plot_path}")
    if result.last_checkpoint:
        lines.append(f"checkpoint: {result.last_checkpoint}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
