"""Jagged attention and GDPA on one GPU: hyperrec's Triton kernels against the peers.

Softmax cases compare ``hyperrec`` (this package's kernels) with FlexAttention under a
document mask (the block mask is built once, outside the timing; its build time is reported
separately), PyTorch SDPA on nested jagged tensors (NJT), and dense SDPA on a padded batch
(no mask: the cost of padding, shown for scale; its rows past each length are not a correct
answer). GDPA cases (HSTU semantics: SiLU, causal, 1/max_seqlen) compare with the HSTU
Triton kernel of generative-recommenders when ``--hstu PATH`` points at a checkout of it.

Throughput counts useful FLOPs only: ``4 * sum(Lq * Lk) * H * D`` for the forward (only
allowed pairs when causal), backward counted as 2.5x the forward (fwd+bwd = 3.5x). Times are
medians of CUDA-event timings (``triton.testing.do_bench``), bf16, random normal inputs.

    python bench/bench_attention.py [--quick] [--hstu PATH] [--out results/attention.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    name: str
    dist: str  # "uniform" | "powerlaw"
    batch: int
    max_len: int
    heads: int
    head_dim: int
    causal: bool = False
    kind: str = "softmax"  # "softmax" | "gdpa_silu"


CASES = [
    Case("u-B1024-L256-H4-D128", "uniform", 1024, 256, 4, 128),
    Case("u-B256-L1024-H8-D64", "uniform", 256, 1024, 8, 64),
    Case("u-B128-L1024-H8-D128", "uniform", 128, 1024, 8, 128),
    Case("u-B16-L8192-H4-D128", "uniform", 16, 8192, 4, 128),
    Case("p-B1024-L1024-H4-D128", "powerlaw", 1024, 1024, 4, 128),
    Case("p-B256-L2048-H4-D128", "powerlaw", 256, 2048, 4, 128),
    Case("u-B64-L2048-H8-D128-causal", "uniform", 64, 2048, 8, 128, causal=True),
    Case("gdpa-u-B128-L1024-H4-D128", "uniform", 128, 1024, 4, 128, True, "gdpa_silu"),
    Case("gdpa-p-B256-L2048-H4-D128", "powerlaw", 256, 2048, 4, 128, True, "gdpa_silu"),
    Case("gdpa-u-B16-L8192-H4-D128", "uniform", 16, 8192, 4, 128, True, "gdpa_silu"),
]
# FlexAttention is compiled once with dynamic shapes for every case; on these cases it is
# also compiled for the exact shapes (its fastest setting, one compilation per case).
FLEX_STATIC = {"u-B128-L1024-H8-D128", "p-B256-L2048-H4-D128"}
QUICK = [
    Case("u-B64-L1024-H4-D128", "uniform", 64, 1024, 4, 128),
    Case("p-B256-L512-H4-D64-causal", "powerlaw", 256, 512, 4, 64, causal=True),
    Case("gdpa-u-B64-L1024-H4-D128", "uniform", 64, 1024, 4, 128, True, "gdpa_silu"),
]


def lengths(dist: str, batch: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """Uniform in [1, max] or power-law ``max * u**2.8`` (mean ~max/3.8), longest = max."""
    g = torch.Generator().manual_seed(seed)
    if dist == "uniform":
        lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    else:
        u = torch.rand(batch, generator=g, dtype=torch.float64)
        lens = (max_len * u**2.8).ceil().clamp(1, max_len).long()
    lens[0] = max_len
    return lens


def useful_flops(lens: torch.Tensor, heads: int, head_dim: int, causal: bool) -> float:
    l = lens.double()
    pairs = (l * (l + 1) / 2).sum() if causal else (l * l).sum()
    return 4.0 * float(pairs) * heads * head_dim


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def matmul_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench_ms(lambda: a @ b) * 1e-9


# ---------------------------------------------------------------------------------------
# Implementations. Each returns (fwd_fn, fwd_bwd_fn, out_fn) closures over prepared inputs.
# ---------------------------------------------------------------------------------------


def call_of(spec, q, k, v, offsets):
    """The launchers' description of one self-attention call."""
    from hyperrec.jagged_attn._opschema import AttentionCall

    return AttentionCall(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip


class _Hyperrec(torch.autograd.Function):
    """The launchers directly (no validation, no custom-op dispatch)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, spec):
        from hyperrec.jagged_attn._triton import attention_forward

        out, lse = attention_forward(call_of(spec, q, k, v, offsets))
        ctx.save_for_backward(q, k, v, out, lse, offsets)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from hyperrec.jagged_attn._triton import attention_backward

        q, k, v, out, lse, offsets = ctx.saved_tensors
        call = call_of(ctx.spec, q, k, v, offsets)
        dq, dk, dv = attention_backward(grad_out.contiguous(), out, lse, call)
        return dq, dk, dv, None, None


def _spec(case: Case, max_len: int):
    """The case's AttentionSpec: softmax, or HSTU (silu(alpha * qk) / max_seqlen, causal)."""
    from hyperrec.jagged_attn import AttentionSpec, MaskSpec

    hstu = case.kind != "softmax"
    return AttentionSpec(
        activation="silu" if hstu else "softmax",
        scale=1 / math.sqrt(case.head_dim),
        normalization="max_seqlen" if hstu else "none",
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        mask=MaskSpec(causal=hstu or case.causal),
    )


def impl_hyperrec(case, q, k, v, do, offsets, lens):
    spec = _spec(case, case.max_len)
    off32 = offsets.to(torch.int32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        return _Hyperrec.apply(q, k, v, off32, spec)

    def fwd_bwd():
        out = _Hyperrec.apply(*leaves, off32, spec)
        return torch.autograd.grad(out, leaves, do)

    return fwd, fwd_bwd, fwd


def impl_flex(case, q, k, v, do, offsets, lens, info, flex_compiled):
    from torch.nn.attention.flex_attention import create_block_mask

    t_total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), lens.cuda())
    causal = case.causal

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    times = []
    for _ in range(2):  # the first build includes compiling the mask builder
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        block_mask = create_block_mask(mask_mod, None, None, t_total, t_total, device="cuda",
                                       _compile=True)  # fmt: skip
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    info["flex_mask_build_s"] = {"first": times[0], "steady": times[1]}
    qf, kf, vf, dof = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, do))
    leaves = [t.detach().clone().requires_grad_() for t in (qf, kf, vf)]

    def fwd():
        return flex_compiled(qf, kf, vf, block_mask=block_mask)

    def fwd_bwd():
        out = flex_compiled(*leaves, block_mask=block_mask)
        return torch.autograd.grad(out, leaves, dof)

    def out_fn():
        return fwd()[0].transpose(0, 1)

    return fwd, fwd_bwd, out_fn


def impl_njt(case, q, k, v, do, offsets, lens):
    max_len = int(lens.max())

    def njt(x):
        return torch.nested.nested_tensor_from_jagged(x, offsets, max_seqlen=max_len).transpose(
            1, 2
        )

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        return F.scaled_dot_product_attention(njt(q), njt(k), njt(v), is_causal=case.causal)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(*(njt(t) for t in leaves), is_causal=case.causal)
        return torch.autograd.grad(out.transpose(1, 2).values(), leaves, do)

    def out_fn():
        return fwd().transpose(1, 2).values()

    return fwd, fwd_bwd, out_fn


def impl_padded(case, q, k, v, do, offsets, lens):
    b, max_len = len(lens), int(lens.max())
    pos = torch.arange(max_len, device="cuda")
    valid = pos[None, :] < lens.cuda()[:, None]
    idx = (offsets[:-1, None] + pos[None, :]).clamp(max=q.shape[0] - 1)

    def pad(x):
        dense = torch.where(valid[..., None, None], x[idx], 0.0)  # (B, L, H, D)
        return dense.transpose(1, 2).contiguous()

    qp, kp, vp, dop = pad(q), pad(k), pad(v), pad(do)
    del b
    leaves = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]

    def fwd():
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=case.causal)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(*leaves, is_causal=case.causal)
        return torch.autograd.grad(out, leaves, dop)

    return fwd, fwd_bwd, None


_HSTU = {}


def load_hstu(path: str | None):
    if "mod" in _HSTU or path is None:
        return _HSTU.get("mod")
    sys.path.insert(0, str(Path(path).resolve()))
    import generative_recommenders.ops.triton.triton_hstu_attention as h

    # Their full autotune space is ~50 configs per shape key; keep a representative subset
    # (the block shapes their H100 kernels use most) so tuning takes seconds per case.
    keep_fwd = {(128, 64, 2, 8), (128, 64, 2, 4), (64, 64, 4, 4), (128, 128, 2, 8), (128, 32, 4, 4)}
    keep_bwd = {(32, 64, 2, 8), (64, 64, 2, 8), (32, 128, 2, 8), (32, 128, 3, 8), (64, 64, 2, 4)}

    def sel(configs, keep):
        out = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages,
                                      c.num_warps) in keep and not c.kwargs.get("USE_TLX")
               and not c.kwargs.get("SEQUENCE_PARALLEL")]  # fmt: skip
        return out or configs

    h._hstu_attn_fwd.configs = sel(h._hstu_attn_fwd.configs, keep_fwd)
    h._hstu_attn_bwd.configs = sel(h._hstu_attn_bwd.configs, keep_bwd)
    _HSTU["mod"] = h
    _HSTU["configs"] = (len(h._hstu_attn_fwd.configs), len(h._hstu_attn_bwd.configs))
    return h


def impl_hstu(case, q, k, v, do, offsets, lens, h):
    alpha = 1 / math.sqrt(case.head_dim)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        return h.triton_hstu_mha(case.max_len, alpha, q, k, v, offsets)

    def fwd_bwd():
        out = h.triton_hstu_mha(case.max_len, alpha, *leaves, offsets)
        return torch.autograd.grad(out, leaves, do)

    return fwd, fwd_bwd, fwd


def _warm(case: Case) -> str:
    """Compile this case's hyperrec kernels on a tiny batch (run in worker processes, so the
    main process finds them in Triton's cache instead of compiling one by one)."""
    try:
        lens = torch.tensor([case.max_len // 3 + 1, 1, 50])
        off = torch.zeros(4, dtype=torch.int32)
        off[1:] = lens.cumsum(0)
        t = int(off[-1])
        q, k, v, do = (torch.randn(t, case.heads, case.head_dim, device="cuda",
                                   dtype=torch.bfloat16, requires_grad=True) for _ in range(4))  # fmt: skip
        out = _Hyperrec.apply(q, k, v, off.cuda(), _spec(case, case.max_len))
        out.backward(do)
        torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{case.name}: {type(e).__name__}: {e}"[:300]


def make_inputs(case: Case, offsets_dtype: torch.dtype = torch.int64):
    """``(lens, offsets, q, k, v, grad_out)`` of ``case`` on the GPU, bf16, seeded."""
    lens = lengths(case.dist, case.batch, case.max_len)
    offsets = torch.zeros(case.batch + 1, dtype=offsets_dtype)
    offsets[1:] = lens.cumsum(0)
    offsets = offsets.cuda()
    t_total = int(lens.sum())
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(t_total, case.heads, case.head_dim, device="cuda",
                               dtype=torch.bfloat16, generator=g) for _ in range(4))  # fmt: skip
    return lens, offsets, q, k, v, do


def run_case(case: Case, args, flex_compiled) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    lens, offsets, q, k, v, do = make_inputs(case, torch.int64)
    t_total = int(lens.sum())
    flops = useful_flops(lens, case.heads, case.head_dim, case.causal)
    info: dict = dict(asdict(case), tokens=t_total,
                      pad_fraction=1 - t_total / (case.batch * case.max_len),
                      flops_fwd=flops, results={})  # fmt: skip
    impls = {"hyperrec": lambda: impl_hyperrec(case, q, k, v, do, offsets, lens)}
    from hyperrec.jagged_attn._triton import _configs

    info["hyperrec_configs"] = {
        kern: asdict(_configs.select_config(_configs.config_key(
            kern, "sm90", case.head_dim, case.kind == "softmax", case.causal, case.max_len)))
        for kern in ("fwd", "dkdv", "dq")
    }  # fmt: skip
    if case.kind == "softmax":
        impls["flex"] = lambda: impl_flex(case, q, k, v, do, offsets, lens, info, flex_compiled)
        if case.name in FLEX_STATIC and not args.quick:
            static = torch.compile(flex_attention, dynamic=False)
            impls["flex_static"] = lambda: impl_flex(case, q, k, v, do, offsets, lens, {}, static)
        impls["sdpa_njt"] = lambda: impl_njt(case, q, k, v, do, offsets, lens)
        impls["sdpa_padded"] = lambda: impl_padded(case, q, k, v, do, offsets, lens)
    else:
        try:
            h = load_hstu(args.hstu)
            if h is not None:
                impls["hstu_triton"] = lambda: impl_hstu(case, q, k, v, do, offsets, lens, h)
            else:
                info["hstu_error"] = "no --hstu path given"
        except Exception as e:
            info["hstu_error"] = f"{type(e).__name__}: {e}"[:400]
    outs = {}
    for name, make in impls.items():
        res: dict = {}
        try:
            fwd, fwd_bwd, out_fn = make()
            if out_fn is not None:
                outs[name] = out_fn().float()
            fwd(), fwd_bwd()  # compile / autotune outside the timing
            torch.cuda.synchronize()
            t = bench_ms(fwd)
            res.update(fwd_ms=t, fwd_tflops=flops / t * 1e-9)
            t = bench_ms(fwd_bwd)
            res.update(fwd_bwd_ms=t, fwd_bwd_tflops=3.5 * flops / t * 1e-9)
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"[:400]
            if args.verbose:
                traceback.print_exc()
        info["results"][name] = res
        torch.cuda.empty_cache()
    # Cross-checks: same math, so the outputs must agree to bf16 rounding.
    if "hyperrec" in outs:
        info["max_abs_diff"] = {n: float((o - outs["hyperrec"]).abs().max())
                                for n, o in outs.items() if n != "hyperrec"}  # fmt: skip
    return info


def best_flex(r: dict, key: str) -> float | None:
    """The faster of FlexAttention compiled for dynamic shapes and for the exact shapes."""
    vals = [r.get(n, {}).get(key) for n in ("flex", "flex_static")]
    vals = [x for x in vals if x]
    return max(vals) if vals else None


def print_table(cases: list[dict], ceiling: float) -> None:
    print(f"\nbf16 matmul ceiling measured in this run: {ceiling:.0f} TFLOP/s")
    print("TFLOP/s (useful FLOPs); flex = the faster of dynamic-shape and exact-shape builds")
    hdr = (f"{'case':28s} {'tokens':>7s} | {'fwd: ours':>9s} {'flex':>5s} {'njt':>5s} "
           f"{'pad':>5s} {'xflex':>5s} | {'f+b: ours':>9s} {'flex':>5s} {'njt':>5s} "
           f"{'pad':>5s} {'xflex':>5s}")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))

    def f(x, w=5):
        return f"{x:{w}.0f}" if x else " " * (w - 1) + "-"

    for c in cases:
        r = c["results"]

        def g(n, key, r=r):
            return r.get(n, {}).get(key)

        if c["kind"] == "softmax":
            cols = []
            for key in ("fwd_tflops", "fwd_bwd_tflops"):
                ours, flex = g("hyperrec", key), best_flex(r, key)
                ratio = f"{ours / flex:5.2f}" if ours and flex else "    -"
                cols.append(f"{f(ours, 9)} {f(flex)} {f(g('sdpa_njt', key))} "
                            f"{f(g('sdpa_padded', key))} {ratio}")  # fmt: skip
            print(f"{c['name']:28s} {c['tokens']:7d} | {cols[0]} | {cols[1]}")
        else:
            cols = []
            for key in ("fwd_tflops", "fwd_bwd_tflops"):
                ours, hstu = g("hyperrec", key), g("hstu_triton", key)
                ratio = f"{ours / hstu:5.2f}" if ours and hstu else "    -"
                cols.append(f"{f(ours, 9)} hstu {f(hstu)} x{ratio}")
            print(f"{c['name']:28s} {c['tokens']:7d} | {cols[0]} | {cols[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="three small cases (smoke test)")
    parser.add_argument("--hstu", default=None, help="path holding generative_recommenders/")
    parser.add_argument("--only", default=None, help="run cases whose name contains this")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "attention_h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))
    from torch.nn.attention.flex_attention import flex_attention

    from hyperrec.testing import write_result

    flex_compiled = torch.compile(flex_attention, dynamic=True)
    torch._dynamo.config.cache_size_limit = 64
    cases = QUICK if args.quick else CASES
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(min(len(cases), 12), mp_context=mp.get_context("spawn")) as ex:
        errors = [e for e in ex.map(_warm, cases) if e]
    print(f"compiled hyperrec kernels in {time.perf_counter() - t0:.0f}s {errors}", flush=True)
    ceiling = matmul_ceiling()
    rows = []

    def save():
        write_result(args.out, {
            "benchmark": "jagged attention / GDPA, bf16, useful FLOPs (bwd = 2.5x fwd)",
            "bf16_matmul_ceiling_tflops": ceiling,
            "hstu_configs_kept": _HSTU.get("configs"),
            "cases": rows,
        })  # fmt: skip

    for case in cases:
        t0 = time.perf_counter()
        rows.append(run_case(case, args, flex_compiled))
        save()  # after every case, so an interrupted run keeps what it measured
        print(f"{case.name}: {time.perf_counter() - t0:.0f}s {rows[-1]['results']}", flush=True)
    print_table(rows, ceiling)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
