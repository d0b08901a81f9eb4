"""Non-causal SiLU (GDPA / HSTU) FP8 forward: the Gluon FP8 kernel against the Triton FP8
kernel, the one FP8 case the default dispatch leaves to Triton without a measurement.

Cases: 32 x 2,048, 8 x 8,192 and 16 jagged sequences of uniform lengths up to 4,096,
H = 8, D = 128, SiLU with HSTU's ``1 / max_seqlen`` normalization, not causal; fresh
instances (new tensors and lengths per seed). Per instance: the FP8 kernel alone on
operands quantized beforehand (V in each kernel's token order), Gluon and Triton; the
public ``gdpa(..., precision="fp8")`` with ``JAGGED_ATTN_GLUON_FP8=1`` and ``=0``; the
public bf16 call. ``triton.testing.do_bench`` with 200 ms windows, order reversed on odd
instances; medians over instances.

    python bench/probe_fp8_silu.py --out bench/results/probe_fp8_silu.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import triton
from bench_fp8 import _with_env  # same directory

from hyperrec.jagged_attn import FP8Config, gdpa
from hyperrec.jagged_attn._opschema import AttentionCall
from hyperrec.jagged_attn._triton import _fp8_launch
from hyperrec.jagged_attn.spec import AttentionSpec

CASES = [("fixed", 32, 2048), ("fixed", 8, 8192), ("uniform", 16, 4096)]


def _lengths(dist: str, batch: int, max_len: int, seed: int) -> torch.Tensor:
    if dist == "fixed":
        return torch.full((batch,), max_len, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(max_len // 8, max_len + 1, (batch,), generator=g)


def _impls(dist: str, batch: int, max_len: int, seed: int, config: FP8Config):
    lens = _lengths(dist, batch, max_len, seed)
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    off = offsets.cuda()
    total = int(lens.sum())
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    q, k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    spec = AttentionSpec(scale=1 / math.sqrt(128), max_seqlen_q=max_len, max_seqlen_kv=max_len,
                         activation="silu", normalization="max_seqlen")  # fmt: skip
    call = AttentionCall(q=q, k=k, v=v, q_offsets=off, kv_offsets=off, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip
    eligible = _fp8_launch.gluon_fp8_unsupported(call, config, None, spec.scale) is None
    mma = _fp8_launch.quantize_qkv(q, k, v, off, off, config, v_mma_order=True)
    rows = _fp8_launch.quantize_qkv(q, k, v, off, off, config)

    def public(precision):
        return lambda: gdpa(q, k, v, off, off, max_len, max_len, activation="silu",
                            normalization="max_seqlen", precision=precision)  # fmt: skip

    def kernel(qkv):
        return lambda: _fp8_launch.attention_forward_fp8(call, config, qkv=qkv)

    env = _fp8_launch.GLUON_FP8_ENV
    fns = {
        "kernel_gluon": _with_env(kernel(mma), env, "1"),
        "kernel_triton": _with_env(kernel(rows), env, "0"),
        "fp8_gluon": _with_env(public("fp8"), env, "1"),
        "fp8_triton": _with_env(public("fp8"), env, "0"),
        "bf16": public("bf16"),
    }  # fmt: skip
    flops = 4.0 * float((lens.double() ** 2).sum()) * 8 * 128
    return fns, flops, eligible


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    config = FP8Config()
    rows = []
    for dist, batch, max_len in CASES:
        name = f"{dist}-B{batch}-L{max_len}"
        for inst in range(args.instances):
            fns, flops, eligible = _impls(dist, batch, max_len, inst, config)
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            order = list(fns.items())
            for impl, fn in order if inst % 2 == 0 else order[::-1]:
                ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms)
                rows.append(dict(case=name, inst=inst, impl=impl, ms=ms,
                                 tflops=flops / ms * 1e-9, gluon_eligible=eligible))  # fmt: skip
            del fns
            torch.cuda.empty_cache()
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by.setdefault((r["case"], r["impl"]), []).append(r["tflops"])
    summary = []
    for (case, impl), values in sorted(by.items()):
        values = sorted(values)
        summary.append(dict(case=case, impl=impl, tflops_median=values[len(values) // 2],
                            tflops_min=values[0]))  # fmt: skip
        print(f"{case:22s} {impl:14s} median {values[len(values) // 2]:7.1f} min {values[0]:7.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                        torch=torch.__version__, triton=triton.__version__,
                                        date=time.strftime("%Y-%m-%d"), rep_ms=args.rep_ms,
                                        summary=summary, rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
