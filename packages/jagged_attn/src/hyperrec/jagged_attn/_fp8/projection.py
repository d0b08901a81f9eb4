"""The body of :func:`hyperrec.jagged_attn.fp8.linear_quantize_qkv`: the fused kernel with
its autograd, or PyTorch's linear followed by the reference quantizer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hyperrec.jagged_attn._fp8.quantize import use_fp8_kernel
from hyperrec.jagged_attn.fp8 import FP8Config, QuantizedJagged, QuantizedQKV

__all__ = ["linear_quantize_qkv"]


class _FusedProjection(torch.autograd.Function):
    """``y = act(x W^T + b)`` by the fused kernel; the quantized tensors ride along as
    non-differentiable outputs. The backward is PyTorch's (two GEMMs and a bias sum), with
    SiLU's derivative from the pre-activation the kernel stored."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        offsets: torch.Tensor,
        heads: int,
        chunks: str,
        silu: bool,
        config: FP8Config,
        v_mma_order: bool,
    ) -> tuple[torch.Tensor, ...]:
        from hyperrec.jagged_attn._triton._fp8_proj import linear_quantize_qkv as kernel

        grad = any(ctx.needs_input_grad[:3])
        y, z, qkv = kernel(x, weight, bias, offsets, heads=heads, chunks=chunks, silu=silu,
                           config=config, v_mma_order=v_mma_order,
                           store_z=grad and silu)  # fmt: skip
        ctx.silu, ctx.has_bias = silu, bias is not None
        if grad:
            ctx.save_for_backward(x, weight, z if silu else y)
        assert qkv.v.pad_offsets is not None
        quantized = (qkv.q.data, qkv.q.scale, qkv.k.data, qkv.k.scale, qkv.v.data, qkv.v.scale,
                     qkv.v.pad_offsets)  # fmt: skip
        ctx.mark_non_differentiable(*quantized)
        return (y, *quantized)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *unused: Any) -> tuple[torch.Tensor | None, ...]:
        x, weight, z = ctx.saved_tensors
        if ctx.silu:
            zf = z.float()
            s = torch.sigmoid(zf)
            dz = (dy.float() * s * (1.0 + zf * (1.0 - s))).to(dy.dtype)
        else:
            dz = dy
        dx = dz @ weight if ctx.needs_input_grad[0] else None
        dw = dz.T @ x if ctx.needs_input_grad[1] else None
        db = dz.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None


def linear_quantize_qkv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    *,
    heads: int,
    chunks: str,
    activation: str,
    config: FP8Config,
    backend: str,
    v_mma_order: bool,
) -> tuple[torch.Tensor, QuantizedQKV]:
    """Arguments checked by the public function."""
    silu = activation == "silu"
    if use_fp8_kernel(backend, x, "run the fused projection"):
        # The kernel indexes bias, offsets and weight rows as dense arrays (a strided view
        # would be read as other values) and x by its row stride only.
        x = x if x.stride(-1) == 1 else x.contiguous()
        bias = None if bias is None else bias.contiguous()
        out = _FusedProjection.apply(x, weight.contiguous(), bias, offsets.contiguous(), heads,
                                     chunks, silu, config, v_mma_order)  # fmt: skip
        y, qd, qs, kd, ks, vd, vs, poff = out
        qkv = QuantizedQKV(
            q=QuantizedJagged(data=qd, scale=qs, layout="rows"),
            k=QuantizedJagged(data=kd, scale=ks, layout="rows"),
            v=QuantizedJagged(
                data=vd, scale=vs, layout="cols", pad_offsets=poff, mma_order=v_mma_order
            ),  # fmt: skip
            config=config,
        )
        return y, qkv
    from hyperrec.jagged_attn import reference_fp8

    y = F.linear(x, weight, bias)
    if silu:
        y = F.silu(y)
    parts = reference_fp8.projection_chunks(y.detach(), heads, chunks)
    qkv = reference_fp8.quantize_qkv(parts["q"], parts["k"], parts["v"], offsets, offsets, config)
    if v_mma_order:
        qkv = _to_mma_order(qkv, offsets, y.shape[0])
    return y, qkv


def _to_mma_order(qkv: QuantizedQKV, offsets: torch.Tensor, total: int) -> QuantizedQKV:
    # The reference writes V in token order; permute each sequence's columns.
    from dataclasses import replace

    from hyperrec.jagged_attn.fp8 import mma_column
    from hyperrec.jagged_attn.reference_fp8 import _positions

    v = qkv.v
    assert v.pad_offsets is not None
    seq, pos = _positions(offsets, total)
    base = v.pad_offsets.long()[seq]
    data = torch.zeros_like(v.data.view(torch.uint8))
    data[:, :, base + mma_column(pos)] = v.data.view(torch.uint8)[:, :, base + pos]
    moved = replace(v, data=data.view(torch.float8_e4m3fn), mma_order=True)
    return replace(qkv, v=moved)
