"""Backward tile sweep on the attention the integration GEM model runs most.

``tune_configs.py`` picked the shipped backward tiles on softmax, non-causal batches of
uniform lengths up to 2,048. The integration ``gem`` preset spends most of its attention
time elsewhere: HSTU attention (SiLU, causal, divided by the max length) over power-law
histories of mean ~800 and up to 8,192 events, H = 8, D = 128, about 98k tokens a step;
there the backward ran at ~190 TFLOP/s against the forward's ~330 (profile of
2026-12-02). This script times the backward with each dK/dV candidate (each with and
without atomic dQ) and each dQ candidate on that call, then re-times the best few and the
shipped pair on fresh instances (new lengths and tensors), GPU time only
(``triton.testing.do_bench``, median; L2 flushed before each call). Every candidate also
runs with ``bwd_tma`` (descriptor reads of the streamed tiles; with atomic dQ, one bulk
reduce-add per tile). ``--softmax`` times a softmax, non-causal call on the same lengths
instead (the tiles are shared by every activation and mask).

    python bench/tune_backward.py --out bench/results      # one H200, ~3 minutes
    python bench/tune_backward.py --out /tmp/t --smoke     # CPU (TRITON_INTERPRET=1), tiny

Writes ``tune_backward_<gpu>_<date>.json``: every timing, the shipped pair's and the
winner's TFLOP/s per instance (backward counted as 2.5x the forward's useful FLOPs).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import math
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gluon import draw_lengths

# The integration preset's history law (integration DataConfig: min_seqlen 32,
# seqlen_scale 512, seqlen_alpha 1.5, max_seqlen 8192), drawn by bench_gluon's
# draw_lengths: lo + floor(scale * (u^(-1/alpha) - 1)), capped at hi.
LAW = {"law": "lomax", "lo": 32, "scale": 512.0, "alpha": 1.5, "hi": 8192}
TOKENS = 98_304
HEADS, HEAD_DIM = 8, 128
INSTANCES = 3
SMOKE = {"law": {"law": "lomax", "lo": 2, "scale": 6.0, "alpha": 1.5, "hi": 40}, "tokens": 96, "heads": 1,
         "head_dim": 16, "instances": 2}  # fmt: skip

# (block_m, block_n, num_warps, num_stages); dK/dV: block_n key rows owned, block_m query
# rows streamed. The shipped pair for this call is (64, 64, 4, 2) / (128, 64, 8, 3).
DKDV = ((64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2),
        (64, 128, 8, 3), (32, 64, 4, 3), (128, 128, 8, 2))  # fmt: skip
DQ = ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2),
      (64, 128, 8, 2))  # fmt: skip


def instance(
    seed: int,
    law: dict[str, Any],
    tokens: int,
    heads: int,
    d: int,
    device: str,
    softmax: bool = False,
):
    """``(call, grad_out, useful forward FLOPs)`` of one fresh HSTU (or softmax) call."""
    from hyperrec.jagged_attn import AttentionSpec, MaskSpec
    from hyperrec.jagged_attn._opschema import AttentionCall

    lens = draw_lengths(law, tokens, seed)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (
        torch.randn(tokens, heads, d, device=device, dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    top = max(lens)
    if softmax:
        spec = AttentionSpec(activation="softmax", scale=1 / math.sqrt(d), max_seqlen_q=top,
                             max_seqlen_kv=top)  # fmt: skip
    else:
        spec = AttentionSpec(activation="silu", scale=1 / math.sqrt(d),
                             normalization="max_seqlen", max_seqlen_q=top, max_seqlen_kv=top,
                             mask=MaskSpec(causal=True))  # fmt: skip
    call = AttentionCall(q=q, k=k, v=v, q_offsets=offsets.to(device), kv_offsets=offsets.to(device),
                         kv_index=None, num_targets=None, spec=spec)  # fmt: skip
    pairs = sum(n * n if softmax else n * (n + 1) // 2 for n in lens)
    return call, do, 4.0 * pairs * heads * d


def _cfg(t: tuple[int, int, int, int], atomic: bool = False, tma: bool = False):
    from hyperrec.jagged_attn._triton import KernelConfig

    bm, bn, w, s = t
    return KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, dq_atomic=atomic,
                        bwd_tma=tma)  # fmt: skip


def _run(call, do, dkdv, dq):
    from hyperrec.jagged_attn._triton import attention_backward, attention_forward

    out, lse = attention_forward(call)
    return lambda: attention_backward(do, out, lse, call, config_dkdv=dkdv, config_dq=dq)


def _compile_job(
    job: tuple[str, tuple[int, ...], bool, bool, dict[str, Any]],
) -> tuple[Any, str | None]:
    """Build one variant in a worker process (the parent then finds it in the cache)."""
    kind, t, atomic, tma, shape = job
    try:
        call, do, _ = instance(0, **shape)
        cfg = _cfg(t, atomic, tma)
        _run(call, do, cfg if kind == "dkdv" else None, cfg if kind == "dq" else None)()
        torch.cuda.synchronize()
        return job, None
    except Exception as e:  # e.g. out of shared memory or registers: skipped below
        return job, f"{type(e).__name__}: {e}"[:300]


def _time(fn, smoke: bool) -> float:
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=30, return_mode="median")


def result_path(out: str, stem: str, softmax: bool, smoke: bool) -> Path:
    """``<out>/<stem>[_softmax]_<gpu or cpu>_<date>.json``, the name every backward script
    writes its result under."""
    tag = "cpu" if smoke else torch.cuda.get_device_name().split()[-1].lower()
    kind = "_softmax" if softmax else ""
    return Path(out) / f"{stem}{kind}_{tag}_{dt.date.today().isoformat()}.json"


def pick_finalists(sweep: list[dict[str, Any]], shipped: tuple[Any, Any], n: int = 4):
    """The shipped pair, then the fastest distinct pairs of ``sweep`` (``n`` in all)."""
    kc = type(shipped[0])
    finalists: list[tuple[Any, Any]] = [shipped]
    for r in sorted(sweep, key=lambda r: r["ms"]):
        pair = (kc(**r["dkdv"]), kc(**r["dq"]))
        if pair not in finalists:
            finalists.append(pair)
        if len(finalists) == n:
            break
    return finalists


def confirm_finalists(finalists, shape: dict[str, Any], n_inst: int, smoke: bool):
    """Time every pair on ``n_inst`` fresh instances (seeds 1..n_inst): the rows, and per
    pair the median / min TFLOP/s, ``x_shipped`` (ratio of medians to pair 0) and
    ``x_shipped_median`` (median of the per-instance ratios)."""
    confirm: list[dict[str, Any]] = []
    for seed in range(1, n_inst + 1):
        c, g, f = instance(seed, **shape)
        for i, (dkdv, dq) in enumerate(finalists):
            ms = _time(_run(c, g, dkdv, dq), smoke)
            confirm.append({"instance": seed, "pair": i, "ms": ms, "tflops": 2.5 * f / ms * 1e-9})
        del c, g
    base = [r["tflops"] for r in confirm if r["pair"] == 0]
    keys = ("block_m", "block_n", "num_warps", "num_stages", "dq_atomic", "bwd_tma")
    summary = []
    for i, (dkdv, dq) in enumerate(finalists):
        tf = [r["tflops"] for r in confirm if r["pair"] == i]
        row = {"pair": i, "shipped": i == 0, "dkdv": asdict(dkdv), "dq": asdict(dq),
               "tflops_median": statistics.median(tf), "tflops_min": min(tf),
               "x_shipped": statistics.median(tf) / statistics.median(base),
               "x_shipped_median": statistics.median(a / b for a, b in zip(tf, base)),
               "tflops": tf}  # fmt: skip
        summary.append(row)
        print(f"pair {i}{' (shipped)' if i == 0 else ''}: {row['tflops_median']:.0f} TFLOP/s "
              f"(min {row['tflops_min']:.0f}), x{row['x_shipped_median']:.3f}; "
              f"dkdv {tuple(row['dkdv'][k] for k in keys)} "
              f"dq {tuple(row['dq'][k] for k in keys)}", flush=True)  # fmt: skip
    return confirm, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes")
    ap.add_argument("--softmax", action="store_true", help="a softmax, non-causal call")
    ap.add_argument(
        "--shipped-tiles",
        action="store_true",
        help="only the shipped tiles, with and without each variant",
    )
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    shape = {"law": SMOKE["law"] if smoke else LAW, "tokens": SMOKE["tokens"] if smoke else TOKENS,
             "heads": SMOKE["heads"] if smoke else HEADS, "d": SMOKE["head_dim"] if smoke else HEAD_DIM,
             "device": device, "softmax": args.softmax}  # fmt: skip
    n_inst = SMOKE["instances"] if smoke else INSTANCES
    dkdv_c, dq_c = (DKDV[:2], DQ[:2]) if smoke else (DKDV, DQ)
    if args.shipped_tiles:
        dkdv_c, dq_c = DKDV[:1], DQ[:1]
    t_start = time.time()

    failed: dict[str, str] = {}
    if not smoke:
        jobs = [("dkdv", t, a, m, shape) for t in dkdv_c for a in (False, True)
                for m in (False, True)]  # fmt: skip
        jobs += [("dq", t, False, m, shape) for t in dq_c for m in (False, True)]
        with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
            for job, err in pool.map(_compile_job, jobs):
                if err:
                    failed[repr(job[:4])] = err
        print(f"compiled {len(jobs)} variants in {time.time() - t_start:.0f}s, "
              f"{len(failed)} failed", flush=True)  # fmt: skip

    def ok(kind: str, t: tuple[int, ...], atomic: bool = False, tma: bool = False) -> bool:
        return repr((kind, t, atomic, tma)) not in failed

    call, do, flops = instance(0, **shape)
    bwd_flops = 2.5 * flops
    sweep: list[dict[str, Any]] = []

    def timed(dkdv, dq) -> float:
        ms = _time(_run(call, do, dkdv, dq), smoke)
        sweep.append({"dkdv": asdict(dkdv), "dq": asdict(dq), "ms": ms,
                      "tflops": bwd_flops / ms * 1e-9})  # fmt: skip
        return ms

    shipped_dq = _cfg(DQ[0])
    best_sep, best_sep_ms = _cfg(DKDV[0]), float("inf")
    for t in dkdv_c:
        for atomic in (False, True):
            for tma in (False, True):
                if ok("dkdv", t, atomic, tma):
                    ms = timed(_cfg(t, atomic, tma), shipped_dq)
                    if not atomic and ms < best_sep_ms:
                        best_sep, best_sep_ms = _cfg(t, False, tma), ms
    for t in dq_c:
        for tma in (False, True):
            if ok("dq", t, False, tma) and (t, tma) != (DQ[0], False):
                timed(best_sep, _cfg(t, False, tma))
    finalists = pick_finalists(sweep, (_cfg(DKDV[0]), shipped_dq))
    confirm, summary = confirm_finalists(finalists, shape, n_inst, smoke)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testing" / "src"))
    from hyperrec.testing.bench import write_result

    path = result_path(args.out, "tune_backward", args.softmax, smoke)
    write_result(path, {
        "benchmark": "jagged_attn backward tile sweep (integration HSTU call)",
        "call": {"activation": "softmax" if args.softmax else "silu",
                 "causal": not args.softmax,
                 "normalization": "none" if args.softmax else "max_seqlen",
                 "law": shape["law"], "tokens": shape["tokens"], "heads": shape["heads"],
                 "head_dim": shape["d"]},
        "method": "GPU time, do_bench median (L2 flushed); sweep on instance 0, finalists on "
                  f"{n_inst} fresh instances; backward FLOPs = 2.5 x the forward's useful ones",
        "failed_builds": failed, "sweep": sweep, "confirm": confirm, "summary": summary,
        "wall_s": time.time() - t_start,
    })  # fmt: skip
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
