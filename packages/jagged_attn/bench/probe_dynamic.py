"""The Gluon kernels' work order on one GPU: static snake vs dynamic claiming, per-tile vs
per-sequence-run schedules, in one run.

Forward kernel alone (``_gluon._launch._run`` with a schedule built here) and forward +
backward through the public API (``jagged_attention`` / HSTU ``gdpa``, ``validate=False``),
bf16, H = 8, D = 128, 65,536 tokens per batch. Variants:

* ``static-tile``: CTAs take items in snake order from the per-tile cost order (0.2.17);
* ``static-runs``: the same over the schedule whose causal tiles form one run per sequence
  (``JAGGED_ATTN_CAUSAL_RUNS=1``);
* ``dynamic-tile`` / ``dynamic-runs``: every CTA claims its next item from a counter.

Cases: equal lengths 1,024 / 2,048 / 8,192, causal and not; uniform 1-2,048 and the GEM
preset's power law capped at 4,096, causal softmax and HSTU. Three fresh instances per case
(new lengths, offsets and tensors); per instance and variant the median of 10 CUDA-event
timings after 3 warm-up calls, the variants' order rotated between instances. Outputs (and
gradients) of every variant are compared with the first's: the work order changes which
CTA computes a tile, never what it computes, so they must be bit-identical. Dense SDPA on
the equal-length cases, for reference.

    python bench/probe_dynamic.py --out bench/results/probe_dynamic.json [--budget 420]

``results/probe_dynamic_rotated_h200_2026-12-04.json`` came from a revision of this script
with two more variants, ``dynamic-tile-rot`` and ``dynamic-runs-rot``: the forward visiting
key tiles from the diagonal down / rotated by the query-tile index (an option removed
after that run: no case gained) and without ``static-runs``.
"""

# The closures below run within the loop iteration that defines them.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gluon import draw_lengths, offsets_of, useful_flops

import hyperrec.jagged_attn as ja
from hyperrec.jagged_attn._gluon import _bwd_launch
from hyperrec.jagged_attn._gluon import _launch as gluon_launch
from hyperrec.jagged_attn._gluon._launch import BLOCK_M, GluonConfig, _run
from hyperrec.jagged_attn._triton._schedule import work_upper_bound
from hyperrec.jagged_attn._triton._tiles import CAUSAL_RUNS_ENV, tile_schedule

TOKENS, H, D = 65536, 8, 128
VARIANTS = ("static-tile", "static-runs", "dynamic-tile", "dynamic-runs")
GEM = {"name": "gem-lomax-cap4096", "law": "lomax", "lo": 32, "hi": 4096, "scale": 600.0,
       "alpha": 1.5}  # fmt: skip
UNIFORM = {"name": "uniform-1..2048", "law": "uniform", "lo": 1, "hi": 2048}
CASES = [
    *({"name": f"L{L}{'-causal' if c else ''}", "L": L, "kind": "softmax_causal" if c else
       "softmax"} for L in (1024, 2048, 8192) for c in (True, False)),
    {"name": "uniform-causal", "dist": UNIFORM, "kind": "softmax_causal"},
    {"name": "gem-causal", "dist": GEM, "kind": "softmax_causal"},
    {"name": "gem-hstu", "dist": GEM, "kind": "hstu"},
]  # fmt: skip


@contextlib.contextmanager
def variant_env(variant: str):
    """Schedule order (env, read at each schedule build) and dynamic flag of the forward's
    default config and the backward launchers."""
    dynamic, order = variant.split("-")
    old_env = os.environ.get(CAUSAL_RUNS_ENV)
    old_cfg, old_bwd = gluon_launch.default_config, _bwd_launch.DYNAMIC
    base = old_cfg(D)
    cfg = GluonConfig(block_n=base.block_n, num_stages=base.num_stages, pingpong=base.pingpong,
                      dynamic=dynamic == "dynamic")  # fmt: skip
    os.environ[CAUSAL_RUNS_ENV] = "1" if order == "runs" else "0"
    gluon_launch.default_config = lambda head_dim: cfg
    _bwd_launch.DYNAMIC = dynamic == "dynamic"
    try:
        yield cfg
    finally:
        gluon_launch.default_config, _bwd_launch.DYNAMIC = old_cfg, old_bwd
        if old_env is None:
            os.environ.pop(CAUSAL_RUNS_ENV, None)
        else:
            os.environ[CAUSAL_RUNS_ENV] = old_env


def gpu_ms(fn) -> float:
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
    torch.cuda._sleep(2_000_000)  # a head start: the events see the kernels, not the host
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def public(kind, q, k, v, offsets, max_len):
    scale = 1.0 / math.sqrt(D)
    if kind == "hstu":
        return ja.gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="silu",
                       scale=scale, causal=True, output_scale=1.0 / max_len,
                       validate=False)  # fmt: skip
    return ja.jagged_attention(q, k, v, offsets, max_len, causal=kind == "softmax_causal",
                               scale=scale, validate=False)  # fmt: skip


def instance(case: dict, seed: int, order: list[str]) -> dict:
    if "L" in case:
        lens = [case["L"]] * (TOKENS // case["L"])
    else:
        lens = draw_lengths(case["dist"], TOKENS, seed)
    causal = case["kind"] != "softmax"
    softmax = case["kind"] != "hstu"
    max_len = max(lens)
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    q, k, v, do = (torch.randn(TOKENS, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    offsets = offsets_of(lens, "cuda")
    flops = useful_flops(lens, H, D, causal)
    row: dict = {"seed": seed, "sequences": len(lens), "max_len": max_len, "order": order,
                 "fwd_ms": {}, "fwd_tflops": {}, "fwd_bwd_ms": {}, "fwd_bwd_tflops": {}}  # fmt: skip
    outs, grads = {}, {}
    upper = work_upper_bound(TOKENS, len(lens), BLOCK_M)
    for variant in order:
        with variant_env(variant) as cfg:
            sched = tile_schedule(offsets, offsets, None, BLOCK_M, causal, upper, max_len,
                                  kv_tiles=False)  # fmt: skip
            out = torch.empty_like(q)
            lse = torch.empty((H, TOKENS) if softmax else (0,), device="cuda",
                              dtype=torch.float32)  # fmt: skip

            def fwd():
                _run(q, k, v, offsets, offsets, max_len, causal, 1.0 / math.sqrt(D), softmax,
                     1.0 if softmax else 1.0 / max_len, not softmax, cfg, sched, out, lse)  # fmt: skip

            ms = gpu_ms(fwd)
            row["fwd_ms"][variant] = ms
            row["fwd_tflops"][variant] = flops / ms * 1e-9
            outs[variant] = out.clone()
            # public fwd+bwd: a new offsets object, so that the schedules are rebuilt here
            offs = offsets.clone()
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

            def fwd_bwd():
                for t in (qq, kk, vv):
                    t.grad = None
                public(case["kind"], qq, kk, vv, offs, max_len).backward(do)

            ms = gpu_ms(fwd_bwd)
            row["fwd_bwd_ms"][variant] = ms
            row["fwd_bwd_tflops"][variant] = 3.5 * flops / ms * 1e-9
            grads[variant] = [t.grad.clone() for t in (qq, kk, vv)]
    ref = "static-tile"
    row["bit_identical"] = {
        v: bool(torch.equal(outs[v], outs[ref]))
        and all(torch.equal(a, b) for a, b in zip(grads[v], grads[ref], strict=True))
        for v in order
    }
    row["out_max_rel_diff"] = {
        v: float((outs[v].float() - outs[ref].float()).abs().max() / outs[ref].float().abs().max())
        for v in order
    }
    if "L" in case:
        b = TOKENS // case["L"]
        qd, kd, vd = (t.view(b, case["L"], H, D).transpose(1, 2) for t in (q, k, v))
        sd = torch.nn.functional.scaled_dot_product_attention
        ms = gpu_ms(lambda: sd(qd, kd, vd, is_causal=causal))
        row["sdpa_fwd_tflops"] = flops / ms * 1e-9
        qg, kg, vg = (t.detach().requires_grad_() for t in (qd, kd, vd))
        dod = do.view(b, case["L"], H, D).transpose(1, 2)

        def sdpa_fb():
            for t in (qg, kg, vg):
                t.grad = None
            sd(qg, kg, vg, is_causal=causal).backward(dod)

        ms = gpu_ms(sdpa_fb)
        row["sdpa_fwd_bwd_tflops"] = 3.5 * flops / ms * 1e-9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_dynamic.json")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; no case starts after")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    args = ap.parse_args()
    t0 = time.time()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "tokens": TOKENS, "heads": H, "head_dim": D, "cases": {}, "skipped": []}  # fmt: skip
    for case in CASES:
        if args.cases and case["name"] not in args.cases:
            continue
        rows = []
        for inst in range(args.instances):
            if time.time() - t0 > args.budget:
                results["skipped"].append(f"{case['name']}#{inst}")
                continue
            n = len(VARIANTS)
            order = list(VARIANTS[inst % n :] + VARIANTS[: inst % n])
            rows.append(instance(case, inst, order))
            print(case["name"], inst, {k: round(v) for k, v in rows[-1]["fwd_tflops"].items()},
                  {k: round(v) for k, v in rows[-1]["fwd_bwd_tflops"].items()},
                  rows[-1]["bit_identical"], flush=True)  # fmt: skip
        if rows:
            summary = {}
            for key in ("fwd_tflops", "fwd_bwd_tflops"):
                summary[key] = {v: statistics.median(r[key][v] for r in rows) for v in VARIANTS}
                base = VARIANTS[0]
                summary[key + "_ratio_median"] = {
                    v: statistics.median(r[key][v] / r[key][base] for r in rows) for v in VARIANTS
                }
            for key in ("sdpa_fwd_tflops", "sdpa_fwd_bwd_tflops"):
                if key in rows[0]:
                    summary[key] = statistics.median(r[key] for r in rows)
            results["cases"][case["name"]] = {"instances": rows, "summary": summary}
        Path(args.out).write_text(json.dumps(results, indent=1))
    print("done in", round(time.time() - t0), "s")


if __name__ == "__main__":
    main()
