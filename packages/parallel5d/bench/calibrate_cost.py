"""Calibrate the cost model on one GPU: matmul rate per layer shape, copy bandwidth,
kernel launch cost, and how much an SM-occupying "collective-like" kernel slows a GEMM.

    python packages/parallel5d/bench/calibrate_cost.py --out DIR     # one H200, ~2 min
    python packages/parallel5d/bench/calibrate_cost.py --smoke --out DIR   # CPU, seconds

Writes ``DIR/calibration.json``, which ``DeviceSpec.from_calibration`` loads:

* ``matmul``: bf16 TFLOP/s of the GEM-scale preset's GEMM shapes, per layer name (the
  FLOP-weighted rate of its GEMMs), median of several freshly built inputs;
* ``device.hbm_gbps``: ``copy_`` of 1 GiB, bytes read + written per second;
* ``device.launch_us``: per-kernel cost of a stream of tiny kernels;
* ``device.sm_slowdown``: a GEMM stream timed alone and while a copy kernel that keeps
  ``N`` SMs busy (a Triton persistent kernel with ``N`` programs, what an NCCL
  collective with ``N`` channels occupies) runs on a side stream; the JSON lists every
  ``N`` and ``sm_slowdown`` is the value at 16 programs.

Network tiers cannot be measured on one GPU: the JSON repeats the cited figures the
model uses, marked ``"cited"``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hyperrec.parallel5d.topology import CROSS_ZONE_ROCE, NVLINK_H200, ROCE_400G

# (layer name, tokens per GEMM, [(in, out), ...]) for the GEM-scale preset
# (hyperrec.parallel5d.cost.gem_scale): dim 1024, MLP 8192-4096-4096-2048-1024,
# experts 1024 -> 4096 -> 1024.
SHAPES = [
    ("seq", 16384, [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]),
    ("interaction_mlp", 16384, [(8192, 4096), (4096, 4096), (4096, 2048), (2048, 1024)]),
    ("moe", 4096, [(1024, 4096), (1024, 4096), (4096, 1024)]),
    ("heads", 16384, [(1024, 256)]),
]
SMOKE_SHAPES = [("seq", 64, [(32, 96), (32, 32)]), ("moe", 32, [(32, 64), (64, 32)])]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` (one warm-up)."""
    out = []
    for _ in range(reps + 1):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def matmul_rates(shapes, dev, dtype, reps: int) -> list[dict]:
    rows = []
    for name, m, pairs in shapes:
        flops = secs = 0.0
        per = []
        for k, n in pairs:
            times = []
            for _ in range(3):  # freshly built inputs per trial
                a = torch.randn(m, k, device=dev, dtype=dtype)
                b = torch.randn(k, n, device=dev, dtype=dtype)
                times.append(_timed(lambda a=a, b=b: a @ b, dev, reps))
            t = statistics.median(times)
            f = 2.0 * m * k * n
            flops += f
            secs += t
            per.append({"m": m, "k": k, "n": n, "tflops": f / t / 1e12, "min_s": min(times)})
        rows.append({"layer": name, "tflops": flops / secs / 1e12, "gemms": per})
    return rows


def copy_bandwidth(dev, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), dev, reps)
    return 2 * nbytes / t / 1e9


def launch_us(dev, n: int) -> float:
    x = torch.zeros(1, device=dev)

    def many() -> None:
        for _ in range(n):
            x.add_(1.0)

    return _timed(many, dev, 3) / n * 1e6


def sm_contention(dev, programs: list[int], reps: int) -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, iters, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for _ in range(iters):
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    n = 64 * 2**20
    src = torch.empty(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()

    def gemms() -> None:
        for _ in range(20):
            a @ b

    alone = _timed(gemms, dev, reps)
    rows = []
    for p in programs:
        # Enough copy iterations to outlast the GEMMs.
        t_copy = _timed(lambda p=p: _copy[(p,)](src, dst, n, 1, BLOCK=1024), dev, 3)
        iters = max(1, int(3 * alone / max(t_copy, 1e-6)))
        times = []
        for _ in range(reps):
            _sync(dev)
            with torch.cuda.stream(side):
                _copy[(p,)](src, dst, n, iters, BLOCK=1024)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gemms()
            end.record()
            _sync(dev)
            times.append(start.elapsed_time(end) / 1e3)
        t = statistics.median(times)
        rows.append(
            {
                "programs": p,
                "gemm_alone_s": alone,
                "gemm_with_copy_s": t,
                "slowdown": t / alone - 1.0,
                "copy_gbps_alone": 2 * n * 4 / t_copy / 1e9,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.time()
    mm = matmul_rates(SMOKE_SHAPES if args.smoke else SHAPES, dev, dtype, args.reps)
    hbm = copy_bandwidth(dev, (2**20 if args.smoke else 2**30), args.reps)
    launch = launch_us(dev, 200 if args.smoke else 2000)
    contention = [] if dev.type != "cuda" else sm_contention(dev, [4, 8, 16, 32, 66, 132], 5)
    at16 = next((r["slowdown"] for r in contention if r["programs"] == 16), None)
    dense = [g["tflops"] for r in mm for g in r["gemms"]]
    device = {
        "name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "matmul_tflops": statistics.median(dense),
        "hbm_gbps": hbm,
        "launch_us": launch,
        "sm_slowdown": max(at16, 0.0) if at16 is not None else None,
        "sources": {
            "matmul_tflops": "measured: median bf16 GEMM rate over the preset's shapes",
            "hbm_gbps": "measured: copy_ of 1 GiB (read + write)",
            "launch_us": "measured: stream of tiny kernels",
            "sm_slowdown": "measured: GEMMs alongside a 16-program Triton copy kernel",
        },
    }
    from hyperrec.testing import write_result

    path = write_result(
        Path(args.out) / "calibration.json",
        {
            "benchmark": "cost-model calibration (one device)",
            "device": device,
            "matmul": mm,
            "contention": contention,
            "tiers_not_measured": {
                name: {
                    "bandwidth_gbps": lk.bandwidth_gbps,
                    "latency_us": lk.latency_us,
                    "source": lk.source,
                }
                for name, lk in (
                    ("nvlink", NVLINK_H200),
                    ("rdma", ROCE_400G),
                    ("cross_zone", CROSS_ZONE_ROCE),
                )
            },
            "seconds": time.time() - t0,
        },
    )
    print(
        f"matmul {device['matmul_tflops']:.1f} TFLOP/s, copy {hbm:.0f} GB/s, launch "
        f"{launch:.1f} us, SM slowdown at 16 programs {at16}; wrote {path} "
        f"({time.time() - t0:.0f}s)"
    )


if __name__ == "__main__":
    main()
