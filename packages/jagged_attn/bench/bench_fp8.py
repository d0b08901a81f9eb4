"""FP8 / MXFP8 jagged attention on one GPU: speed against our bf16 kernels and FlexAttention,
and accuracy against a float64 reference and a naive per-tensor FP8 baseline, in one run.

Speed. Every case is timed on ``--instances`` (default 5) freshly built instances (new
lengths from the case's distribution, new offsets and tensors; seed = instance number),
each implementation (in reverse order on odd instances) warmed on the instance first, then
``triton.testing.do_bench`` (median of CUDA-event timings, L2 cleared between calls). Per case: median and minimum
over instances of the useful TFLOP/s (``4 * sum(Lq * Lk) * H * D`` forward, allowed pairs
only when causal; fwd+bwd counted 3.5x), and the ratios per instance. Implementations:

* ``fp8``: ``jagged_attention(..., precision="fp8")`` (quantization of Q/K/V included;
  Hadamard on, the default for D = 128); fwd+bwd = FP8 forward + the bf16 backward, which
  recomputes its softmax statistics (since 0.2.20, where the Gluon backward serves the
  call, by a bf16 forward; ``fp8_stats_pass``: the same call with the Triton dQ kernel's
  statistics pass and Triton backward kernels, what ran from 0.2.4 to 0.2.19);
* ``fp8_bwd``: fwd+bwd with ``FP8Config(backward="fp8")`` (the FP8 backward), and
  ``fp8_bwd_transposed``: the same reading the token-reducing products' B operands from
  K-major transposed copies instead of the rows copies (``FP8_BWD_TRANSPOSED_B``);
* ``fp8_kernel``: the FP8 forward kernel alone on operands quantized beforehand (what a
  producer that emits FP8 would pay); the default dispatch picks the Gluon FP8 forward
  where it serves the call (``JAGGED_ATTN_GLUON_FP8``), and ``fp8_triton`` /
  ``fp8_kernel_triton`` are the same two with the Triton FP8 forward; and ``fp8_quantize``: the quantization alone (ms;
  also without the Hadamard rotation, ``fp8_quantize_no_hadamard``);
* ``mxfp8``: ``precision="mxfp8"`` (Hopper: MX scales folded into bf16 operands; no speedup
  is expected, the row shows its cost);
* ``bf16``: ``jagged_attention`` (our bf16 Triton kernels), the same call;
* ``flex``: FlexAttention (bf16) compiled with dynamic shapes under a document mask built
  per instance outside the timing (+ causal).
The FP8 (``torch._scaled_mm``) and bf16 GEMM ceilings are measured in the same run.

Accuracy (first instance of each case, whole sequences up to ``--acc-tokens`` tokens):
outputs of ``fp8`` (default config), ``fp8`` without Hadamard, ``fp8`` without key
smoothing (``smooth_k=False``), ``mxfp8``, the naive
per-tensor FP8 baseline (one scale per tensor for Q, K, V; P cast to E4M3 unscaled; see
``hyperrec.jagged_attn.reference_fp8.naive_attention_forward``) and our ``bf16`` kernel,
each against the float64 reference: relative L1, RMSE, cosine similarity, SNR. Two input
distributions: ``gaussian`` (N(0, 1)), ``outliers`` (Q and K with two head-dim
channels 20x larger, then both / 3, as in trained models) and ``key_bias`` (every key plus
one common vector per head, 3x the keys' own spread: a projection bias). Gradients of ``fp8`` (bf16
backward from the FP8 forward's output and log-sum-exp) and of ``bf16`` against the
float64 reference backward, on one case.

    python bench/bench_fp8.py --out bench/results            # 8 cases, <= 5 min on one H200
    python bench/bench_fp8.py --quick --out /tmp/b            # 2 cases, no Flex, <= 2 min
    python bench/bench_fp8.py --rep-ms 1000 --out /tmp/b      # timings under the power cap
    python bench/bench_fp8.py --smoke --out /tmp/b            # CPU interpreter, tiny
    python bench/bench_fp8.py --cpu-accuracy --out bench/results   # accuracy table on the
        CPU with the pure-PyTorch specification in place of the kernels (a few minutes)
    python bench/bench_fp8.py --sweep --out /tmp/b            # FP8 tile configurations, ~3 min

No new speed case starts after ``--budget-min`` minus a reserve for the accuracy cases (3.5
minutes, reserve 0.8; ``--quick``: 1.8 and 0.4) and no accuracy case after ``--budget-min``;
cases left out are listed under ``skipped_for_time``. ``--quick`` leaves FlexAttention out
(its compilation alone takes about a minute). The JSON is rewritten after every case.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))
# this package and hyperrec-mxfp8 from the checkout when they are not installed
for _pkg in ("jagged_attn", "mxfp8"):
    _src = HERE.parents[1] / _pkg / "src"
    if str(_src) not in sys.path:
        sys.path.append(str(_src))


@dataclass(frozen=True)
class Case:
    name: str
    dist: str  # "uniform" | "powerlaw" | "fixed"
    batch: int
    max_len: int
    heads: int = 8
    head_dim: int = 128
    causal: bool = False


CASES = [
    Case("fixed-B64-L1024", "fixed", 64, 1024),
    Case("fixed-B32-L2048", "fixed", 32, 2048),
    Case("fixed-B16-L4096", "fixed", 16, 4096),
    Case("fixed-B8-L8192", "fixed", 8, 8192),
    Case("p-B256-L2048", "powerlaw", 256, 2048),
    Case("u-B16-L8192", "uniform", 16, 8192),
    Case("fixed-B16-L4096-causal", "fixed", 16, 4096, causal=True),
    Case("p-B256-L2048-causal", "powerlaw", 256, 2048, causal=True),
]
QUICK = [Case("fixed-B32-L2048", "fixed", 32, 2048), Case("fixed-B8-L8192", "fixed", 8, 8192)]
SMOKE = [
    Case("smoke-fixed-B2-L64-H1-D32", "fixed", 2, 64, heads=1, head_dim=32),
    Case("smoke-p-B3-L64-H1-D32-causal", "powerlaw", 3, 64, heads=1, head_dim=32, causal=True),
]
CPU_ACCURACY = [
    Case("cpu-fixed-B2-L1024-H2", "fixed", 2, 1024, heads=2),
    Case("cpu-p-B16-L2048-H2", "powerlaw", 16, 2048, heads=2),
    Case("cpu-fixed-B1-L4096-H1-causal", "fixed", 1, 4096, heads=1, causal=True),
]
# Kernel configurations timed by --sweep: (block_m, num_warps, num_stages, p_block, tma).
# The pointer-load row is the configuration shipped before K/V tiles went through
# descriptors (the earlier sweep timed the other pointer-load tiles).
SWEEP = [(128, 8, 3, 128, True), (128, 8, 2, 128, True), (128, 8, 4, 128, True),
         (128, 4, 3, 128, True), (64, 4, 3, 128, True), (64, 4, 2, 128, True),
         (64, 4, 4, 128, True), (64, 4, 3, 64, True), (128, 8, 3, 64, True),
         (128, 8, 3, 128, False)]  # fmt: skip


def _ba():
    import bench_attention  # same directory: lengths, FlexAttention plumbing, timing

    return bench_attention


def make_inputs(case: Case, seed: int, device: str):
    ba = _ba()
    lens = ba.lengths(case.dist, case.batch, case.max_len, seed)
    offsets = torch.zeros(case.batch + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    offsets = offsets.to(device)
    total = int(lens.sum())
    g = torch.Generator(device=device).manual_seed(10_000 + seed)
    q, k, v, do = (torch.randn(total, case.heads, case.head_dim, device=device,
                               dtype=torch.bfloat16, generator=g) for _ in range(4))  # fmt: skip
    return lens, offsets, q, k, v, do


def _call(case, q, k, v, offsets, precision, backend):
    from hyperrec.jagged_attn import jagged_attention

    return jagged_attention(q, k, v, offsets, case.max_len, causal=case.causal, backend=backend,
                            precision=precision)  # fmt: skip


def impl_public(case, q, k, v, do, offsets, precision, backend):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        return _call(case, q, k, v, offsets, precision, backend)

    def fwd_bwd():
        return torch.autograd.grad(_call(case, *leaves, offsets, precision, backend), leaves, do)

    return fwd, fwd_bwd


def _with_attr(fn, module, name: str, value):
    """``fn`` run with ``module.name`` set to ``value`` (a switch read per call)."""

    def run():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, saved)

    return run


def _with_transposed_operands(fn):
    """``fn`` run with the FP8 backward reading its B operands from transposed copies."""
    from hyperrec.jagged_attn._triton import _fp8_launch

    return _with_attr(fn, _fp8_launch, "FP8_BWD_TRANSPOSED_B", True)


def _with_env(fn, name: str, value: str):
    """``fn`` run with environment variable ``name`` set to ``value`` (read per call)."""

    def run():
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved

    return run


def _with_stats_pass(fn):
    """``fn`` with ``recompute_stats`` served by the Triton kernels' statistics pass
    (``_launch.STATS_BY_FORWARD = False``)."""
    from hyperrec.jagged_attn._triton import _launch

    return _with_attr(fn, _launch, "STATS_BY_FORWARD", False)


def _triton_fp8(pair):
    """An implementation pair with the Gluon FP8 forward switched off (the Triton kernel)."""
    from hyperrec.jagged_attn._triton._fp8_launch import GLUON_FP8_ENV

    return tuple(None if fn is None else _with_env(fn, GLUON_FP8_ENV, "0") for fn in pair)


def _spec(case: Case):
    from hyperrec.jagged_attn import AttentionSpec, MaskSpec

    return AttentionSpec(scale=1 / math.sqrt(case.head_dim), max_seqlen_q=case.max_len,
                         max_seqlen_kv=case.max_len, mask=MaskSpec(causal=case.causal))  # fmt: skip


def impl_fp8_parts(case, q, k, v, offsets, config, kernel_config=None, triton=False):
    """(kernel-only forward on pre-quantized operands, quantization alone). The operands are
    quantized in the layout the call's forward reads (V in ``mma_order`` where the Gluon
    FP8 forward takes it, as the public call quantizes them; before 2026-12-04 token order
    always, which made the Gluon kernel take its slower unpermuted path). ``triton``: for
    the Triton FP8 kernel (token order)."""
    from hyperrec.jagged_attn._opschema import AttentionCall
    from hyperrec.jagged_attn._triton import _fp8_launch
    from hyperrec.jagged_attn._triton._fp8_launch import attention_forward_fp8, quantize_qkv

    call = AttentionCall(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, kv_index=None,
                         num_targets=None, spec=_spec(case))  # fmt: skip
    gluon = (not triton and kernel_config is None and q.is_cuda
             and _fp8_launch._use_gluon_fp8(call, config, None, call.spec.scale, True))  # fmt: skip
    qkv = quantize_qkv(q, k, v, offsets, offsets, config, v_mma_order=gluon)

    def kernel():
        return attention_forward_fp8(call, config, qkv=qkv, kernel_config=kernel_config)[0]

    def quantize():
        return quantize_qkv(q, k, v, offsets, offsets, config)

    return kernel, quantize


def fp8_gemm_ceiling() -> float | None:
    """TFLOP/s of an 8192^3 E4M3 GEMM through ``torch._scaled_mm`` (None if unavailable)."""
    try:
        n = 8192
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device="cuda")
        ms = _ba().bench_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
        return 2 * n**3 / ms * 1e-9
    except Exception as e:  # API differences across torch versions
        print(f"fp8 GEMM ceiling unavailable: {type(e).__name__}: {e}"[:200])
        return None


# ---------------------------------------------------------------------------------------
# Speed
# ---------------------------------------------------------------------------------------


def run_speed(case: Case, args, device: str, flex_compiled) -> dict:
    from hyperrec.jagged_attn import FP8Config

    ba = _ba()
    info: dict = dict(asdict(case), instances=[], results={})
    backend = "auto" if device == "cuda" else "triton"
    timings: dict[str, dict[str, list[float]]] = {}
    extra_ms: dict[str, list[float]] = {}
    for seed in range(args.instances):
        lens, offsets, q, k, v, do = make_inputs(case, seed, device)
        flops = ba.useful_flops(lens, case.heads, case.head_dim, case.causal)
        inst = dict(seed=seed, tokens=int(lens.sum()), flops_fwd=flops)
        fp8_bwd = FP8Config(backward="fp8")
        impls = {
            "fp8": impl_public(case, q, k, v, do, offsets, "fp8", backend),
            "fp8_stats_pass": (
                None,
                _with_stats_pass(impl_public(case, q, k, v, do, offsets, "fp8", backend)[1]),
            ),
            "fp8_bwd": (None, impl_public(case, q, k, v, do, offsets, fp8_bwd, backend)[1]),
            # the same with the token-reducing products on K-major transposed copies
            "fp8_bwd_transposed": (
                None,
                _with_transposed_operands(
                    impl_public(case, q, k, v, do, offsets, fp8_bwd, backend)[1]
                ),
            ),
            "mxfp8": impl_public(case, q, k, v, do, offsets, "mxfp8", backend),
            "bf16": impl_public(case, q, k, v, do, offsets, "bf16", backend),
        }
        kernel, quantize = impl_fp8_parts(case, q, k, v, offsets, FP8Config())
        impls["fp8_kernel"] = (kernel, None)
        # the Triton FP8 forward, whichever forward the default dispatch picks above
        impls["fp8_triton"] = _triton_fp8(impls["fp8"])
        triton_kernel, _ = impl_fp8_parts(case, q, k, v, offsets, FP8Config(), triton=True)
        impls["fp8_kernel_triton"] = _triton_fp8((triton_kernel, None))
        for name in args.skip:
            impls.pop(name, None)
        if flex_compiled is not None:
            try:
                fwd, fwd_bwd, _ = ba.impl_flex(case_for_flex(case), q, k, v, do, offsets, lens,
                                               info, flex_compiled)  # fmt: skip
                impls["flex"] = (fwd, fwd_bwd)
            except Exception as e:
                info["results"].setdefault("flex", {})["error"] = f"{type(e).__name__}: {e}"[:400]
        # Odd instances time the implementations in reverse order: in one run (2026-12-04)
        # the same Triton kernel timed 5-7% slower right after the bf16 fwd+bwd than last.
        order = list(impls.items())
        for name, (fwd, fwd_bwd) in order if seed % 2 == 0 else order[::-1]:
            for key, fn, mult in (("fwd", fwd, 1.0), ("fwd_bwd", fwd_bwd, 3.5)):
                if fn is None or (key == "fwd_bwd" and name == "mxfp8" and not args.mx_bwd):
                    continue
                try:
                    fn()  # compile, schedules, checks: outside the timing
                    if device == "cuda":
                        torch.cuda.synchronize()
                    ms = ba.bench_ms(fn, device)
                except Exception as e:
                    info["results"].setdefault(name, {})[f"{key}_error"] = (
                        f"{type(e).__name__}: {e}"[:400]
                    )
                    if args.verbose:
                        traceback.print_exc()
                    continue
                inst[f"{name}/{key}_ms"] = ms
                timings.setdefault(name, {}).setdefault(key, []).append(mult * flops / ms * 1e-9)
        # The pass with and without the Hadamard rotation (what the rotation costs).
        _, plain_quantize = impl_fp8_parts(case, q, k, v, offsets, FP8Config(hadamard=False))
        for key, fn in (("fp8_quantize_ms", quantize),
                        ("fp8_quantize_no_hadamard_ms", plain_quantize)):  # fmt: skip
            try:
                fn()
                ms = ba.bench_ms(fn, device)
                inst[key] = ms
                extra_ms.setdefault(key, []).append(ms)
            except Exception as e:
                info["results"][key.replace("_ms", "_error")] = f"{type(e).__name__}: {e}"[:400]
        info["instances"].append(inst)
        del lens, offsets, q, k, v, do, impls
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, by_pass in timings.items():
        for key, values in by_pass.items():
            info["results"].setdefault(name, {})[f"{key}_tflops"] = ba._stats(values)
    for name, values in extra_ms.items():
        info["results"][name] = ba._stats(values)
    for ours in ("fp8", "fp8_stats_pass", "fp8_bwd", "fp8_bwd_transposed", "fp8_kernel", "mxfp8",
                 "fp8_triton", "fp8_kernel_triton"):  # fmt: skip
        peers = ["bf16", "flex"] + (["fp8_stats_pass"] if ours == "fp8" else [])
        if ours in ("fp8", "fp8_kernel"):  # Gluon (where it serves the call) over Triton
            peers.append({"fp8": "fp8_triton", "fp8_kernel": "fp8_kernel_triton"}[ours])
        for peer in peers:
            for key in ("fwd", "fwd_bwd"):
                a, b = timings.get(ours, {}).get(key), timings.get(peer, {}).get(key)
                if a and b and len(a) == len(b) and ours in info["results"]:
                    info["results"][ours][f"{key}_ratio_over_{peer}"] = ba._stats(
                        [x / y for x, y in zip(a, b)]
                    )
    return info


def case_for_flex(case: Case):
    """bench_attention's Case for its FlexAttention plumbing (softmax, same mask)."""
    ba = _ba()
    return ba.Case(case.name, case.dist, case.batch, case.max_len, case.heads, case.head_dim,
                   case.causal)  # fmt: skip


# ---------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------


def _truncate(lens: torch.Tensor, budget: int) -> torch.Tensor:
    """The leading whole sequences that fit in ``budget`` tokens (at least one)."""
    keep = int((lens.cumsum(0) <= budget).sum().clamp(min=1))
    return lens[:keep]


def accuracy_inputs(case: Case, dist: str, budget: int, device: str, seed: int = 0):
    ba = _ba()
    lens = _truncate(ba.lengths(case.dist, case.batch, case.max_len, seed), budget)
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    g = torch.Generator().manual_seed(20_000 + seed)
    total = int(lens.sum())
    q, k, v, do = (torch.randn(total, case.heads, case.head_dim, generator=g) for _ in range(4))
    if dist == "outliers":
        q[..., :2] *= 20
        k[..., :2] *= 20
        q, k = q / 3, k / 3
    elif dist == "key_bias":
        # keys sharing a common component (a projection bias): 3x their own spread
        k = k + 3.0 * torch.randn(1, case.heads, case.head_dim, generator=g)
    return lens, offsets.to(device), *(t.to(device, torch.bfloat16) for t in (q, k, v, do))


def run_accuracy(case: Case, args, device: str, grads: bool) -> dict:
    from hyperrec.jagged_attn import FP8Config, jagged_attention, reference, reference_fp8

    spec = replace(_spec(case))
    row: dict = dict(asdict(case), results={})
    kernels = device == "cuda" or args.smoke
    backend = ("auto" if device == "cuda" else "triton") if kernels else "torch"
    row["fp8_computed_by"] = "kernels" if kernels else "pure-PyTorch specification (emulation)"
    row["bf16_computed_by"] = (
        "our bf16 Triton kernels" if kernels
        else "the reference backend (float32 math, bf16 output)"
    )  # fmt: skip
    methods = {
        "fp8": "fp8",
        "fp8_no_hadamard": FP8Config(hadamard=False),
        "fp8_no_smoothing": FP8Config(smooth_k=False),
        "mxfp8": "mxfp8",
    }
    for dist in ("gaussian", "outliers", "key_bias"):
        lens, offsets, q, k, v, do = accuracy_inputs(case, dist, args.acc_tokens, device)
        spec = replace(spec, max_seqlen_q=int(lens.max()), max_seqlen_kv=int(lens.max()))
        args64 = (q.double(), k.double(), v.double(), offsets, offsets, spec)
        exact = reference.attention_forward(*args64)
        res: dict = dict(tokens=int(lens.sum()), sequences=int(lens.numel()))
        outs = {}
        for name, precision in methods.items():
            outs[name] = jagged_attention(q, k, v, offsets, spec.max_seqlen_q, causal=case.causal,
                                          backend=backend, precision=precision)  # fmt: skip
        outs["naive_fp8"] = reference_fp8.naive_attention_forward(*args64, dtype=torch.float32)
        outs["bf16"] = jagged_attention(q, k, v, offsets, spec.max_seqlen_q, causal=case.causal,
                                        backend=backend if kernels else "torch")  # fmt: skip
        for name, out in outs.items():
            res[name] = reference_fp8.error_metrics(out, exact)
        res["rmse_naive_over_fp8"] = res["naive_fp8"]["rmse"] / res["fp8"]["rmse"]
        # (the reference backend's backward ignores the forward's precision: gradients are
        # only informative through the kernels)
        if grads and dist == "gaussian" and kernels:
            res["grads"] = _grad_accuracy(case, q, k, v, do, offsets, spec, backend, kernels)
        if args.cpu_accuracy and dist == "gaussian" and case is CPU_ACCURACY[0]:
            res["attribution"] = _attribution(args64, exact)
        row["results"][dist] = res
        del outs, exact
    return row


def _attribution(args64, exact) -> dict:
    """The specification's error with only one operand quantized at a time (what each of
    Q, K, V and P costs), and with all four; Hadamard off (Gaussian inputs)."""
    from hyperrec.jagged_attn import FP8Config, reference_fp8

    config = FP8Config(hadamard=False)
    out = {}
    for ops in ("q", "k", "v", "p", "qkvp"):
        o = reference_fp8.attention_forward(*args64, config, operands=ops)
        out[f"only_{ops}" if len(ops) == 1 else "all"] = reference_fp8.error_metrics(o, exact)
    return out


def _grad_accuracy(case, q, k, v, do, offsets, spec, backend, kernels) -> dict:
    from hyperrec.jagged_attn import jagged_attention, reference, reference_fp8

    exact = reference.attention_backward(do.double(), q.double(), k.double(), v.double(),
                                         offsets, offsets, spec)  # fmt: skip
    out: dict = {}
    for name, precision in (("fp8_fwd_bf16_bwd", "fp8"), ("bf16", "bf16")):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = jagged_attention(*leaves, offsets, spec.max_seqlen_q, causal=case.causal,
                             backend=backend, precision=precision)  # fmt: skip
        g = torch.autograd.grad(o, leaves, do)
        out[name] = {n: reference_fp8.error_metrics(a, e) for n, a, e in zip("qkv", g, exact)}
    return out


def _warm(case: Case, flex: bool = True) -> str:
    """Compile this case's kernels (fp8, mxfp8, bf16; FlexAttention) on a tiny batch, in a
    worker process: the main process then finds them in the on-disk caches."""
    try:
        small = replace(case, batch=2, max_len=min(case.max_len, 512), dist="fixed")
        lens, offsets, q, k, v, do = make_inputs(small, 0, "cuda")
        for precision in ("fp8", "bf16", "mxfp8"):
            fwd, fwd_bwd = impl_public(small, q, k, v, do, offsets, precision, "auto")
            fwd() if precision == "mxfp8" else fwd_bwd()
        from hyperrec.jagged_attn import FP8Config

        impl_fp8_parts(small, q, k, v, offsets, FP8Config())[0]()
        if flex:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention, dynamic=True)
            _, fb, _ = _ba().impl_flex(case_for_flex(small), q, k, v, do, offsets, lens, {},
                                       compiled)  # fmt: skip
            fb()
        torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{case.name}: {type(e).__name__}: {e}"[:300]


# ---------------------------------------------------------------------------------------
# Configuration sweep
# ---------------------------------------------------------------------------------------


def run_sweep(args, device: str) -> list[dict]:
    from hyperrec.jagged_attn import FP8Config
    from hyperrec.jagged_attn._triton import KernelConfig

    ba = _ba()
    rows = []
    for case in (Case("fixed-B32-L2048", "fixed", 32, 2048), Case("fixed-B8-L8192", "fixed", 8, 8192),
                 Case("fixed-B16-L4096-causal", "fixed", 16, 4096, causal=True)):  # fmt: skip
        lens, offsets, q, k, v, _ = make_inputs(case, 0, device)
        flops = ba.useful_flops(lens, case.heads, case.head_dim, case.causal)
        for bm, warps, stages, pb, tma in SWEEP:
            config = FP8Config(p_block=pb)
            kc = KernelConfig(block_m=bm, block_n=pb, num_warps=warps, num_stages=stages,
                              tma=tma)  # fmt: skip
            entry = dict(case=case.name, block_m=bm, num_warps=warps, num_stages=stages,
                         p_block=pb, tma=tma)  # fmt: skip
            try:
                kernel, _ = impl_fp8_parts(case, q, k, v, offsets, config, kc)
                kernel()
                entry["kernel_tflops"] = flops / ba.bench_ms(kernel, device) * 1e-9
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(entry)
            print(entry, flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def print_tables(speed: list[dict], acc: list[dict], ceilings: dict) -> None:
    print(f"\nceilings measured in this run (TFLOP/s): {ceilings}")
    print("TFLOP/s, median over instances (min); ratios: median per-instance")

    def cell(r, name, key):
        s = r.get(name, {}).get(f"{key}_tflops")
        return f"{s['median']:6.0f} ({s['min']:4.0f})" if s else " " * 13

    def ratio(r, name, key, peer):
        s = r.get(name, {}).get(f"{key}_ratio_over_{peer}")
        return f"{s['median']:5.2f}" if s else "    -"

    for key in ("fwd", "fwd_bwd"):
        print(f"\n{key}: {'case':24s} {'fp8':>13s} {'fp8_kernel':>13s} {'mxfp8':>13s} "
              f"{'bf16':>13s} {'flex':>13s}  fp8/bf16 fp8/flex kern/bf16 quant_ms (no H)")  # fmt: skip
        for c in speed:
            r = c["results"]
            qms = r.get("fp8_quantize_ms", {}).get("median")
            qplain = r.get("fp8_quantize_no_hadamard_ms", {}).get("median")
            print(f"     {c['name']:24s} {cell(r, 'fp8', key)} {cell(r, 'fp8_kernel', key)} "
                  f"{cell(r, 'mxfp8', key)} {cell(r, 'bf16', key)} {cell(r, 'flex', key)}  "
                  f"{ratio(r, 'fp8', key, 'bf16')}    {ratio(r, 'fp8', key, 'flex')}    "
                  f"{ratio(r, 'fp8_kernel', key, 'bf16')}    "
                  f"{'' if qms is None else f'{qms:.3f}'}"
                  f"{'' if qplain is None else f' ({qplain:.3f})'}")  # fmt: skip
            if key == "fwd_bwd" and r.get("fp8_stats_pass"):
                print(f"       statistics pass (<= 0.2.19): {cell(r, 'fp8_stats_pass', key)} = "
                      f"{ratio(r, 'fp8_stats_pass', key, 'bf16')}x bf16; now "
                      f"{ratio(r, 'fp8', key, 'fp8_stats_pass')}x that")  # fmt: skip
            if key == "fwd_bwd" and r.get("fp8_bwd"):
                print(f"       FP8 backward: {cell(r, 'fp8_bwd', key)} = "
                      f"{ratio(r, 'fp8_bwd', key, 'bf16')}x bf16; transposed operands "
                      f"{cell(r, 'fp8_bwd_transposed', key)}")  # fmt: skip
    if acc:
        print("\naccuracy vs float64: RMSE (SNR dB)")
        names = ("fp8", "fp8_no_hadamard", "fp8_no_smoothing", "mxfp8", "naive_fp8", "bf16")
        print(f"{'case':30s} {'inputs':9s} " + " ".join(f"{n:>20s}" for n in names)
              + "  naive/fp8")  # fmt: skip
        for row in acc:
            for dist, res in row["results"].items():
                cells = " ".join(f"{res[n]['rmse']:10.2e} ({res[n]['snr_db']:5.1f})" for n in names)
                print(f"{row['name']:30s} {dist:9s} {cells}  {res['rmse_naive_over_fp8']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="JSON directory")
    parser.add_argument("--quick", action="store_true", help="two cases (<= 2 minutes)")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter")
    parser.add_argument("--cpu-accuracy", action="store_true",
                        help="accuracy only, on the CPU, with the pure-PyTorch specification")  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="FP8 kernel configurations only")
    parser.add_argument("--instances", type=int, default=5, help="fresh instances per case")
    parser.add_argument("--acc-tokens", type=int, default=16384,
                        help="token budget of the accuracy inputs")  # fmt: skip
    parser.add_argument("--mx-bwd", action="store_true", help="also time mxfp8 fwd+bwd")
    parser.add_argument(
        "--only", default=None, help="run cases whose name contains one of these (comma-separated)"
    )
    parser.add_argument(
        "--skip",
        default="",
        type=lambda s: [x for x in s.split(",") if x],
        help="implementations to leave out (comma-separated), e.g. fp8_bwd_transposed,mxfp8",
    )
    parser.add_argument("--budget-min", type=float, default=None)
    parser.add_argument(
        "--rep-ms",
        type=int,
        default=None,
        help="ms per timing (default 25; 1000 times under the sustained power cap)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.rep_ms is not None:
        _ba().REP_MS = args.rep_ms
    from hyperrec.testing import write_result

    t_start = time.perf_counter()
    ceilings: dict = {}
    flex_compiled = None
    if args.smoke or args.cpu_accuracy:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cpu"
        args.instances = min(args.instances, 2)
        if args.smoke:
            from torch.nn.attention.flex_attention import flex_attention

            cases, acc_cases = SMOKE, SMOKE[:1]
            flex_compiled = flex_attention  # eager on the CPU: exercises the plumbing
            args.acc_tokens = min(args.acc_tokens, 256)
        else:
            cases, acc_cases = [], CPU_ACCURACY
            args.acc_tokens = min(args.acc_tokens, 8192)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_fp8.py needs a CUDA GPU (or --smoke / --cpu-accuracy)")
        device = "cuda"
        cases = QUICK if args.quick else CASES
        acc_cases = QUICK[:1] if args.quick else [CASES[0], CASES[3], CASES[4], CASES[6]]
        if args.quick:
            args.acc_tokens = min(args.acc_tokens, 8192)
        from torch.nn.attention.flex_attention import flex_attention

        flex_compiled = None if args.quick else torch.compile(flex_attention, dynamic=True)
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        ceilings["bf16_mm"] = _ba().matmul_ceiling()
        ceilings["fp8_scaled_mm"] = fp8_gemm_ceiling()
    if args.only:
        wanted = args.only.split(",")
        cases = [c for c in cases if any(w in c.name for w in wanted)]
        acc_cases = [c for c in acc_cases if any(w in c.name for w in wanted)]
    if device == "cuda" and not args.sweep and cases:
        import concurrent.futures as cf
        import multiprocessing as mp

        t0 = time.perf_counter()
        distinct = list({c.causal: c for c in cases}.values())  # kernels differ by mask only
        with cf.ProcessPoolExecutor(len(distinct), mp_context=mp.get_context("spawn")) as ex:
            errors = [
                e for e in ex.map(_warm, distinct, [flex_compiled is not None] * len(distinct)) if e
            ]
        print(f"compiled kernels in {time.perf_counter() - t0:.0f}s {errors}", flush=True)
    budget = args.budget_min if args.budget_min is not None else (1.8 if args.quick else 3.5)
    reserve = 0.4 if args.quick else 0.8
    suffix = ("smoke" if args.smoke else "cpu_accuracy" if args.cpu_accuracy
              else "sweep" if args.sweep else "quick" if args.quick else "h200")  # fmt: skip
    path = args.out / f"fp8_{suffix}.json"
    speed: list[dict] = []
    acc: list[dict] = []
    sweep: list[dict] = []
    skipped: list[str] = []

    def save():
        write_result(path, {
            "benchmark": "FP8/MXFP8 jagged attention: speed (useful FLOPs, fwd+bwd = 3.5x fwd, "
                         f"{args.instances} fresh instances per case) and accuracy vs float64",
            "ceilings_tflops": ceilings,
            "rep_ms": _ba().REP_MS,
            "seconds": time.perf_counter() - t_start,
            "skipped_for_time": skipped,
            "speed": speed,
            "accuracy": acc,
            "sweep": sweep,
        })  # fmt: skip

    if args.sweep:
        sweep.extend(run_sweep(args, device))
        save()
        print(f"wrote {path}")
        return
    for case in cases:
        if time.perf_counter() - t_start > 60 * (budget - reserve):
            skipped.append(case.name)
            continue
        t0 = time.perf_counter()
        speed.append(run_speed(case, args, device, flex_compiled))
        save()
        summary = {n: {k: round(v["median"], 2) for k, v in r.items() if isinstance(v, dict)
                       and "median" in v} for n, r in speed[-1]["results"].items()
                   if isinstance(r, dict)}  # fmt: skip
        print(f"{case.name}: {time.perf_counter() - t0:.0f}s {summary}", flush=True)
    for i, case in enumerate(acc_cases):
        if time.perf_counter() - t_start > 60 * budget:
            skipped.append(f"accuracy:{case.name}")
            continue
        t0 = time.perf_counter()
        try:
            acc.append(run_accuracy(case, args, device, grads=i == 0))
        except Exception as e:
            acc.append(dict(name=case.name, error=f"{type(e).__name__}: {e}"[:400]))
            if args.verbose:
                traceback.print_exc()
        save()
        print(f"accuracy {case.name}: {time.perf_counter() - t0:.0f}s", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    save()
    print_tables(speed, [a for a in acc if "results" in a], ceilings)
    print(f"{time.perf_counter() - t_start:.0f}s; skipped for time: {skipped}; wrote {path}")


if __name__ == "__main__":
    main()
