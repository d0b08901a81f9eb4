"""Steady-state step time of one preset under several configurations, no profiler.

    python integration/bench/step_variants.py --out DIR \\
        --variant base= \\
        --variant autoac=train.activation_checkpointing=autoac \\
        --variant gluon=@JAGGED_ATTN_GLUON=1
    python integration/bench/step_variants.py --out /tmp/v --smoke --variant base=   # CPU

A variant is ``NAME=ITEM,ITEM,...``: each item is an override ``SECTION.FIELD=VALUE`` or an
environment variable ``@NAME=VALUE`` (set before the child imports torch). Each variant
runs in a fresh process (environment variables such as allocator settings only act at
start-up; ``@STEP_VARIANTS_SWITCH_INTERVAL=SECONDS`` sets Python's GIL switch interval,
``@STEP_VARIANTS_GC_FREEZE=1`` freezes the garbage collector's view after the build),
trains ``--warmup`` steps, then ``--steps`` steps exactly as ``Trainer.fit`` runs them
(step n + 1 queued before step n's metrics are read). Per variant: median and minimum step
time, requests/s, model TFLOP/s and MFU over the timed steps, the host's time to queue one
step (``launch_step``) and to read one back (``finish_step``, where the host waits for
the GPU), peak memory, the Triton kernels compiled during timed steps, and the CUDA caching allocator's counters per timed step
(``cudaMalloc``/``cudaFree`` calls, cache flushes with retry: a step that goes past the
cache pays for them on the host and may synchronise the device). The profiler slows the
host side of a step (``profile_step.py``), so these are the figures to compare
configurations with.

Writes ``step_variants_<preset>_<tag>_<date>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from _common import (  # noqa: E402
    JitLog,
    allocator_counters,
    counter_delta,
    jsonable,
    run_steps,
    single_rank_group,
)

#: Environment variable a variant can set (``@STEP_VARIANTS_SWITCH_INTERVAL=0.0005``) to
#: change ``sys.setswitchinterval`` in its process.
SWITCH_INTERVAL_ENV = "STEP_VARIANTS_SWITCH_INTERVAL"
#: ``@STEP_VARIANTS_GC_FREEZE=1``: ``gc.freeze()`` once the trainer is built (the collector's
#: full passes then skip the model, optimizer and data pipeline objects).
GC_FREEZE_ENV = "STEP_VARIANTS_GC_FREEZE"


def parse_variant(text: str) -> tuple[str, list[str], dict[str, str]]:
    """``NAME=ITEM,...`` -> (name, overrides, environment).

    Raises:
        ValueError: no name, or an item that is neither ``a.b=v`` nor ``@NAME=v``.
    """
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--variant must be NAME=ITEM,..., got {text!r}")
    overrides, env = [], {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--variant {name!r}: item {item!r} has no '='")
        if key.startswith("@"):
            env[key[1:]] = value
        elif "." in key:
            overrides.append(item)
        else:
            raise ValueError(
                f"--variant {name!r}: {item!r} is neither SECTION.FIELD=VALUE nor @ENV=VALUE"
            )
    return name, overrides, env


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant in this process; returns its figures."""
    import torch

    from hyperrec.integration import Trainer, get_preset, override

    cuda = not args.smoke
    interval = os.environ.get(SWITCH_INTERVAL_ENV)
    if interval:
        # How long another thread (the DataLoader's pin-memory thread) may hold the GIL
        # before the trainer's thread gets it back (Python's default: 5 ms).
        sys.setswitchinterval(float(interval))
    name = args.preset or ("tiny" if args.smoke else "gem")
    total = args.warmup + args.steps
    overrides = [f"train.steps={total + 1}", "train.eval_every=0", "train.ckpt_every=0",
                 "train.warmup_steps=1", "train.baseline_requests=0", *args.set]  # fmt: skip
    if args.smoke:
        overrides.append("train.data_workers=1")
    preset = override(get_preset(name), overrides)
    device = "cuda" if cuda else "cpu"
    single_rank_group(device)
    jit = JitLog()
    t0 = time.perf_counter()
    trainer = Trainer(preset, out_dir=Path(args.out) / "variant-run", device=device, progress=False)
    build_s = time.perf_counter() - t0
    if os.environ.get(GC_FREEZE_ENV) == "1":
        import gc

        gc.collect()
        gc.freeze()
    alloc: dict[str, dict[str, int]] = {}
    queued: list[float] = []  # when each timed step was queued

    def before_step(k: int) -> None:
        if k == args.warmup:
            alloc["before"] = allocator_counters()
        if k >= args.warmup:
            queued.append(time.perf_counter())

    metrics, launch, finish = run_steps(trainer, total, before_step)
    drained = time.perf_counter()
    alloc["after"] = allocator_counters()  # after the drain: every timed step is done
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    autoac_plan = trainer.autoac_summary()
    trainer.close()
    from torch._dynamo.utils import counters

    # recompiles and eager fallbacks of the compiled small-op regions, if any
    dynamo = {k: dict(counters[k]) for k in ("stats", "recompiles", "graph_break") if k in counters}
    timed = metrics[args.warmup :]
    times = [m["step_time_s"] for m in timed]
    tflop = [m["step_tflop"] for m in timed]
    batch = preset.train.global_batch_size
    mfu = [m["mfu"] for m in timed if m.get("mfu") is not None]
    gaps = [m["gpu_gap_s"] for m in timed if m.get("gpu_gap_s") == m.get("gpu_gap_s")]
    dry = [m["gpu_dry_at_launch"] for m in timed if m.get("gpu_dry_at_launch") in (0.0, 1.0)]
    # finish[k] reads step k back while step k + 1 is queued: the timed steps' reads are
    # finish[warmup:], none when one step is timed (the last step's read is not timed)
    finished = finish[args.warmup :]
    return {
        "build_s": build_s,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "step_times_s": times,
        "requests_per_s": batch * len(times) / sum(times),
        "tflops_per_gpu": sum(tflop) / sum(times),
        "median_mfu": statistics.median(mfu) if mfu else None,
        "launch_step_s_median": statistics.median(launch[args.warmup :]),
        "finish_step_s_median": statistics.median(finished) if finished else None,
        # GPU idle between steps (the previous step's end to this one's start, on the GPU's
        # clock) and the share of steps whose queue had run dry when the host began them:
        # both near 0 when the GPU is the bottleneck
        "gpu_gap_s_median": statistics.median(gaps) if gaps else None,
        "gpu_dry_at_launch_fraction": sum(dry) / len(dry) if dry else None,
        "peak_memory_gb": peak,
        "allocator_per_step": counter_delta(alloc.get("before", {}), alloc["after"], args.steps),
        "switch_interval_s": sys.getswitchinterval(),
        "autoac": autoac_plan,
        "dynamo_counters": dynamo,
        # Triton kernels first compiled/loaded while a timed step was queued or run (step =
        # index among the timed steps): stalls the warm-up did not cover
        "triton_jit_in_timed_steps": jit.per_step(queued, drained) if jit.available else None,
        "triton_jit_total": len(jit.events) if jit.available else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", help="default: gem (smoke: tiny)")
    p.add_argument("--variant", action="append", default=[], help="NAME=ITEM,... (repeat)")
    p.add_argument("--set", action="append", default=[], help="overrides for every variant")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per variant")
    p.add_argument("--tag", default="variants")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        import faulthandler

        # every thread's stack on stderr shortly before the parent kills this process: the
        # timeout record then shows where it stood (a compile, a wait on the GPU, a hang)
        faulthandler.dump_traceback_later(max(args.timeout - 10.0, 1.0), exit=False)
        result = run_child(args)
        faulthandler.cancel_dump_traceback_later()
        Path(args._child).write_text(json.dumps(jsonable(result)))
        return 0
    variants = [parse_variant(v) for v in (args.variant or ["base="])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from hyperrec.testing.bench import machine_info

    doc: dict[str, Any] = {
        "benchmark": "integration step_variants",
        "machine": machine_info(),
        "preset": args.preset or ("tiny" if args.smoke else "gem"),
        "common_overrides": args.set,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "variants": [],
    }
    stamp = dt.date.today().isoformat()
    path = out / f"step_variants_{doc['preset']}_{args.tag}_{stamp}.json"
    for name, overrides, env in variants:
        result_file = out / f".variant_{name}.json"
        cmd = [sys.executable, __file__, "--out", str(out), "--_child", str(result_file),
               "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--timeout", str(args.timeout)]  # fmt: skip
        if args.preset:
            cmd += ["--preset", args.preset]
        if args.smoke:
            cmd.append("--smoke")
        for o in [*args.set, *overrides]:
            cmd += ["--set", o]
        record: dict[str, Any] = {"name": name, "overrides": overrides, "env": env}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True,
                                  text=True, timeout=args.timeout)  # fmt: skip
            if proc.returncode == 0:
                record |= json.loads(result_file.read_text())
                record["status"] = "ok"
            else:
                record["status"] = "failed"
                record["error"] = proc.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            record["status"] = "timeout"
            # what the child printed before it was killed: tells a slow compile from a hang
            tail = exc.stderr or b""
            text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            record["error"] = text[-2000:]
        record["wall_s"] = time.perf_counter() - t0
        result_file.unlink(missing_ok=True)
        doc["variants"].append(record)
        path.write_text(json.dumps(jsonable(doc), indent=1))  # saved after every variant
        if record["status"] == "ok":
            fin = record["finish_step_s_median"]  # None: one timed step, no timed read
            mfu = record["median_mfu"]  # None: a CPU or a GPU without a listed peak
            print(f"{name:>14}: median {record['median_step_s'] * 1e3:7.1f} ms (min "
                  f"{record['min_step_s'] * 1e3:.1f}), MFU {'n/a' if mfu is None else f'{mfu:.1%}'}, "
                  f"launch {record['launch_step_s_median'] * 1e3:.1f} ms, finish "
                  f"{'n/a' if fin is None else f'{fin * 1e3:.1f}'} ms, "
                  f"{record['requests_per_s']:.0f} req/s", flush=True)  # fmt: skip
            if record.get("gpu_gap_s_median") is not None:
                print(" " * 16 + f"GPU idle between steps {record['gpu_gap_s_median'] * 1e3:.2f} ms "
                      f"(median); queue ran dry before {record['gpu_dry_at_launch_fraction']:.0%} "
                      "of the steps")  # fmt: skip
            late = record.get("triton_jit_in_timed_steps")
            if late:
                print(" " * 16 + f"{len(late)} Triton kernel(s) compiled in timed steps: "
                      + ", ".join(f"step {e['step']} {e['kernel']} {e['seconds']:.2f} s"
                                  for e in late[:6]))  # fmt: skip
            alloc = record["allocator_per_step"]
            if alloc:
                print(" " * 16 + "per step: " + ", ".join(f"{k} {v:g}" for k, v in alloc.items()))
        else:
            print(f"{name:>14}: {record['status']} {record.get('error', '')[-400:]}", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
