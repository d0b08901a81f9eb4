"""Launcher of the projection with Q/K/V quantization in its epilogue
(:func:`hyperrec.jagged_attn.fp8.linear_quantize_qkv`, ``_fp8_kernels._proj_quant_kernel``).

Takes validated input. The kernel's tiles are the quantization's (token tiles of one
sequence x one head), so the GEMM is a plain Triton GEMM with a jagged row schedule: no
host read of a length, one launch for every chunk of the projection.
"""

from __future__ import annotations

import torch

from hyperrec.jagged_attn._triton import _fp8_kernels, interpreting
from hyperrec.jagged_attn._triton._fp8_launch import _device_signs, _pow2, qkv_buffers, rceil_e4m3
from hyperrec.jagged_attn._triton._schedule import as_int32, q_tile_schedule, work_upper_bound
from hyperrec.jagged_attn.fp8 import FP8Config, QuantizedQKV

__all__ = ["PROJ_BLOCK_K", "PROJ_NUM_STAGES", "PROJ_NUM_WARPS", "linear_quantize_qkv"]

#: Reduction step of the GEMM (elements of ``x``'s last dim per iteration). Untuned: no GPU
#: timing of the fused projection has been made yet (see the package README).
PROJ_BLOCK_K = 64
#: Warps and pipeline stages of the fused projection (untuned, as above).
PROJ_NUM_WARPS = 8
PROJ_NUM_STAGES = 3
#: Token rows per program for ``"mxfp8"`` (any multiple of 32 gives the same bytes: MX
#: blocks run along the head dim for Q/K and over 32 tokens for V).
MX_TILE = 128


def _tile(config: FP8Config) -> int:
    if config.mx:
        return MX_TILE
    # every Q and K/V scale block must lie inside one program's rows
    return max(32, config.q_block, config.kv_block)


def linear_quantize_qkv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    *,
    heads: int,
    chunks: str,
    silu: bool,
    config: FP8Config,
    v_mma_order: bool = False,
    store_z: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedQKV]:
    """``(y, z, qkv)``: ``y = act(x @ weight^T + bias)`` ``(T, N)`` in ``x.dtype``, ``z``
    (the pre-activation, ``x.dtype``) when ``store_z`` else None, and the chunks of ``y``
    named ``q``/``k``/``v`` in ``chunks`` quantized as
    :func:`~hyperrec.jagged_attn._triton._fp8_launch.quantize_qkv` quantizes them (no key
    shift). ``x`` ``(T, K)`` with a contiguous last dim; ``weight`` ``(N, K)`` contiguous,
    ``N = len(chunks) * heads * D``."""
    total, k_dim = x.shape
    n_out = weight.shape[0]
    n_chunks = len(chunks)
    dim = n_out // (n_chunks * heads)
    device = x.device
    mx = config.mx
    assert not (mx and v_mma_order), "v_mma_order is for format 'fp8' only"
    n_seq = offsets.numel() - 1
    off = as_int32(offsets)
    y = torch.empty((total, n_out), dtype=x.dtype, device=device)
    z = torch.empty_like(y) if store_z else None
    qkv = qkv_buffers(total, total, n_seq, heads, dim, dim, off, config, device, v_mma_order)
    qd, kd, vd = (t.data.view(torch.uint8) for t in (qkv.q, qkv.k, qkv.v))
    qs, ks, vs = qkv.q.scale, qkv.k.scale, qkv.v.scale
    poff = qkv.v.pad_offsets
    add, odd = rceil_e4m3(config)
    group_q, group_kv = (32, 32) if mx else (config.q_block, config.kv_block)
    if total == 0 or heads == 0 or n_out == 0:
        return y, z, qkv
    if k_dim == 0:  # nothing to reduce: the GEMM is zero (kept out of the kernel's loop)
        x = x.new_zeros((total, 1))
        weight = weight.new_zeros((n_out, 1))
        k_dim = 1
    tile = _tile(config)
    seq, idx, tot = q_tile_schedule(off, off, None, tile, False, total)
    tiles = work_upper_bound(total, n_seq, tile)
    rotate = config.rotates(dim)
    signs = _device_signs(dim, config.hadamard_seed, device) if rotate else qs
    vs_strides = (vs.stride(1), vs.stride(0)) if mx else (vs.stride(0), vs.stride(1))
    _fp8_kernels._proj_quant_kernel[(tiles * heads * n_chunks,)](
        x, weight, weight if bias is None else bias, y, y if z is None else z,
        qd, kd, vd, qs, ks, vs, signs, off, poff, seq, idx, tot, k_dim,
        x.stride(0), weight.stride(0), y.stride(0), y.stride(0),
        qd.stride(0), qd.stride(1), kd.stride(0), kd.stride(1), vd.stride(1), vd.stride(0),
        qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), *vs_strides,
        H=heads, D=dim, BD=_pow2(dim), BK=min(PROJ_BLOCK_K, max(16, _pow2(k_dim))),
        TILE=tile, GROUP_Q=group_q, GROUP_KV=group_kv, MODE_QK=1 if mx else 0,
        MODE_V=2 if mx else 0, POW2=config.scale_rule == "pow2", HADAMARD=rotate,
        LOG2D=max(dim.bit_length() - 1, 0), ADD=add, ODD=odd,
        CHUNK_Q=chunks.index("q"), CHUNK_K=chunks.index("k"), CHUNK_V=chunks.index("v"),
        HAS_BIAS=bias is not None, SILU=silu, STORE_Z=store_z,
        DOT_F32=interpreting() or x.dtype == torch.float32, V_MMA_ORDER=v_mma_order,
        N_CHUNKS=n_chunks, num_warps=PROJ_NUM_WARPS, num_stages=PROJ_NUM_STAGES,
    )  # fmt: skip
    return y, z, qkv
