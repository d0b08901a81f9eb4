"""Fault drills on the tiny preset (CPU, gloo, 2 ranks under torchrun): a JSON report.

Four runs, each against an uninterrupted reference of the same length:

1. ``restart``: rank 1 is killed in the middle of step ``kill_step``; the restarted job
   (``torchrun --max-restarts 2``) resumes, and rank 0 is killed while the next checkpoint
   is being written; the third attempt must ignore that half-written checkpoint. Checked:
   final parameters and every logged loss bitwise equal to the reference, every request
   trained exactly once (from the per-step request logs), steps retrained, wall time.
2. ``corrupt``: the reference's newest checkpoint gets one flipped byte; a resume from the
   run directory must report it and continue from the checkpoint before.
3. ``reshard``: the reference resumed from its middle checkpoint on 1 rank: every request
   trained at most once and none lost below the old read position; final AUC vs the
   reference (not bitwise: the steps are regrouped).
4. ``nonfinite``: a NaN loss on rank 1 at one step with ``train.nonfinite=skip``: the
   step is reported (step, rank) and skipped, the run finishes.

Usage::

    python integration/bench/fault_runs.py --out integration/results            # ~5 min, 2 cores
    python integration/bench/fault_runs.py --out /tmp/x --smoke                 # micro preset

Writes ``faults_cpu_<date>.json`` (``faults_smoke_<date>.json`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _run(cmd: list[str], env_extra: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if k != "HYPERREC_FAULT"}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0, proc


_DEVICE = ["cpu"]


def _train_cmd(preset: str, steps: int, ckpt: int, out: Path, nproc: int, restarts: int) -> list:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(nproc), "--max-restarts", str(restarts), "-m"]  # fmt: skip
    return [*launcher, "hyperrec.integration.train", "--preset", preset, "--steps", str(steps),
            "--ckpt-every", str(ckpt), "--eval-every", "0", "--out", str(out), "--auto-resume",
            "--sample-log", "--no-plot", "--quiet", "--device", _DEVICE[0]]  # fmt: skip


def _samples(out: Path) -> tuple[dict, dict]:
    last, attempts = {}, {}
    for f in sorted((out / "samples").glob("rank*.jsonl")):
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            key = (rank, rec["step"])
            attempts.setdefault(key, []).append(rec["ids"])
            last[key] = rec
    return last, attempts


def _params(run: Path, scratch: Path) -> dict[str, torch.Tensor]:
    from hyperrec.integration import Trainer
    from hyperrec.integration.train import preset_of_run

    t = Trainer(preset_of_run(run), resume=run, out_dir=scratch, progress=False, device=_DEVICE[0])
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="micro preset, a few steps")
    p.add_argument("--workdir")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (gloo; the committed results) or cuda (NCCL: needs 2 GPUs; bitwise "
        "equality then also needs deterministic kernels)",
    )
    args = p.parse_args()
    _DEVICE[0] = args.device
    preset, steps, ckpt = ("micro", 24, 4) if args.smoke else ("tiny", 160, 20)
    kill_step, ckpt_kill = (10, 16) if args.smoke else (70, 100)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fault-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "preset": preset,
        "steps": steps,
        "ckpt_every": ckpt,
        "ranks": 2,
        "device": args.device,
    }
    try:
        ref = work / "reference"
        wall, _ = _run(_train_cmd(preset, steps, ckpt, ref, 2, 0), {})
        ref_metrics = json.loads((ref / "metrics.json").read_text())
        report["reference"] = {"wall_s": wall, "test": ref_metrics["final"]}

        # 1. Killed mid-step, then killed while checkpointing.
        run = work / "restart"
        spec = f"kill@step={kill_step},rank=1; kill_in_checkpoint@step={ckpt_kill},rank=0,attempt=1"
        wall, _ = _run(_train_cmd(preset, steps, ckpt, run, 2, 2), {"HYPERREC_FAULT": spec})
        metrics = json.loads((run / "metrics.json").read_text())
        last, attempts = _samples(run)
        ref_last, _ = _samples(ref)
        ids = [i for rec in last.values() for i in rec["ids"]]
        pa, pr = _params(run, work / "s1"), _params(ref, work / "s2")
        report["restart"] = {
            "faults": spec,
            "wall_s": wall,
            "attempts": 1 + max(rec["restart"] for rec in last.values()),
            "steps_trained_more_than_once": sum(len(v) > 1 for v in attempts.values()) // 2,
            "requests_trained": len(ids),
            "distinct_requests": len(set(ids)),
            "every_request_once": sorted(ids) == list(range(len(ids))),
            "same_requests_per_step_as_reference": {k: v["ids"] for k, v in last.items()}
            == {k: v["ids"] for k, v in ref_last.items()},
            "losses_bitwise_equal": metrics["history"]["loss"] == ref_metrics["history"]["loss"],
            "final_parameters_bitwise_equal": all(torch.equal(pa[k], pr[k]) for k in pa),
            "test_metrics_equal": metrics["final"] == ref_metrics["final"],
        }
        print("restart", json.dumps(report["restart"]), flush=True)

        # 2. A corrupt newest checkpoint: detected, the one before used.
        corrupt = work / "corrupt"
        shutil.copytree(ref, corrupt, ignore=shutil.ignore_patterns("samples"))
        from hyperrec.integration import Trainer
        from hyperrec.integration.checkpoint import list_checkpoints
        from hyperrec.integration.train import preset_of_run

        newest = list_checkpoints(corrupt)[0]
        victim = sorted(newest.glob("*.distcp"))[0]
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 3] ^= 0x01
        victim.write_bytes(bytes(raw))
        t = Trainer(preset_of_run(corrupt), resume=corrupt, progress=False, device=args.device)
        report["corrupt"] = {
            "flipped_byte_in": f"{newest.name}/{victim.name}",
            "resumed_from_step": t.step,
            "note": t.resume_notes[0] if t.resume_notes else None,
        }
        print("corrupt", json.dumps(report["corrupt"]), flush=True)
        del t

        # 3. The reference's middle checkpoint resumed on 1 rank.
        mid = (steps // 2) // ckpt * ckpt
        reshard = work / "reshard"
        shutil.copytree(ref / "checkpoints" / f"step_{mid:08d}",
                        reshard / "checkpoints" / f"step_{mid:08d}")  # fmt: skip
        wall, _ = _run(_train_cmd(preset, steps, ckpt, reshard, 1, 0), {})
        metrics = json.loads((reshard / "metrics.json").read_text())
        before = [rec for (r, s), rec in ref_last.items() if s <= mid]
        after, _ = _samples(reshard)
        subs = [j for rec in before for j in rec["sub_batches"]]
        subs += [j for rec in after.values() for j in rec["sub_batches"]]
        ids = [i for rec in before for i in rec["ids"]]
        ids += [i for rec in after.values() for i in rec["ids"]]
        report["reshard"] = {
            "from_ranks": 2,
            "to_ranks": 1,
            "resumed_at_step": mid,
            "wall_s": wall,
            "sub_batches_trained": len(subs),
            "sub_batches_distinct": len(set(subs)),
            "requests_trained": len(ids),
            "requests_distinct": len(set(ids)),
            "resume_notes": metrics["resume_notes"],
            "test_ctr_auc": metrics["final"]["ctr_auc"],
            "reference_test_ctr_auc": ref_metrics["final"]["ctr_auc"],
        }
        print("reshard", json.dumps(report["reshard"]), flush=True)

        # 4. A NaN loss on rank 1, skipped.
        nan_run = work / "nonfinite"
        cmd = [*_train_cmd(preset, steps, 0, nan_run, 2, 0), "--set", "train.nonfinite=skip"]
        wall, proc = _run(cmd, {"HYPERREC_FAULT": f"nan_loss@step={kill_step},rank=1"})
        metrics = json.loads((nan_run / "metrics.json").read_text())
        report["nonfinite"] = {
            "fault": f"nan_loss@step={kill_step},rank=1",
            "policy": "skip",
            "wall_s": wall,
            "reports": metrics["nonfinite_steps"],
            "steps_completed": metrics["steps_completed"],
            "test_ctr_auc": metrics["final"]["ctr_auc"],
        }
        print("nonfinite", json.dumps(report["nonfinite"]), flush=True)

        from hyperrec.testing.bench import write_result

        date = datetime.date.today().isoformat()
        name = f"faults_{'smoke' if args.smoke else 'cpu'}_{date}.json"
        out = write_result(Path(args.out) / name, report)
        print(f"wrote {out}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
