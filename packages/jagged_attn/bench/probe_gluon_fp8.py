"""The Gluon FP8 forward kernel alone: pipeline variants against the Triton FP8 kernel and
the bf16 Gluon forward, in one run on one GPU.

Cases: 32 x 2,048, 8 x 8,192 and causal 16 x 4,096 tokens, H = 8, D = 128, softmax; three
fresh instances each (new tensors per seed). Variants: ring depth, ping-pong on/off, and
V stored in the kernel's token order (``mma_order``, the launcher's default) or not. All
operands are quantized before the timing (kernel time only). ``triton.testing.do_bench``
median per instance; the JSON lists every instance.

    python bench/probe_gluon_fp8.py --out bench/results/probe_gluon_fp8.json
    python bench/probe_gluon_fp8.py --ncu   # one launch of the default variant, for ncu
"""

# The closures below run within the loop iteration that defines them.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import triton

from hyperrec.jagged_attn import FP8Config
from hyperrec.jagged_attn._gluon import _fp8_launch as g8
from hyperrec.jagged_attn._gluon import jagged_attention_fwd_gluon
from hyperrec.jagged_attn._gluon._launch import _schedule
from hyperrec.jagged_attn._opschema import AttentionCall
from hyperrec.jagged_attn._triton._fp8_launch import (
    GLUON_FP8_ENV,
    attention_forward_fp8,
    quantize_qkv,
)
from hyperrec.jagged_attn.fp8 import hadamard_scale
from hyperrec.jagged_attn.masks import MaskSpec
from hyperrec.jagged_attn.spec import AttentionSpec

CASES = [(32, 2048, False), (8, 8192, False), (16, 4096, True)]
# (num_stages, pingpong, V in mma_order)
VARIANTS = [(3, False, True), (2, False, True), (4, False, True), (3, True, True),
            (3, False, False)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_gluon_fp8.json")
    ap.add_argument("--ncu", action="store_true", help="run the default variant 4 times, no timing")
    args = ap.parse_args()
    cases = [(8, 8192, False)] if args.ncu else CASES
    variants = [(3, True, True)] if args.ncu else VARIANTS
    rows = []
    for batch, length, causal in cases:
        name = f"B{batch}-L{length}{'-causal' if causal else ''}"
        for inst in range(1 if args.ncu else 3):
            torch.manual_seed(inst)
            total = batch * length
            q, k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))  # fmt: skip
            off = torch.arange(0, total + 1, length, device="cuda")
            flops = 4 * batch * length * length * 8 * 128 * (0.5 if causal else 1.0)
            cfg = FP8Config()
            qkvs = {m: quantize_qkv(q, k, v, off, off, cfg, v_mma_order=m) for m in (False, True)}
            sched = _schedule(off, off, causal, total, length)
            qk_scale = math.log2(math.e) / math.sqrt(128) / hadamard_scale(cfg, 128)
            out = torch.empty_like(q)
            lse = torch.empty(8, total, device="cuda")
            spec = AttentionSpec(scale=1 / math.sqrt(128), max_seqlen_q=length,
                                 max_seqlen_kv=length, mask=MaskSpec(causal=causal))  # fmt: skip
            call = AttentionCall(q=q, k=k, v=v, q_offsets=off, kv_offsets=off, kv_index=None,
                                 num_targets=None, spec=spec)  # fmt: skip
            fns = {}
            for stages, pp, mma in variants:
                gc = g8.GluonFP8Config(num_stages=stages, pingpong=pp)

                def gluon(gc=gc, x=qkvs[mma]):
                    return g8.run(x, causal=causal, qk_scale=qk_scale, coef=1.0, softmax=True,
                                  schedule=sched, out=out, lse=lse, config=gc)  # fmt: skip

                fns[f"gluon_s{stages}_pp{int(pp)}_mma{int(mma)}"] = gluon
            if not args.ncu:
                os.environ[GLUON_FP8_ENV] = "0"
                fns["triton_fp8"] = lambda: attention_forward_fp8(call, cfg, qkv=qkvs[False])
                fns["gluon_bf16"] = lambda: jagged_attention_fwd_gluon(q, k, v, off, length,
                                                                       causal=causal)  # fmt: skip
            for impl, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                if args.ncu:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    continue
                ms = triton.testing.do_bench(fn, warmup=50, rep=200)
                rows.append(dict(case=name, inst=inst, impl=impl, ms=ms, tflops=flops / ms * 1e-9))
    if args.ncu:
        return
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by.setdefault((r["case"], r["impl"]), []).append(r["tflops"])
    for (case, impl), values in sorted(by.items()):
        values.sort()
        print(f"{case:18s} {impl:28s} median {values[len(values) // 2]:7.1f} min {values[0]:7.1f}")
    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, rows=rows)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
