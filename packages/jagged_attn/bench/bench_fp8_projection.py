"""The HSTU layer's projection with Q/K/V quantization fused into its epilogue
(``linear_quantize_qkv``) against the unfused path, and the FP8 forward each feeds.

Per case (jagged batches, model width 1,024, H = 8, D = 128, ``silu(W x + b)`` split into
``u, v, q, k``, bf16), fresh instances (new tensors and lengths per seed), each timed with
``triton.testing.do_bench`` (order reversed on odd instances), medians and minima over
instances:

* ``proj_bf16``: ``F.silu(F.linear(x, W, b))`` (cuBLAS + one pointwise kernel): the
  projection the bf16 model runs, the floor for the rest.
* ``proj_then_quant``: ``proj_bf16`` then ``quantize_qkv`` of the chunks (what
  ``precision="fp8"`` does today: one more read of Q/K/V).
* ``proj_fused``: ``linear_quantize_qkv(..., chunks="uvqk", activation="silu")``;
  ``proj_fused_16_warps`` the same launched with 16 warps instead of 8.
* ``layer_fp8_unfused`` / ``layer_fp8_fused``: the projection then ``gdpa(...,
  precision="fp8")`` (HSTU's SiLU with ``1 / max_seqlen``, causal), quantizing in the
  attention or reading ``quantized=``; ``layer_bf16``: the same in bf16.

Also the GEMM ceiling measured in the run (``torch.mm``, bf16, 8,192^3). ``--smoke`` runs
one tiny case on whatever device there is (the CPU under ``TRITON_INTERPRET=1``) to check
that the script works; its timings mean nothing.

    python bench/bench_fp8_projection.py --out bench/results/fp8_projection.json
    python bench/bench_fp8_projection.py --out FILE --sweep   # + launch settings (warps,
                                                              # stages, BK) on the first case
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hyperrec.jagged_attn import FP8Config, gdpa, linear_quantize_qkv, quantize_qkv
from hyperrec.jagged_attn.reference_fp8 import projection_chunks

CASES = [("fixed", 32, 2048), ("fixed", 8, 8192), ("uniform", 64, 1024), ("uniform", 16, 4096)]
SMOKE = [("uniform", 3, 40)]


def _time(fn: Callable[[], object], rep_ms: int, device: torch.device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms)


def _case(dist, batch, max_len, seed, dim, heads, device):
    g = torch.Generator().manual_seed(seed)
    if dist == "fixed":
        lens = torch.full((batch,), max_len, dtype=torch.int64)
    else:
        lens = torch.randint(max_len // 8, max_len + 1, (batch,), generator=g)
    off = torch.zeros(batch + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    total = int(off[-1])
    x = torch.randn(total, dim, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(4 * dim, dim, generator=g) / dim**0.5).to(device, torch.bfloat16)
    b = (torch.randn(4 * dim, generator=g) * 0.1).to(device, torch.bfloat16)
    return x, w, b, off.to(device), lens


def _impls(x, w, b, off, max_len, heads, config):
    def proj():
        return F.silu(F.linear(x, w, b))

    def proj_then_quant():
        p = projection_chunks(proj(), heads, "uvqk")
        return quantize_qkv(p["q"], p["k"], p["v"], off, precision=config)

    def fused():
        return linear_quantize_qkv(x, w, b, off, heads=heads, chunks="uvqk", activation="silu",
                                   precision=config)  # fmt: skip

    def fused_16_warps():
        # ptxas (compile_sm90.py): 8 warps spill (255 registers + 0.9 KB stack), 16 do not
        # much (128 + 0.25 KB); which is faster is for the GPU to say
        from hyperrec.jagged_attn._triton import _fp8_proj

        before, _fp8_proj.PROJ_NUM_WARPS = _fp8_proj.PROJ_NUM_WARPS, 16
        try:
            return fused()
        finally:
            _fp8_proj.PROJ_NUM_WARPS = before

    def attn(p, **kw):
        return gdpa(p["q"], p["k"], p["v"], off, off, max_len, max_len, activation="silu",
                    normalization="max_seqlen", causal=True, validate=False, **kw)  # fmt: skip

    def layer_bf16():
        return attn(projection_chunks(proj(), heads, "uvqk"))

    def layer_unfused():
        return attn(projection_chunks(proj(), heads, "uvqk"), precision=config)

    def layer_fused():
        y, qkv = fused()
        return attn(projection_chunks(y, heads, "uvqk"), precision=config, quantized=qkv)

    return {
        "proj_bf16": proj,
        "proj_then_quant": proj_then_quant,
        "proj_fused": fused,
        "proj_fused_16_warps": fused_16_warps,
        "layer_bf16": layer_bf16,
        "layer_fp8_unfused": layer_unfused,
        "layer_fp8_fused": layer_fused,
    }


#: ``--sweep``: launch settings of the fused kernel tried on the first case.
SWEEP = [(w, s, k) for w in (4, 8) for s in (2, 3, 4) for k in (32, 64, 128)]


def sweep(x, w, b, off, heads, config, rep_ms, device) -> list[dict]:
    """Time ``linear_quantize_qkv`` under each (warps, stages, BK) of :data:`SWEEP` (the
    module constants patched for the call); a setting that does not build (shared memory)
    is recorded with its error."""
    from hyperrec.jagged_attn._triton import _fp8_proj

    saved = (_fp8_proj.PROJ_NUM_WARPS, _fp8_proj.PROJ_NUM_STAGES, _fp8_proj.PROJ_BLOCK_K)
    out = []
    try:
        for warps, stages, bk in SWEEP:
            _fp8_proj.PROJ_NUM_WARPS = warps
            _fp8_proj.PROJ_NUM_STAGES = stages
            _fp8_proj.PROJ_BLOCK_K = bk

            def fn():
                return linear_quantize_qkv(x, w, b, off, heads=heads, chunks="uvqk",
                                           activation="silu", precision=config)  # fmt: skip

            try:
                fn()
                ms, err = _time(fn, rep_ms, device), None
            except Exception as e:  # a setting that does not build is data, not a failure
                ms, err = None, f"{type(e).__name__}: {str(e)[:200]}"
            out.append(dict(num_warps=warps, num_stages=stages, block_k=bk, ms=ms, error=err))
            print(f"sweep warps {warps} stages {stages} BK {bk}: "
                  + (f"{ms:.3f} ms" if ms is not None else str(err)), flush=True)  # fmt: skip
    finally:
        _fp8_proj.PROJ_NUM_WARPS, _fp8_proj.PROJ_NUM_STAGES, _fp8_proj.PROJ_BLOCK_K = saved
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--instances", type=int, default=5)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--smoke", action="store_true", help="one tiny case (any device)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the fused kernel's launch settings on the first case")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dim, heads = (64, 2) if args.smoke else (1024, 8)
    cases = SMOKE if args.smoke else CASES
    instances = 1 if args.smoke else args.instances
    config = FP8Config(smooth_k=False)
    ceiling = None
    if device.type == "cuda" and not args.smoke:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        ms = _time(lambda: a @ a, args.rep_ms, device)
        ceiling = 2 * 8192**3 / ms * 1e-9
        del a
    rows = []
    swept = None
    if args.sweep:
        x, w, b, off, _ = _case(*cases[0], 0, dim, heads, device)
        swept = sweep(x, w, b, off, heads, config, args.rep_ms, device)
        del x, w, b
    for dist, batch, max_len in cases:
        name = f"{dist}-B{batch}-L{max_len}"
        for inst in range(instances):
            x, w, b, off, lens = _case(dist, batch, max_len, inst, dim, heads, device)
            fns = _impls(x, w, b, off, max_len, heads, config)
            for fn in fns.values():
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            gemm_flops = 2.0 * x.shape[0] * dim * 4 * dim
            order = list(fns.items())
            for impl, fn in order if inst % 2 == 0 else order[::-1]:
                ms = _time(fn, args.rep_ms, device)
                rows.append(dict(case=name, inst=inst, impl=impl, ms=ms, tokens=x.shape[0],
                                 proj_tflops=gemm_flops / ms * 1e-9))  # fmt: skip
            del fns, x, w, b
            if device.type == "cuda":
                torch.cuda.empty_cache()
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by.setdefault((r["case"], r["impl"]), []).append(r["ms"])
    summary = []
    for (case, impl), values in sorted(by.items()):
        base = by[(case, "proj_then_quant" if impl.startswith("proj") else "layer_fp8_unfused")]
        summary.append(dict(case=case, impl=impl, ms_median=statistics.median(values),
                            ms_min=min(values),
                            speedup_vs_unfused=statistics.median(base) / statistics.median(values)))  # fmt: skip
        print(f"{case:22s} {impl:18s} median {statistics.median(values):8.3f} ms "
              f"min {min(values):8.3f}  x{summary[-1]['speedup_vs_unfused']:.2f} vs unfused")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        torch=torch.__version__, date=time.strftime("%Y-%m-%d"), smoke=args.smoke,
        dim=dim, heads=heads, instances=instances, rep_ms=args.rep_ms,
        bf16_mm_ceiling_tflops=ceiling,
    )  # fmt: skip
    doc = dict(
        **meta, summary=summary, rows=rows, sweep=swept, sweep_case=cases[0] if swept else None
    )
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
