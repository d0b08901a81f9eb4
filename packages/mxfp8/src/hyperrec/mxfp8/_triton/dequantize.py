"""The MX dequantizer: one pass, ``decode(data) * 2**(scale - 127)``, for FP8 elements
and (since 0.4.3) MX4's E2M1 codes packed two to a byte.

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
    D, DB, S, OUT, n_rows, width, stride_d, stride_sr, stride_sc, stride_o,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, FP4: tl.constexpr,
    E5M2: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (r < n_rows)[:, None] & (c < width)[None, :]
    r64 = r.to(tl.int64)[:, None]
    if FP4:
        # element 2i in the low nibble of byte i, 2i + 1 in the high one (each byte is
        # read by its two columns: the second read hits the cache)
        byte = tl.load(D + r64 * stride_d + (c // 2)[None, :], mask=ok, other=0).to(tl.int32)
        code = tl.where((c % 2 == 0)[None, :], byte & 0xF, byte >> 4)
        # E2M1: 0, 0.5 (subnormal), then (1 + m / 2) * 2**(e - 1): 1, 1.5, 2, 3, 4, 6
        e = (code >> 1) & 3
        half = (code & 1).to(tl.float32) * 0.5
        p2 = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))
        mag = tl.where(e == 0, half, (1.0 + half) * p2)
        x = tl.where((code & 8) != 0, -mag, mag)
    else:
        x = tl.load(D + r64 * stride_d + c[None, :], mask=ok, other=0.0).to(tl.float32)
        # NaN and Inf codes from their bits (the same bytes through a uint8 view; the
        # second read hits the cache): Triton's interpreter converts them as if they were
        # finite (E4M3 0x7F read as 480, E5M2 0x7C as 65536)
        bits = tl.load(DB + r64 * stride_d + c[None, :], mask=ok, other=0).to(tl.int32)
        if E5M2:
            special = (bits & 0x7C) == 0x7C
            inf = tl.where(bits >= 128, float("-inf"), float("inf"))
            x = tl.where(special, tl.where((bits & 3) == 0, inf, float("nan")), x)
        else:
            x = tl.where((bits & 0x7F) == 0x7F, float("nan"), x)
    # the scale byte of each element's block (repeated loads of one byte hit the cache)
    b = tl.load(S + r64 * stride_sr + (c // BLOCK)[None, :] * stride_sc, mask=ok,
                other=127).to(tl.int32)  # fmt: skip
    # E8M0: 2**(b - 127) from the exponent field; b = 0 is 2**-127, a float32 subnormal
    s = tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)
    y = tl.where(b == 255, float("nan"), x * s)
    tl.store(OUT + r.to(tl.int64)[:, None] * stride_o + c[None, :], y.to(OUT.dtype.element_ty),
             mask=ok)  # fmt: skip


def dequantize_rows(
    data: torch.Tensor,
    scale: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    fp4_width: int | None = None,
) -> torch.Tensor:
    """``(rows, width)`` FP8 ``data`` blocked along the last dim with ``(rows,
    ceil(width / block_size))`` E8M0 ``scale`` (any strides: the quantizer stores scales
    column-major) -> ``(rows, width)`` in ``dtype``. With ``fp4_width``, ``data`` is
    ``(rows, ceil(fp4_width / 2))`` bytes of E2M1 codes two to a byte (low nibble first)
    and the output ``(rows, fp4_width)``; every E2M1 value times a power of two is exact in
    float32, so the one rounding to ``dtype`` gives the reference's bits. ``data``'s last
    dim must be contiguous (the caller checks)."""
    rows = data.shape[0]
    width = data.shape[1] if fp4_width is None else fp4_width
    out = torch.empty((rows, width), dtype=dtype, device=data.device)
    if rows and width:
        grid = (triton.cdiv(rows, _ROWS), triton.cdiv(width, _COLS))
        raw = data.view(torch.uint8)  # MX4 data may be typed torch.float4_e2m1fn_x2
        _dequant_rows_kernel[grid](
            raw if fp4_width is not None else data, raw, scale, out, rows, width, data.stride(0),
            scale.stride(0), scale.stride(1), out.stride(0),
            BLOCK=block_size, ROWS=_ROWS, COLS=_COLS, FP4=fp4_width is not None,
            E5M2=data.dtype == torch.float8_e5m2, num_warps=4,
        )  # fmt: skip
    return out
