"""Triton kernels of the FP8 / MXFP8 attention forward (``precision="fp8" | "mxfp8"``).

The numerics are :mod:`hyperrec.jagged_attn.reference_fp8`; the layouts are those of
:class:`hyperrec.jagged_attn.fp8.QuantizedJagged`.

* ``_quant_qkv_kernel``: Q, K and V in one launch (grid axis 2 picks the tensor). A
  program owns one tile of token rows of one sequence and one head: it reads the tile
  once (bf16/fp16, any row and head strides), optionally rotates it (Walsh-Hadamard
  butterflies), takes the block maxima from the float32 bits, and writes E4M3 codes and
  scales. V is written transposed (``(H, Dv, Tp)``, tokens contiguous) because FP8 tensor
  cores on Hopper read both operands K-major, and ``P @ V`` reduces over the tokens.
* ``_proj_quant_kernel``: the same quantization in the epilogue of the projection that
  produces Q/K/V (``y = act(x @ W^T + b)``), so the activations are read once, by the GEMM.
* ``_fp8_fwd_kernel``: the persistent forward of ``_kernels._fwd_kernel`` (same work list,
  mask rules and key ranges; the mask helpers are shared) with FP8 operands.
  ``"fp8"``: ``S = Q8 @ K8^T`` on the FP8 tensor cores, scaled per query row (the Q
  block's scale, free: folded into the softmax scale) and per key tile (the K block's
  scale; a key tile never straddles two K blocks). ``"mxfp8"`` (no MX tensor cores on
  Hopper): the E8M0 block scales are folded into the operands, which are dequantized to
  bf16 in registers (exact) and multiplied on the bf16 tensor cores: Blackwell's
  MXFP8 numerics at bf16 speed.
  P is quantized per (row, key tile) to E4M3 with a power-of-two scale ``2**k``; the
  accumulator is kept in units of ``2**k / v_scale`` of the current tile and converted
  when they change, by a per-row factor folded into the softmax rescale (``alpha``), so
  neither scale costs a multiply per element in the softmax loop. ``"fp8"`` then runs
  ``P8 @ V8`` on the FP8 tensor cores; ``"mxfp8"`` upcasts P8 (exact) and the MX V.

Triton's CPU interpreter casts float32 to E4M3 wrongly (it does not round to nearest) and
multiplies bf16 tiles wrongly: under ``TRITON_INTERPRET`` the kernels round to E4M3 by
hand (the same values as the hardware's nearest-even conversion) and keep MX operands in
float32 (they are exact there too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyperrec.jagged_attn._triton import interpreting
from hyperrec.jagged_attn._triton._kernels import (
    _act,
    _allowed,
    _kv_range,
    _load_rows,
    _query_tile,
    _store_rows,
    _work_item,
)
from hyperrec.jagged_attn.fp8 import P_EXP_MAX, P_LOG2_MAX

_INTERP = tl.constexpr(interpreting())
_E4M3_MAX = tl.constexpr(448.0)
_P_LOG2_MAX = tl.constexpr(P_LOG2_MAX)
_P_EXP_MAX = tl.constexpr(float(P_EXP_MAX))
_NEG_P_EXP_MAX = tl.constexpr(-float(P_EXP_MAX))
_TINY_AMAX = tl.constexpr(2.0**-24)
_NAN_BYTE = tl.constexpr(0x7F)


# ----------------------------------------------------------------------------------------
# Element helpers
# ----------------------------------------------------------------------------------------


@triton.jit
def _f32(x):
    """``x.to(tl.float32)``. Under ``TRITON_INTERPRET`` bf16 moves by its bits: the
    interpreter's own conversion gets bf16 subnormals wrong (1e-39 -> 4.4e-39), so the
    quantized bytes would differ from ``reference_fp8``; compiled, the conversion is
    exact and is left as it was."""
    if _INTERP and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` to nearest-even. Under ``TRITON_INTERPRET`` the
    conversion to bf16 truncates, so it is rounded on the bits first (NaN kept NaN);
    compiled, the hardware conversion is used."""
    if _INTERP and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        r = tl.where(x != x, u | 0x400000, r)
        return r.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(dtype)


@triton.jit
def _pow2(e):
    """2**e as float32 for integer-valued ``e`` (float or int) in [-126, 127]: exact."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):
    """float32 ``y`` (|y| <= 448) rounded to the E4M3 grid, nearest-even, sign kept.

    Only under the interpreter (see the module doc). Normal E4M3 values keep 3 mantissa
    bits (integer rounding on the float32 bits); below 2**-6 the grid is 2**-9, which
    adding and subtracting 2**14 rounds to in float32.
    """
    u = y.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    mag = u & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    a = mag.to(tl.float32, bitcast=True)
    sub = ((a + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    r = tl.where(a < 0.015625, sub, normal)
    r = tl.where(a != a, mag, r)  # NaN stays NaN
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(y):
    """``y`` (float32, |y| <= 448 or NaN) as E4M3, rounding to nearest-even."""
    if _INTERP:
        r = _round_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        r = tl.where(y != y, _NAN_BYTE, r)  # the interpreter does not convert NaN to 0x7F
        r = r.to(tl.float8e4nv, bitcast=True)
    else:
        r = y.to(tl.float8e4nv)
    return r


@triton.jit
def _e4m3_codes(y, bad):
    """E4M3 bytes of ``y`` (saturating at +-448); ``bad`` elements get the NaN byte."""
    y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
    codes = _to_e4m3(y).to(tl.uint8, bitcast=True)
    return tl.where(bad, _NAN_BYTE, codes)


@triton.jit
def _e8m0_to_f32(byte):
    """E8M0 byte -> 2**(byte - 127) (byte 0: 2**-127, a float32 subnormal; 255: NaN)."""
    b = byte.to(tl.int32)
    edge = (b - 1).to(tl.uint32, bitcast=True) >= 254
    return ((b << 23) | tl.where(edge, 4194304, 0)).to(tl.float32, bitcast=True)


@triton.jit
def _fwht(x, ROWS: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """Unnormalised Walsh-Hadamard transform of each row of ``x`` (ROWS, N): butterflies
    ``(a + b, a - b)`` on pairs ``(i, i + h)``, ``h = 1, 2, ...`` (reference_fp8.fwht)."""
    for stage in tl.static_range(LOG2N):
        y = tl.reshape(x, (ROWS, N >> (stage + 1), 2, 1 << stage))
        a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (ROWS, N))
    return x


@triton.jit
def _block_scale(bits, POW2: tl.constexpr, TINY: tl.constexpr):
    """(scale, inv) of blocks whose |x| max has float32 bits ``bits`` (int32), scaled as if
    that max were at least ``TINY``: reference_fp8.fp8_block_scales."""
    bad = bits >= 0x7F800000
    zero = bits == 0
    a = tl.maximum(bits.to(tl.float32, bitcast=True), TINY)
    if POW2:
        ab = a.to(tl.int32, bitcast=True)
        e = ((ab >> 23) & 0xFF) - 135 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = _pow2(e)
        inv = _pow2(-e)
    else:
        full = tl.full(a.shape, 448.0, tl.float32)
        scale = tl.math.div_rn(a, full)
        inv = tl.math.div_rn(full, a)
    scale = tl.where(zero, 1.0, scale)
    inv = tl.where(zero, 1.0, inv)
    return tl.where(bad, float("nan"), scale), tl.where(bad, float("nan"), inv)


@triton.jit
def _e8m0_byte(bits, ADD: tl.constexpr, ODD: tl.constexpr):
    """MX scale byte (RCEIL, ``hyperrec.mxfp8``'s rule) of block maxima with float32 bits
    ``bits``, without the division: ``amax / 448`` rounds above a power of two exactly when
    ``amax``'s mantissa exceeds 448's, which adding ``ADD`` carries into the exponent; one
    amax (``ODD``) has a subnormal quotient that rounds down. NaN/Inf -> 255."""
    byte = tl.maximum((bits + ADD) >> 23, 0) - (bits == ODD).to(tl.int32)
    return tl.where(bits >= 0x7F800000, 255, byte)


# ----------------------------------------------------------------------------------------
# Quantization of Q, K, V
# ----------------------------------------------------------------------------------------


@triton.jit
def _key_mean_kernel(
    K, OUT, offsets, stride_kt, stride_kh,
    D: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Grid (B, H, cdiv(D, COLS)): the mean over the finite values of ``COLS`` columns of
    one sequence's keys of one head (``fp8.key_shift``), float64 sums (exact for bf16/fp16
    keys, so their order does not matter), stored as float64 into ``OUT`` (B, H, D)
    contiguous (the launcher rounds to bf16: the interpreter's own conversions do not
    round to nearest). Column blocks give long sequences more programs; the loop adds
    element-wise and reduces over the rows once at the end (a reduction per step made
    the launch latency-bound: 0.13 ms for 65,536 keys x 8 heads on an H200)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2) * COLS + tl.arange(0, COLS)
    start = tl.load(offsets + b)
    n_rows = tl.load(offsets + b + 1) - start
    acc = tl.zeros([ROWS, COLS], dtype=tl.float64)
    cnt = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for r0 in range(0, n_rows, ROWS):
        r = r0 + tl.arange(0, ROWS)
        ok = (r < n_rows)[:, None] & (c < D)[None, :]
        rows64 = (start + r).to(tl.int64)
        x = _f32(tl.load(K + rows64[:, None] * stride_kt + h * stride_kh + c[None, :], mask=ok,
                         other=0.0)).to(tl.float64)  # fmt: skip
        finite = ok & (tl.abs(x) < float("inf"))  # NaN compares false too
        acc += tl.where(finite, x, 0.0)
        cnt += finite.to(tl.int32)
    mean = tl.sum(acc, 0) / tl.maximum(tl.sum(cnt, 0), 1).to(tl.float64)
    tl.store(OUT + (b * tl.num_programs(1) + h) * D + c, mean, mask=c < D)


@triton.jit
def _quant_tile(
    X, DATA, SCALE, SIGNS, offsets, poffsets, tile_seq, tile_idx, tile_total, w, h,
    stride_xt, stride_xh, stride_dt, stride_dh, stride_st, stride_sh,
    D: tl.constexpr, BD: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr,
    MODE: tl.constexpr, COLS: tl.constexpr, POW2: tl.constexpr, HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr, ADD: tl.constexpr, ODD: tl.constexpr, TINY: tl.constexpr,
    SHIFT, HAS_SHIFT: tl.constexpr, MMA_ORDER: tl.constexpr = False,
):  # fmt: skip
    """Quantize token rows [t * TILE, (t + 1) * TILE) of work item ``w``'s sequence, head h.

    MODE 0: one scale per GROUP rows (``"fp8"``); 1: MX blocks of 32 along the head dim;
    2: MX blocks of 32 along the tokens (TILE a multiple of 32). ``COLS`` writes the data
    transposed at the sequence's padded column offset (V). Strides: data ``(row, head)``
    for rows, ``(head dim, head)`` for ``COLS``; scales ``(row, head)``, or for MODE 2
    ``(head dim, head)`` with one byte per 32 columns. ``MMA_ORDER`` (``COLS``, TILE a
    multiple of 16): tokens in ``fp8.mma_column`` order within every 16 columns.
    """
    if w < tl.load(tile_total):
        b = tl.load(tile_seq + w)
        t = tl.load(tile_idx + w)
        start = tl.load(offsets + b)
        n_rows = tl.load(offsets + b + 1) - start
        r = t * TILE + tl.arange(0, TILE)
        c = tl.arange(0, BD)
        row_ok = r < n_rows
        ok = row_ok[:, None] & (c < D)[None, :]
        rows64 = (start + r).to(tl.int64)
        x = _f32(tl.load(X + rows64[:, None] * stride_xt + h * stride_xh + c[None, :], mask=ok,
                         other=0.0))  # fmt: skip
        if HAS_SHIFT:
            # (B, H, D) contiguous, one row per sequence. Rows past the sequence stay 0:
            # they share block maxima with the sequence's rows (GROUP > 1).
            sh = tl.load(SHIFT + (b * tl.num_programs(1) + h) * D + c, mask=c < D, other=0.0)
            x = tl.where(row_ok[:, None], x - _f32(sh)[None, :], 0.0)
        _quant_store(
            x, DATA, SCALE, SIGNS, poffsets, b, t, start, n_rows, h,
            stride_dt, stride_dh, stride_st, stride_sh,
            D, BD, TILE, GROUP, MODE, COLS, POW2, HADAMARD, LOG2D, ADD, ODD, TINY, MMA_ORDER,
        )  # fmt: skip


@triton.jit
def _quant_store(
    x, DATA, SCALE, SIGNS, poffsets, b, t, start, n_rows, h,
    stride_dt, stride_dh, stride_st, stride_sh,
    D: tl.constexpr, BD: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr,
    MODE: tl.constexpr, COLS: tl.constexpr, POW2: tl.constexpr, HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr, ADD: tl.constexpr, ODD: tl.constexpr, TINY: tl.constexpr,
    MMA_ORDER: tl.constexpr,
):  # fmt: skip
    """The quantizing half of ``_quant_tile``: float32 ``x`` (TILE, BD) holds rows
    ``[t * TILE, (t + 1) * TILE)`` of sequence ``b`` (token ``start`` on, ``n_rows`` long),
    head ``h``, zero past the sequence and past ``D``. Rotates (``HADAMARD``), scales,
    rounds and stores. Shared with the fused projection (``_proj_quant_kernel``), whose
    tiles come out of a GEMM instead of a load."""
    r = t * TILE + tl.arange(0, TILE)
    c = tl.arange(0, BD)
    row_ok = r < n_rows
    ok = row_ok[:, None] & (c < D)[None, :]
    rows64 = (start + r).to(tl.int64)
    if HADAMARD:
        # (masked: BD pads head dims below 16, and the sign vector has D entries)
        x = _fwht(x * tl.load(SIGNS + c, mask=c < D, other=0.0)[None, :], TILE, BD, LOG2D)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if MODE == 0:
        rb = tl.max(bits, 1)
        if GROUP > 1:
            gb = tl.max(tl.reshape(rb, (TILE // GROUP, GROUP)), 1)
            rb = tl.reshape(tl.broadcast_to(gb[:, None], (TILE // GROUP, GROUP)), (TILE,))
        scale, inv = _block_scale(rb, POW2, TINY)
        codes = _e4m3_codes(x * inv[:, None], (rb >= 0x7F800000)[:, None])
        tl.store(SCALE + rows64 * stride_st + h * stride_sh, scale, mask=row_ok)
    elif MODE == 1:
        NB: tl.constexpr = BD // 32
        byte = _e8m0_byte(tl.max(tl.reshape(bits, (TILE, NB, 32)), 2), ADD, ODD)
        inv = _pow2(tl.minimum(tl.maximum(127 - byte, -126), 127))
        inv = tl.reshape(tl.broadcast_to(inv[:, :, None], (TILE, NB, 32)), (TILE, BD))
        bad = tl.reshape(tl.broadcast_to((byte == 255)[:, :, None], (TILE, NB, 32)),
                         (TILE, BD))  # fmt: skip
        codes = _e4m3_codes(x * inv, bad)
        ch = tl.arange(0, NB)
        tl.store(SCALE + rows64[:, None] * stride_st + h * stride_sh + ch[None, :],
                 byte.to(tl.uint8), mask=row_ok[:, None] & (ch < D // 32)[None, :])  # fmt: skip
    else:
        NT: tl.constexpr = TILE // 32
        byte = _e8m0_byte(tl.max(tl.reshape(bits, (NT, 32, BD)), 1), ADD, ODD)
        inv = _pow2(tl.minimum(tl.maximum(127 - byte, -126), 127))
        inv = tl.reshape(tl.broadcast_to(inv[:, None, :], (NT, 32, BD)), (TILE, BD))
        bad = tl.reshape(tl.broadcast_to((byte == 255)[:, None, :], (NT, 32, BD)),
                         (TILE, BD))  # fmt: skip
        codes = _e4m3_codes(x * inv, bad)
        blk = tl.arange(0, NT)
        col0 = tl.load(poffsets + b) + t * TILE
        tl.store(SCALE + h * stride_sh + c[None, :] * stride_st + (col0 // 32 + blk)[:, None],
                 byte.to(tl.uint8),
                 mask=(t * TILE + blk * 32 < n_rows)[:, None] & (c < D)[None, :])  # fmt: skip
    if COLS:
        col0 = tl.multiple_of(tl.load(poffsets + b), 16)  # sequences start 16-aligned
        if MMA_ORDER:
            # row 16g + 4t + 2a + b of the stored tile holds token 16g + 8a + 2t + b:
            # permute the registers, then store contiguous columns as before
            codes = tl.reshape(codes, (TILE // 16, 2, 4, 2, BD))
            codes = tl.reshape(tl.permute(codes, (0, 2, 1, 3, 4)), (TILE, BD))
            u = r % 16
            tok = r - u + 8 * ((u >> 1) & 1) + 2 * ((u >> 2) & 3) + (u & 1)
            ok = (tok < n_rows)[:, None] & (c < D)[None, :]
        cols64 = (col0 + r).to(tl.int64)
        ptrs = DATA + h * stride_dh + c[None, :].to(tl.int64) * stride_dt + cols64[:, None]
        if t * TILE + TILE <= n_rows:
            # A whole tile: no mask along the contiguous tokens, so the stores can be
            # 16-byte vectors (a per-token mask forces byte stores).
            if BD == D:
                tl.store(ptrs, codes)
            else:
                tl.store(ptrs, codes, mask=(c < D)[None, :])
        else:
            tl.store(ptrs, codes, mask=ok)
    else:
        ptrs = DATA + rows64[:, None] * stride_dt + h * stride_dh + c[None, :]
        tl.store(ptrs, codes, mask=ok)


@triton.jit
def _quant_qkv_kernel(
    Q, K, V, QD, KD, VD, QS, KS, VS, SIGNS, SHIFT,
    q_offsets, kv_offsets, v_poffsets,
    q_seq, q_idx, q_total, kv_seq, kv_idx, kv_total,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qdt, stride_qdh, stride_kdt, stride_kdh, stride_vdd, stride_vdh,
    stride_qst, stride_qsh, stride_kst, stride_ksh, stride_vst, stride_vsh,
    D: tl.constexpr, BD: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
    TILE_Q: tl.constexpr, GROUP_Q: tl.constexpr, TILE_KV: tl.constexpr, GROUP_KV: tl.constexpr,
    MODE_QK: tl.constexpr, MODE_V: tl.constexpr, POW2: tl.constexpr, HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr, ADD: tl.constexpr, ODD: tl.constexpr, HAS_SHIFT: tl.constexpr,
    V_MMA_ORDER: tl.constexpr = False,
):  # fmt: skip
    """Grid (tiles, H, 3): axis 2 = 0 quantizes Q, 1 K, 2 V (see ``_quant_tile``; MODE_QK
    is 0 or 1, MODE_V 0 or 2). ``HAS_SHIFT``: subtract ``SHIFT`` (B, H, D) from the keys of
    each kv sequence."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    role = tl.program_id(2)
    if role == 0:
        _quant_tile(
            Q, QD, QS, SIGNS, q_offsets, q_offsets, q_seq, q_idx, q_total, w, h,
            stride_qt, stride_qh, stride_qdt, stride_qdh, stride_qst, stride_qsh,
            D, BD, TILE_Q, GROUP_Q, MODE_QK, False, POW2, HADAMARD, LOG2D, ADD, ODD, _TINY_AMAX,
            SHIFT, False,
        )  # fmt: skip
    elif role == 1:
        _quant_tile(
            K, KD, KS, SIGNS, kv_offsets, kv_offsets, kv_seq, kv_idx, kv_total, w, h,
            stride_kt, stride_kh, stride_kdt, stride_kdh, stride_kst, stride_ksh,
            D, BD, TILE_KV, GROUP_KV, MODE_QK, False, POW2, HADAMARD, LOG2D, ADD, ODD, _TINY_AMAX,
            SHIFT, HAS_SHIFT,
        )  # fmt: skip
    else:
        _quant_tile(
            V, VD, VS, SIGNS, kv_offsets, v_poffsets, kv_seq, kv_idx, kv_total, w, h,
            stride_vt, stride_vh, stride_vdd, stride_vdh, stride_vst, stride_vsh,
            DV, BDV, TILE_KV, GROUP_KV, MODE_V, True, POW2, False, 0, ADD, ODD, _TINY_AMAX,
            SHIFT, False, V_MMA_ORDER,
        )  # fmt: skip


@triton.jit
def _proj_quant_kernel(
    X, W, BIAS, Y, Z, QD, KD, VD, QS, KS, VS, SIGNS,
    offsets, v_poffsets, tile_seq, tile_idx, tile_total, K_DIM,
    stride_xt, stride_wn, stride_yt, stride_zt,
    stride_qdt, stride_qdh, stride_kdt, stride_kdh, stride_vdd, stride_vdh,
    stride_qst, stride_qsh, stride_kst, stride_ksh, stride_vst, stride_vsh,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, TILE: tl.constexpr,
    GROUP_Q: tl.constexpr, GROUP_KV: tl.constexpr, MODE_QK: tl.constexpr, MODE_V: tl.constexpr,
    POW2: tl.constexpr, HADAMARD: tl.constexpr, LOG2D: tl.constexpr, ADD: tl.constexpr,
    ODD: tl.constexpr, CHUNK_Q: tl.constexpr, CHUNK_K: tl.constexpr, CHUNK_V: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, STORE_Z: tl.constexpr,
    DOT_F32: tl.constexpr, V_MMA_ORDER: tl.constexpr, N_CHUNKS: tl.constexpr,
):  # fmt: skip
    """The projection ``y = act(x @ W^T + b)`` with Q/K/V quantized in its epilogue.

    Grid (tiles * chunks * H,), column tile fastest: a program computes one tile of TILE
    token rows of one sequence (the quantization's tiles, so a scale block never straddles
    two programs) times the D columns of one head of one chunk of ``W``'s rows (chunk ``c``,
    head ``h``: rows ``(c * H + h) * D`` on), reducing over ``K_DIM`` in steps of BK. It
    stores ``y`` in ``Y``'s dtype (and ``z = x @ W^T + b`` when ``STORE_Z``, for the
    backward of SiLU), and for the chunks ``CHUNK_Q``/``CHUNK_K``/``CHUNK_V`` quantizes the
    *stored* (rounded) values with ``_quant_store``, so the codes equal ``quantize_qkv`` of
    ``y``'s chunks bit for bit. ``DOT_F32``: multiply in float32 (float32 inputs, and the
    interpreter, which multiplies bf16 tiles wrongly).
    """
    # One flat grid, the (chunk, head) column tile fastest: the programs running at once
    # share their row tile of X, read from HBM once and from L2 by the others (with the
    # row tile fastest each column tile streamed all of X again: ~2 TB/s, 0.65x unfused).
    pid = tl.program_id(0)
    hc = pid % (N_CHUNKS * H)
    w = pid // (N_CHUNKS * H)
    h = hc % H
    chunk = hc // H
    if w < tl.load(tile_total):
        b = tl.load(tile_seq + w)
        t = tl.load(tile_idx + w)
        start = tl.load(offsets + b)
        n_rows = tl.load(offsets + b + 1) - start
        r = t * TILE + tl.arange(0, TILE)
        c = tl.arange(0, BD)
        row_ok = r < n_rows
        col_ok = c < D
        ok = row_ok[:, None] & col_ok[None, :]
        rows64 = (start + r).to(tl.int64)
        n = (chunk * H + h) * D + c
        acc = tl.zeros((TILE, BD), dtype=tl.float32)
        kk = tl.arange(0, BK)
        # pointers advanced by BK per step (the usual GEMM form, which the compiler keeps
        # as one base plus small offsets instead of a 64-bit address per element per step)
        a_ptrs = X + rows64[:, None] * stride_xt + kk[None, :]
        w_ptrs = W + n[None, :].to(tl.int64) * stride_wn + kk[:, None]
        for k0 in range(0, K_DIM, BK):
            k_ok = kk < K_DIM - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            a_ptrs += BK
            w_ptrs += BK
            if DOT_F32:
                acc = tl.dot(_f32(a), _f32(wt), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wt, acc)
        if HAS_BIAS:
            acc += _f32(tl.load(BIAS + n, mask=col_ok, other=0.0))[None, :]
        if STORE_Z:
            tl.store(Z + rows64[:, None] * stride_zt + n[None, :],
                     _cast(acc, Z.dtype.element_ty), mask=ok)  # fmt: skip
        if SILU:
            acc = acc * tl.sigmoid(acc)
        y = _cast(acc, Y.dtype.element_ty)
        tl.store(Y + rows64[:, None] * stride_yt + n[None, :], y, mask=ok)
        # the quantizers see what was stored, zero outside the tile's rows and the head dim
        x = tl.where(ok, _f32(y), 0.0)
        if chunk == CHUNK_Q:
            _quant_store(
                x, QD, QS, SIGNS, offsets, b, t, start, n_rows, h,
                stride_qdt, stride_qdh, stride_qst, stride_qsh,
                D, BD, TILE, GROUP_Q, MODE_QK, False, POW2, HADAMARD, LOG2D, ADD, ODD,
                _TINY_AMAX, False,
            )  # fmt: skip
        elif chunk == CHUNK_K:
            _quant_store(
                x, KD, KS, SIGNS, offsets, b, t, start, n_rows, h,
                stride_kdt, stride_kdh, stride_kst, stride_ksh,
                D, BD, TILE, GROUP_KV, MODE_QK, False, POW2, HADAMARD, LOG2D, ADD, ODD,
                _TINY_AMAX, False,
            )  # fmt: skip
        elif chunk == CHUNK_V:
            _quant_store(
                x, VD, VS, SIGNS, v_poffsets, b, t, start, n_rows, h,
                stride_vdd, stride_vdh, stride_vst, stride_vsh,
                D, BD, TILE, GROUP_KV, MODE_V, True, POW2, False, 0, ADD, ODD,
                _TINY_AMAX, V_MMA_ORDER,
            )  # fmt: skip


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


@triton.jit
def _mx_operand(x8, scale):
    """An MX tile dequantized for the bf16 tensor cores (exact: an E4M3 value times a power
    of two is a bf16 number); float32 under the interpreter."""
    x = x8.to(tl.float32) * scale
    if not _INTERP:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _mx_dot(a, b, acc):
    """acc + a @ b for MX operands (see ``_mx_operand``), float32 accumulation."""
    if _INTERP:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _fp8_tiles(
    acc, m_i, l_i, k_i, sv_prev, q, c_row, k_base, vt_base, ks_base, vs_base, v_col0,
    K_desc, VT_desc, k_row0, k_col, v_row,
    stride_kt, stride_vd, stride_kst, stride_vsd, offs_m, lo, hi, Lq, Lk, n_targets,
    wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr, ACT: tl.constexpr,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST: tl.constexpr, MX: tl.constexpr, FMA: tl.constexpr, K_TMA: tl.constexpr,
    V_TMA: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) of one work item. State per row: ``m_i`` running max (softmax,
    base 2), ``l_i`` the sum of the unquantized weights, ``k_i`` the exponent of the last
    P scale; ``acc`` is in units of ``2**k_i / sv_prev`` (``sv_prev`` the last V block
    scale, "fp8" only)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if K_TMA:
            # Keys past the sequence (the next sequence's, or zeros past the tensor) get
            # scores that the mask replaces below (tl.where: even a NaN never leaks).
            k8 = K_desc.load([k_row0 + start_n, k_col])
        else:
            k8 = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                            offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        if V_TMA:
            # Only in mask-free tiles: columns past the sequence are padding that is never
            # written, and P = 0 times a NaN there would still be NaN.
            vt8 = VT_desc.load([v_row, v_col0 + start_n])
        else:
            vt_mask = (offs_n < Lk)[None, :]
            if BLOCK_DV != HEAD_DIM_V:
                vt_mask = vt_mask & (offs_dv < HEAD_DIM_V)[:, None]
            vt8 = tl.load(vt_base + offs_dv[:, None] * stride_vd + (v_col0 + offs_n)[None, :],
                          mask=vt_mask, other=0.0)  # fmt: skip
        if MX:
            kmask = (offs_n < Lk)[:, None] & (offs_d < HEAD_DIM)[None, :]
            ksc = tl.load(ks_base + offs_n[:, None] * stride_kst + (offs_d // 32)[None, :],
                          mask=kmask, other=127)  # fmt: skip
            kf = _mx_operand(k8, _e8m0_to_f32(ksc))
            s = _mx_dot(q, tl.trans(kf), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32))
            vsc = tl.load(vs_base + offs_dv * stride_vsd + (v_col0 + start_n) // 32,
                          mask=offs_dv < HEAD_DIM_V, other=127)  # fmt: skip
            vf = _mx_operand(vt8, _e8m0_to_f32(vsc)[:, None])
            cr = c_row
        else:
            sk = tl.load(ks_base + start_n * stride_kst)
            sv = tl.load(vs_base + start_n * stride_kst)
            s = tl.dot(q, tl.trans(k8))  # FP8 x FP8 -> float32
            cr = c_row * sk
        if MASKED:
            ok = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                          CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                          HAS_BLOCK, BLOCK_PREV)  # fmt: skip
        if ACT == 0:
            if FMA:
                # cr > 0, so max(s) * cr == max(s * cr); the exponent below is one FMA.
                if MASKED:
                    s = tl.where(ok, s, float("-inf"))
                t_max = tl.max(s, 1) * cr
            else:
                s = s * cr[:, None]
                if MASKED:
                    s = tl.where(ok, s, float("-inf"))
                t_max = tl.max(s, 1)
            m_new = tl.maximum(m_i, t_max)
            if MASKED:
                # A row with nothing allowed so far keeps m = -inf: shift by 0 instead.
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                k_new = tl.minimum(tl.floor(m_use - t_max + _P_LOG2_MAX), _P_EXP_MAX)
                k_new = tl.where(t_max == float("-inf"), k_i, k_new)
            else:
                m_use = m_new
                k_new = tl.minimum(tl.floor(m_use - t_max + _P_LOG2_MAX), _P_EXP_MAX)
            # P * 2**k = exp2(s - (m - k)): the scale is folded into the exponent.
            shift = m_use - k_new
            if FMA:
                p = tl.exp2(s * cr[:, None] - shift[:, None])
            else:
                p = tl.exp2(s - shift[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1) * _pow2(-k_new)
            ratio = alpha * _pow2(k_new - k_i)
            m_i = m_new
        else:
            a = _act(s * cr[:, None], ACT, FAST)
            if MASKED:
                a = tl.where(ok, a, 0.0)
            amax = tl.max(tl.abs(a), 1)
            # (a zero row takes log2 of a tiny number and keeps its exponent below)
            k_new = tl.floor((0.0 - tl.log2(tl.maximum(amax, 1e-30))) + _P_LOG2_MAX)
            k_new = tl.minimum(tl.maximum(k_new, _NEG_P_EXP_MAX), _P_EXP_MAX)
            k_new = tl.where(amax > 0.0, k_new, k_i)
            p = a * _pow2(k_new)[:, None]
            ratio = _pow2(k_new - k_i)
        if not MX:
            ratio = ratio * (sv_prev / sv)
            sv_prev = sv
        acc = acc * ratio[:, None]
        p8 = _to_e4m3(p)
        if MX:
            acc = _mx_dot(_mx_operand(p8, 1.0), tl.trans(vf), acc)
        else:
            acc = tl.dot(p8, tl.trans(vt8), acc)  # FP8 x FP8 -> float32
        if _INTERP:
            # The interpreter reads the E4M3 NaN byte as 480 (for MX too: _mx_operand's
            # upcast); the hardware gives NaN. Without this, MX rows with a NaN/Inf in
            # their Q or keys came out finite under the interpreter.
            acc = tl.where(tl.max((p != p).to(tl.int32), 1)[:, None] > 0, float("nan"), acc)
        k_i = k_new
    return acc, m_i, l_i, k_i, sv_prev


@triton.jit
def _fp8_item(
    Q8, K8, VT8, QS, KS, VS, O, LSE, K_desc, VT_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vh, stride_vd,
    stride_qst, stride_qsh, stride_kst, stride_ksh, stride_vsh, stride_vsd,
    stride_ot, stride_oh, stride_lh,
    h, q_start, Lq, k_start, Lk, v_col0, n_targets, m0, qk_scale, coef, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST: tl.constexpr, MX: tl.constexpr, FMA: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One work item: query rows [m0, m0 + BLOCK_M) of one sequence and head."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (q_start + offs_m).to(tl.int64)
    q8 = _load_rows(Q8 + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
    k_base = K8 + k_start.to(tl.int64) * stride_kt + h * stride_kh
    vt_base = VT8 + h.to(tl.int64) * stride_vh
    v_col0 = tl.multiple_of(v_col0, 16)
    if MX:
        qmask = (offs_m < Lq)[:, None] & (offs_d < HEAD_DIM)[None, :]
        qsc = tl.load(QS + q_rows[:, None] * stride_qst + h * stride_qsh + (offs_d // 32)[None, :],
                      mask=qmask, other=127)  # fmt: skip
        q = _mx_operand(q8, _e8m0_to_f32(qsc))
        c_row = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
        ks_base = KS + k_start.to(tl.int64) * stride_kst + h * stride_ksh
        vs_base = VS + h.to(tl.int64) * stride_vsh
    else:
        q = q8
        sq = tl.load(QS + q_rows * stride_qst + h * stride_qsh, mask=offs_m < Lq, other=1.0)
        c_row = sq * qk_scale
        ks_base = KS + k_start.to(tl.int64) * stride_kst + h * stride_ksh
        vs_base = VS + k_start.to(tl.int64) * stride_kst + h * stride_ksh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    sv_prev = qk_scale * 0.0 + 1.0
    lo, full, hi = _kv_range(
        m0, Lq, Lk, n_targets, wl, wr, ctx, bsz,
        CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
        BLOCK_PREV, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i, k_i, sv_prev = _fp8_tiles(
        acc, m_i, l_i, k_i, sv_prev, q, c_row, k_base, vt_base, ks_base, vs_base, v_col0,
        K_desc, VT_desc, k_start, h * HEAD_DIM, h * HEAD_DIM_V,
        stride_kt, stride_vd, stride_kst, stride_vsd, offs_m, lo, full, Lq, Lk, n_targets,
        wl, wr, ctx, bsz, CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
        HAS_BLOCK, BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
        FAST, MX, FMA, TMA, TMA,
    )  # fmt: skip
    acc, m_i, l_i, k_i, sv_prev = _fp8_tiles(
        acc, m_i, l_i, k_i, sv_prev, q, c_row, k_base, vt_base, ks_base, vs_base, v_col0,
        K_desc, VT_desc, k_start, h * HEAD_DIM, h * HEAD_DIM_V,
        stride_kt, stride_vd, stride_kst, stride_vsd, offs_m, full, hi, Lq, Lk, n_targets,
        wl, wr, ctx, bsz, CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
        HAS_BLOCK, BLOCK_PREV, ACT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
        FAST, MX, FMA, TMA, False,
    )  # fmt: skip
    c = coef
    if NORM == 2:
        c = coef / tl.maximum(Lk, 1).to(tl.float32)
    unit = _pow2(-k_i) * c
    if not MX:
        unit = unit * sv_prev
    if ACT == 0:
        # A row with no allowed key (l == 0) outputs 0 and stores LSE = +inf.
        has_key = l_i > 0.0
        l_safe = tl.where(has_key, l_i, 1.0)
        o = acc * (unit / l_safe)[:, None]
        lse = tl.where(has_key, m_i + tl.log2(l_safe), float("inf"))
        lse = tl.where(l_i != l_i, l_i, lse)  # NaN inputs: NaN, so the backward sees them
        tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=offs_m < Lq)
    else:
        o = acc * unit[:, None]
    o_ptrs = (O + q_start.to(tl.int64) * stride_ot + h * stride_oh
              + offs_m[:, None] * stride_ot + offs_dv[None, :])  # fmt: skip
    _store_rows(o_ptrs, o, offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)


@triton.jit(do_not_specialize=["stride_lh", "wl", "wr", "ctx", "bsz"])
def _fp8_fwd_kernel(
    Q8, K8, VT8, QS, KS, VS, O, LSE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vh, stride_vd,
    stride_qst, stride_qsh, stride_kst, stride_ksh, stride_vsh, stride_vsd,
    stride_ot, stride_oh, stride_lh,
    q_offsets, kv_offsets, v_offsets, kv_index, num_targets, tile_seq, tile_idx, tile_total,
    qk_scale, coef, wl, wr, ctx, bsz, n_kv_rows, n_v_cols,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_MAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    MX: tl.constexpr, FMA: tl.constexpr, TMA: tl.constexpr = False,
):  # fmt: skip
    """Persistent FP8 forward over the cost-sorted query-tile list of ``_schedule``.

    ``TMA``: K tiles (all) and V tiles (mask-free ones) arrive through tensor descriptors
    built here, once per program, over K as ``(tokens, H * D)`` and V as ``(H * Dv, Tp)``:
    one bulk copy per tile instead of per-thread address arithmetic and masked loads.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(tile_total) * H
    K_desc = K8
    VT_desc = VT8
    if TMA:
        K_desc = tl.make_tensor_descriptor(K8, shape=[n_kv_rows, H * HEAD_DIM],
                                           strides=[stride_kt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])  # fmt: skip
        VT_desc = tl.make_tensor_descriptor(VT8, shape=[H * HEAD_DIM_V, n_v_cols],
                                            strides=[stride_vd, 1],
                                            block_shape=[BLOCK_DV, BLOCK_N])  # fmt: skip
    for r in range(0, tl.cdiv(total, nprog)):
        w = _work_item(r, pid, nprog)
        if w < total:
            h, b, q_start, Lq, k_start, Lk, n_targets, m0 = _query_tile(
                w, tile_seq, tile_idx, q_offsets, kv_offsets, kv_index, num_targets,
                H, HAS_MAP, HAS_TARGETS, BLOCK_M,
            )  # fmt: skip
            kb = b
            if HAS_MAP:
                kb = tl.load(kv_index + b)
            v_col0 = tl.load(v_offsets + kb)
            _fp8_item(
                Q8, K8, VT8, QS, KS, VS, O, LSE, K_desc, VT_desc,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vh, stride_vd,
                stride_qst, stride_qsh, stride_kst, stride_ksh, stride_vsh, stride_vsd,
                stride_ot, stride_oh, stride_lh,
                h, q_start, Lq, k_start, Lk, v_col0, n_targets, m0, qk_scale, coef,
                wl, wr, ctx, bsz,
                CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                BLOCK_PREV, ACT, NORM, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                BLOCK_N, FAST, MX, FMA, TMA,
            )  # fmt: skip
