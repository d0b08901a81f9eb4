"""Host side of the Gluon backward kernels (``_bwd_kernel.py``): descriptors and launches.

Called by the package's backward (``_triton._launch.attention_backward``) for calls that
``gluon_unsupported`` accepts; nothing here checks arguments or reads a device value.
"""

from __future__ import annotations

import torch

from hyperrec.jagged_attn._gluon._launch import _MAXNREG, _persistent_grid, _smem_layout

__all__ = ["BLOCK_N", "DEFAULT_STAGES", "block_m", "run_dkdv", "run_dq"]

# Key rows of one work item: two consumer warpgroups of 64 keys each.
BLOCK_N = 128


#: Query rows per streamed tile of the dK/dV kernel at head dim 128, softmax / SiLU: 64
#: rows spill registers in both, which cost SiLU 1.5-1.6x and saved softmax 2-12%
#: (one H200, ``bench/results/bench_gluon_bwd_h200_2026-12-03_m64.json``); read at every
#: launch, switches for benchmarks.
BLOCK_M_D128_SOFTMAX = 64
BLOCK_M_D128_SILU = 32


def block_m(head_dim: int, softmax: bool = True) -> int:
    """Query rows per streamed tile of the dK/dV kernel: 64 at head dim 64; at head dim
    128 :data:`BLOCK_M_D128_SOFTMAX` or :data:`BLOCK_M_D128_SILU`."""
    if head_dim <= 64:
        return 64
    return BLOCK_M_D128_SOFTMAX if softmax else BLOCK_M_D128_SILU


#: Depth of the query/dO ring (three stages: 112-160 KiB of shared memory at head dim 128).
DEFAULT_STAGES = 3
#: Which kernel computes dQ: ``"gluon"`` (``jagged_bwd_dq_kernel`` after the dK/dV
#: kernel), ``"triton"`` (the package's Triton dQ kernel after it) or ``"fused"`` (the
#: dK/dV kernel itself, with bulk reduce-adds into an fp32 buffer: five GEMMs per tile pair
#: instead of seven; softmax, and SiLU at head dim 64, see :func:`fused_dq_supported`; not
#: with ``deterministic``: the adds' order varies between runs); read at every call, a
#: switch for benchmarks.
DQ_KERNEL = "gluon"
#: Key rows per tile of the dQ kernel and the depth of its K/V ring.
DQ_BLOCK_N = 64
DQ_STAGES = 3
#: Issue ``dV += P^T dO`` before ``dS^T`` is computed (``EARLY_DV`` in the kernel); read at
#: every launch, a switch for benchmarks.
EARLY_DV = True
#: Both kernels claim work items from a global counter (``GluonConfig.dynamic`` of the
#: forward); off: the static snake order. Read at every launch, a switch for benchmarks;
#: ``JAGGED_ATTN_GLUON_DYNAMIC=0`` turns it off too.
DYNAMIC = True
_OPTIONS = {"num_warps": 4, "maxnreg": _MAXNREG}


def fused_dq_supported(head_dim: int, softmax: bool) -> bool:
    """Whether the dK/dV kernel can add dQ itself: 64-row query tiles (one warpgroup MMA's
    rows), which SiLU at head dim 128 cannot afford (registers)."""
    return softmax or head_dim <= 64


def _dqa_descriptor(dqa: torch.Tensor, rows: int, cols: int) -> object:
    """The fused dQ's fp32 accumulator as ``(T, H * D)`` with unswizzled ``[rows, cols]``
    boxes (a swizzled box is limited to 128-byte rows)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(dqa, shape=[dqa.shape[0], dqa.shape[1] * dqa.shape[2]],
                            strides=[dqa.stride(0), 1], block_shape=[rows, cols],
                            layout=layout)  # fmt: skip


def _descriptor(t: torch.Tensor, rows: int, n_heads: int, head_dim: int) -> object:
    """A ``[rows, head_dim]``-box TMA descriptor over ``t`` viewed as ``(T, H * D)``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, shape=[t.shape[0], n_heads * head_dim], strides=[t.stride(0), 1],
                            block_shape=[rows, head_dim],
                            layout=_smem_layout(rows, head_dim, t.dtype))  # fmt: skip


def run_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    schedule: tuple[torch.Tensor, ...],
    *,
    causal: bool,
    softmax: bool,
    qk_scale: float,
    coef: float,
    dk_scale: float,
    num_stages: int = DEFAULT_STAGES,
    dq_accum: torch.Tensor | None = None,
) -> None:
    """Write dK and dV of a validated call into ``dk``/``dv``.

    ``q``, ``grad_out``: ``(Tq, H, D)``; ``k``, ``v``, ``dk``, ``dv``: ``(Tk, H, D)``; all
    with packed heads and 16-byte aligned rows (TMA), ``dk``/``dv`` contiguous. ``lse``,
    ``delta``: ``(H, Tq)`` fp32 (softmax; ignored for SiLU). ``schedule``: ``(q_offsets32,
    kv_offsets32, tile_seq, tile_idx, total, ...)``, the dK/dV kernel's key-tile schedule
    for :data:`BLOCK_N`-key tiles (``_triton._launch._kv_schedule``). ``qk_scale``:
    ``scale * log2(e)`` (softmax) or ``scale`` (SiLU); ``coef``: the output multiplier;
    ``dk_scale``: ``scale`` (softmax) or ``scale * coef`` (SiLU). ``dq_accum``: a zeroed
    ``(Tq, H, D)`` fp32 contiguous buffer to which the kernel adds ``dS K`` (dQ before its
    ``scale``), where :func:`fused_dq_supported`; ``None``: dQ is left to another kernel.
    """
    from hyperrec.jagged_attn._gluon._bwd_kernel import jagged_bwd_dkdv_kernel
    from hyperrec.jagged_attn._triton import _direct
    from hyperrec.jagged_attn._triton._schedule import work_upper_bound

    n_heads, head_dim = q.shape[1], q.shape[2]
    q32, kv32, tile_seq, tile_idx, total = schedule[:5]

    def desc(t: torch.Tensor, rows: int) -> object:
        return _descriptor(t, rows, n_heads, head_dim)

    fused = dq_accum is not None
    bm = 64 if fused else block_m(head_dim, softmax)
    dk_desc = desc(dk, 64)
    # without the fused dQ the kernel does not read dqa_desc: dK's descriptor stands in
    dqa = dk_desc if dq_accum is None else _dqa_descriptor(dq_accum, bm, head_dim // 2)

    if not softmax:
        lse = delta = dk  # never read
    items = work_upper_bound(k.shape[0], kv32.numel() - 1, BLOCK_N) * n_heads
    grid, work, dynamic = _persistent_grid(items, q.device, DYNAMIC, total)
    args = (desc(q, bm), desc(grad_out, bm), desc(k, 64), desc(v, 64), dk_desc, desc(dv, 64),
            dqa, dk, dv, lse, delta, tile_seq, tile_idx,
            q32, kv32, total, work, dk.stride(0), lse.stride(0) if softmax else 0, qk_scale, coef,
            dk_scale)  # fmt: skip
    kw = dict(H=n_heads, HEAD_DIM=head_dim, BLOCK_M=bm, NUM_STAGES=num_stages, CAUSAL=causal,
              ACT=0 if softmax else 1, ISOLATE_ROWS=True,
              EARLY_DV=EARLY_DV, DYNAMIC=dynamic, FUSED_DQ=fused)  # fmt: skip
    key = ("gluon_dkdv", q.dtype, q.device, tuple(sorted(kw.items())))
    _direct.launch(jagged_bwd_dkdv_kernel, grid, key, args, kw, _OPTIONS)


def run_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    schedule: tuple[torch.Tensor, ...],
    *,
    causal: bool,
    softmax: bool,
    qk_scale: float,
    coef: float,
    dq_scale: float,
    block_n: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Write dQ of a validated call into ``dq`` (``(Tq, H, D)``, contiguous).

    ``schedule``: ``(q_offsets32, kv_offsets32, tile_seq, tile_idx, total)``, the forward's
    query-tile schedule for 128-row tiles. ``dq_scale``: ``scale`` (softmax) or ``scale *
    coef`` (SiLU); the rest as in :func:`run_dkdv`. ``block_n``/``num_stages``: default
    :data:`DQ_BLOCK_N` / :data:`DQ_STAGES`.
    """
    from hyperrec.jagged_attn._gluon._bwd_kernel import jagged_bwd_dq_kernel
    from hyperrec.jagged_attn._triton import _direct
    from hyperrec.jagged_attn._triton._schedule import work_upper_bound

    n_heads, head_dim = q.shape[1], q.shape[2]
    block_n = DQ_BLOCK_N if block_n is None else block_n
    num_stages = DQ_STAGES if num_stages is None else num_stages
    q32, kv32, tile_seq, tile_idx, total = schedule[:5]

    def desc(t: torch.Tensor, rows: int) -> object:
        return _descriptor(t, rows, n_heads, head_dim)

    if not softmax:
        lse = delta = dq  # never read
    items = work_upper_bound(q.shape[0], q32.numel() - 1, 2 * 64) * n_heads
    grid, work, dynamic = _persistent_grid(items, q.device, DYNAMIC, total)
    args = (desc(q, 64), desc(grad_out, 64), desc(k, block_n), desc(v, block_n), desc(dq, 64),
            dq, lse, delta, tile_seq, tile_idx, q32, kv32, total, work, dq.stride(0),
            lse.stride(0) if softmax else 0, qk_scale, coef, dq_scale)  # fmt: skip
    kw = dict(H=n_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_STAGES=num_stages,
              CAUSAL=causal, ACT=0 if softmax else 1, ISOLATE_ROWS=True,
              DYNAMIC=dynamic)  # fmt: skip
    key = ("gluon_dq", q.dtype, q.device, tuple(sorted(kw.items())))
    _direct.launch(jagged_bwd_dq_kernel, grid, key, args, kw, _OPTIONS)
