"""Host side of the Gluon FP8 forward (``_fp8_kernel.py``): which calls it serves, the
descriptors, the launch.

The package's FP8 launcher (``_triton._fp8_launch.attention_forward_fp8``) calls
:func:`run` for the calls :func:`fp8_unsupported` accepts, with operands that
:func:`~hyperrec.jagged_attn._triton._fp8_launch.quantize_qkv` produced; nothing here reads
a device value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyperrec.jagged_attn._gluon import _launch
from hyperrec.jagged_attn._gluon._launch import (
    _MAXNREG,
    _SMEM_LIMIT,
    _WG_ROWS,
    BLOCK_M,
    _persistent_grid,
    _smem_layout,
)
from hyperrec.jagged_attn.fp8 import FP8Config, QuantizedQKV

__all__ = ["GluonFP8Config", "fp8_shared_memory_bytes", "fp8_unsupported", "run"]


@dataclass(frozen=True, kw_only=True)
class GluonFP8Config:
    """Pipeline parameters of the Gluon FP8 forward (key tiles are the P tile, 128)."""

    num_stages: int = 3
    """Depth of the shared-memory K/V ring (E4M3 tiles are half the bf16 kernel's)."""
    pingpong: bool = True
    """The consumers take turns issuing their GEMMs (see ``GluonConfig.pingpong``). With V
    in ``mma_order``, 3-5% faster than without turns on an H200
    (``bench/results/probe_gluon_fp8_h200_2026-12-04.json``)."""
    dynamic: bool = True
    """CTAs claim work items from a counter (see ``GluonConfig.dynamic``)."""
    overlap_pv: bool = False
    """Keep the wait for the previous tile's ``P V`` after this tile's softmax in the
    compiled code (see ``GluonConfig.overlap_pv``; measured 0.94-0.99x, so off)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool):
            raise TypeError(f"num_stages must be an int, got {type(self.num_stages).__name__}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        for name in ("pingpong", "dynamic", "overlap_pv"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


_BLOCK_N = 128


def fp8_shared_memory_bytes(head_dim: int, config: GluonFP8Config, out_size: int = 2) -> int:
    """Shared memory of one CTA: E4M3 Q tiles, the E4M3 K/V ring, the output tiles."""
    q = 2 * _WG_ROWS * head_dim
    ring = 2 * config.num_stages * _BLOCK_N * head_dim
    o = 2 * _WG_ROWS * head_dim * out_size
    return q + ring + o


def fp8_unsupported(config: FP8Config, qkv: QuantizedQKV | None, scale: float) -> str | None:
    """Why the Gluon FP8 forward cannot take a call that the Gluon bf16 forward could
    (``_triton._launch.gluon_unsupported`` is None), or None: ``format="fp8"`` with 128-key P
    tiles (the kernel's key tile), a positive score scale (the exponent is one FMA), and
    operands in the launcher's packed layout."""
    if config.mx:
        return "format 'mxfp8' (no MX tensor cores on Hopper: the Triton kernel dequantizes)"
    if config.tile_n != _BLOCK_N:
        return f"P tiles of {config.tile_n} keys (the kernel's key tile is {_BLOCK_N})"
    if not scale > 0:
        return f"scale {scale} (must be > 0)"
    if qkv is not None and not _packed(qkv):
        return "quantized operands not in the packed layout of quantize_qkv"
    return None


def _packed(qkv: QuantizedQKV) -> bool:
    q8, k8, v8 = qkv.q, qkv.k, qkv.v
    for t in (q8.data, k8.data):
        if t.dim() != 3 or not t.is_contiguous() or t.data_ptr() % 16:
            return False
    vt = v8.data
    if vt.dim() != 3 or not vt.is_contiguous() or vt.data_ptr() % 16 or vt.shape[2] % 16:
        return False
    scales = (q8.scale, k8.scale, v8.scale)
    return all(s.dim() == 2 and s.is_contiguous() and s.dtype == torch.float32 for s in scales)


def run(
    qkv: QuantizedQKV,
    *,
    causal: bool,
    qk_scale: float,
    coef: float,
    softmax: bool,
    schedule: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    lse: torch.Tensor,
    config: GluonFP8Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Gluon FP8 forward.

    ``qkv``: packed operands (:func:`fp8_unsupported`), Q/K ``(T, H, D)`` E4M3, V
    ``(H, D, Tp)`` (in ``mma_order`` or not: the kernel variant follows), float32 ``(T, H)``
    scales. ``qk_scale``: the score multiplier with ``log2(e)`` (softmax) and the
    rotation's ``1 / D`` folded in, > 0; ``coef``: the output multiplier.
    ``schedule``: ``(q_offsets32, kv_offsets32, tile_seq, tile_idx, total)`` for 128-row
    tiles (``_gluon._launch._schedule``). ``out``: ``(Tq, H, D)`` bf16/fp16 contiguous;
    ``lse``: ``(H, Tq)`` float32 (softmax) or empty.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hyperrec.jagged_attn._gluon._fp8_kernel import jagged_fp8_fwd_kernel
    from hyperrec.jagged_attn._triton import _direct
    from hyperrec.jagged_attn._triton._schedule import work_upper_bound

    config = GluonFP8Config() if config is None else config
    q8, k8, v8 = qkv.q, qkv.k, qkv.v
    total_q, heads, dim = q8.data.shape
    n_seq = schedule[0].numel() - 1
    if total_q == 0 or n_seq == 0:
        return out, lse
    smem = fp8_shared_memory_bytes(dim, config, out.element_size())
    if smem > _SMEM_LIMIT:
        raise ValueError(f"config needs {smem} bytes of shared memory, more than {_SMEM_LIMIT}")
    if k8.data.shape[0] == 0:
        out.zero_()
        lse.fill_(math.inf)
        return out, lse

    def desc(t: torch.Tensor, rows: int, cols: int, block: list[int]) -> TensorDescriptor:
        return TensorDescriptor(t, shape=[rows, cols], strides=[cols, 1], block_shape=block,
                                layout=_smem_layout(*block, t.dtype))  # fmt: skip

    hd = heads * dim
    q_desc = desc(q8.data, total_q, hd, [_WG_ROWS, dim])
    k_desc = desc(k8.data, k8.data.shape[0], hd, [_BLOCK_N, dim])
    v_desc = desc(v8.data, hd, v8.data.shape[2], [dim, _BLOCK_N])
    o_desc = desc(out, total_q, hd, [_WG_ROWS, dim])
    q32, kv32, tile_seq, tile_idx, total = schedule
    lse_arg = lse if softmax else torch.empty(1, dtype=torch.float32, device=out.device)
    items = work_upper_bound(total_q, n_seq, BLOCK_M) * heads
    grid, work, dynamic = _persistent_grid(items, out.device, config.dynamic, total)
    args = (q_desc, k_desc, v_desc, o_desc, out, lse_arg, q8.scale, k8.scale, v8.scale,
            tile_seq, tile_idx, q32, kv32, v8.pad_offsets, total, work, out.stride(0), total_q,
            q8.scale.stride(0), qk_scale, coef)  # fmt: skip
    kw = dict(H=heads, HEAD_DIM=dim, BLOCK_N=_BLOCK_N, NUM_STAGES=config.num_stages,
              CAUSAL=causal, ACT=0 if softmax else 1, PINGPONG=config.pingpong,
              PERMUTED_P=v8.mma_order, DYNAMIC=dynamic,
              OVERLAP_PV=config.overlap_pv, TREE_MAX=_launch.ROW_MAX_TREE)  # fmt: skip
    key = ("gluon_fp8_fwd", out.dtype, out.device, tuple(sorted(kw.items())))
    _direct.launch(jagged_fp8_fwd_kernel, grid, key, args, kw, _OPTIONS)
    return out, lse


_OPTIONS = {"num_warps": 4, "maxnreg": _MAXNREG}
