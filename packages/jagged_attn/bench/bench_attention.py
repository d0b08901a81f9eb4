"""Jagged attention and GDPA on one GPU: hyperrec against its peers, over fresh instances.

Every case is timed on ``--instances`` (default 10) freshly built instances: new lengths
drawn from the case's distribution (seed = instance number), new offsets tensor, new q, k,
v and gradient tensors. Each implementation is warmed on the instance (compile, schedule,
checks) and then timed two ways, both with L2 cleared before every call:

* ``<pass>_ms``: ``triton.testing.do_bench`` (median of CUDA-event timings). When the host
  needs longer to issue a call than the GPU needs to flush L2, the GPU waits for the host
  and the wait is counted: a call whose kernels are shorter than its Python is timed by
  the host (and its noise). That is what a host-bound training step sees.
* ``<pass>_device_ms``: the GPU's time alone: the GPU gets a head start (a sleep kernel)
  long enough for the host to issue every repetition, so the events see the kernels back
  to back (``device_and_host``); ``<pass>_host_us`` is the host's time to issue one call.
  That is what a step whose host runs ahead of the GPU sees, and the fair kernel-to-kernel
  comparison.

Per-instance setup is outside both: FlexAttention's block mask (its build time is
recorded per instance, ``flex/mask_build_ms``) and our schedules and value checks, which
are built at the first call with a new offsets object (recorded per instance as
``hyperrec/fwd_first_call_ms`` and ``hyperrec/fwd_bwd_first_call_ms``, wall time from an
idle GPU, next to the same call again, ``*_cached_call_ms``). In training the offsets are
new at every step, and every attention layer of the step shares them: the first layer
pays the first call, the others the cached one.

The JSON keeps every instance's numbers and, per case, the median and minimum over
instances and the spread (max / min of the per-instance TFLOP/s). The issue it answers:
throughput that moved by up to 2x between instances of one case. (The cause, in the
2026-12-01 run: the quick cases were host-bound; see ``diagnose_variance.py --explain``.)

Implementations, in the same process on the same instance:

* ``hyperrec``: the public ``jagged_attention`` / ``gdpa`` (default ``validate=True``:
  sync-free checks; Triton backend);
* ``flex``: FlexAttention compiled with dynamic shapes, under a document mask (plus
  ``q >= kv`` when causal) built per instance outside the timing; ``flex_static``:
  compiled for the exact shapes, on the first ``--static-instances`` instances only (one
  compilation per instance);
* ``sdpa_padded``: dense SDPA (flash backend, no mask) on the batch padded to its longest
  sequence: the cost of padding, shown for scale (its padded rows are not a jagged
  answer; non-causal rows also attend to the zero padding). On the dense single-sequence
  cases it is exactly the same attention as ours;
* ``hstu_triton`` (GDPA cases, with ``--hstu PATH``): generative-recommenders' HSTU kernel;
* ``hyperrec_packed``, ``hyperrec_packed_m64`` (cases of sequences <= 128): the opt-in
  packed-rows forward (``KernelConfig.pack_rows``; shipped tiles, and 64-row tiles) through
  the launchers, with the shipped backward. Their ``ratio_hyperrec_over_peer`` is the
  default path over the packed one.

Throughput counts useful FLOPs only: ``4 * sum(Lq * Lk) * H * D`` for the forward (allowed
pairs only when causal), backward counted 2.5x (fwd+bwd = 3.5x). bf16, random normal.

    python bench/bench_attention.py [--out bench/results]   # 14 cases, <= 8 min on one H200
    python bench/bench_attention.py --quick --out /tmp/b     # 3 cases, ~3 min
    python bench/bench_attention.py --smoke --out /tmp/b     # CPU interpreter, tiny

(The durations are estimates from the per-timing cost; the JSON records the real one. No
new case starts after ``--budget-min`` minutes, 7.5 or 2.7 with ``--quick``; cases left out
are listed under ``skipped_for_time``.)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    name: str
    dist: str  # "uniform" | "powerlaw" | "fixed"
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
    Case("u-B128-L1024-H8-D128-causal", "uniform", 128, 1024, 8, 128, causal=True),
    Case("dense-B1-L16384-H8-D128", "fixed", 1, 16384, 8, 128),
    Case("dense-B1-L16384-H8-D128-causal", "fixed", 1, 16384, 8, 128, causal=True),
    Case("tiny-u-B4096-L64-H4-D128", "uniform", 4096, 64, 4, 128),
    Case("tiny-u-B8192-L32-H4-D64", "uniform", 8192, 32, 4, 64),
    Case("gdpa-u-B128-L1024-H4-D128", "uniform", 128, 1024, 4, 128, True, "gdpa_silu"),
    Case("gdpa-p-B256-L2048-H4-D128", "powerlaw", 256, 2048, 4, 128, True, "gdpa_silu"),
]
# FlexAttention compiled for the exact shapes recompiles per instance: only on these cases.
FLEX_STATIC = {"u-B128-L1024-H8-D128", "dense-B1-L16384-H8-D128"}
QUICK = [
    Case("u-B64-L1024-H4-D128", "uniform", 64, 1024, 4, 128),
    Case("p-B256-L512-H4-D64-causal", "powerlaw", 256, 512, 4, 64, causal=True),
    Case("tiny-u-B2048-L64-H4-D128", "uniform", 2048, 64, 4, 128),
]
SMOKE = [
    Case("smoke-u-B3-L40-H1-D16", "uniform", 3, 40, 1, 16),
    Case("smoke-tiny-u-B12-L8-H1-D16", "uniform", 12, 8, 1, 16),
    Case("smoke-p-B4-L40-H1-D16-causal", "powerlaw", 4, 40, 1, 16, causal=True),
    Case("smoke-gdpa-u-B3-L40-H1-D16", "uniform", 3, 40, 1, 16, True, "gdpa_silu"),
]


def lengths(dist: str, batch: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """Uniform in [1, max], power-law ``max * u**2.8`` (mean ~max/3.8) or all ``max``;
    the longest sequence is always ``max`` (at a random position)."""
    g = torch.Generator().manual_seed(seed)
    if dist == "fixed":
        return torch.full((batch,), max_len, dtype=torch.long)
    if dist == "uniform":
        lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    else:
        u = torch.rand(batch, generator=g, dtype=torch.float64)
        lens = (max_len * u**2.8).ceil().clamp(1, max_len).long()
    lens[int(torch.randint(batch, (1,), generator=g))] = max_len
    return lens


def useful_flops(lens: torch.Tensor, heads: int, head_dim: int, causal: bool) -> float:
    n = lens.double()
    pairs = (n * (n + 1) / 2).sum() if causal else (n * n).sum()
    return 4.0 * float(pairs) * heads * head_dim


#: Milliseconds ``bench_ms`` keeps the GPU busy per measurement (``do_bench``'s ``rep``). At
#: 25 ms an H200 stays near its boost clock; at 1 s its 700 W cap lowers the clock of the
#: power-hungrier kernels (bf16 attention 1,613-1,653 MHz against FP8's ~1,950,
#: ``results/fp8_timing_window_h200_2026-12-04.json``). ``bench_fp8.py --rep-ms`` sets it.
REP_MS = 25


def bench_ms(fn, device: str = "cuda") -> float:
    if device != "cuda":  # the interpreter: one call, wall clock (a smoke test, not a number)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=REP_MS, return_mode="median")


_FLUSH: dict[str, torch.Tensor] = {}
# A 1 ms head start is ~2e6 cycles of the sleep kernel at the H200's 1.98 GHz boost clock;
# at lower clocks the sleep only lasts longer.
_CYCLES_PER_S = 2.0e9


def device_and_host(fn, reps: int = 10, device: str = "cuda", flush: bool = True) -> dict:
    """Median GPU time per call with the host's work hidden, and the host's time per call.

    ``do_bench`` (``bench_ms``) measures from an event recorded after the L2 flush to one
    after the call: when the host needs longer to issue the call than the GPU needs for
    the flush, the GPU idles and the idle time is counted, so a call whose kernels are
    shorter than its Python is timed by the host's speed (and its noise). Here the GPU is
    first given a head start (a sleep kernel long enough for the host to issue every
    repetition), then each repetition flushes L2 and is bracketed by events as in
    ``do_bench``: the events see the kernels back to back, never the host. The host's
    time to issue each call (``host_us``) is measured meanwhile; ``host_hidden`` is False
    if the head start ran out before the host was done (the device time is then an upper
    bound). ``flush=False`` leaves L2 as the previous repetition left it (calls back to
    back, as an eager step runs them).
    """
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return dict(device_ms=ms, host_us=ms * 1e3, host_hidden=True)
    if flush and "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    buf = _FLUSH.get("buf")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):  # host time per repetition, to size the head start
        if flush:
            buf.zero_()
        fn()
    per_rep = (time.perf_counter() - t0) / 3
    torch.cuda.synchronize()
    head_start = reps * per_rep * 2 + 2e-3
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    host = []
    torch.cuda._sleep(int(head_start * _CYCLES_PER_S))
    t_issue = time.perf_counter()
    for i in range(reps):
        if flush:
            buf.zero_()
        starts[i].record()
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        ends[i].record()
    issued = time.perf_counter() - t_issue
    torch.cuda.synchronize()
    return dict(device_ms=statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)),
                host_us=statistics.median(host) * 1e6, host_hidden=issued < head_start)  # fmt: skip


def first_call_ms(fn, device: str = "cuda") -> float:
    """Wall time of one call, host and device, from an idle GPU to its end (a fresh
    offsets object's first call includes its schedule and value checks)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def matmul_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench_ms(lambda: a @ b) * 1e-9


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


def call_of(spec, q, k, v, offsets):
    """The launchers' description of one self-attention call (for the sweep scripts)."""
    from hyperrec.jagged_attn._opschema import AttentionCall

    return AttentionCall(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip


def make_inputs(case: Case, offsets_dtype: torch.dtype = torch.int64, seed: int = 0,
                device: str = "cuda"):  # fmt: skip
    """``(lens, offsets, q, k, v, grad_out)`` of instance ``seed`` of ``case``, bf16."""
    lens = lengths(case.dist, case.batch, case.max_len, seed)
    offsets = torch.zeros(case.batch + 1, dtype=offsets_dtype)
    offsets[1:] = lens.cumsum(0)
    offsets = offsets.to(device)
    t_total = int(lens.sum())
    g = torch.Generator(device=device).manual_seed(10_000 + seed)
    q, k, v, do = (torch.randn(t_total, case.heads, case.head_dim, device=device,
                               dtype=torch.bfloat16, generator=g) for _ in range(4))  # fmt: skip
    return lens, offsets, q, k, v, do


# ---------------------------------------------------------------------------------------
# Implementations. Each returns (fwd_fn, fwd_bwd_fn, out_fn) closures over one instance.
# ---------------------------------------------------------------------------------------


def impl_hyperrec(case, q, k, v, do, offsets, lens, backend="auto"):
    from hyperrec.jagged_attn import gdpa, jagged_attention

    max_len = case.max_len

    def call(q, k, v):
        if case.kind == "softmax":
            return jagged_attention(q, k, v, offsets, max_len, causal=case.causal,
                                    backend=backend)  # fmt: skip
        return gdpa(q, k, v, offsets, offsets, max_len, max_len, causal=True,
                    normalization="max_seqlen", scale=1 / math.sqrt(case.head_dim),
                    backend=backend)  # fmt: skip

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        return call(q, k, v)

    def fwd_bwd():
        return torch.autograd.grad(call(*leaves), leaves, do)

    return fwd, fwd_bwd, fwd


def first_calls_hyperrec(case, q, k, v, do, offsets, lens, backend="auto") -> dict:
    """The first forward and fwd+bwd with a new offsets object (its schedules and value
    checks are built in the call), and the same calls again (cached), wall time each."""
    from hyperrec.jagged_attn import gdpa, jagged_attention

    def call(q, k, v, off):
        if case.kind == "softmax":
            return jagged_attention(q, k, v, off, case.max_len, causal=case.causal,
                                    backend=backend)  # fmt: skip
        return gdpa(q, k, v, off, off, case.max_len, case.max_len, causal=True,
                    normalization="max_seqlen", scale=1 / math.sqrt(case.head_dim),
                    backend=backend)  # fmt: skip

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    device = q.device.type
    out = {}
    for key, fn in (("fwd", lambda o: call(q, k, v, o)),
                    ("fwd_bwd", lambda o: torch.autograd.grad(call(*leaves, o), leaves, do))):  # fmt: skip
        run = partial(fn, offsets.clone())  # a new offsets object
        out[f"{key}_first_call_ms"] = first_call_ms(run, device)
        out[f"{key}_cached_call_ms"] = first_call_ms(run, device)
    return out


# Opt-in packed-rows forward (KernelConfig.pack_rows) on cases of short sequences: the
# shipped tiles, and 64-row tiles.
PACKED_MAX_LEN = 128


def _packed_configs(case: Case, device: str) -> dict:
    from hyperrec.jagged_attn._triton import KernelConfig, _configs, _launch

    arch = _launch._arch(torch.device(device))
    c = _configs.select_config(_configs.config_key("fwd", arch, case.head_dim,
                                                   case.kind == "softmax", case.causal,
                                                   case.max_len))  # fmt: skip
    return {
        "hyperrec_packed": KernelConfig(block_m=c.block_m, block_n=c.block_n,
                                        num_warps=c.num_warps, num_stages=c.num_stages,
                                        pack_rows=True),
        "hyperrec_packed_m64": KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                            pack_rows=True),
    }  # fmt: skip


def impl_hyperrec_packed(case, q, k, v, do, offsets, lens, config):
    """The launchers with a pinned packed-rows forward (the backward is the shipped one)."""
    from hyperrec.jagged_attn._triton import attention_backward, attention_forward

    call = call_of(_spec(case, case.max_len), q, k, v, offsets)

    def fwd():
        return attention_forward(call, config=config)[0]

    def fwd_bwd():
        out, lse = attention_forward(call, config=config)
        return attention_backward(do, out, lse, call)

    return fwd, fwd_bwd, fwd


# FlexAttention's mask functions read the document ids from here, so that one compiled
# function serves every instance (a new closure per instance would be a new guard).
_DOC: dict[str, torch.Tensor] = {}


def _doc_mask(b, h, q_idx, kv_idx):
    return _DOC["ids"][q_idx] == _DOC["ids"][kv_idx]


def _doc_causal_mask(b, h, q_idx, kv_idx):
    return (_DOC["ids"][q_idx] == _DOC["ids"][kv_idx]) & (q_idx >= kv_idx)


def impl_flex(case, q, k, v, do, offsets, lens, info, flex_compiled):
    from torch.nn.attention.flex_attention import create_block_mask

    t_total, dev = q.shape[0], q.device
    _DOC["ids"] = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens.to(dev))
    mask_mod = _doc_causal_mask if case.causal else _doc_mask
    gpu = dev.type == "cuda"
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    # (the CPU smoke test builds the mask eagerly: its sizes are tiny)
    block_mask = create_block_mask(mask_mod, None, None, t_total, t_total, device=dev,
                                   _compile=gpu)  # fmt: skip
    if gpu:
        torch.cuda.synchronize()
    info.setdefault("flex_mask_build_s", []).append(time.perf_counter() - t0)
    info["_last_mask_build_ms"] = (time.perf_counter() - t0) * 1e3
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


def impl_padded(case, q, k, v, do, offsets, lens):
    device = q.device
    max_len = int(lens.max())
    pos = torch.arange(max_len, device=device)
    valid = pos[None, :] < lens.to(device)[:, None]
    idx = (offsets[:-1, None] + pos[None, :]).clamp(max=q.shape[0] - 1)

    def pad(x):
        dense = torch.where(valid[..., None, None], x[idx], 0.0)  # (B, L, H, D)
        return dense.transpose(1, 2).contiguous()

    qp, kp, vp, dop = pad(q), pad(k), pad(v), pad(do)
    leaves = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]
    causal = case.causal or case.kind != "softmax"

    def fwd():
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        return torch.autograd.grad(out, leaves, dop)

    def out_fn():  # the jagged rows of the padded answer (exact for dense cases)
        return fwd().transpose(1, 2)[valid]

    return fwd, fwd_bwd, out_fn if case.dist == "fixed" and case.kind == "softmax" else None


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
        lens = torch.tensor([case.max_len // 3 + 1, 1, 50][: max(case.batch, 1)])
        lens = lens.clamp(max=case.max_len)
        off = torch.zeros(lens.numel() + 1, dtype=torch.int64)
        off[1:] = lens.cumsum(0)
        t = int(off[-1])
        q, k, v, do = (torch.randn(t, case.heads, case.head_dim, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(4))  # fmt: skip
        _, fwd_bwd, _ = impl_hyperrec(case, q, k, v, do, off.cuda(), lens)
        fwd_bwd()
        if case.max_len <= PACKED_MAX_LEN:
            for cfg in _packed_configs(case, "cuda").values():
                impl_hyperrec_packed(case, q, k, v, do, off.cuda(), lens, cfg)[1]()
        torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{case.name}: {type(e).__name__}: {e}"[:300]


def _stats(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values),
                spread=max(values) / min(values) if min(values) > 0 else None,
                per_instance=values)  # fmt: skip


def run_case(case: Case, args, device: str, flex_compiled) -> dict:
    info: dict = dict(asdict(case), instances=[], results={})
    from hyperrec.jagged_attn._triton import _configs, _launch

    arch = _launch._arch(torch.device(device))
    info["hyperrec_configs"] = {
        kern: asdict(_configs.select_config(_configs.config_key(
            kern, arch, case.head_dim, case.kind == "softmax",
            case.causal or case.kind != "softmax", case.max_len)))
        for kern in ("fwd", "dkdv", "dq")
    }  # fmt: skip
    static = None
    if device == "cuda" and case.name in FLEX_STATIC and case.kind == "softmax":
        from torch.nn.attention.flex_attention import flex_attention

        static = torch.compile(flex_attention, dynamic=False)
    hstu = None
    if case.kind != "softmax" and device == "cuda":
        try:
            hstu = load_hstu(args.hstu)
            if hstu is None:
                info["hstu_error"] = "no --hstu path given"
        except Exception as e:
            info["hstu_error"] = f"{type(e).__name__}: {e}"[:400]
    timings: dict[str, dict[str, list[float]]] = {}
    for seed in range(args.instances):
        inputs = make_inputs(case, seed=seed, device=device)
        lens = inputs[0]
        flops = useful_flops(lens, case.heads, case.head_dim, case.causal or case.kind != "softmax")
        inst = dict(seed=seed, tokens=int(lens.sum()), flops_fwd=flops)
        impls = {"hyperrec": partial(impl_hyperrec, case, *inputs[2:], inputs[1], lens,
                                     "triton" if device != "cuda" else "auto")}  # fmt: skip
        if case.max_len <= PACKED_MAX_LEN:
            for name, cfg in _packed_configs(case, device).items():
                impls[name] = partial(impl_hyperrec_packed, case, *inputs[2:], inputs[1], lens,
                                      cfg)  # fmt: skip
        if case.kind == "softmax" and flex_compiled is not None:
            impls["flex"] = partial(impl_flex, case, *inputs[2:], inputs[1], lens, info,
                                    flex_compiled)  # fmt: skip
            if static is not None and seed < args.static_instances:
                impls["flex_static"] = partial(impl_flex, case, *inputs[2:], inputs[1], lens,
                                               info, static)  # fmt: skip
        if hstu is not None:
            impls["hstu_triton"] = partial(impl_hstu, case, *inputs[2:], inputs[1], lens, hstu)
        impls["sdpa_padded"] = partial(impl_padded, case, *inputs[2:], inputs[1], lens)
        outs = {}
        for name, make in impls.items():
            try:
                fwd, fwd_bwd, out_fn = make()
                if out_fn is not None and seed == 0:
                    outs[name] = out_fn().float()
            except Exception as e:
                info["results"].setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"[:400]
                continue
            if name in ("flex", "flex_static"):  # its per-instance setup, outside the timing
                inst[f"{name}/mask_build_ms"] = info.pop("_last_mask_build_ms", None)
            if name == "hyperrec":  # ours: a new offsets object builds schedules and checks
                try:
                    firsts = first_calls_hyperrec(
                        case, *inputs[2:], inputs[1], lens, "triton" if device != "cuda" else "auto"
                    )
                    inst.update({f"hyperrec/{k}": v for k, v in firsts.items()})
                except Exception as e:
                    info["results"].setdefault(name, {})["first_call_error"] = str(e)[:400]
            for key, fn, mult in (("fwd", fwd, 1.0), ("fwd_bwd", fwd_bwd, 3.5)):
                try:
                    fn()  # compile / tune / build schedules outside the timing
                    if device == "cuda":
                        torch.cuda.synchronize()
                    ms = bench_ms(fn, device)
                    dev = device_and_host(fn, device=device)
                except Exception as e:
                    err = f"{type(e).__name__}: {e}"[:400]
                    info["results"].setdefault(name, {})[f"{key}_error"] = err
                    if args.verbose:
                        traceback.print_exc()
                    continue
                inst[f"{name}/{key}_ms"] = ms
                inst[f"{name}/{key}_device_ms"] = dev["device_ms"]
                inst[f"{name}/{key}_host_us"] = dev["host_us"]
                inst[f"{name}/{key}_host_hidden"] = dev["host_hidden"]
                by = timings.setdefault(name, {})
                by.setdefault(key, []).append(mult * flops / ms * 1e-9)
                by.setdefault(f"{key}_device", []).append(mult * flops / dev["device_ms"] * 1e-9)
        if "hyperrec" in outs:  # same math: the outputs agree to bf16 rounding
            info["max_abs_diff_vs_hyperrec"] = {
                n: float((o - outs["hyperrec"]).abs().max()) for n, o in outs.items()
                if n != "hyperrec"
            }  # fmt: skip
        info["instances"].append(inst)
        del inputs, lens, impls, outs
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, by_pass in timings.items():
        res = info["results"].setdefault(name, {})
        for key, values in by_pass.items():
            res[f"{key}_tflops"] = _stats(values)
        for key in ("fwd", "fwd_bwd"):
            host = [i[f"{name}/{key}_host_us"] for i in info["instances"]
                    if f"{name}/{key}_host_us" in i]  # fmt: skip
            if host:
                res[f"{key}_host_us"] = _stats(host)
    ours = timings.get("hyperrec", {})
    for peer in ("flex", "flex_static", "sdpa_padded", "hstu_triton", "hyperrec_packed",
                 "hyperrec_packed_m64"):  # fmt: skip
        for key in ("fwd", "fwd_bwd", "fwd_device", "fwd_bwd_device"):
            theirs = timings.get(peer, {}).get(key)
            if ours.get(key) and theirs:
                n = len(theirs)  # flex_static ran on the first instances only
                ratios = [a / b for a, b in zip(ours[key][:n], theirs)]
                info["results"][peer][f"{key}_ratio_hyperrec_over_peer"] = _stats(ratios)
    return info


def print_table(cases: list[dict], ceiling: float | None) -> None:
    if ceiling:
        print(f"\nbf16 matmul ceiling measured in this run: {ceiling:.0f} TFLOP/s")
    print("TFLOP/s (useful FLOPs): median over instances (min), spread = max/min of instances")

    def cell(r, name, key):
        s = r.get(name, {}).get(f"{key}_tflops")
        return f"{s['median']:6.0f} ({s['min']:4.0f}) x{s['spread']:.2f}" if s else " " * 19

    def ratio(r, name, key):
        s = r.get(name, {}).get(f"{key}_ratio_hyperrec_over_peer")
        return f"{s['median']:5.2f}" if s else "    -"

    print("'fwd'/'fwd_bwd': do_bench per call (the host's issue time counts where it exceeds "
          "the GPU's); '_device': the GPU's time alone (host hidden)")  # fmt: skip
    for key in ("fwd", "fwd_device", "fwd_bwd", "fwd_bwd_device"):
        print(f"\n{key}: {'case':32s} {'hyperrec':>19s} {'flex':>19s} {'sdpa_padded':>19s}"
              f"  ours/flex ours/flex_static ours/pad ours/hstu")  # fmt: skip
        for c in cases:
            r = c["results"]
            print(f"     {c['name']:32s} {cell(r, 'hyperrec', key)} {cell(r, 'flex', key)} "
                  f"{cell(r, 'sdpa_padded', key)}  {ratio(r, 'flex', key)}     "
                  f"{ratio(r, 'flex_static', key)}          {ratio(r, 'sdpa_padded', key)}    "
                  f"{ratio(r, 'hstu_triton', key)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="JSON directory")
    parser.add_argument("--quick", action="store_true", help="three cases (~3 minutes)")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter")
    parser.add_argument("--instances", type=int, default=10, help="fresh instances per case")
    parser.add_argument("--static-instances", type=int, default=1,
                        help="instances timed with exact-shape FlexAttention")  # fmt: skip
    parser.add_argument("--hstu", default=None, help="path holding generative_recommenders/")
    parser.add_argument("--only", default=None, help="run cases whose name contains this")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start no new case after this many minutes (default 7.5; "
                             "2.7 with --quick)")  # fmt: skip
    args = parser.parse_args()
    budget = args.budget_min if args.budget_min is not None else (2.7 if args.quick else 7.5)
    sys.path.insert(0, str(HERE.parents[1] / "testing" / "src"))
    from hyperrec.testing import write_result

    t_start = time.perf_counter()
    if args.smoke:
        from torch.nn.attention.flex_attention import flex_attention

        os.environ.setdefault("TRITON_INTERPRET", "1")
        # eager FlexAttention: exercises the code path, no compiler needed on the CPU
        device, cases, flex_compiled, ceiling = "cpu", SMOKE, flex_attention, None
        args.instances = min(args.instances, 2)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_attention.py needs a CUDA GPU (or --smoke)")
        from torch.nn.attention.flex_attention import flex_attention

        device = "cuda"
        cases = QUICK if args.quick else CASES
        flex_compiled = torch.compile(flex_attention, dynamic=True)
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    if device == "cuda":
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(min(len(cases), 12), mp_context=ctx) as ex:
            errors = [e for e in ex.map(_warm, cases) if e]
        print(f"compiled hyperrec kernels in {time.perf_counter() - t0:.0f}s {errors}",
              flush=True)  # fmt: skip
        ceiling = matmul_ceiling()
    suffix = "smoke" if args.smoke else ("quick" if args.quick else "h200")
    path = args.out / f"attention_{suffix}.json"
    rows: list[dict] = []

    def save():
        write_result(path, {
            "benchmark": "jagged attention / GDPA, bf16, useful FLOPs (bwd = 2.5x fwd), "
                         f"{args.instances} fresh instances per case",
            "timing": "<impl>/<pass>_ms: do_bench (L2 flushed; the GPU's wait for the host "
                      "counts when a call's Python outlasts the flush); <pass>_device_ms: "
                      "the GPU's time alone (host hidden behind a head start); "
                      "<pass>_host_us: the host's time to issue one call; "
                      "hyperrec/<pass>_first_call_ms: wall time of the first call with a new "
                      "offsets object (schedules + value checks), *_cached_call_ms the next; "
                      "flex/mask_build_ms: its per-instance block mask (outside its timings)",
            "bf16_matmul_ceiling_tflops": ceiling,
            "hstu_configs_kept": _HSTU.get("configs"),
            "seconds": time.perf_counter() - t_start,
            "skipped_for_time": skipped,
            "cases": rows,
        })  # fmt: skip

    skipped: list[str] = []
    for case in cases:
        if time.perf_counter() - t_start > 60 * budget:
            skipped.append(case.name)
            continue
        t0 = time.perf_counter()
        rows.append(run_case(case, args, device, flex_compiled))
        save()  # after every case, so an interrupted run keeps what it measured
        summary = {n: {k: round(v["median"]) for k, v in r.items() if k.endswith("tflops")}
                   for n, r in rows[-1]["results"].items()}  # fmt: skip
        print(f"{case.name}: {time.perf_counter() - t0:.0f}s {summary}", flush=True)
    save()
    print_table(rows, ceiling)
    print(f"{time.perf_counter() - t_start:.0f}s; skipped for time: {skipped}; wrote {path}")


if __name__ == "__main__":
    main()
