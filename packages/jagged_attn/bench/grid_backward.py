"""A wider backward tile grid (descriptor reads on) against the shipped pair, same run.

``tune_backward.py`` times a short list of tiles; this script times the grid
``block_m x block_n x warps x stages`` for dK/dV (with the shipped dQ) and then for dQ
(with the best dK/dV), every candidate with ``bwd_tma``, on the call of
``tune_backward.py`` (the integration model's HSTU attention, or ``--softmax``), and
re-times the shipped pair (today's table) and the three fastest pairs on fresh instances.

    python bench/grid_backward.py --out bench/results [--softmax]   # one H200, ~2 minutes
    python bench/grid_backward.py --out /tmp/g --smoke                # CPU, tiny

Writes ``grid_backward[_softmax]_<gpu>_<date>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import multiprocessing as mp
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_backward import (
    HEAD_DIM,
    HEADS,
    INSTANCES,
    LAW,
    SMOKE,
    TOKENS,
    _run,
    _time,
    confirm_finalists,
    instance,
    pick_finalists,
    result_path,
)

DKDV_GRID = list(itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (2, 3, 4)))
DQ_GRID = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))


def _cfg(t: tuple[int, int, int, int]):
    from hyperrec.jagged_attn._triton import KernelConfig

    bm, bn, w, s = t
    return KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, bwd_tma=True)


def _shipped(call):
    from hyperrec.jagged_attn._triton._launch import _pick

    return _pick("dkdv", call, None), _pick("dq", call, None)


def _compile_job(job):
    kind, t, shape = job
    try:
        call, do, _ = instance(0, **shape)
        dkdv, dq = _shipped(call)
        cfg = _cfg(t)
        _run(call, do, cfg if kind == "dkdv" else dkdv, cfg if kind == "dq" else dq)()
        torch.cuda.synchronize()
        return job, None
    except Exception as e:  # out of shared memory or registers: skipped below
        return job, f"{type(e).__name__}: {e}"[:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--softmax", action="store_true", help="a softmax, non-causal call")
    ap.add_argument("--workers", type=int, default=14, help="parallel compile processes")
    args = ap.parse_args(argv)
    smoke = args.smoke
    shape = {
        "law": SMOKE["law"] if smoke else LAW,
        "tokens": SMOKE["tokens"] if smoke else TOKENS,
        "heads": SMOKE["heads"] if smoke else HEADS,
        "d": SMOKE["head_dim"] if smoke else HEAD_DIM,
        "device": "cpu" if smoke else "cuda",
        "softmax": args.softmax,
    }
    dkdv_grid, dq_grid = (DKDV_GRID[:2], DQ_GRID[:2]) if smoke else (DKDV_GRID, DQ_GRID)
    n_inst = SMOKE["instances"] if smoke else INSTANCES + 2
    t_start = time.time()
    failed: dict[str, str] = {}
    if not smoke:
        jobs = [("dkdv", t, shape) for t in dkdv_grid] + [("dq", t, shape) for t in dq_grid]
        with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
            for job, err in pool.map(_compile_job, jobs):
                if err:
                    failed[repr(job[:2])] = err
        print(f"compiled {len(jobs)} variants in {time.time() - t_start:.0f}s, "
              f"{len(failed)} failed", flush=True)  # fmt: skip

    call, do, flops = instance(0, **shape)
    shipped = _shipped(call)
    sweep: list[dict[str, Any]] = []

    def timed(dkdv, dq) -> float:
        ms = _time(_run(call, do, dkdv, dq), smoke)
        sweep.append({"dkdv": asdict(dkdv), "dq": asdict(dq), "ms": ms,
                      "tflops": 2.5 * flops / ms * 1e-9})  # fmt: skip
        return ms

    timed(*shipped)
    best, best_ms = shipped[0], float("inf")
    for t in dkdv_grid:
        if repr(("dkdv", t)) not in failed:
            ms = timed(_cfg(t), shipped[1])
            if ms < best_ms:
                best, best_ms = _cfg(t), ms
    for t in dq_grid:
        if repr(("dq", t)) not in failed:
            timed(best, _cfg(t))
    finalists = pick_finalists(sweep, shipped)
    confirm, summary = confirm_finalists(finalists, shape, n_inst, smoke)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testing" / "src"))
    from hyperrec.testing.bench import write_result

    path = result_path(args.out, "grid_backward", args.softmax, smoke)
    write_result(path, {
        "benchmark": "jagged_attn backward tile grid with descriptor reads vs the shipped pair",
        "call": {"activation": "softmax" if args.softmax else "silu", "causal": not args.softmax,
                 "law": shape["law"], "tokens": shape["tokens"], "heads": shape["heads"],
                 "head_dim": shape["d"]},
        "shipped": {"dkdv": asdict(shipped[0]), "dq": asdict(shipped[1])},
        "method": "GPU time, do_bench median (L2 flushed); grid on instance 0, finalists on "
                  f"{n_inst} fresh instances; ratio = median of per-instance ratios to the "
                  "shipped pair; backward FLOPs = 2.5 x the forward's useful ones",
        "failed_builds": failed, "sweep": sweep, "confirm": confirm, "summary": summary,
        "wall_s": time.time() - t_start,
    })  # fmt: skip
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
