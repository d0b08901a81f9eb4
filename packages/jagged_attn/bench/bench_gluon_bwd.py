"""The experimental Gluon dK/dV kernel against the Triton one, through the public API.

For each case (a length law x softmax / causal softmax / HSTU's SiLU), ``--instances``
fresh instances (new lengths where the law is random, new q/k/v/dO every time), H = 8,
D = 128, bf16, 65,536 tokens per batch:

* ``bwd``: the backward of one public call (``torch.autograd.grad`` on a retained graph),
  with ``JAGGED_ATTN_GLUON_BWD=0`` (the Triton kernels) and ``=1`` (the Gluon dK/dV and
  dQ kernels; on the GPU also ``1-late``, the dK/dV kernel's ``EARLY_DV`` off, and
  ``1-tdq``, Gluon dK/dV with the Triton dQ kernel); the delta pre-pass is the same;
* ``fwd_bwd``: forward plus backward, both settings (the forward is the package default);
* ``flex/fwd_bwd`` (softmax kinds): FlexAttention compiled, document (and causal) mask
  built outside the timing;
* gradients of the two settings compared (max relative difference; the float64 checks are
  ``tests/test_gluon_backward.py``).

Timing is ``bench_gluon.time_split``: CUDA events back to back (``ms``), the GPU alone
(``device_ms``) and the host's issue time. Per case: median and minimum over instances,
per-instance ratios. Writes ``--out`` (JSON). A CPU smoke run (``--smoke``, interpreter,
tiny shapes) checks the plumbing only.

    python bench/bench_gluon_bwd.py --out results/bench_gluon_bwd_h200_<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_gluon as bg  # noqa: E402  (same directory)

DISTS = (
    {"name": "fixed-1024", "law": "fixed", "len": 1024},
    {"name": "fixed-8192", "law": "fixed", "len": 8192},
    {"name": "uniform-1..2048", "law": "uniform", "lo": 1, "hi": 2048},
    {"name": "gem-lomax-cap4096", "law": "lomax", "lo": 32, "hi": 4096, "scale": 600.0,
     "alpha": 1.5},
)  # fmt: skip
SMOKE_DISTS = ({"name": "uniform-1..24", "law": "uniform", "lo": 1, "hi": 24},)
KINDS = ("hstu", "softmax", "softmax_causal")
#: what the GPU run compares (``set_env``); ``--settings`` overrides
SETTINGS = ("0", "1")


def lengths(dist: dict, tokens: int, seed: int) -> list[int]:
    if dist["law"] == "fixed":
        return [dist["len"]] * (tokens // dist["len"])
    return bg.draw_lengths(dist, tokens, seed)


def set_env(setting: str) -> None:
    """``"0"``: the Triton backward; ``"1"``: the Gluon dK/dV and dQ kernels;
    ``"1-late"``: the same with both dK/dV products issued after dS
    (``_bwd_launch.EARLY_DV = False``); ``"1-tdq"``: Gluon dK/dV, Triton dQ; ``"1-m64"`` /
    ``"1-m32"``: 64- / 32-row query tiles in the dK/dV kernel at head dim 128 for both
    activations (the defaults: 64 for softmax, 32 for SiLU); ``"1-dq128"``: the dQ kernel
    with 128-key tiles and a two-stage ring (default: 64 keys, three stages); ``"1-fused"``:
    dQ fused into the dK/dV kernel (bulk reduce-adds; ``_bwd_launch.DQ_KERNEL = "fused"``,
    64-row query tiles there)."""
    from hyperrec.jagged_attn._gluon import _bwd_launch
    from hyperrec.jagged_attn._triton._launch import GLUON_BWD_ENV

    os.environ[GLUON_BWD_ENV] = setting[0]
    _bwd_launch.EARLY_DV = setting != "1-late"
    _bwd_launch.DQ_KERNEL = {"1-tdq": "triton", "1-fused": "fused"}.get(setting, "gluon")
    _bwd_launch.BLOCK_M_D128_SOFTMAX = 32 if setting == "1-m32" else 64
    _bwd_launch.BLOCK_M_D128_SILU = 64 if setting == "1-m64" else 32
    _bwd_launch.DQ_BLOCK_N, _bwd_launch.DQ_STAGES = (128, 2) if setting == "1-dq128" else (64, 3)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    top = b.float().abs().max().item()
    return (a.float() - b.float()).abs().max().item() / max(top, 1e-30)


def instance(dist, kind, inst, device, heads, dim, tokens, flex_cache, settings) -> dict:
    lens = lengths(dist, tokens, 7000 + inst)
    causal = kind != "softmax"
    off = bg.offsets_of(lens, device)
    seed = 30000 + 97 * inst + 7 * KINDS.index(kind)
    q, k, v = bg.fresh(sum(lens), heads, dim, device, seed)
    do = bg.fresh(sum(lens), heads, dim, device, seed + 1)[0]
    max_len = max(lens)
    flops = bg.useful_flops(lens, heads, dim, causal)
    row: dict = {"dist": dist["name"], "kind": kind, "instance": inst, "n_seq": len(lens),
                 "tokens": sum(lens), "max_len": max_len, "flops_fwd": flops, "timings": {},
                 "errors": {}}  # fmt: skip
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    grads = {}
    for setting in settings if inst % 2 == 0 else settings[::-1]:
        try:
            set_env(setting)
            out = bg.public_call(kind, *leaves, off, max_len)

            def bwd(out=out):
                return torch.autograd.grad(out, leaves, do, retain_graph=True)

            def fwd_bwd():
                return torch.autograd.grad(bg.public_call(kind, *leaves, off, max_len), leaves, do)

            grads[setting] = bwd()
            for name, fn, mult in (("bwd", bwd, 2.5), ("fwd_bwd", fwd_bwd, bg.FWD_BWD_FLOPS)):
                t = bg.time_split(fn, device)
                t["tflops"] = mult * flops / t["ms"] * 1e-9
                t["tflops_device"] = mult * flops / t["device_ms"] * 1e-9
                row["timings"].setdefault(f"gluon_bwd={setting}", {})[name] = t
            del out
        except Exception as e:  # record and go on
            row["errors"][f"gluon_bwd={setting}"] = bg._error(e)
    if "0" in grads and "1" in grads:
        row["rel_diff"] = {n: rel_diff(a, b) for n, a, b in zip("qkv", grads["1"], grads["0"])}
        row["non_finite"] = int(sum((~torch.isfinite(g)).sum().item() for g in grads["1"]))
    if "1-fused" in grads and "0" in grads:
        row["rel_diff_fused"] = {n: rel_diff(a, b)
                                 for n, a, b in zip("qkv", grads["1-fused"], grads["0"])}  # fmt: skip
        row["non_finite_fused"] = int(sum((~torch.isfinite(g)).sum().item()
                                          for g in grads["1-fused"]))  # fmt: skip
    del grads
    if kind != "hstu" and device != "cpu":
        try:
            if causal not in flex_cache:
                flex_cache[causal] = bg.make_flex(causal, device, sum(lens), compiled=True)
            compiled, build = flex_cache[causal]
            mask = build(lens)
            fl = [x.detach().transpose(0, 1).unsqueeze(0).requires_grad_() for x in (q, k, v)]
            dof = do.transpose(0, 1).unsqueeze(0)
            scale = 1.0 / math.sqrt(dim)

            def flex():
                out = compiled(*fl, block_mask=mask, scale=scale)
                return torch.autograd.grad(out, fl, dof)

            t = bg.time_split(flex, device)
            t["tflops"] = bg.FWD_BWD_FLOPS * flops / t["ms"] * 1e-9
            t["tflops_device"] = bg.FWD_BWD_FLOPS * flops / t["device_ms"] * 1e-9
            row["timings"]["flex"] = {"fwd_bwd": t}
        except Exception as e:  # record and go on
            row["errors"]["flex"] = bg._error(e)
    return row


def summarise(rows: list[dict]) -> list[dict]:
    by: dict = {}
    for r in rows:
        by.setdefault((r["dist"], r["kind"]), []).append(r)
    out = []
    for (dist, kind), rs in by.items():
        s: dict = {"dist": dist, "kind": kind, "instances": len(rs),
                   "errors": sorted({e for r in rs for e in r["errors"]})}  # fmt: skip
        for path in ("gluon_bwd=0", "gluon_bwd=1", "gluon_bwd=1-late", "gluon_bwd=1-tdq",
                     "gluon_bwd=1-fused", "flex"):  # fmt: skip
            for pass_ in ("bwd", "fwd_bwd"):
                ts = [r["timings"].get(path, {}).get(pass_) for r in rs]
                ts = [t for t in ts if t]
                if ts:
                    s[f"{path}/{pass_}"] = {key: bg._stats([t[key] for t in ts])
                                            for key in ("ms", "device_ms", "tflops_device")}  # fmt: skip

        def ratio(a, b, pass_a, pass_b, key, rs=rs):
            vals = [r["timings"][a][pass_a][key] / r["timings"][b][pass_b][key] for r in rs
                    if pass_a in r["timings"].get(a, {}) and pass_b in r["timings"].get(b, {})]  # fmt: skip
            return bg._stats(vals) if vals else None

        for key in ("ms", "device_ms"):
            s[f"gluon_over_triton/bwd/{key}"] = ratio(
                "gluon_bwd=0", "gluon_bwd=1", "bwd", "bwd", key
            )
            for alt in ("m64", "m32"):
                s[f"{alt}_over_triton/bwd/{key}"] = ratio("gluon_bwd=0", f"gluon_bwd=1-{alt}",
                                                          "bwd", "bwd", key)  # fmt: skip
            s[f"tdq_over_triton/bwd/{key}"] = ratio("gluon_bwd=0", "gluon_bwd=1-tdq", "bwd",
                                                    "bwd", key)  # fmt: skip
            s[f"late_dv_over_triton/bwd/{key}"] = ratio("gluon_bwd=0", "gluon_bwd=1-late", "bwd",
                                                        "bwd", key)  # fmt: skip
            s[f"gluon_over_triton/fwd_bwd/{key}"] = ratio("gluon_bwd=0", "gluon_bwd=1", "fwd_bwd",
                                                          "fwd_bwd", key)  # fmt: skip
            s[f"over_flex/gluon_bwd=1/fwd_bwd/{key}"] = ratio("flex", "gluon_bwd=1", "fwd_bwd",
                                                              "fwd_bwd", key)  # fmt: skip
            s[f"over_flex/gluon_bwd=0/fwd_bwd/{key}"] = ratio("flex", "gluon_bwd=0", "fwd_bwd",
                                                              "fwd_bwd", key)  # fmt: skip
            s[f"over_flex/gluon_bwd=1-fused/fwd_bwd/{key}"] = ratio(
                "flex", "gluon_bwd=1-fused", "fwd_bwd", "fwd_bwd", key
            )
            for pass_ in ("bwd", "fwd_bwd"):
                s[f"fused_over_gluon/{pass_}/{key}"] = ratio(
                    "gluon_bwd=1", "gluon_bwd=1-fused", pass_, pass_, key
                )
        diffs = [r["rel_diff"] for r in rs if "rel_diff" in r]
        if diffs:
            s["max_rel_diff"] = {n: max(d[n] for d in diffs) for n in "qkv"}
            s["non_finite"] = sum(r.get("non_finite", 0) for r in rs)
        diffs = [r["rel_diff_fused"] for r in rs if "rel_diff_fused" in r]
        if diffs:
            s["max_rel_diff_fused"] = {n: max(d[n] for d in diffs) for n in "qkv"}
            s["non_finite_fused"] = sum(r.get("non_finite_fused", 0) for r in rs)
        out.append(s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting instances after")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--settings", nargs="+", default=None, help=f"default {SETTINGS}")
    ap.add_argument("--dists", nargs="+", default=None, help="length laws by name (default all)")
    ap.add_argument("--kinds", nargs="+", default=None, help=f"of {KINDS} (default all)")
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    device = "cpu" if args.smoke else "cuda"
    heads, dim, tokens = (1, 64, 64) if args.smoke else (bg.HEADS, bg.HEAD_DIM, bg.TOKENS)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "heads": heads, "head_dim": dim, "tokens": tokens,
            "instances": args.instances, "reps": bg.REPS, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if device == "cuda":
        import triton

        meta["triton"] = triton.__version__
        meta["gemm_tflops_measured"] = bg.gemm_ceiling(device)
    settings = tuple(args.settings or (SETTINGS if device == "cuda" else ("0", "1")))
    meta["settings"] = settings
    rows, skipped, flex_cache = [], [], {}
    for inst in range(args.instances):
        for dist in SMOKE_DISTS if args.smoke else DISTS:
            if args.dists and dist["name"] not in args.dists:
                continue
            for kind in args.kinds or KINDS:
                if time.time() > t_end:
                    skipped.append(f"{dist['name']} {kind} #{inst}")
                    continue
                t0 = time.perf_counter()
                row = instance(dist, kind, inst, device, heads, dim, tokens, flex_cache,
                               settings)  # fmt: skip
                row["seconds"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                tim = row["timings"]
                cells = [f"{p}/{s} {tim[p][s]['tflops_device']:.0f}" for p in tim for s in tim[p]]
                print(f"{dist['name']} {kind} #{inst}: {', '.join(cells)} TFLOP/s (GPU time); "
                      f"diff {row.get('rel_diff')} fused {row.get('rel_diff_fused')}; errors {list(row['errors'])} "
                      f"({row['seconds']} s)", flush=True)  # fmt: skip
        if device == "cuda":
            torch.cuda.empty_cache()
    res = {"meta": meta, "rows": rows, "skipped": skipped, "summary": summarise(rows),
           "notes": {"flops": "useful FLOPs: fwd 4 * allowed pairs * H * D; bwd 2.5x, "
                              "fwd_bwd 3.5x the forward",
                     "ratios": "per-instance time of the first over the second, "
                               "median/min/max over instances"}}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    for s in res["summary"]:
        g = s.get("gluon_over_triton/bwd/device_ms") or {}
        f = s.get("over_flex/gluon_bwd=1/fwd_bwd/device_ms") or {}
        print(
            f"{s['dist']:18} {s['kind']:15} bwd Gluon/Triton x{g.get('median', 0):.2f} "
            f"(min {g.get('min', 0):.2f}); fwd+bwd over Flex x{f.get('median', 0):.2f}; "
            f"diff {s.get('max_rel_diff')}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
