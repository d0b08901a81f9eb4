"""Host time of one cuBLAS call on a shape it has seen vs a new row count per call.

    python integration/bench/cublas_host.py --out DIR          # a CUDA GPU
    python integration/bench/cublas_host.py --out DIR --smoke  # CPU: the bookkeeping only

Why: the jagged token and candidate counts give the model's GEMMs a new ``M`` every step,
and cuBLAS(Lt) picks its kernel per shape on the host (a heuristic query; its result is
cached per shape). ``train.row_buckets`` pads the counts to a few sizes so that they
repeat. Per case (``M`` about 120,000 rows of width 1,024, the GEM preset's token count
and width), the host time of one call, the GPU idle before it (synchronised), is timed
for 30 calls each: the same ``M`` every call, a new ``M`` every call, and new ``M`` s
rounded up to multiples of 256 (which repeat). Also a ``torch.compile``'d linear + SiLU
(dynamic shapes, as the model's regions) and the GPU time of one GEMM, for scale.
With ``--no-cache`` the process sets ``CUBLASLT_HEURISTICS_CACHE_CAPACITY=0`` first.

Writes ``cublas_host_<gpu>_<date>.json`` (``_nocache`` appended with ``--no-cache``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CALLS = 30
BASE_M = 120_000
WIDTH = 1024


def _host_us(fn: Any, rows: list[int], device: str) -> list[float]:
    import torch

    out = []
    for m in rows:
        a = torch.randn(m, WIDTH, device=device, dtype=torch.bfloat16)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(a)
        out.append((time.perf_counter() - t) * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return out


def _stats(v: list[float]) -> dict[str, float]:
    return {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}


def measure(device: str, base: int, calls: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    w = torch.randn(4 * WIDTH, WIDTH, device=device, dtype=torch.bfloat16)
    b = torch.randn(4 * WIDTH, device=device, dtype=torch.bfloat16)
    cases = {
        "mm_NT (forward, x W^T)": lambda a: torch.mm(a, w.t()),
        "linear_bias (cublasLt with bias epilogue)": lambda a: F.linear(a, w, b),
        "mm_TN (weight gradient, x^T x)": lambda a: torch.mm(a.t(), a),
    }
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        fn(torch.randn(base, WIDTH, device=device, dtype=torch.bfloat16))
        same = _host_us(fn, [base] * calls, device)
        new = _host_us(fn, [base + 7 * i + 1 for i in range(calls)], device)
        rounded = _host_us(fn, [-(-(base + 7 * i + 1) // 256) * 256 for i in range(calls)], device)
        out[name] = {
            "same_M": _stats(same),
            "new_M_each_call": _stats(new),
            "M_rounded_up_to_256": _stats(rounded),
        }
        print(name, {k: round(v["median_us"], 1) for k, v in out[name].items()}, flush=True)
    if device == "cuda":

        def proj(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.silu(F.linear(a, w, b))

        compiled = torch.compile(proj, dynamic=True)
        for m in (base, base + 3):
            compiled(torch.randn(m, WIDTH, device=device, dtype=torch.bfloat16), w, b)
        same = _host_us(lambda a: compiled(a, w, b), [base] * calls, device)
        new = _host_us(
            lambda a: compiled(a, w, b), [base + 7 * i + 100 for i in range(calls)], device
        )
        out["compiled linear + silu (dynamic shapes)"] = {
            "same_M": _stats(same),
            "new_M_each_call": _stats(new),
        }
        a = torch.randn(base, WIDTH, device=device, dtype=torch.bfloat16)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            torch.mm(a, w.t())
        e1.record()
        torch.cuda.synchronize()
        out["gpu_us_one_mm_NT"] = e0.elapsed_time(e1) * 100.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, small shapes")
    p.add_argument("--no-cache", action="store_true", help="CUBLASLT_HEURISTICS_CACHE_CAPACITY=0")
    args = p.parse_args(argv)
    if args.no_cache:
        os.environ["CUBLASLT_HEURISTICS_CACHE_CAPACITY"] = "0"  # before cuBLAS loads
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cublas_host.py needs a CUDA GPU (or --smoke)")
    results = measure(device, 512 if args.smoke else BASE_M, 3 if args.smoke else CALLS)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    doc = {
        "benchmark": "cublas_host",
        "machine": {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": gpu,
        },
        "rows": BASE_M if not args.smoke else 512,
        "width": WIDTH,
        "calls_per_case": CALLS if not args.smoke else 3,
        "heuristics_cache": "disabled" if args.no_cache else "default",
        "results": results,
    }
    names = [w.lower() for w in gpu.split() if w[:1] in "HABL" and w[1:2].isdigit()]
    tag = "cpu" if device == "cpu" else (names[0] if names else "gpu")  # "h100", "h200"
    name = f"cublas_host_{tag}_{dt.date.today().isoformat()}{'_nocache' if args.no_cache else ''}"
    path = Path(args.out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
