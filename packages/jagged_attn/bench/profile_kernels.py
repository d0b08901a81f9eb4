"""Where the GPU time of one public forward + backward goes, kernel by kernel.

For each case (equal lengths, H = 8, D = 128, bf16, 65,536 tokens), ``--instances`` fresh
instances; each instance runs the public call (forward, then ``autograd.grad``) a few times
under ``torch.profiler`` and sums the CUDA time per kernel name. Each kernel's share of the
step and, for the three attention kernels, the rate at the GEMM work they execute (forward:
2 GEMMs per tile pair, dK/dV kernel: 4, dQ kernel: 3; the public figures count 5 for the
whole backward), so that the kernel furthest from the GEMM ceiling is the one to work on.

    python bench/profile_kernels.py --out results/profile_kernels_h200_<date>.json
    python bench/profile_kernels.py --ncu fwd     # two forwards of 8 x 8,192, for ncu
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_gluon as bg  # noqa: E402  (same directory)

TOKENS = 65536
CASES = ((8192, "softmax"), (8192, "softmax_causal"), (2048, "softmax"))
#: GEMMs per (query tile, key tile) pair that each kernel executes, by name fragment
GEMMS = {"fwd": 2, "dkdv": 4, "dq": 3}


def kernel_class(name: str) -> str:
    low = name.lower()
    if "dkdv" in low:
        return "dkdv"
    if "bwd_dq" in low or "dq_kernel" in low:
        return "dq"
    if "fwd" in low and "jagged" in low:
        return "fwd"
    return "other"


def one_instance(length: int, kind: str, inst: int, reps: int) -> dict:
    lens = [length] * (TOKENS // length)
    off = bg.offsets_of(lens, "cuda")
    q, k, v = bg.fresh(TOKENS, 8, 128, "cuda", 50000 + 31 * inst)
    do = bg.fresh(TOKENS, 8, 128, "cuda", 50001 + 31 * inst)[0]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def step():
        out = bg.public_call(kind, *leaves, off, length)
        return torch.autograd.grad(out, leaves, do)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t > 0:
            per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + t / reps / 1e3  # ms
    causal = kind == "softmax_causal"
    pair_flops = bg.useful_flops(lens, 8, 128, causal) / 2  # one GEMM over all tile pairs
    classes: dict[str, float] = {}
    for name, ms in per_kernel.items():
        c = kernel_class(name)
        classes[c] = classes.get(c, 0.0) + ms
    rates = {c: GEMMS[c] * pair_flops / (classes[c] * 1e-3) * 1e-12 for c in GEMMS if c in classes}
    return {"length": length, "kind": kind, "instance": inst, "kernels_ms": per_kernel,
            "classes_ms": classes, "executed_tflops": rates,
            "step_ms": sum(per_kernel.values())}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--ncu",
        choices=("fwd", "fwd_bwd"),
        default=None,
        help="run one softmax call (after one warm call), no profiler",
    )
    ap.add_argument("--ncu-length", type=int, default=8192, help="sequence length for --ncu")
    args = ap.parse_args()
    if args.ncu:
        length = args.ncu_length
        off = bg.offsets_of([length] * (TOKENS // length), "cuda")
        grad = args.ncu == "fwd_bwd"
        q, k, v = (x.requires_grad_(grad) for x in bg.fresh(TOKENS, 8, 128, "cuda", 1))
        for _ in range(2):
            out = bg.public_call("softmax", q, k, v, off, length)
            if args.ncu == "fwd_bwd":
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
        return 0
    rows = []
    for length, kind in CASES:
        for inst in range(args.instances):
            r = one_instance(length, kind, inst, args.reps)
            rows.append(r)
            rates = " ".join(f"{c} {r['classes_ms'][c]:.3f} ms {t:.0f} TF/s"
                             for c, t in r["executed_tflops"].items())  # fmt: skip
            print(
                f"L{length} {kind:15s} inst {inst}: step {r['step_ms']:.3f} ms; {rates}; "
                f"other {r['classes_ms'].get('other', 0.0):.3f} ms",
                flush=True,
            )
    summary = []
    for length, kind in CASES:
        rs = [r for r in rows if r["length"] == length and r["kind"] == kind]
        s = {"length": length, "kind": kind}
        for c in (*GEMMS, "other"):
            vals = [r["classes_ms"].get(c, 0.0) for r in rs]
            s[f"{c}_ms_median"] = statistics.median(vals)
            if c in GEMMS:
                s[f"{c}_tflops_median"] = statistics.median(r["executed_tflops"][c] for r in rs)
        summary.append(s)
        print(json.dumps(s))
    if args.out:
        payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "heads": 8, "head_dim": 128, "tokens": TOKENS, "reps": args.reps,
                   "gemms_per_tile_pair": GEMMS, "rows": rows, "summary": summary,
                   "note": "executed_tflops counts the GEMMs each kernel runs, not the "
                           "public 2.5x-forward convention"}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1))
    return 0 if math.isfinite(sum(r["step_ms"] for r in rows)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
