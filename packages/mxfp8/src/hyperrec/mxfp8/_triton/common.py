"""Small Triton helpers shared by the kernels: E8M0 decoding, the counter hash, the
scale rule and element encoding. Each mirrors a function of ``reference.py`` exactly."""

from __future__ import annotations

import triton
import triton.language as tl


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
    # Bytes 0 and 255 get the top mantissa bit: 2**-127 and a quiet NaN.
    edge = (b - 1).to(tl.uint32, bitcast=True) >= 254
    return ((b << 23) | tl.where(edge, 4194304, 0)).to(tl.float32, bitcast=True)


def scale_constants(max_value: float, emax: int) -> tuple[int, int]:
    """Integer constants of the division-free scale rules (see :func:`e8m0_byte`).

    With ``max_value = c * 2**emax`` (``1 <= c < 2``) and ``T = (c - 1) * 2**23``:
    ``add = 2**23 - 1 - T - emax * 2**23`` and ``odd``, the bits of the one FP32 amax
    whose RCEIL byte the exponent formula gets one too high (the quotient lands in the
    subnormal range and rounds down to ``2**-127``). Exact rational arithmetic.
    """
    from fractions import Fraction

    c = Fraction(max_value) / 2**emax
    if not 1 <= c < 2:
        raise ValueError(f"max_value {max_value} is not c * 2**{emax} with 1 <= c < 2")
    t = int((c - 1) * 2**23)
    # amax / max_value rounds to 2**-127 or below while amax < max_value * (2**-127 +
    # 2**-150); the largest such float32 has bits `odd`.
    limit = Fraction(max_value) * (Fraction(1, 2**127) + Fraction(1, 2**150))
    e = (limit.numerator.bit_length() - limit.denominator.bit_length()) - 1
    while Fraction(2) ** (e + 1) <= limit:
        e += 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    q = limit / ulp
    n = -(-q.numerator // q.denominator) - 1  # the largest multiple of ulp below limit
    v = n * ulp  # a normal float32 (max_value >= 1)
    mant = int((v / Fraction(2) ** e - 1) * 2**23)
    odd = ((e + 127) << 23) | mant
    return 2**23 - 1 - t - (emax << 23), odd


@triton.jit
def e8m0_byte(amax, EMAX: tl.constexpr, RCEIL: tl.constexpr, ADD: tl.constexpr, ODD: tl.constexpr):
    """Scale byte (int32) of a block's FP32 amax (reference.e8m0_scale; NaN/Inf -> 255).

    RCEIL without the division: ``amax / max_value`` rounds above ``2**(E - emax)`` (for
    ``amax`` in ``[2**E, 2**(E + 1))``) exactly when the mantissa of ``amax`` exceeds
    ``T``; adding ``2**23 - 1 - T`` to the bits carries that into the exponent field.
    The clamp at byte 0 covers the subnormal quotients except one amax (``ODD``).
    Checked against the division for every FP32 value (``scale_constants``).
    """
    bits = amax.to(tl.int32, bitcast=True)
    if RCEIL:
        byte = tl.maximum((bits + ADD) >> 23, 0) - (bits == ODD).to(tl.int32)
    else:
        byte = tl.maximum((bits - (EMAX << 23)) >> 23, 0)
    return tl.where(bits >= 0x7F800000, 255, byte)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(v, axis: tl.constexpr, FLOAT_MAX: tl.constexpr):
    """max |v| along ``axis`` as float32; NaN (bits >= 0x7F800001) if any element is NaN.

    ``FLOAT_MAX``: a NaN-propagating float max, one instruction a element on the GPU.
    Otherwise the integer max of the magnitude bits (the same value for every input; the
    interpreter runs it much faster than a custom reduction)."""
    if FLOAT_MAX:
        return tl.reduce(tl.abs(v), axis, _max_nan)
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis).to(tl.float32, bitcast=True)


@triton.jit
def inv_scale(byte):
    """2**-(byte - 127) as float32 for a scale byte (NaN for the NaN byte 255). Bytes
    above 253 never occur for finite blocks of these formats (emax >= 2), so the result
    is always a normal number."""
    inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)
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
        # The hardware cast rounds to nearest-even and saturates (satfinite): the same
        # as clamping to +-MAXV first. NaN stays NaN.
        v = y
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
