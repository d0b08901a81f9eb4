"""The MX dequantizer for FP8 elements: one pass, ``decode(data) * 2**(scale - 127)``.

The PyTorch reference (``reference.dequantize``) takes four passes through a float32
temporary (decode, expand the scales, multiply, cast). Here each program reads a tile of
FP8 bytes and their scale bytes once and writes the output dtype: 1 + 1/block bytes in,
2 or 4 out per element. The product is formed in float32, exactly as the reference forms
it (an FP8 value times a power of two), and rounded once to the output dtype, so the
results are the reference's bit for bit (on the GPU too, except products below float32's
normal range, where the hardware may flush subnormals: blocks whose scale byte is below
about 10, i.e. ``amax`` under ``2**-110``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dequantize_rows"]

_ROWS = 16
_COLS = 256


@triton.jit
def _dequant_rows_kernel(
    D, S, OUT, n_rows, width, stride_d, stride_sr, stride_sc, stride_o,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (r < n_rows)[:, None] & (c < width)[None, :]
    r64 = r.to(tl.int64)[:, None]
    x = tl.load(D + r64 * stride_d + c[None, :], mask=ok, other=0.0).to(tl.float32)
    # the scale byte of each element's block (repeated loads of one byte hit the cache)
    b = tl.load(S + r64 * stride_sr + (c // BLOCK)[None, :] * stride_sc, mask=ok,
                other=127).to(tl.int32)  # fmt: skip
    # E8M0: 2**(b - 127) from the exponent field; b = 0 is 2**-127, a float32 subnormal
    s = tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)
    y = tl.where(b == 255, float("nan"), x * s)
    tl.store(OUT + r.to(tl.int64)[:, None] * stride_o + c[None, :], y.to(OUT.dtype.element_ty),
             mask=ok)  # fmt: skip


def dequantize_rows(
    data: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``(rows, width)`` FP8 ``data`` blocked along the last dim with ``(rows,
    ceil(width / block_size))`` E8M0 ``scale`` (any strides: the quantizer stores scales
    column-major) -> ``(rows, width)`` in ``dtype``. ``data``'s last dim must be
    contiguous (the caller checks)."""
    rows, width = data.shape
    out = torch.empty((rows, width), dtype=dtype, device=data.device)
    if rows and width:
        grid = (triton.cdiv(rows, _ROWS), triton.cdiv(width, _COLS))
        _dequant_rows_kernel[grid](
            data, scale, out, rows, width, data.stride(0), scale.stride(0), scale.stride(1),
            out.stride(0),
            BLOCK=block_size, ROWS=_ROWS, COLS=_COLS, num_warps=4,
        )  # fmt: skip
    return out
