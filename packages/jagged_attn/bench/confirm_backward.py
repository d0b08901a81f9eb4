"""Backward configurations on fresh instances of several cases, same run.

``tune_backward.py`` sweeps tiles on one call (the integration model's HSTU attention).
This script checks a candidate change of the shipped table on cases it was not tuned on:
softmax and SiLU, causal and not, power-law and uniform lengths, the short-length bucket,
head dims 64 and 128. Per case and per variant it times ``attention_backward`` (GPU time,
``do_bench`` median, L2 flushed) on ``--instances`` freshly built inputs and reports the
median and minimum TFLOP/s (backward counted as 2.5x the forward's useful FLOPs) and the
median of the per-instance ratios to the shipped pair.

Variants: ``shipped`` (the table), ``tma`` (the same tiles with ``bwd_tma`` on both
kernels) and ``tma_32x64`` (dK/dV tiles 32x64, 4 warps, 3 stages, with ``bwd_tma``; dQ as
``tma``).

    python bench/confirm_backward.py --out bench/results      # one H200, ~2 minutes
    python bench/confirm_backward.py --out /tmp/c --smoke     # CPU (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import math
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gluon import draw_lengths
from tune_backward import _time

GEM_LAW = {"law": "lomax", "lo": 32, "scale": 512.0, "alpha": 1.5, "hi": 8192}
# name -> (length law, tokens, heads, head dim, activation, causal)
CASES: dict[str, tuple[dict[str, Any], int, int, int, str, bool]] = {
    "hstu-gem-D128": (GEM_LAW, 98_304, 8, 128, "silu", True),
    "softmax-gem-D128": (GEM_LAW, 98_304, 8, 128, "softmax", False),
    "softmax-causal-gem-D128": (GEM_LAW, 98_304, 8, 128, "softmax", True),
    "softmax-causal-u1024-D128": ({"law": "uniform", "lo": 1, "hi": 1024}, 65_536, 8, 128,
                                  "softmax", True),
    "hstu-u2048-D64": ({"law": "uniform", "lo": 256, "hi": 2048}, 65_536, 8, 64, "silu", True),
    "softmax-short-u256-D128": ({"law": "uniform", "lo": 1, "hi": 256}, 65_536, 8, 128,
                                "softmax", True),
}  # fmt: skip
SMOKE_CASE = ({"law": "uniform", "lo": 0, "hi": 40}, 96, 1, 16, "silu", True)


def instance(case, seed: int, device: str):
    from hyperrec.jagged_attn import AttentionSpec, MaskSpec
    from hyperrec.jagged_attn._opschema import AttentionCall

    law, tokens, heads, d, activation, causal = case
    lens = draw_lengths(law, tokens, seed)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (
        torch.randn(tokens, heads, d, device=device, dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    top = max(lens)
    extra = {} if activation == "softmax" else {"normalization": "max_seqlen"}
    spec = AttentionSpec(activation=activation, scale=1 / math.sqrt(d), max_seqlen_q=top,
                         max_seqlen_kv=top, mask=MaskSpec(causal=causal), **extra)  # fmt: skip
    offsets = offsets.to(device)
    call = AttentionCall(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
    return call, do, 4.0 * pairs * heads * d


def variants(call) -> dict[str, tuple[Any, Any]]:
    from hyperrec.jagged_attn._triton import KernelConfig
    from hyperrec.jagged_attn._triton._launch import _pick

    dkdv, dq = _pick("dkdv", call, None), _pick("dq", call, None)
    dkdv, dq = replace(dkdv, bwd_tma=False), replace(dq, bwd_tma=False)
    small = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, bwd_tma=True)
    return {
        "shipped_no_tma": (dkdv, dq),
        "tma": (replace(dkdv, bwd_tma=True), replace(dq, bwd_tma=True)),
        "tma_32x64": (small, replace(dq, bwd_tma=True)),
    }


def main(argv: list[str] | None = None) -> int:
    from hyperrec.jagged_attn._triton import attention_backward, attention_forward

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one tiny case")
    ap.add_argument("--instances", type=int, default=5)
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    cases = {"smoke": SMOKE_CASE} if args.smoke else CASES
    n_inst = 2 if args.smoke else args.instances
    t_start = time.time()
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for name, case in cases.items():
        per: dict[str, list[float]] = {}
        configs: dict[str, Any] = {}
        for seed in range(n_inst):
            call, do, flops = instance(case, seed, device)
            out, lse = attention_forward(call)
            for vname, (dkdv, dq) in variants(call).items():
                configs[vname] = {"dkdv": asdict(dkdv), "dq": asdict(dq)}
                fn = functools.partial(attention_backward, do, out, lse, call,
                                       config_dkdv=dkdv, config_dq=dq)  # fmt: skip
                ms = _time(fn, args.smoke)
                tf = 2.5 * flops / ms * 1e-9
                per.setdefault(vname, []).append(tf)
                rows.append({"case": name, "instance": seed, "variant": vname, "ms": ms,
                             "tflops": tf})  # fmt: skip
            del call, do, out, lse
        base = per["shipped_no_tma"]
        for vname, tf in per.items():
            ratio = statistics.median(t / b for t, b in zip(tf, base))
            summary.append({"case": name, "variant": vname, "tflops_median": statistics.median(tf),
                            "tflops_min": min(tf), "x_shipped_median": ratio,
                            "config": configs[vname]})  # fmt: skip
            print(f"{name:28s} {vname:16s} {statistics.median(tf):6.0f} TFLOP/s "
                  f"(min {min(tf):5.0f})  x{ratio:.3f}", flush=True)  # fmt: skip

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testing" / "src"))
    from hyperrec.testing.bench import write_result

    tag = "cpu" if args.smoke else torch.cuda.get_device_name().split()[-1].lower()
    path = Path(args.out) / f"confirm_backward_{tag}_{dt.date.today().isoformat()}.json"
    write_result(path, {
        "benchmark": "jagged_attn backward: shipped tiles vs descriptor reads, fresh instances",
        "cases": {k: {"law": c[0], "tokens": c[1], "heads": c[2], "head_dim": c[3],
                      "activation": c[4], "causal": c[5]} for k, c in cases.items()},
        "method": f"GPU time, do_bench median (L2 flushed), {n_inst} fresh instances per case; "
                  "backward FLOPs = 2.5 x the forward's useful ones; ratio = median of the "
                  "per-instance ratios to shipped_no_tma",
        "rows": rows, "summary": summary, "wall_s": time.time() - t_start,
    })  # fmt: skip
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
