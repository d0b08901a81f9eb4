"""``hyperrec-train`` / ``python -m hyperrec.integration.train``: train a preset.

Examples::

    hyperrec-train                                  # the tiny preset on this machine
    hyperrec-train --preset small --steps 200 --set model.dim=64
    hyperrec-train --data events.csv --epochs 3     # your interaction log (CSV/Parquet)
    hyperrec-train --data ratings.parquet --set data.label_column=rating \
        --set data.rating_threshold=4 --epochs 2
    hyperrec-train --resume runs/tiny-20260101-120000   # preset and data from the run
    torchrun --nproc_per_node 2 -m hyperrec.integration.train --preset tiny
    torchrun --nproc_per_node 2 --max-restarts 3 -m hyperrec.integration.train \
        --out runs/job --auto-resume                # restarts continue from a checkpoint

Prints where the metrics JSON and the PNG plot were written. Everything that can be
checked is checked before any work starts: exit status 2 with a message naming the
field or argument on a bad configuration or argument; 1 when training fails (e.g. a
non-finite step under ``train.nonfinite=stop``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hyperrec.integration.checkpoint import (
    CheckpointError,
    list_checkpoints,
    read_manifest,
    read_meta,
)
from hyperrec.integration.config import (
    PRESETS,
    EventLogConfig,
    Preset,
    get_preset,
    override,
)
from hyperrec.integration.faults import NonFiniteError
from hyperrec.integration.trainer import Trainer

__all__ = ["build_parser", "main", "preset_of_run"]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    presets = "; ".join(f"{n}: {PRESETS[n]().description}" for n in PRESETS)
    p = argparse.ArgumentParser(
        prog="hyperrec-train",
        description=f"Train the GEM-style model on synthetic data or an interaction log. "
        f"Presets: {presets}.",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="default: tiny, or the preset of the run given to --resume",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="train on an interaction log: a .csv/.parquet file or a directory of them "
        "(columns user_id, item_id, timestamp, label by default; see --set data.*)",
    )
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--epochs", type=int, help="override train.epochs (passes over a log)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set model.dim=64 --set train.lr=1e-3 "
        "--set data.rating_threshold=4",
    )
    p.add_argument("--out", help="run directory (default: runs/<preset>-<timestamp>/)")
    p.add_argument("--resume", help="checkpoint or run directory to resume from")
    p.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume from the newest checkpoint in --out if there is one, else start: for "
        "torchrun --max-restarts",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--ckpt-every", type=int, help="override train.ckpt_every (0: never)")
    p.add_argument("--eval-every", type=int, help="override train.eval_every (0: at the end)")
    p.add_argument(
        "--stop-after", type=int, help="stop after this step as if interrupted (resume demo)"
    )
    p.add_argument(
        "--sample-log",
        action="store_true",
        help="record every step's request ids in <out>/samples/rank<r>.jsonl",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _fmt(x: object) -> str:
    return f"{x:.4f}" if isinstance(x, float) and math.isfinite(x) else "n/a"


def preset_of_run(path: str | Path) -> Preset:
    """The preset a run (or checkpoint) directory was trained with.

    Read from the newest readable checkpoint manifest (0.1.x checkpoints: from their
    DCP metadata).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no readable checkpoint there, one that records no preset, or the run
            trained on a data source given in Python (which the CLI cannot rebuild).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint or run directory: {path}")
    candidates = (
        [path]
        if (path / "MANIFEST.json").is_file() or (path / ".metadata").is_file()
        else list_checkpoints(path)
    )
    for ckpt in candidates:
        try:
            manifest = read_manifest(ckpt)
            info = manifest["info"] if manifest is not None else read_meta(ckpt)
        except CheckpointError:
            continue
        if not isinstance(info.get("preset"), dict):
            raise ValueError(
                f"{ckpt} records no preset (not written by the trainer): give --preset"
            )
        if info.get("custom_source"):
            raise ValueError(
                f"{ckpt} was trained on a data source given in Python: resume it with "
                "Trainer(preset, data=..., resume=...)"
            )
        return Preset.from_dict(info["preset"])
    raise ValueError(f"--resume {str(path)!r} holds no complete checkpoint")


def _check_args(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be checked before any work."""
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after must be a positive step number, got {args.stop_after}")
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {args.out!r} exists and is not a directory")
    if args.auto_resume and args.out is None:
        raise ValueError("--auto-resume needs --out (the run directory to resume)")
    if args.auto_resume and args.resume is not None:
        raise ValueError("give --resume or --auto-resume, not both")
    if args.data is not None and not Path(args.data).exists():
        raise FileNotFoundError(f"--data: no such file or directory: {args.data}")


def _build_preset(args: argparse.Namespace) -> Preset:
    if args.preset is not None:
        preset = get_preset(args.preset)
    elif args.resume is not None:
        preset = preset_of_run(args.resume)
    else:
        preset = get_preset("tiny")
    if args.data is not None:
        if isinstance(preset.data, EventLogConfig):
            data = dataclasses.replace(preset.data, path=args.data)
        else:
            # The model's history cap stays the preset's.
            data = EventLogConfig(path=args.data, max_seqlen=preset.data.max_seqlen)
        preset = dataclasses.replace(preset, data=data)
    sets = list(args.set)
    keys = {item.partition("=")[0].strip() for item in sets}
    if args.data is not None and "data.path" in keys:
        # --set would silently replace the log given to --data.
        raise ValueError("give the event log with --data or with --set data.path, not both")
    for flag, key in (
        (args.steps, "train.steps"),
        (args.epochs, "train.epochs"),
        (args.ckpt_every, "train.ckpt_every"),
        (args.eval_every, "train.eval_every"),
    ):
        if flag is not None:
            sets.append(f"{key}={flag}")
    preset = override(preset, sets)
    if preset.train.epochs and (args.steps is not None or "train.steps" in keys):
        # The trainer replaces train.steps by the steps of the epochs: ignored otherwise.
        raise ValueError(
            f"--steps / train.steps has no effect with train.epochs={preset.train.epochs} "
            "(the run takes the steps of its epochs): give --epochs 0 to train a number "
            "of steps, or leave --steps out"
        )
    return preset


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        resume = args.resume
        if args.auto_resume and Path(args.out).is_dir() and list_checkpoints(args.out):
            resume = args.out
            if args.preset is None:
                args.resume = resume  # the preset comes from the run
        preset = _build_preset(args)
        trainer = Trainer(
            preset,
            out_dir=args.out,
            resume=resume,
            device=args.device,
            progress=not args.quiet,
            sample_log=args.sample_log,
        )
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"hyperrec-train: error: {err}", file=sys.stderr)
        return 2
    try:
        result = trainer.fit(stop_after=args.stop_after, plot=not args.no_plot)
    except NonFiniteError as err:
        print(f"hyperrec-train: error: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    if not result.metrics:
        return 0
    m = result.metrics
    how = (
        "stopped early after"
        if result.stopped_early
        else "stopped"
        if result.interrupted
        else "trained"
    )
    lines = [
        f"{how} {m['steps_completed']} steps "
        f"({m['requests_trained']:,} requests) in {m['train_time_s']:.1f} s of training, "
        f"{m['mean_samples_per_s'] or 0:,.0f} requests/s over {m['world_size']} rank(s) "
        f"on {m['device']}",
    ]
    mfu = m.get("mfu") or {}
    if mfu.get("tflops_per_gpu"):
        rate = f"model FLOPs: {mfu['tflops_per_gpu']:.3g} TFLOP/s per device"
        if mfu.get("mfu") is not None:
            rate += f", MFU {mfu['mfu']:.1%} of {mfu['peak_tflops']:g} TFLOP/s"
        lines.append(rate)
    if m["final"]:
        f, b = m["final"], m["baselines"]
        refs = ", ".join(f"{k.replace('_', ' ')} {_fmt(v['ctr_auc'])}" for k, v in b.items())
        line = (
            f"test CTR AUC {_fmt(f['ctr_auc'])} ({refs}); GAUC {_fmt(f.get('ctr_gauc'))}; "
            f"CTR NE {_fmt(f['ctr_ne'])}; calibration {_fmt(f['ctr_calibration'])}"
        )
        if "cvr_auc" in f:
            line += (
                f"; CVR AUC {_fmt(f['cvr_auc'])} (popularity "
                f"{_fmt(b['popularity'].get('cvr_auc'))})"
            )
        lines.append(line)
    lines.append(f"metrics: {result.metrics_path}")
    if result.plot_path:
        lines.append(f"plot:    {result.plot_path}")
    if result.last_checkpoint:
        lines.append(f"checkpoint: {result.last_checkpoint}")
    print("\n".join(lines))
    return 0


def _cli() -> None:
    """The command-line entry point: :func:`main`, then the exit. In a run of several
    processes the exit skips the interpreter's teardown (after flushing the output and
    the logging handlers; the trainer has already stopped its workers, finished its
    files and destroyed the process group): on the CPU CI, rank 1 of a complete two-rank
    torchrun run intermittently aborted in that teardown ("terminate called without an
    active exception", a C++ thread destroyed while still joinable; cause not found),
    which torchrun reports as a failed run and, with --max-restarts, restarts."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import logging

        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _cli()
