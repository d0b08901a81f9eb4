"""Small Triton helpers shared by the kernels: E8M0 decoding, the counter hash, the
scale rule and element encoding. Each mirrors a function of ``reference.py`` exactly."""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["interpreting"]


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def hash32(x):
    """lowbias32 of uint32 ``x`` (reference.hash32)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def e8m0_to_f32(s):
    """E8M0 bytes -> float32 (byte 0 is the FP32 subnormal 2**-127; 255 is NaN)."""
    b = s.to(tl.int32)
    bits = tl.where(b == 0, 4194304, b << 23)
    f = bits.to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), f)


@triton.jit
def e8m0_byte(amax_bits, EMAX: tl.constexpr, MAXV: tl.constexpr, RCEIL: tl.constexpr):
    """Scale byte (int32) from the int32 bits of the block amax (reference.e8m0_scale)."""
    if RCEIL:
        d = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), MAXV)
        db = d.to(tl.int32, bitcast=True)
        biased = db >> 23
        mant = db & 0x7FFFFF
        e = tl.where(
            biased > 0,
            biased - 127 + (mant != 0).to(tl.int32),
            -127 + (mant > 4194304).to(tl.int32),
        )
    else:
        e = (amax_bits >> 23) - 127 - EMAX
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(amax_bits >= 0x7F800000, 255, e + 127)


@triton.jit
def inv_scale(byte):
    """2**-(byte - 127) as float32 (always a normal number); NaN for the NaN byte."""
    e = byte - 127
    inv = ((127 - tl.minimum(e, 126)) << 23).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), inv)


@triton.jit
def encode(
    y,
    r,
    FMT: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAXV: tl.constexpr,
    SR: tl.constexpr,
    HW: tl.constexpr,
):
    """Element bytes (uint8) of scaled values ``y`` (reference.round_to_format + encode).

    FMT 0/1/2 = E4M3/E5M2/E2M1 (E2M1 gives 4-bit codes, unpacked). ``HW`` uses the
    hardware's round-to-nearest-even saturating FP8 conversion; otherwise the rounding is
    done in integer arithmetic (exact everywhere, the interpreter included). ``r`` holds
    23 random bits per element when ``SR``.
    """
    if HW and (not SR) and FMT != 2:
        v = tl.clamp(y, -MAXV, MAXV, propagate_nan=tl.PropagateNan.ALL)
    else:
        sign = y.to(tl.int32, bitcast=True) & -2147483648
        a = tl.abs(y)
        biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.maximum(biased - 127, EMIN) - MBITS
        inv_ulp = ((127 - e) << 23).to(tl.float32, bitcast=True)
        ulp = ((127 + e) << 23).to(tl.float32, bitcast=True)
        q = a * inv_ulp  # exact: |y| / ulp < 2**(MBITS + 2)
        if SR:
            fixed = (q * 8388608.0).to(tl.int32)
            rq = ((fixed + r) >> 23).to(tl.float32)
        else:
            fl = q.to(tl.int32)
            frac = q - fl.to(tl.float32)
            up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
            rq = (fl + up.to(tl.int32)).to(tl.float32)
        mag = tl.minimum(rq * ulp, MAXV)
        v = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    if FMT == 0:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif FMT == 1:
        code = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        m = tl.abs(v)
        c = tl.where(m < 2.0, m * 2.0, tl.where(m < 4.0, m + 2.0, m * 0.5 + 4.0)).to(tl.int32)
        neg = v.to(tl.int32, bitcast=True) < 0
        code = tl.where(neg, c | 8, c).to(tl.uint8)
    return code


@triton.jit
def activation(x, ACT: tl.constexpr):
    """Producer activations in FP32 (reference.apply_activation): 0 none, 1 relu,
    2 relu2, 3 silu, 4 gelu_tanh."""
    if ACT == 1:
        x = tl.where(x > 0, x, 0.0)
    elif ACT == 2:
        x = tl.where(x > 0, x, 0.0)
        x = x * x
    elif ACT == 3:
        x = x / (1.0 + tl.exp(-x))
    elif ACT == 4:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # tanh through exp so the interpreter and the GPU share one formula; clamp keeps
        # exp finite.
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(u, -15.0), 15.0)) + 1.0)
        x = 0.5 * x * (1.0 + t)
    return x
