"""Memory-time curves of activation checkpointing strategies, one H200, same run.

Two models, defined here in plain PyTorch so that the benchmark depends on nothing but
torch, hyperrec-autoac and hyperrec-mxfp8:

* ``hstu``: a GEM-scale HSTU-style tower: 12 layers, dim 1024, 8 heads x 128,
  pointwise SiLU attention (no softmax, so no flash kernel: the attention matrix is
  materialised, as in HSTU's PyTorch reference), jagged user histories stored padded
  to the batch's longest sequence with a causal length mask.
* ``llama``: Llama-like blocks: RMSNorm, RoPE, causal SDPA (flash), SwiGLU MLP.

Strategies, per model (each a point: measured peak, step time):

* ``no_ac``: eager, nothing checkpointed.
* ``full_ac``: eager, every layer under ``checkpoint(use_reentrant=False)``.
* ``op_sac``: eager op-level selective checkpointing in torchtitan's style: save the
  outputs of SDPA and of the linear-layer matmuls (``mm``/``addmm``), recomputing
  every second matmul; everything else recomputed.
* ``torch_budget@f``: ``torch.compile`` (Inductor) of each layer with
  ``torch._functorch.config.activation_memory_budget = f`` (a fraction of saved bytes,
  0 = full checkpointing, 1 = the default min-cut); ``compiled_no_ac`` is ``f`` = 1.
* ``autoac@b``: autoac's plan for a peak budget ``b`` (keep / recompute per op,
  checkpoint or not per layer), eager.
* ``autoac_quant@b``: the same with packed saved activations allowed (MXFP8, FP8, MX4
  where the measured gradient error is within the bound).
* ``autoac_compiled@b``: autoac's keep/recompute plan applied under ``torch.compile``
  of each layer (full run only: each distinct layer plan is its own compile).
  ``autoac_compiled_quant@b`` (``--compiled`` with ``mxint8`` in ``--formats``): the plan
  with MXINT8 packed saves, the packing traced into the compiled graphs;
  ``pack_all_compiled_mxint8``: ``pack_all_mxint8`` compiled the same way;
  ``autoac_apply_compiled_quant@b``: the public ``autoac.apply`` with those settings,
  whose verification replans while the measured peak exceeds the budget.
  ``--curve``: ``autoac_apply_compiled[_fused][_quant]@torch_budget@f``, the public
  ``autoac.apply(..., compile=True)`` from the one profile at the peak each torch point
  measured (``_fused``: recomputing the ops Inductor fuses priced as free, apply's
  default with Inductor; without it: ``fused_recompute=False``, eager op times).
* ``autoac@<peer>``: autoac at the measured peak of a peer point (``op_sac``,
  ``torch_budget@0.5``): the matched-budget comparison.
* ``pack_all``: nothing checkpointed, every saved tensor packed whose class passed the
  gradient-error bound: the activation memory quantized saves alone remove
  (``activation_reduction_vs_no_ac``: no AC's peak above its start over this one's);
  ``pack_all_<fmt>`` the same for each other format given with ``--formats``.

The profiled ends of autoac's model are checked against the measured baselines of the
same run: if the predicted no-AC or full-recompute peak is off by more than 10%, the
model's ``autoac.checks`` and the top-level ``WARNINGS`` say so (and the log shouts).

Budgets ``b`` are spread between the measured peaks of ``full_ac`` and ``no_ac``.
Every timed step uses one of several freshly built input batches; times are the
median and minimum over the timed steps; the peak is ``torch.cuda.max_memory_allocated``
of one separate step. The JSON (machine, versions, date; every point; autoac's
predicted peak next to the measured one) goes to ``--out``.

Usage::

    python bench_autoac.py --out DIR            # H200, <= 8 minutes
    python bench_autoac.py --out DIR --quick    # H200, <= 2.5 minutes
    python bench_autoac.py --out DIR --smoke    # CPU, tiny shapes, checks the code paths

On the CPU (``--smoke``) peaks come from autoac's storage tracker; Dynamo does not
compile under a dispatch mode, so the compiled points' smoke peaks are eager ones. Their
times are real.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hyperrec import autoac

H200 = {"bf16_tflops": 780.0, "fp8_tflops": 1250.0, "copy_tbps": 4.2}
#: Seconds a compiled point needs (Inductor compiles one layer graph, shared by every
#: layer; 18 s for the Llama point on the H200 run of 2026-12-01).
COMPILE_S = 30.0
#: ``--curve --variants``: autoac's ways of planning at a peer's peak.
CURVE_VARIANTS = ("eager", "fused", "quant", "fused_quant", "fused_calib", "fused_search")
#: ``fused_search``: the partitioner's fractions autoac also measures (the same list at
#: every budget: autoac is told the budget in bytes only).
SEARCH_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
#: Relative error of the profiled no-AC / full-AC peaks against the measured ones above
#: which the JSON carries a warning (the model is then not to be trusted).
CHECK_REL = 0.10


# --------------------------------------------------------------------------- models
class HSTULayer(nn.Module):
    """HSTU-style layer: ``u, v, q, k = silu(W x)``; ``a = silu(q k^T) * mask / n``;
    ``y = x + W_o (norm(a v) * u)``."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.h, self.dh = heads, head_dim
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.out_norm = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)

        # Two spans a plan may checkpoint apart (``span_free_bound.py --spans``); the layer
        # computes the same either way.
        self.proj_span = autoac.Span(self._proj)
        self.attn_span = autoac.Span(self._attn)

    def _proj(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.uvqk(self.norm(x)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attn_span(x, self.proj_span(x), mask)

    def spans(self) -> list[nn.Module]:
        return [self.proj_span, self.attn_span]

    def _attn(self, x: torch.Tensor, uvqk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        hd = self.h * self.dh
        u, v, q, k = uvqk.split(hd, dim=-1)
        q = q.view(b, n, self.h, self.dh).transpose(1, 2)
        k = k.view(b, n, self.h, self.dh).transpose(1, 2)
        v = v.view(b, n, self.h, self.dh).transpose(1, 2)
        a = F.silu(torch.matmul(q, k.transpose(-1, -2))) * mask
        o = torch.matmul(a, v).transpose(1, 2).reshape(b, n, hd)
        return x + self.out(self.out_norm(o) * u)


class HSTUTower(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HSTULayer(dim, heads, head_dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


def hstu_batch(b: int, n: int, dim: int, device: str, dtype: torch.dtype, seed: int):
    """Jagged histories: lengths drawn in [n/8, n], padded to ``n``; the mask is causal,
    zero outside each sequence and scaled by ``1/n`` (HSTU's normalisation)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(n // 8, 1), n + 1, (b,), generator=g)
    lengths[0] = n
    pos = torch.arange(n)
    valid = pos[None, :] < lengths[:, None]
    mask = (
        torch.tril(torch.ones(n, n, dtype=torch.bool))[None] & valid[:, None, :] & valid[:, :, None]
    )
    x = torch.randn(b, n, dim, generator=g) * valid[..., None]
    mask = (mask[:, None].to(torch.float32) / n).to(dtype)
    return x.to(device=device, dtype=dtype), mask.to(device), int(lengths.sum())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).type_as(x) * self.w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.h, self.dh = heads, dim // heads
        self.n1, self.n2 = RMSNorm(dim), RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        # Two spans a plan may checkpoint apart (``span_free_bound.py --spans``).
        self.attn_span = autoac.Span(self._attn)
        self.mlp_span = autoac.Span(self._mlp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.mlp_span(self.attn_span(x, cos, sin))

    def _attn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.n1(x)).view(b, t, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        return x + self.wo(a.transpose(1, 2).reshape(b, t, d))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def spans(self) -> list[nn.Module]:
        return [self.attn_span, self.mlp_span]


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, ffn) for _ in range(layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def llama_batch(b: int, t: int, dim: int, heads: int, device: str, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, dim, generator=g)
    dh = dim // heads
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
    ang = torch.outer(torch.arange(t).float(), inv)
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos().to(device, dtype), ang.sin().to(device, dtype)
    return x.to(device=device, dtype=dtype), cos, sin, b * t


SIZES = {
    # name: (builder kwargs, batch kwargs)
    "full": {
        "hstu": dict(layers=12, dim=1024, heads=8, head_dim=128, b=32, n=1024),
        "llama": dict(layers=8, dim=2048, heads=16, ffn=5632, b=4, t=4096),
    },
    "smoke": {
        "hstu": dict(layers=2, dim=64, heads=2, head_dim=32, b=2, n=32),
        "llama": dict(layers=2, dim=64, heads=2, ffn=128, b=2, t=32),
    },
}


# --------------------------------------------------------------------------- strategies
def _wrap_layers(model: nn.Module, wrapper: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Replace each layer's forward by ``wrapper(orig)``; returns the undo."""
    saved = []
    for layer in model.layers:
        orig = layer.forward
        layer.forward = wrapper(orig)
        saved.append((layer, orig))

    def undo() -> None:
        for layer, _ in saved:
            del layer.forward

    return undo


def full_ac(model: nn.Module) -> Callable[[], None]:
    def wrap(fn):
        return lambda *a: checkpoint(fn, *a, use_reentrant=False)

    return _wrap_layers(model, wrap)


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_ATTN = {
    getattr(torch.ops.aten, n).default
    for n in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, n)
}


def op_sac(model: nn.Module) -> Callable[[], None]:
    """torchtitan-style op list: keep SDPA and every other linear matmul."""

    def context_fn():
        # Separate counts for the forward and (older torch) the recomputation, which
        # asks the policy again and must get the same answers.
        count = {False: 0, True: 0}

        def policy(ctx, func, *args, **kwargs):
            if func in _ATTN:
                return CheckpointPolicy.MUST_SAVE
            if func in _MATMULS:
                rc = bool(getattr(ctx, "is_recompute", False))
                count[rc] += 1
                if count[rc] % 2 == 1:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    def wrap(fn):
        return lambda *a: checkpoint(fn, *a, use_reentrant=False, context_fn=context_fn)

    return _wrap_layers(model, wrap)


def torch_budget(model: nn.Module, frac: float, backend: str) -> Callable[[], None]:
    """Compile each layer with the functorch knob set (read when the layer compiles)."""
    import torch._functorch.config as fconfig

    torch._dynamo.reset()
    patch = fconfig.patch(activation_memory_budget=frac)
    patch.__enter__()
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, backend=backend)

    def undo() -> None:
        for layer in model.layers:
            del layer.forward
        patch.__exit__(None, None, None)
        torch._dynamo.reset()

    return undo


# --------------------------------------------------------------------------- measuring
class Case:
    """One model with a pool of freshly built batches."""

    def __init__(self, name: str, size: dict, device: str, dtype: torch.dtype, pool: int) -> None:
        self.name, self.size, self.device, self.dtype = name, size, device, dtype
        torch.manual_seed(0)
        if name == "hstu":
            self.model = HSTUTower(size["layers"], size["dim"], size["heads"], size["head_dim"])
            self.batches = [
                hstu_batch(size["b"], size["n"], size["dim"], device, dtype, s) for s in range(pool)
            ]
        else:
            self.model = Llama(size["layers"], size["dim"], size["heads"], size["ffn"])
            self.batches = [
                llama_batch(size["b"], size["t"], size["dim"], size["heads"], device, dtype, s)
                for s in range(pool)
            ]
        self.model.to(device=device, dtype=dtype).train()
        self.i = 0

    def step_fn(self, k: int | None = None) -> Callable[[nn.Module], torch.Tensor]:
        batch = self.batches[self.i % len(self.batches) if k is None else k]
        self.i += 1
        inputs = batch[:-1]

        def step(m: nn.Module) -> torch.Tensor:
            return m(*inputs).float().square().mean()

        return step

    def flops_per_step(self) -> float:
        """Model FLOPs of forward + backward (3x forward), padded tokens included."""
        s = self.size
        if self.name == "hstu":
            tok = s["b"] * s["n"]
            hd = s["heads"] * s["head_dim"]
            lin = 2 * tok * (s["dim"] * 4 * hd + hd * s["dim"])
            att = 2 * 2 * s["b"] * s["heads"] * s["n"] ** 2 * s["head_dim"]
            return 3 * s["layers"] * (lin + att)
        tok = s["b"] * s["t"]
        lin = 2 * tok * (s["dim"] * 3 * s["dim"] + s["dim"] ** 2 + 3 * s["dim"] * s["ffn"])
        att = 2 * 2 * s["b"] * s["heads"] * s["t"] ** 2 * (s["dim"] // s["heads"]) // 2
        return 3 * s["layers"] * (lin + att)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(case: Case, *, warmup: int, steps: int) -> dict[str, Any]:
    """Peak (one step) and time (``steps`` timed steps over fresh batches)."""
    m = case.model
    for p in m.parameters():
        p.grad = None
    for _ in range(warmup):
        case.step_fn()(m).backward()
        for p in m.parameters():
            p.grad = None
    _sync(case.device)
    if case.device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        case.step_fn(0)(m).backward()
        _sync(case.device)
        peak = torch.cuda.max_memory_allocated()
    else:
        meas = autoac.measure_step(m, case.step_fn(0), track=True)
        peak, base = meas.peak_bytes, 0
    for p in m.parameters():
        p.grad = None
    times = []
    for _ in range(steps):
        step = case.step_fn()
        _sync(case.device)
        t0 = time.perf_counter()
        step(m).backward()
        _sync(case.device)
        times.append(time.perf_counter() - t0)
        for p in m.parameters():
            p.grad = None
    med = statistics.median(times)
    return {
        "peak_bytes": int(peak),
        "start_bytes": int(base),
        "time_ms_median": med * 1e3,
        "time_ms_min": min(times) * 1e3,
        "tflops": case.flops_per_step() / med / 1e12,
    }


# --------------------------------------------------------------------------- runner
def run_case(case: Case, args: argparse.Namespace, deadline: float, log: Callable) -> dict:
    rows: list[dict] = []
    warm, steps = (1, 2) if args.smoke else (2, 5 if not args.quick else 3)
    backend = "aot_eager_decomp_partition" if args.smoke else "inductor"
    partial = _partial_path(args, case.name)
    if not args.smoke:
        partial.parent.mkdir(parents=True, exist_ok=True)

    def point(
        method: str,
        setup: Callable[[], Callable[[], None]] | None,
        need_s: float = 5.0,
        **extra,
    ) -> dict | None:
        # A point starts only with ``need_s`` seconds left (an eager point takes 1-3 s on
        # the H200, a compiled one ~20 s: COMPILE_S), so
        # that the whole run ends within its budget.
        if time.monotonic() + (1.0 if args.smoke else need_s) > deadline:
            rows.append({"method": method, "skipped": "time budget", **extra})
            log(f"  {method:<24} skipped (time budget)")
            return None
        undo = None
        t0 = time.monotonic()
        try:
            undo = setup() if setup is not None else None
            res = {"method": method, **extra, **measure(case, warmup=warm, steps=steps)}
        except Exception as exc:  # an OOM or a compile failure is a result, not a crash
            res = {"method": method, **extra, "error": f"{type(exc).__name__}: {exc}"[:500]}
            log(traceback.format_exc(limit=3))
        finally:
            if undo is not None:
                undo()
            gc.collect()
            if case.device.startswith("cuda"):
                torch.cuda.empty_cache()
        res["wall_s"] = round(time.monotonic() - t0, 2)
        rows.append(res)
        if not args.smoke:  # kept if the run is killed before the model's JSON is written
            partial.write_text(json.dumps(rows, indent=1, default=str) + "\n")
        if "peak_bytes" in res:
            log(
                f"  {method:<24} peak {res['peak_bytes'] / 2**30:7.2f} GiB  "
                f"{res['time_ms_median']:8.2f} ms (min {res['time_ms_min']:.2f})  "
                f"{res['tflops']:6.1f} TFLOP/s" + (f"  [{extra}]" if extra else "")
            )
        else:
            log(f"  {method:<24} {res.get('error')}")
        return res

    def budget_point(f: float) -> dict | None:
        name = "compiled_no_ac" if f == 1.0 else f"torch_budget@{f:g}"
        return point(
            name, lambda: torch_budget(case.model, f, backend), need_s=COMPILE_S, fraction=f
        )

    noac = point("no_ac", None)
    full = point("full_ac", lambda: full_ac(case.model))
    osac = None if args.pack_all or args.curve else point("op_sac", lambda: op_sac(case.model))
    if noac is None or full is None or "peak_bytes" not in noac or "peak_bytes" not in full:
        return {"points": rows, "error": "baselines failed"}
    lo, hi = full["peak_bytes"], noac["peak_bytes"]
    # The strongest peer first: a compile takes ~20-40 s, and the deadline cuts from
    # the end (autoac's eager points take ~1 s each after the profile).
    tb = None if args.pack_all or (args.curve and 0.5 not in args.peers) else budget_point(0.5)

    # autoac: one profile (fully checkpointed step), then a plan per budget.
    t0 = time.monotonic()
    few = args.quick or args.smoke or args.compiled or args.curve
    if args.formats:
        formats = tuple(f for f in args.formats.split(",") if f and f != "none")
    else:
        formats = ("mxfp8",) if few else ("mxfp8", "fp8_e4m3", "mx4")
    pcfg = autoac.ProfileConfig(
        steps=2 if args.smoke else 3,
        formats=formats,
        min_pack_bytes=4096 if args.smoke else 1 << 20,
        max_grad_error=args.max_grad_error,
    )
    try:
        prof = autoac.profile(
            case.model, case.step_fn(0), regions=list(case.model.layers), config=pcfg
        )
    except Exception as exc:  # keep the torch points even if profiling fails
        log(traceback.format_exc())
        prof = None
        info_err = f"{type(exc).__name__}: {exc}"[:500]
    profile_s = time.monotonic() - t0
    if prof is None:
        if not args.quick:
            for f in (1.0, 0.0):
                budget_point(f)
        return {"points": rows, "autoac": {"error": info_err}}
    free = autoac.plan(prof, budget=1e18)
    compiled_quant = "mxint8" in formats and autoac.compiled_packing_supported()
    info = {
        "compiled_packing": compiled_quant,
        "profile_s": round(profile_s, 2),
        "floor_predicted": free.floor,
        "no_ac_predicted": free.no_ac_peak,
        "full_recompute_s": free.full_recompute_s,
        "device_offset": prof.device_offset,
        "tracked_peak": prof.tracked_peak,
        "pack_errors": {f"{k[0]}|{k[1]}": v for k, v in prof.pack_errors.items()},
        "pack_costs": prof.pack_costs,
        "ops_per_layer": len(prof.regions[0].ops),
        "diagnostics": prof.diagnostics,
    }
    info["checks"] = checks = _model_checks(free, prof, lo, hi)
    for w in checks["warnings"]:
        log(f"  !!! WARNING: {w}")
    log(
        f"  profile {profile_s:.1f} s: floor {free.floor / 2**30:.2f} GiB (measured full AC "
        f"{lo / 2**30:.2f}), no AC {free.no_ac_peak / 2**30:.2f} GiB (measured {hi / 2**30:.2f})"
    )
    plans: dict[str, Any] = {}

    def autoac_point(kind: str, f: float, matched: dict | None = None) -> None:
        """``f``: budget as a fraction of the way from full AC's to no AC's measured
        peak; ``matched``: a peer's point whose measured peak is the budget instead."""
        name = f"{kind}@{f:g}"
        extra: dict[str, Any] = {}
        if matched is not None:
            if "peak_bytes" not in matched:
                return
            f = min(max((matched["peak_bytes"] - lo) / max(hi - lo, 1), 0.0), 1.0)
            name = f"{kind}@{matched['method']}"
            extra["matched"] = matched["method"]
        b = lo + f * (hi - lo)
        b_eff = max(b, free.floor)
        t1 = time.monotonic()
        fm = () if kind == "autoac" else None
        p = autoac.plan(prof, budget=b_eff, config=autoac.PlanConfig(formats=fm))
        plan_s = time.monotonic() - t1
        # what any plan within this budget adds, whatever its regions
        span_free = autoac.span_free_bound(prof, b_eff, formats=fm)
        plans[name] = p.to_dict()
        handle: list = []

        def setup():
            handle.append(autoac.apply_plan(case.model, p))
            return lambda: handle.pop().remove()

        point(
            name,
            setup,
            **extra,
            budget_fraction=f,
            budget_bytes=int(b),
            budget_used=int(b_eff),
            predicted_peak=p.predicted_peak,
            predicted_added_ms=p.added_s * 1e3,
            lower_bound_ms=(p.lower_bound_s * 1e3) if math.isfinite(p.lower_bound_s) else None,
            span_free_bound=span_free.to_dict(),
            solver=p.solver,
            proven_optimal=p.proven_optimal,
            plan_s=round(plan_s, 3),
            packed=p.packed,
            modes=[r.mode for r in p.regions],
        )

    def activation(r: dict) -> int:
        """Activation memory of a point: the step's peak above what was allocated before."""
        return r["peak_bytes"] - r["start_bytes"]

    def record_activation_cut(res: dict) -> None:
        res["activation_bytes"] = act = activation(res)
        res["activation_reduction_vs_no_ac"] = activation(noac) / max(act, 1)

    def compiled_setup(p: Any, seen: dict, profile: Any = None) -> Any:
        """``setup`` for :func:`point` of a plan under ``torch.compile``; ``seen`` gets the
        nodes each region packed in its graphs (read before the plan is removed) and, with
        the ``profile`` the plan came from, the plan's peak priced from what its compiled
        graphs save (``autoac.price_compiled``, one compiled step before the timed ones)."""
        handle: list = []

        def setup():
            torch._dynamo.reset()
            h = autoac.apply_plan(case.model, p, compile=True, compile_kwargs={"backend": backend})
            handle.append(h)
            if profile is not None:
                h.profile = profile
                seen["predicted_peak_priced"] = autoac.price_compiled(
                    h, case.step_fn(0)
                ).predicted_peak

            def undo():
                h = handle.pop()
                seen["packed_in_graph"] = h.packed_in_graph
                h.remove()
                torch._dynamo.reset()

            return undo

        return setup

    def autoac_compiled_point(f: float, matched: str | None = None, quant: bool = False) -> None:
        b = max(lo + f * (hi - lo), free.floor)
        if quant and not compiled_quant:
            return
        fmts = ("mxint8",) if quant else ()
        cprof = autoac.for_compiled_packing(prof)
        p = autoac.plan(cprof, budget=b, config=autoac.PlanConfig(formats=fmts))
        seen: dict = {}
        setup = compiled_setup(p, seen, cprof)
        res = point(
            f"autoac_compiled{'_quant' if quant else ''}@{matched or f'{f:g}'}",
            setup,
            need_s=COMPILE_S,
            **({"matched": matched} if matched else {}),
            budget_fraction=f,
            budget_bytes=int(b),
            predicted_peak=p.predicted_peak,
            predicted_added_ms=p.added_s * 1e3,
            packed=p.packed,
        )
        if res is not None and quant and "packed_in_graph" in seen:
            res["packed_in_graph"] = seen["packed_in_graph"]
        if res is not None and "predicted_peak_priced" in seen:
            res["predicted_peak_priced"] = seen["predicted_peak_priced"]

    def apply_compiled_setup(
        b: float, seen: dict, record: Callable[[Any], dict], **kwargs: Any
    ) -> Callable[[], Callable[[], None]]:
        """``setup`` for :func:`point` of ``autoac.apply(case.model, budget=b,
        compile=True, **kwargs)``; ``seen`` gets ``record(handle)`` before the plan is
        removed."""
        handle: list = []

        def setup():
            torch._dynamo.reset()
            handle.append(
                autoac.apply(
                    case.model,
                    budget=b,
                    step_fn=case.step_fn(0),
                    compile=True,
                    compile_kwargs={"backend": backend},
                    **kwargs,
                )
            )

            def undo():
                h = handle.pop()
                seen.update(record(h))
                h.remove()
                torch._dynamo.reset()

            return undo

        return setup

    def apply_compiled_quant_point(f: float) -> None:
        """``autoac.apply(..., formats=("mxint8",), compile=True)``, the public call: it
        profiles again, plans, compiles and verifies, replanning while the measured peak
        is over the budget by more than ``PEAK_TOLERANCE`` (the bare plan's points above
        are not verified)."""
        if not compiled_quant:
            return
        b = max(lo + f * (hi - lo), free.floor)
        seen: dict = {}
        setup = apply_compiled_setup(
            b,
            seen,
            lambda h: {
                "verification": h.verification,
                "packed_in_graph": h.packed_in_graph,
                "predicted_peak": h.plan.predicted_peak,
            },  # fmt: skip
            regions=list(case.model.layers),
            formats=("mxint8",),
            profile_config=pcfg,
        )
        res = point(f"autoac_apply_compiled_quant@{f:g}", setup, need_s=2 * COMPILE_S,
                    budget_fraction=f, budget_bytes=int(b))  # fmt: skip
        if res is not None:
            res.update(seen)

    def fitted_compiled_point(
        peer: dict | None,
        quant: bool = False,
        fused: bool = False,
        calib: bool = False,
        search: bool = False,
    ) -> None:
        """autoac at a peer point's measured peak, through the public call a user makes:
        ``autoac.apply(..., compile=True, profile_=prof)`` prices the plan from its
        compiled graphs and plans again while that is over the budget, then verifies one
        measured step (replanning on a measured overshoot); exact (keep / recompute) or
        with MXINT8 saves; ``fused``: the recomputation of ops Inductor fuses priced as
        free (``fused_recompute=True``, apply's default with Inductor since 0.1.20; the
        points without it pass ``False``: eager op times, as before); ``calib``: the
        un-checkpointed regions priced at what their graphs save before planning
        (``calibrate_none=True``, experimental); ``search``: autoac's plan measured
        against torch's partitioner at :data:`SEARCH_FRACTIONS`, the fastest within the
        budget kept (``partitioner_fractions``, experimental)."""
        if peer is None or "peak_bytes" not in peer or (quant and not compiled_quant):
            return
        b = max(peer["peak_bytes"], free.floor)
        seen: dict = {}

        def record(h: Any) -> dict:
            v = h.verification or {}
            return {
                "predicted_peak_priced": h.plan.predicted_peak,
                "predicted_added_ms": h.plan.added_s * 1e3,
                "planned_budget": v.get("planned_budget"),
                "peak_replans": v.get("peak_replans"),
                "within_budget": v.get("within_budget"),
                "grad_error": v.get("grad_error"),
                "modes": [r.mode for r in h.plan.regions],
                "packed": h.plan.packed,
                "packed_in_graph": h.packed_in_graph,
                "fractions": [r.fraction for r in h.plan.regions],
                "search": h.search,
            }

        setup = apply_compiled_setup(
            b,
            seen,
            record,
            profile_=prof,
            fused_recompute=fused,
            calibrate_none=calib,
            partitioner_fractions=SEARCH_FRACTIONS if search else (),
            formats=("mxint8",) if quant else (),
            plan_config=None if quant else autoac.PlanConfig(formats=()),
        )
        kind = (
            ("_fused" if fused else "")
            + ("_quant" if quant else "")
            + ("_calib" if calib else "")
            + ("_search" if search else "")
        )
        name = f"autoac_apply_compiled{kind}@{peer['method']}"
        need = (3 + (len(SEARCH_FRACTIONS) if search else 0)) * COMPILE_S
        res = point(name, setup, need_s=need, matched=peer["method"],
                    budget_bytes=int(b), budget_used=int(b))  # fmt: skip
        if res is not None:
            res.update(seen)

    def curve_points() -> None:
        """autoac at the peak of torch's compiled budget 0.5 (measured first), at eager
        full AC's peak (the 1.2x target's budget), then at the peaks of torch's other
        compiled budgets, each measured just before (the deadline cuts from the end)."""

        def peers() -> Iterator[dict | None]:
            for f in args.peers[: 3 if args.smoke else None]:
                yield tb if f == 0.5 else full if f == "full_ac" else budget_point(f)

        for peer in peers():
            for v in args.variants:
                fitted_compiled_point(peer, quant="quant" in v, fused="fused" in v,
                                      calib="calib" in v, search="search" in v)  # fmt: skip

    def pack_all_compiled_point() -> None:
        """``pack_all_mxint8`` with every layer compiled: the packing traced into the
        graphs (``autoac.compiled_packing_supported``) instead of one Python call a save."""
        p = pack_all_plan(prof, free, "mxint8")
        if p is None or not compiled_quant:
            return
        seen: dict = {}
        setup = compiled_setup(p, seen)
        res = point("pack_all_compiled_mxint8", setup, need_s=COMPILE_S, format="mxint8")
        if res is not None and "packed_in_graph" in seen:
            res["packed_in_graph"] = seen["packed_in_graph"]
        if res is not None and "peak_bytes" in res:
            record_activation_cut(res)
            # the like-for-like cut: against the compiled graphs without packing
            cnoac = next((r for r in rows if r.get("method") == "compiled_no_ac"), None)
            if cnoac is not None and "peak_bytes" in cnoac:
                res["activation_reduction_vs_compiled_no_ac"] = activation(cnoac) / max(
                    res["activation_bytes"], 1
                )

    def pack_all_point(fmt: str, inputs: bool = True) -> None:
        """Memory of quantized saves: nothing checkpointed, every saved tensor whose
        class passed the gradient-error bound in ``fmt`` packed (the planner's choice
        aside). Named ``pack_all`` for MXFP8 (as in earlier runs), else ``pack_all_<fmt>``;
        ``_no_inputs`` appended with ``inputs=False`` (the regions' inputs kept, as
        before 0.1.18; measured only where the profile offers an input to pack)."""
        name = ("pack_all" if fmt == "mxfp8" else f"pack_all_{fmt}") + (
            "" if inputs else "_no_inputs"
        )
        if not inputs and not any(
            o.is_input and fmt in o.formats for r in prof.regions for o in r.ops
        ):
            return
        p = pack_all_plan(prof, free, fmt, inputs)
        if p is None:
            rows.append({"method": name, "skipped": "no packable saved tensor"})
            return
        plans[name] = p.to_dict()
        handle: list = []

        def setup():
            handle.append(autoac.apply_plan(case.model, p))
            return lambda: handle.pop().remove()

        # What the profile says autograd holds for the backward, and how much of it the
        # plan packs: bounds the activation cut that packing alone can reach.
        needed = packed = inputs_packed = 0
        for rp, r in zip(prof.regions, p.regions):
            for o in rp.ops:
                held = sum(lv.nbytes for lv in o.storages if lv.needed)
                needed += held
                if r.saves.get(o.key) == fmt:
                    packed += held
                    inputs_packed += held if o.is_input else 0
        res = point(
            name,
            setup,
            format=fmt,
            packed_ops=sum(map(len, (r.saves for r in p.regions))),
            regions_saved_bytes=needed,
            regions_packed_bytes=packed,
            regions_packed_fraction=packed / max(needed, 1),
            regions_inputs_packed_bytes=inputs_packed,
        )
        if res is not None and "peak_bytes" in res:
            record_activation_cut(res)

    def pack_all_points() -> None:
        """Each format's ``pack_all`` point, with and without the regions' inputs."""
        for fmt in formats if prof.pack_errors else ():
            pack_all_point(fmt)
            pack_all_point(fmt, inputs=False)

    def _eager_and_other_points() -> None:
        # Most informative points first: the deadline cuts from the end.
        autoac_point("autoac", 0.0)
        autoac_point("autoac", 0.0, matched=tb)
        autoac_point("autoac_quant", 0.0)
        autoac_point("autoac", 0.5)
        autoac_point("autoac_quant", 0.5)
        pack_all_points()
        autoac_point("autoac", 0.0, matched=osac)
        if not args.quick:
            budget_point(1.0)
            budget_point(0.0)
            for f in (0.25, 0.75):
                autoac_point("autoac", f)
                autoac_point("autoac_quant", f)
            budget_point(0.25)
            budget_point(0.75)
            autoac_compiled_point(0.5)
            if tb is not None and "peak_bytes" in tb:
                f_tb = min(max((tb["peak_bytes"] - lo) / max(hi - lo, 1), 0.0), 1.0)
                autoac_compiled_point(f_tb, matched=tb["method"])

    if args.pack_all:
        pack_all_points()
    elif args.curve:
        curve_points()
    elif args.compiled:
        # The compiled comparison alone: autoac's plan under torch.compile against torch's
        # compiled budget at the same memory and compiled no-AC (eager autoac beside it);
        # with "mxint8" among --formats, autoac's plan with packed saves compiled too.
        autoac_point("autoac", 0.5)
        autoac_compiled_point(0.5)
        autoac_compiled_point(0.5, quant=True)
        apply_compiled_quant_point(0.5)
        if tb is not None and "peak_bytes" in tb:
            f_tb = min(max((tb["peak_bytes"] - lo) / max(hi - lo, 1), 0.0), 1.0)
            autoac_compiled_point(f_tb, matched=tb["method"])
            autoac_compiled_point(f_tb, matched=tb["method"], quant=True)
        autoac_compiled_point(0.25, quant=True)
        budget_point(1.0)
        pack_all_compiled_point()
    else:
        _eager_and_other_points()
    for r in rows:  # ratios against the eager baselines of the same run
        if "time_ms_median" in r:
            r["speedup_vs_full_ac"] = full["time_ms_median"] / r["time_ms_median"]
            r["slowdown_vs_no_ac"] = r["time_ms_median"] / noac["time_ms_median"]
            r["peak_vs_budget"] = (
                r["peak_bytes"] / r["budget_used"] if r.get("budget_used") else None
            )
    return {"points": rows, "autoac": info, "plans": plans}


def pack_all_plan(prof: Any, free: Any, fmt: str, inputs: bool = True) -> Any:
    """``free`` (nothing checkpointed) with every saved tensor packed in ``fmt`` where
    the profile allows ``fmt`` for it (with ``inputs=False`` not the regions' inputs,
    as before autoac 0.1.18); ``None`` if there is none."""
    import dataclasses

    regions = []
    for rp, r in zip(prof.regions, free.regions):
        saves = {
            o.key: fmt
            for o in rp.ops
            if o.needed and fmt in o.formats and (inputs or not o.is_input)
        }
        regions.append(dataclasses.replace(r, mode="none", saves=saves))
    if not any(r.saves for r in regions):
        return None
    return dataclasses.replace(free, regions=tuple(regions), predicted_peak=-1)


def _model_checks(free: Any, prof: Any, lo: int, hi: int) -> dict[str, Any]:
    """Compare autoac's two ends with the measured baselines of the same run.

    ``free.no_ac_peak`` (no region checkpointed) should match the measured no-AC peak
    and ``free.floor`` (full recompute) the measured full-AC peak. A large error means
    the profile missed tensors and every plan below is untrustworthy.
    """
    rel_noac = free.no_ac_peak / hi - 1.0
    rel_floor = free.floor / lo - 1.0
    warnings: list[str] = []
    if abs(rel_noac) > CHECK_REL:
        warnings.append(
            f"profiled no-AC peak {free.no_ac_peak / 2**30:.2f} GiB vs measured "
            f"{hi / 2**30:.2f} GiB ({rel_noac:+.0%}): the memory model is wrong on this run"
        )
    if abs(rel_floor) > CHECK_REL:
        warnings.append(
            f"profiled full-recompute peak {free.floor / 2**30:.2f} GiB vs measured full AC "
            f"{lo / 2**30:.2f} GiB ({rel_floor:+.0%})"
        )
    if any(not r.ops for r in prof.regions if "sac" in r.modes):
        warnings.append("a checkpointed region has no profiled op: nothing to plan")
    return {
        "no_ac_rel_error": rel_noac,
        "floor_rel_error": rel_floor,
        "ok": not warnings,
        "warnings": warnings,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON result")
    ap.add_argument("--quick", action="store_true", help="fewer points (<= 2.5 minutes on an H200)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--models", default="hstu,llama")
    ap.add_argument("--minutes", type=float, default=None, help="time budget (default 7 / 1.9)")
    ap.add_argument("--max-grad-error", type=float, default=0.03)
    ap.add_argument(
        "--formats",
        default="",
        help="comma-separated packed formats to profile (default: mxfp8 with --quick/--smoke, "
        "else mxfp8,fp8_e4m3,mx4; 'none': none); one pack_all point per format",
    )
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="baselines, torch's compiled budget, compiled no AC and autoac under torch.compile only",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="baselines, torch's compiled budget at each of --peers and autoac.apply"
        "(compile=True) at each one's measured peak (exact, and MXINT8 with mxint8 in --formats)",
    )
    ap.add_argument(
        "--peers",
        default="0.5,full_ac,0,0.75,0.25,1",
        help="--curve: the peers autoac is matched to, in order: torch budget fractions "
        "(1: compiled no AC) or full_ac",
    )
    ap.add_argument(
        "--variants",
        default="eager,fused,quant,fused_quant",
        help="--curve: autoac variants at each peer (eager: eager op times; fused: fused "
        "recompute priced free, apply's default; quant: MXINT8 saves; fused_calib: fused "
        "with calibrate_none=True; fused_search: fused, also measuring torch's partitioner "
        "at SEARCH_FRACTIONS; both experimental, not in the default list)",
    )
    ap.add_argument(
        "--pack-all",
        action="store_true",
        help="no AC, full AC and the pack_all points only (each with and without the "
        "regions' inputs packed)",
    )
    args = ap.parse_args()
    # checked before any measurement (a typo would otherwise end a GPU run after its
    # baselines and profile)
    args.peers = _curve_peers(args.peers)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(args.variants) - set(CURVE_VARIANTS))
    if bad:
        raise SystemExit(f"--variants: {bad} not among {CURVE_VARIANTS}")
    t_start = time.monotonic()
    # Start-up (imports, CUDA context) and the last point's overrun fit in the rest of
    # the 2.5 / 8 minutes.
    minutes = args.minutes or (1.9 if args.quick else 7.0)
    deadline_all = t_start + 60 * minutes
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke on the CPU")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = SIZES["smoke" if args.smoke else "full"]
    models = [m for m in args.models.split(",") if m]
    out: dict[str, Any] = {
        "benchmark": "autoac",
        "mode": next(
            (m for m in ("smoke", "quick", "compiled", "pack_all", "curve") if getattr(args, m)),
            "full",
        ),
        "pack_all_only": args.pack_all,
        "device": device,
        "dtype": str(dtype),
        "ceilings_h200": H200,
        "sizes": {m: sizes[m] for m in models},
        "models": {},
    }

    def log(msg: str) -> None:
        print(msg, flush=True)

    for i, name in enumerate(models):
        # Split the remaining time across the remaining models.
        left = deadline_all - time.monotonic()
        deadline = time.monotonic() + left / (len(models) - i) * 0.92
        log(f"[{name}] {sizes[name]}")
        case = None
        try:
            case = Case(name, sizes[name], device, dtype, pool=3)
            out["models"][name] = run_case(case, args, deadline, log)
        except Exception as exc:  # record it; the other model still runs
            log(traceback.format_exc())
            out["models"][name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        checks = out["models"][name].get("autoac", {}).get("checks")
        if checks is not None and checks["warnings"]:
            out.setdefault("WARNINGS", []).extend(f"{name}: {w}" for w in checks["warnings"])
        del case
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        out["wall_s"] = round(time.monotonic() - t_start, 1)
        dest = _write(args, out)  # after every model: a later failure keeps this one
        _partial_path(args, name).unlink(missing_ok=True)
    log(f"wrote {dest} in {out['wall_s']} s")


def _curve_peers(spec: str) -> list[float | str]:
    """``--peers``: fractions in [0, 1] or ``full_ac``."""
    out: list[float | str] = []
    for tok in (t.strip() for t in spec.split(",") if t.strip()):
        if tok == "full_ac":
            out.append(tok)
            continue
        try:
            f = float(tok)
        except ValueError:
            raise SystemExit(f"--peers: {tok!r} is neither a fraction nor full_ac") from None
        if not 0.0 <= f <= 1.0:
            raise SystemExit(f"--peers: fraction {f} outside [0, 1]")
        out.append(f)
    return out


def _write(args: argparse.Namespace, out: dict) -> Path:
    path = Path(args.out)
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    tag = (
        "smoke"
        if args.smoke
        else ("h200_quick" if args.quick else ("h200_compiled" if args.compiled else "h200"))
    )
    if args.pack_all and not args.smoke:
        # the card's model, not always an H200
        tag = _card() + "_pack_all"
    elif args.pack_all:
        tag = "smoke_pack_all"
    if args.curve:
        dev = "smoke" if args.smoke else _card()
        tag = f"{dev}_curve_{args.models.replace(',', '_')}"
    return write_out(path / f"{tag}_{stamp}.json", out)


def _partial_path(args: argparse.Namespace, model: str) -> Path:
    """Where a model's points are kept while it runs (deleted once its result is written)."""
    return Path(args.out) / f"partial_{model}.json"


def _card() -> str:
    """The GPU's model for file names (the runs are not always on an H200)."""
    name = torch.cuda.get_device_name().lower()
    return "h100" if "h100" in name else "h200" if "h200" in name else "gpu"


def write_out(dest: Path, out: dict) -> Path:
    """``out`` as JSON at ``dest``, with the machine block where hyperrec-testing is
    installed."""
    try:
        from hyperrec.testing import write_result

        return write_result(dest, out)
    except ImportError:  # hyperrec-testing absent: write without the machine block
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(out, indent=2, default=str) + "\n")
        return dest


if __name__ == "__main__":
    main()
