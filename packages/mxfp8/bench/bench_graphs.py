"""Device time without host overhead: the quantizer and the GEMMs replayed from CUDA graphs.

``bench_mxfp8.py`` times the public Python calls, which at these sizes include ~0.2-0.3 ms
of host work per call (custom-op dispatch, the Triton launcher and autotuner). Here each
op is captured ``REPS`` times into one CUDA graph and the graph is replayed, so the time
is the kernels' alone; the host cost per call is measured separately.

Usage: ``python bench_graphs.py [--out PATH]``; writes JSON via ``write_result``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from hyperrec.mxfp8 import mx_mm, mx_quantize, to_mx
from hyperrec.testing import write_result

RESULTS = Path(__file__).resolve().parent / "results"
REPS = 10


def graph_ms(fn) -> float:
    """Median device ms of one ``fn()`` call, from a graph of REPS calls."""
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    return do_bench(g.replay, warmup=10, rep=60, return_mode="median") / REPS


def host_us(fn, n: int = 200) -> float:
    """Host microseconds per call (small inputs, no sync inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "h200_2026-11-29_graphs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    m, k = 16384, 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([7], device="cuda", dtype=torch.int64)
    copy_dst = torch.empty_like(x)
    copy_ms = graph_ms(lambda: copy_dst.copy_(x))
    rows = [
        {
            "variant": "copy (ceiling)",
            "ms": round(copy_ms, 4),
            "GBps": round(4 * m * k / copy_ms / 1e6, 1),
        }
    ]
    variants = [
        ("row e4m3 bs32", {"rowwise": True}, 1, 32),
        ("row+col e4m3 bs32", {"colwise": True}, 2, 32),
        ("row+col e4m3 bs128", {"colwise": True, "block_size": 128}, 2, 128),
        ("row+col + RHT16", {"colwise": True, "hadamard": 16}, 2, 32),
        ("row+col + SR", {"colwise": True, "stochastic_rounding": True, "seed": seed}, 2, 32),
        ("row+col + gelu", {"colwise": True, "activation": "gelu_tanh"}, 2, 32),
    ]
    for name, kw, copies, bs in variants:
        ms = graph_ms(lambda kw=kw: mx_quantize(x, **kw))
        moved = 2 * m * k + copies * (m * k + m * k // bs)
        rows.append(
            {
                "variant": name,
                "ms": round(ms, 4),
                "GBps": round(moved / ms / 1e6, 1),
                "% of copy": round(100 * copy_ms * moved / (4 * m * k) / ms, 1),
            }
        )
    gemm = []
    for n in (4096, 8192):
        a_hp = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b_hp = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        flop = 2 * n**3
        row = {
            "M=K=N": n,
            "bf16 torch.mm TFLOPs": round(
                flop / graph_ms(lambda a_hp=a_hp, b_hp=b_hp: a_hp @ b_hp.t()) / 1e9, 1
            ),
        }
        for name, bs, kernel in [
            ("fast bs128 cublas", 128, "cublas"),
            ("exact bs32 upcast", 32, "upcast"),
        ]:
            a, b = to_mx(a_hp, block_size=bs), to_mx(b_hp, block_size=bs).t()
            row[f"{name} TFLOPs"] = round(
                flop / graph_ms(lambda a=a, b=b, kernel=kernel: mx_mm(a, b, kernel=kernel)) / 1e9, 1
            )
        gemm.append(row)
    small = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    qa, qb = to_mx(small, block_size=128), to_mx(small, block_size=128).t()
    host = {
        "mx_quantize row+col (us/call)": round(
            host_us(lambda: mx_quantize(small, colwise=True)), 1
        ),
        "mx_mm cublas (us/call)": round(host_us(lambda: mx_mm(qa, qb, kernel="cublas")), 1),
        "torch.mm (us/call)": round(host_us(lambda: small @ small), 1),
    }
    payload = {
        "benchmark": "mxfp8 device time via CUDA graphs",
        "shape": [m, k],
        "quantize": rows,
        "gemm": gemm,
        "host_overhead": host,
    }
    write_result(args.out, payload)
    for r in rows + gemm + [host]:
        print("  ".join(f"{kk}={v}" for kk, v in r.items()))


if __name__ == "__main__":
    main()
