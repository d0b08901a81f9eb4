"""The bf16 -> fp32 gradient landing of ``fully_shard`` (mixed precision), kernel by kernel.

A gradient produced in bf16 is cast into its slot of the fp32 reduction buffer: a
dtype-changing ``copy_`` (first landing) or ``add_`` (accumulation) on a view of the flat
buffer. This times those calls against the one-tensor foreach kernels and against a
same-dtype fp32 copy (the copy rate's ceiling) at the shapes of the Llama-like stack,
on three freshly allocated buffer/gradient pairs, 10 timed calls each (median and
minimum over the 30), and for 16 tensors at once (the deferred path's
``_foreach_copy_``, one pair).

    python packages/parallel5d/bench/bench_landing.py --out DIR   # CUDA
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

SHAPES = [(4096, 4096), (11008, 4096), (1024, 1024), (4096,)]
INSTANCES = 3  # freshly allocated buffer and gradient per instance


def _variants(view: torch.Tensor, g: torch.Tensor) -> dict:
    g32 = g.float()
    return {
        "copy_": lambda: view.copy_(g),
        "foreach_copy_": lambda: torch._foreach_copy_([view], [g]),
        "add_": lambda: view.add_(g),
        "foreach_add_": lambda: torch._foreach_add_([view], [g]),
        "fp32_copy_ceiling": lambda: view.copy_(g32),
    }


def _time(fn, reps: int = 10) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for bench_landing.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_landing.py times CUDA kernels: no CUDA device here")
    dev = torch.device("cuda")
    cases = []
    for shape in SHAPES:
        n = 1
        for d in shape:
            n *= d
        times: dict[str, list[float]] = {}
        for _ in range(INSTANCES):
            flat = torch.empty(n + 64, dtype=torch.float32, device=dev)
            view = flat[16 : 16 + n].view(shape)  # a 64-byte aligned slot, as in the buffer
            g = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            for name, fn in _variants(view, g).items():
                times.setdefault(name, []).extend(_time(fn))
        for name, ts in times.items():
            med, low = statistics.median(ts), min(ts)
            moved = n * (8 if name == "fp32_copy_ceiling" else 6)
            cases.append({"shape": list(shape), "variant": name, "median_us": med * 1e6,
                          "min_us": low * 1e6, "gbps": moved / med / 1e9})  # fmt: skip
            print(f"{shape} {name:18} {med * 1e6:8.1f} us {moved / med / 1e9:6.0f} GB/s")
    gs = [torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) for _ in range(16)]
    flat = torch.empty(16 * 4096 * 4096, device=dev)
    vs = list(flat.view(16, 4096, 4096).unbind(0))
    many = {
        "foreach_copy_x16": lambda: torch._foreach_copy_(vs, gs),
        "copy_loop_x16": lambda: [v.copy_(x) for v, x in zip(vs, gs)],
        "foreach_add_x16": lambda: torch._foreach_add_(vs, gs),
    }
    for name, fn in many.items():
        ts = _time(fn)
        med, low = statistics.median(ts), min(ts)
        moved = 16 * 4096 * 4096 * 6
        cases.append({"shape": [16, 4096, 4096], "variant": name, "median_us": med * 1e6,
                      "min_us": low * 1e6, "gbps": moved / med / 1e9})  # fmt: skip
        print(f"16 x (4096, 4096) {name:18} {med * 1e6:8.1f} us {moved / med / 1e9:6.0f} GB/s")
    from hyperrec.testing import write_result

    write_result(
        Path(args.out) / "bench_landing.json",
        {"benchmark": "bf16 -> fp32 gradient landing kernels", "cases": cases},
    )


if __name__ == "__main__":
    main()
