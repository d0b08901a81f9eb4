"""Pure-PyTorch specification of every op in this package (CPU, readable, exact).

The kernels are tested bit for bit against these functions. Semantics (OCP MX v1.0
plus the choices this package makes where the spec leaves room):

* **Scale** (one E8M0 byte per block of ``block_size`` elements, taken from the FP32
  value of the inputs, never after a premature BF16 round):

  - ``"floor"`` (OCP): ``e = floor(log2(amax)) - emax_elem``.
  - ``"rceil"``: ``d = amax / max_elem`` (one FP32 division, round-to-nearest-even),
    ``e = ceil(log2(d))`` read exactly from the bits of ``d``; nothing overflows.

  ``e`` is clamped to ``[-127, 127]`` and stored as ``e + 127``. A block holding NaN or
  Inf gets byte 255 (NaN) and every element the format's NaN byte (``0x7F``; MX4 has
  no NaN and stores code 0, the scale alone marks the block). An all-zero block gets
  byte 0 (``2**-127``; E8M0 has no zero) and zero elements.
* **Elements**: ``V * 2**-e`` (exact in FP32) rounded to the element format with
  round-to-nearest-even and saturation to ``+-max_elem``; signed zeros are kept.
* **Stochastic rounding** (optional): with ``ulp`` the element spacing at ``|y|``, the
  magnitude becomes ``floor((floor(|y|/ulp * 2**23) + r) / 2**23) * ulp`` where ``r`` is
  23 random bits; the bits are a counter hash of ``(seed, element index)``, see
  :func:`sr_bits`, so the kernels reproduce them exactly.
* **Hadamard**: ``H_n diag(s)`` (Sylvester ``H_n`` with entries +-1, *unnormalised*,
  and a fixed random sign vector ``s``) applied to groups of ``n`` along the block dim.
  Because ``H_n^T H_n = n I``, ``(H A)^T (H B) = n A^T B``: a GEMM over two transformed
  operands divides by ``n`` (exact, a power of two).
* **MX4** (E2M1) codes are packed two to a byte along the block dim: element ``2i`` in
  the low nibble, ``2i + 1`` in the high nibble.
"""

from __future__ import annotations

from typing import Literal

import torch

from hyperrec.mxfp8.formats import E8M0_BIAS, E8M0_NAN, ElemFormat

__all__ = [
    "ACTIVATIONS",
    "apply_activation",
    "decode",
    "dequantize",
    "e8m0_scale",
    "e8m0_to_fp32",
    "encode",
    "hadamard_matrix",
    "hadamard_signs",
    "hash32",
    "mx_mm",
    "pack_fp4",
    "quantize_2d",
    "quantize_blocks",
    "rht",
    "round_to_format",
    "sr_bits",
    "sr_keys",
    "to_mx",
    "unpack_fp4",
]

Activation = Literal["none", "relu", "relu2", "silu", "gelu_tanh"]
"""Producer activation fused into the quantizer / applied to an MX layer's input."""
ACTIVATIONS: tuple[Activation, ...] = ("none", "relu", "relu2", "silu", "gelu_tanh")
_U32 = 0xFFFFFFFF
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_COL_STREAM = 0x632BE5AB  # offsets the column-wise random stream from the row-wise one


# --------------------------------------------------------------------------- random bits
def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, "lowbias32") of int64 values in [0, 2**32).

    Returns int64 values in ``[0, 2**32)``. The kernels compute the same function in
    uint32 arithmetic.
    """
    x = x & _U32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def sr_keys(seed: int) -> tuple[int, int]:
    """The (row-wise, column-wise) stream keys derived from a stochastic-rounding seed."""
    s = torch.tensor([seed & _U32, (seed + _COL_STREAM) & _U32], dtype=torch.int64)
    k = hash32(s)
    return int(k[0]), int(k[1])


def sr_bits(index: torch.Tensor, key: int) -> torch.Tensor:
    """23 random bits per element: ``hash32((index mod 2**32) ^ key) >> 9`` (int64)."""
    return hash32((index & _U32) ^ key) >> 9


# --------------------------------------------------------------------------- producers
def apply_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """The producer activations the quantizer can fuse, evaluated in FP32.

    ``relu`` maps -0 to +0; ``relu2`` is ``relu(x)**2``; ``silu`` is ``x*sigmoid(x)``;
    ``gelu_tanh`` is the tanh approximation. Transcendentals (silu, gelu_tanh) may
    differ from the kernels' in the last FP32 bit.
    """
    x = x.float()
    if name == "none":
        return x
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name == "relu2":
        r = torch.where(x > 0, x, torch.zeros_like(x))
        return r * r
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), entries +-1, float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_signs(n: int, seed: int) -> torch.Tensor:
    """The fixed random sign vector (+-1, float32, length ``n``) for a Hadamard seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def rht(x: torch.Tensor, n: int, signs: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Block random Hadamard transform along ``dim``: groups of ``n`` -> ``H_n diag(s) g``.

    Unnormalised (entries +-1). Summed in float64 and rounded once to float32. A length
    that is not a multiple of ``n`` is zero-padded for the transform and cut back, so the
    transform is only orthogonal (up to ``n``) when the length is a multiple of ``n``.
    """
    x = x.float().movedim(dim, 0)
    length = x.shape[0]
    pad = (-length) % n
    xp = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))], 0) if pad else x
    g = xp.double().reshape(-1, n, *x.shape[1:])
    m = (hadamard_matrix(n) * signs.float().cpu()[None, :]).double().to(x.device)
    y = torch.einsum("ij,gj...->gi...", m, g).reshape(xp.shape)[:length]
    return y.float().movedim(0, dim)


# --------------------------------------------------------------------------- scales
def e8m0_scale(blocks: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> torch.Tensor:
    """E8M0 scale bytes (uint8, shape ``blocks.shape[:-1]``) of ``(..., block)`` values."""
    x = blocks.float().contiguous()
    amax_bits = (x.view(torch.int32) & 0x7FFFFFFF).amax(-1)  # int order == |float| order
    bad = amax_bits >= 0x7F800000
    if scale_mode == "floor":
        e = (amax_bits >> 23) - 127 - fmt.emax
    elif scale_mode == "rceil":
        d = (amax_bits.view(torch.float32) / fmt.max_value).view(torch.int32)
        biased, mant = d >> 23, d & 0x7FFFFF
        e = torch.where(biased > 0, biased - 127 + (mant != 0).int(), -127 + (mant > 1 << 22).int())
    else:
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    byte = (e.clamp(-127, 127) + E8M0_BIAS).to(torch.int32)
    return torch.where(bad, E8M0_NAN, byte).to(torch.uint8)


def e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to float32: ``2**(b - 127)``; 0 -> ``2**-127``; 255 -> NaN."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, 1 << 22, b << 23)
    out = bits.view(torch.float32)
    return torch.where(b == E8M0_NAN, float("nan"), out)


def _pow2_fp32(e: torch.Tensor) -> torch.Tensor:
    # 2**e for integer e in [-126, 127], built from the exponent field (exact).
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


# --------------------------------------------------------------------------- elements
def round_to_format(
    y: torch.Tensor, fmt: ElemFormat, rand: torch.Tensor | None = None
) -> torch.Tensor:
    """Round float32 ``y`` onto ``fmt``'s grid with saturation (signed zeros kept).

    ``rand=None``: round-to-nearest-even (FP8 through torch's casts, E2M1 through a
    table). Otherwise stochastic rounding with 23-bit integers ``rand`` (int64, same
    shape). NaN inputs give NaN. Returns float32 values exactly representable in ``fmt``.
    """
    y = y.float()
    y = y.contiguous()
    sign_neg = (y.view(torch.int32) < 0) & ~torch.isnan(y)
    a = y.abs()
    if rand is None:
        if fmt.packed:
            vals = torch.tensor(_E2M1_VALUES, device=y.device)
            mids = (vals[1:] + vals[:-1]) / 2
            lo = torch.bucketize(a, mids, right=False)
            hi = torch.bucketize(a, mids, right=True)
            code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo).clamp_max(7)
            mag = vals[code]
        else:
            mag = a.clamp_max(fmt.max_value).to(fmt.storage_dtype).float()
    else:
        biased = (a.view(torch.int32) >> 23) & 0xFF
        e = (biased - 127).clamp_min(fmt.emin) - fmt.mbits
        q = a.double() * torch.pow(2.0, -e.double())  # exact: a / ulp
        fixed = torch.floor(q * 2.0**23).to(torch.int64)
        rounded = (fixed + rand.to(torch.int64)) >> 23
        mag = (rounded.double() * torch.pow(2.0, e.double())).float()
        mag = mag.clamp_max(fmt.max_value)
    mag = torch.where(torch.isnan(a), float("nan"), mag)
    return torch.where(sign_neg, -mag, mag)


def encode(v: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Bytes of values already on ``fmt``'s grid: FP8 bytes, or 4-bit E2M1 codes (uint8)."""
    if not fmt.packed:
        return v.to(fmt.storage_dtype).view(torch.uint8)
    a = v.abs()
    code = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    neg = v.view(torch.int32) < 0
    return torch.where(neg, code | 0x8, code)


def decode(codes: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """float32 values of element bytes (FP8 bytes or unpacked 4-bit E2M1 codes)."""
    if not fmt.packed:
        return codes.contiguous().view(fmt.storage_dtype).float()
    vals = torch.tensor(_E2M1_VALUES, device=codes.device)
    c = codes.to(torch.int64)
    mag = vals[c & 0x7]
    return torch.where(c & 0x8 != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim (even length): low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"MX4 packing needs an even length, got {codes.shape[-1]}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 ``(..., n)`` -> 4-bit codes ``(..., 2n)``."""
    lo, hi = packed & 0xF, packed >> 4
    # the length spelt out: ``-1`` cannot be inferred for an empty tensor (zero rows)
    return torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# --------------------------------------------------------------------------- blocks
def quantize_blocks(
    x: torch.Tensor,
    fmt: ElemFormat,
    block_size: int,
    scale_mode: str,
    rand: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``(R, C)`` float tensor in blocks along dim 1.

    A last block shorter than ``block_size`` behaves as if zero-padded.

    Returns:
        ``(codes, scale)``: ``codes`` uint8 ``(R, C)`` (FP8 bytes, or unpacked E2M1
        codes), ``scale`` uint8 E8M0 ``(R, ceil(C / block_size))``.
    """
    x = x.float()
    rows, cols = x.shape
    nb = -(-cols // block_size)
    pad = nb * block_size - cols
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    blocks = xp.reshape(rows, nb, block_size)
    scale = e8m0_scale(blocks, fmt, scale_mode)
    e = scale.to(torch.int32) - E8M0_BIAS
    bad = scale == E8M0_NAN
    inv = _pow2_fp32(torch.where(bad, 0, -e).clamp(-126, 127))
    y = (blocks * inv[..., None]).reshape(rows, nb * block_size)[:, :cols]
    codes = encode(round_to_format(torch.nan_to_num(y), fmt, rand), fmt)
    bad_el = bad.repeat_interleave(block_size, 1)[:, :cols]
    nan_code = 0 if fmt.nan_code is None else fmt.nan_code
    codes = torch.where(bad_el, torch.full_like(codes, nan_code), codes)
    return codes, scale


def to_mx(
    x: torch.Tensor,
    fmt: ElemFormat,
    block_size: int,
    scale_mode: str,
    axis: int,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`hyperrec.mxfp8.to_mx`: ``(data, scale)`` for blocks along ``axis``.

    ``data`` has ``x``'s shape (MX4: ``shape[axis]`` halved, packed), ``scale`` has
    ``x``'s shape with ``shape[axis] = ceil(n / block_size)``. With ``seed``, stochastic
    rounding with element index ``i * n + j`` of the ``(rows, n)`` view that has the block
    dim last (2-D ``axis=0`` uses the column-wise stream of :func:`quantize_2d`).
    """
    axis = axis % x.dim()
    if x.dim() == 2 and axis == 0:
        _, _, data, scale = quantize_2d(
            x,
            fmt=fmt,
            block_size=block_size,
            scale_mode=scale_mode,
            rowwise=False,
            colwise=True,
            seed=seed,
        )
        if data is None or scale is None:  # colwise=True always writes both
            raise RuntimeError("quantize_2d(colwise=True) returned no column-wise copy")
        return data, scale
    xm = x.movedim(axis, -1)
    lead, n = xm.shape[:-1], xm.shape[-1]
    flat = xm.reshape(-1, n)
    rand = None
    if seed is not None:
        idx = torch.arange(flat.numel(), dtype=torch.int64, device=x.device).reshape(flat.shape)
        rand = sr_bits(idx, sr_keys(seed)[0])
    codes, scale = quantize_blocks(flat, fmt, block_size, scale_mode, rand)
    if fmt.packed:
        codes = pack_fp4(codes)
    else:
        codes = codes.view(fmt.storage_dtype)
    data = codes.reshape(*lead, codes.shape[-1]).movedim(-1, axis)
    return data, scale.reshape(*lead, scale.shape[-1]).movedim(-1, axis)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    fmt: ElemFormat,
    block_size: int,
    axis: int,
    length: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`to_mx`: ``decode(data) * 2**(scale - 127)`` (NaN blocks give NaN).

    ``length`` is the unpacked size along ``axis`` (needed for MX4 and ragged blocks).
    """
    axis = axis % data.dim()
    d = data.movedim(axis, -1)
    codes = d.contiguous().view(torch.uint8)
    if fmt.packed:
        codes = unpack_fp4(codes)
    vals = decode(codes, fmt)[..., :length]
    s = e8m0_to_fp32(scale.movedim(axis, -1)).repeat_interleave(block_size, -1)[..., :length]
    return (vals * s).movedim(-1, axis).to(dtype)


def quantize_2d(
    x: torch.Tensor,
    *,
    fmt: ElemFormat,
    block_size: int,
    scale_mode: str,
    rowwise: bool = True,
    colwise: bool = False,
    activation: str = "none",
    hadamard: int = 0,
    hadamard_seed: int = 0,
    seed: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Reference of the fused quantizer: row-wise and column-wise MX copies of ``act(x)``.

    ``x`` is ``(M, K)``. Row-wise: blocks along K of ``act(x)``, random index ``m*K+k``
    with the row key. Column-wise: blocks along M of ``rht(act(x))`` (when ``hadamard``)
    with the column key and the same index; the transform's input is ``act(x)`` rounded
    to ``x.dtype``.

    Returns:
        ``(row_data, row_scale, col_data, col_scale)`` with logical shapes ``(M, K)``,
        ``(M, ceil(K/bs))``, ``(M, K)``, ``(ceil(M/bs), K)`` (MX4: ``(M, K/2)`` and
        ``(M/2, K)`` packed); ``None`` for a copy not requested.
    """
    m, k = x.shape
    x32 = apply_activation(x, activation)
    keys = sr_keys(seed) if seed is not None else None
    idx = torch.arange(m * k, dtype=torch.int64, device=x.device).reshape(m, k)
    out: list[torch.Tensor | None] = [None] * 4
    if rowwise:
        rand = sr_bits(idx, keys[0]) if keys else None
        codes, scale = quantize_blocks(x32, fmt, block_size, scale_mode, rand)
        data = pack_fp4(codes) if fmt.packed else codes.view(fmt.storage_dtype)
        out[0], out[1] = data, scale
    if colwise:
        t = x32
        if hadamard:
            # The transform runs in the input precision (tensor cores): act(x) is rounded
            # to x.dtype first (a no-op without an activation).
            t = rht(x32.to(x.dtype), hadamard, hadamard_signs(hadamard, hadamard_seed))
        rand = sr_bits(idx, keys[1]).t() if keys else None
        codes, scale = quantize_blocks(t.t(), fmt, block_size, scale_mode, rand)
        data = pack_fp4(codes) if fmt.packed else codes.view(fmt.storage_dtype)
        out[2], out[3] = data.t(), scale.t()
    return out[0], out[1], out[2], out[3]


# --------------------------------------------------------------------------- GEMM
def mx_mm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_fmt: ElemFormat,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_fmt: ElemFormat,
    block_size: int,
    *,
    bias: torch.Tensor | None = None,
    alpha: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize-then-matmul: ``alpha * deq(a) @ deq(b) + bias`` in ``acc_dtype``.

    ``a``: ``(M, K)`` blocks along K; ``b``: ``(K, N)`` blocks along K (dim 0).
    """
    k = a_data.shape[1] * (2 if a_fmt.packed else 1)
    a = dequantize(a_data, a_scale, a_fmt, block_size, 1, k, acc_dtype)
    b = dequantize(b_data, b_scale, b_fmt, block_size, 0, k, acc_dtype)
    out = (a @ b) * alpha
    if bias is not None:
        out = out + bias.to(acc_dtype)
    return out.to(out_dtype)
