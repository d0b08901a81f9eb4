"""Triton kernels of the ``"mxint8"`` save format: one pass to pack, one to unpack.

Bit-identical to the PyTorch path in :mod:`hyperrec.autoac.formats` (tests compare them
under ``TRITON_INTERPRET=1``). Each program handles ``BLOCKS`` blocks of 32 consecutive
elements of the flat storage.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCKS = 64  # 2,048 elements a program


@triton.jit
def _program_blocks(n_blocks, BLOCKS: tl.constexpr):
    """This program's block indices, their elements' offsets ``(BLOCKS, 32)`` and which
    blocks exist."""
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    return b, b[:, None] * 32 + tl.arange(0, 32)[None, :], b < n_blocks


@triton.jit
def _pack_kernel(x_ptr, q_ptr, s_ptr, n_blocks, BLOCKS: tl.constexpr):
    b, offs, inside = _program_blocks(n_blocks, BLOCKS)
    x = tl.load(x_ptr + offs, mask=inside[:, None], other=0.0).to(tl.float32)
    ax = tl.abs(x)
    # max() may drop NaN (fmaxf semantics): detect non-finite elements separately.
    bad = tl.max(((x != x) | (ax == float("inf"))).to(tl.int32), 1) > 0
    amax = tl.max(ax, 1)
    # floor(log2 amax) from the exponent field; zero and subnormal amax give -127 and are
    # raised to the format's smallest exponent, -120.
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -120)
    factor = ((133 - e) << 23).to(tl.float32, bitcast=True)  # 2**(6 - e), exact
    v = x * factor[:, None]  # |v| < 128, exact
    # round half to even: adding and subtracting 1.5 * 2**23 rounds |v| < 2**22 in fp32
    r = (v + 12582912.0) - 12582912.0
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(bad[:, None], 0.0, r)
    tl.store(q_ptr + offs, r.to(tl.int8), mask=inside[:, None])
    tl.store(s_ptr + b, tl.where(bad, 255, e + 127).to(tl.uint8), mask=inside)


@triton.jit
def _unpack_kernel(q_ptr, s_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    b, offs, inside = _program_blocks(n_blocks, BLOCKS)
    q = tl.load(q_ptr + offs, mask=inside[:, None], other=0).to(tl.float32)
    s = tl.load(s_ptr + b, mask=inside, other=127).to(tl.int32)
    # 2**(s - 127 - 6): biased exponent s - 6 (s >= 7 for every finite block)
    f = ((s - 6) << 23).to(tl.float32, bitcast=True)
    f = tl.where(s == 255, float("nan"), f)
    out = q * f[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside[:, None])


def pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data int8 (rows, width), scale uint8 (rows, width // 32))`` of a contiguous
    ``(rows, width)`` float tensor."""
    rows, width = x.shape
    n_blocks = rows * width // 32
    data = torch.empty(rows, width, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, width // 32, dtype=torch.uint8, device=x.device)
    if n_blocks:
        grid = (triton.cdiv(n_blocks, _BLOCKS),)
        _pack_kernel[grid](x, data, scale, n_blocks, BLOCKS=_BLOCKS)
    return data, scale


def unpack(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of ``(data, scale)`` in ``dtype``, shape ``data.shape``."""
    n_blocks = data.numel() // 32
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    if n_blocks:
        grid = (triton.cdiv(n_blocks, _BLOCKS),)
        _unpack_kernel[grid](data, scale, out, n_blocks, BLOCKS=_BLOCKS)
    return out
