"""The fused MX quantizer: one read of ``x`` writes a row-wise copy (blocks along K) and
a column-wise copy (blocks along M, stored K-major) plus their E8M0 scales.

Options fused into the same pass: a producer activation, a block random Hadamard
transform of the column-wise copy (on the tensor cores), stochastic rounding, MX4
packing, and FP32 copies of the scales (the operand layout of cuBLAS's block-scaled
GEMM, so nothing converts them between the quantizer and the GEMM). The spec is
``reference.quantize_2d``.

Performance notes (H200, BF16 in): the kernel is bound by instruction issue as much as
by memory, so the per-element work is kept minimal. Tiles whose rows and columns are
all in range skip the bounds masks (``EVEN_M``/``EVEN_K``); with hardware FP8 casts the
saturating conversion replaces the clamp and, where the cast already yields the NaN
byte for a NaN input, the NaN-block select (``NAN_SEL``). Launch configs are tuned once
per (options, dtype, size bucket), not per shape, and the launch goes straight to the
JIT kernel without the ``triton.autotune`` wrapper.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from hyperrec.mxfp8._triton.common import (
    activation,
    block_amax,
    e8m0_byte,
    e8m0_to_f32,
    encode,
    hash32,
    interpreting,
    inv_scale,
    scale_constants,
)
from hyperrec.mxfp8.formats import ElemFormat

__all__ = ["ACT_CODES", "launch_quantize_2d", "quantize_configs"]

ACT_CODES = {"none": 0, "relu": 1, "relu2": 2, "silu": 3, "gelu_tanh": 4}
_COL_STREAM = tl.constexpr(0x632BE5AB)  # must match reference._COL_STREAM


@triton.jit
def _store_codes(
    ptr,
    code,
    row0,
    col0,
    rows,
    cols,
    n_rows,
    n_cols,
    s_row,
    s_col,
    PACK_ALONG_ROWS: tl.constexpr,
    PACKED: tl.constexpr,
    MASKED: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    # code: [BR, BC] uint8 for logical rows/cols. MX4 packs pairs along one dim.
    if PACKED:
        if PACK_ALONG_ROWS:
            ct = tl.trans(code)  # [BC, BR]
            lo, hi = tl.split(tl.reshape(ct, [BC, BR // 2, 2]))
            byte = lo | (hi << 4)  # [BC, BR // 2]
            prow = row0 // 2 + tl.arange(0, BR // 2)
            mask = (prow < (n_rows + 1) // 2)[None, :] & (cols < n_cols)[:, None]
            tl.store(ptr + prow[None, :] * s_row + cols[:, None] * s_col, byte, mask=mask)
        else:
            lo, hi = tl.split(tl.reshape(code, [BR, BC // 2, 2]))
            byte = lo | (hi << 4)
            pcol = col0 // 2 + tl.arange(0, BC // 2)
            mask = (rows < n_rows)[:, None] & (pcol < (n_cols + 1) // 2)[None, :]
            tl.store(ptr + rows[:, None] * s_row + pcol[None, :] * s_col, byte, mask=mask)
    else:
        ptrs = ptr + rows[:, None] * s_row + cols[None, :] * s_col
        code = code.to(ptr.dtype.element_ty, bitcast=True)  # FP8 storage: same bytes
        if MASKED:
            tl.store(ptrs, code, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])
        else:
            tl.store(ptrs, code)


@triton.jit
def _store_scales(
    ptr,
    f32_ptr,
    byte,
    rows,
    cols,
    n_rows,
    n_cols,
    s_row,
    s_col,
    F32S: tl.constexpr,
    MASKED: tl.constexpr,
):
    # E8M0 bytes [R, C] (int32) -> uint8, plus their FP32 values when F32S.
    off = rows[:, None] * s_row + cols[None, :] * s_col
    if MASKED:
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        tl.store(ptr + off, byte.to(tl.uint8), mask=mask)
        if F32S:
            tl.store(f32_ptr + off, e8m0_to_f32(byte), mask=mask)
    else:
        tl.store(ptr + off, byte.to(tl.uint8))
        if F32S:
            tl.store(f32_ptr + off, e8m0_to_f32(byte))


@triton.jit
def _mx_quantize_2d_kernel(
    x_ptr,
    M,
    K,
    s_xm,
    s_xk,
    rd_ptr,
    rs_ptr,
    rsf_ptr,
    s_rdm,
    s_rdk,
    s_rsm,
    s_rsk,
    cd_ptr,
    cs_ptr,
    csf_ptr,
    s_cdm,
    s_cdk,
    s_csm,
    s_csk,
    h_ptr,
    h_stride,
    seed_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SB: tl.constexpr,
    FMT: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX: tl.constexpr,
    MAXV: tl.constexpr,
    NAN_CODE: tl.constexpr,
    RCEIL: tl.constexpr,
    ADD: tl.constexpr,
    ODD: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    ACT: tl.constexpr,
    HAD: tl.constexpr,
    HAD_F32: tl.constexpr,
    SR: tl.constexpr,
    HW: tl.constexpr,
    NAN_SEL: tl.constexpr,
    F32S: tl.constexpr,
    FLOAT_MAX: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    MASKED: tl.constexpr = not (EVEN_M and EVEN_K)
    x_ptrs = x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk
    if MASKED:
        x_raw = tl.load(x_ptrs, mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
    else:
        x_raw = tl.load(x_ptrs)
    if x_raw.dtype == tl.bfloat16 and not HW:
        # BF16 -> FP32 by moving the bits: exact for subnormals too (the interpreter's
        # conversion flushes them).
        x = (x_raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x_raw.to(tl.float32)
    x = activation(x, ACT)
    PACKED: tl.constexpr = FMT == 2
    NBK: tl.constexpr = BLOCK_K // SB
    NBM: tl.constexpr = BLOCK_M // SB

    if SR:
        seed = tl.load(seed_ptr).to(tl.uint32)
        # Element index m * K + k modulo 2**32, in 32-bit arithmetic.
        idx = rm.to(tl.uint32)[:, None] * K.to(tl.uint32) + rk.to(tl.uint32)[None, :]
    if ROW:
        x3 = tl.reshape(x, [BLOCK_M, NBK, SB])
        byte = e8m0_byte(block_amax(x3, 2, FLOAT_MAX), EMAX, RCEIL, ADD, ODD)
        y = tl.reshape(x3 * inv_scale(byte)[:, :, None], [BLOCK_M, BLOCK_K])
        r = 0
        if SR:
            r = (hash32(idx ^ hash32(seed)) >> 9).to(tl.int32)
        if NAN_SEL:
            bad = tl.reshape(
                tl.broadcast_to((byte == 255)[:, :, None], [BLOCK_M, NBK, SB]),
                [BLOCK_M, BLOCK_K],
            )
            if not HW:
                y = tl.where(bad, 0.0, y)
            code = encode(y, r, FMT, MBITS, EMIN, MAXV, SR, HW)
            code = tl.where(bad, NAN_CODE, code).to(tl.uint8)
        else:
            # A NaN block scales every element to NaN, which the hardware cast turns
            # into the NaN byte.
            code = encode(y, r, FMT, MBITS, EMIN, MAXV, SR, HW)
        _store_codes(
            rd_ptr,
            code,
            pid_m * BLOCK_M,
            pid_k * BLOCK_K,
            rm,
            rk,
            M,
            K,
            s_rdm,
            s_rdk,
            False,
            PACKED,
            MASKED,
            BLOCK_M,
            BLOCK_K,
        )
        kb = pid_k * NBK + tl.arange(0, NBK)
        _store_scales(rs_ptr, rsf_ptr, byte, rm, kb, M, tl.cdiv(K, SB), s_rsm, s_rsk, F32S, MASKED)
    if COL:
        t = x
        if HAD > 0:
            # Block-diagonal H_n diag(s) as one [BM, BM] matrix: the transform runs on the
            # tensor cores in the input precision (+-1 entries are exact there).
            hr = tl.arange(0, BLOCK_M)
            # The top-left [BM, BM] corner of the stored block-diagonal matrix is itself
            # block-diagonal, so one matrix serves every BLOCK_M.
            h = tl.load(h_ptr + hr[:, None] * h_stride + hr[None, :])
            if HAD_F32:
                # FP32 inputs, or the interpreter (whose BF16 dot is broken): the same
                # exact +-1 products, summed in FP32.
                xh = x
                if ACT != 0:
                    xh = x.to(x_raw.dtype).to(tl.float32)
                t = tl.dot(h.to(tl.float32), xh, input_precision="ieee")
            else:
                t = tl.dot(h, x.to(x_raw.dtype) if ACT != 0 else x_raw)
        t3 = tl.reshape(t, [NBM, SB, BLOCK_K])
        byte = e8m0_byte(block_amax(t3, 1, FLOAT_MAX), EMAX, RCEIL, ADD, ODD)
        y = tl.reshape(t3 * inv_scale(byte)[:, None, :], [BLOCK_M, BLOCK_K])
        r = 0
        if SR:
            r = (hash32(idx ^ hash32(seed + _COL_STREAM)) >> 9).to(tl.int32)
        if NAN_SEL:
            bad = tl.reshape(
                tl.broadcast_to((byte == 255)[:, None, :], [NBM, SB, BLOCK_K]),
                [BLOCK_M, BLOCK_K],
            )
            if not HW:
                y = tl.where(bad, 0.0, y)
            code = encode(y, r, FMT, MBITS, EMIN, MAXV, SR, HW)
            code = tl.where(bad, NAN_CODE, code).to(tl.uint8)
        else:
            code = encode(y, r, FMT, MBITS, EMIN, MAXV, SR, HW)
        _store_codes(
            cd_ptr,
            code,
            pid_m * BLOCK_M,
            pid_k * BLOCK_K,
            rm,
            rk,
            M,
            K,
            s_cdm,
            s_cdk,
            True,
            PACKED,
            MASKED,
            BLOCK_M,
            BLOCK_K,
        )
        mb = pid_m * NBM + tl.arange(0, NBM)
        _store_scales(cs_ptr, csf_ptr, byte, mb, rk, tl.cdiv(M, SB), K, s_csm, s_csk, F32S, MASKED)


_H_SIZE = 128  # the stored block-diagonal Hadamard matrix covers BLOCK_M <= 128

#: Formats whose hardware cast (``HW``) writes the format's NaN byte for a NaN input, so
#: NaN blocks need no select (sm_90's ``cvt.rn.satfinite`` gives 0x7F for E4M3 and E5M2;
#: ``tests/test_gpu.py`` checks NaN and Inf blocks byte for byte).
HW_NAN_BYTE_OK = {0: True, 1: True}

# Launch candidates (BLOCK_M, BLOCK_K, num_warps), best first. Measured on an H200 with
# bench/sweep_quantize.py (BF16 in, device time from CUDA graphs): with 32-blocks small
# tiles on one or two warps win (no cross-warp reductions: 32x128 on 2 warps, ~84% of the
# copy bandwidth row+col); 128-blocks need 128x128 tiles, best on 4 warps (~75-78%); the
# row-wise copy alone is bandwidth-bound on any of them (93-97%).
_COLWISE_CANDIDATES = ((32, 128, 2), (32, 64, 1), (32, 256, 4), (64, 128, 2), (64, 256, 8))
_COLWISE_128 = ((128, 128, 4), (128, 128, 8), (128, 256, 8))
_ROWWISE_CANDIDATES = ((32, 256, 4), (64, 256, 8), (32, 128, 2))


def quantize_configs(
    block_size: int, hadamard: int, *, rowwise: bool = True, colwise: bool = True
) -> list[tuple[int, int, int]]:
    """Launch candidates on a GPU, ``(BLOCK_M, BLOCK_K, num_warps)``, the default first.

    A tile holds whole scale blocks along each blocked dim it writes (and whole
    Hadamard groups along M).
    """
    bm_min = max(block_size if colwise else 1, hadamard, 16)
    bk_min = max(block_size if rowwise else 1, 32)
    if not colwise:
        shapes = _ROWWISE_CANDIDATES
    elif bm_min > 64:
        shapes = _COLWISE_128
    else:
        shapes = _COLWISE_CANDIDATES + _COLWISE_128
    found = [(m, k, w) for m, k, w in shapes if m >= bm_min and k >= bk_min]
    if not found:  # e.g. 64-blocks on both dims
        bm, bk = triton.next_power_of_2(bm_min), triton.next_power_of_2(bk_min)
        found = [(bm, bk, 4 if bm * bk <= 16384 else 8)]
    return found


#: Autotune on GPUs (set False to always use the first candidate, e.g. in tests).
AUTOTUNE = True
#: A candidate replaces the default only when this much faster (timing noise).
TUNE_MARGIN = 0.04
#: Chosen configs: ``{tune key: (BLOCK_M, BLOCK_K, num_warps)}``. The key holds the
#: options, the dtype and the power-of-two size classes of M and K (not the shape), so a
#: new shape in a known class neither re-tunes nor recompiles.
_TUNED: dict[tuple, tuple[int, int, int]] = {}

_scale_constants = functools.cache(scale_constants)


def _bucket(n: int) -> int:
    # Coarse size classes: the best tile depends on the size only through occupancy.
    return min(1 << max(int(n - 1).bit_length(), 0), 1 << 14)


@functools.lru_cache(maxsize=256)
def _static(
    fmt: ElemFormat,
    block_size: int,
    rceil: bool,
    rowwise: bool,
    colwise: bool,
    act: str,
    had_n: int,
    dtype: torch.dtype,
    sr: bool,
    hw: bool,
    scale_fp32: bool,
    interp: bool,
) -> tuple[dict, tuple[tuple[int, int, int], ...], tuple]:
    """Per-option launch constants (built once): meta-parameters, candidates, tune key."""
    add, odd = _scale_constants(fmt.max_value, fmt.emax)
    meta = {
        "SB": block_size,
        "FMT": fmt.code,
        "MBITS": fmt.mbits,
        "EMIN": fmt.emin,
        "EMAX": fmt.emax,
        "MAXV": fmt.max_value,
        "NAN_CODE": 0 if fmt.nan_code is None else fmt.nan_code,
        "RCEIL": rceil,
        "ADD": add,
        "ODD": odd,
        "ROW": rowwise,
        "COL": colwise,
        "ACT": ACT_CODES[act],
        "HAD": had_n,
        "HAD_F32": dtype == torch.float32 or interp,
        "SR": sr,
        "HW": hw,
        "NAN_SEL": not (hw and HW_NAN_BYTE_OK.get(fmt.code, False)),
        "F32S": scale_fp32,
        "FLOAT_MAX": not interp,
    }
    if interp:
        candidates = ((max(32, block_size if colwise else 1, had_n), max(32, block_size), 4),)
    else:
        candidates = tuple(quantize_configs(block_size, had_n, rowwise=rowwise, colwise=colwise))
    return meta, candidates, (dtype, *meta.values())


def _launch(args: list, meta: dict, m: int, k: int, config: tuple[int, int, int]) -> None:
    bm, bk, warps = config
    grid = (-(-m // bm), -(-k // bk))  # plain ints: triton.cdiv costs microseconds here
    _mx_quantize_2d_kernel[grid](
        *args,
        **meta,
        BLOCK_M=bm,
        BLOCK_K=bk,
        EVEN_M=m % bm == 0,
        EVEN_K=k % bk == 0,
        num_warps=warps,
    )


def _pick_config(
    key: tuple, candidates: tuple[tuple[int, int, int], ...], args: list, meta: dict, m: int, k: int
) -> tuple[int, int, int]:
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    if len(candidates) == 1 or not AUTOTUNE:
        return candidates[0]
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]  # no benchmarking inside a CUDA graph capture (not cached)
    from triton.testing import do_bench

    timings = {}
    for c in candidates:
        try:
            timings[c] = do_bench(
                lambda c=c: _launch(args, meta, m, k, c), warmup=5, rep=25, return_mode="median"
            )
        except Exception:  # a config this GPU cannot run (e.g. out of resources)
            timings[c] = math.inf
    cfg = candidates[0]
    best = min(timings, key=timings.get)
    if timings[best] < (1 - TUNE_MARGIN) * timings[cfg]:
        cfg = best
    _TUNED[key] = cfg
    return cfg


def launch_quantize_2d(
    x: torch.Tensor,
    *,
    fmt: ElemFormat,
    block_size: int,
    rceil: bool,
    rowwise: bool,
    colwise: bool,
    act: str,
    hadamard: int | None,
    seed: torch.Tensor | None,
    hadamard_seed: int = 0,
    hw_cast: bool | None = None,
    config: tuple[int, int, int] | None = None,
    scale_fp32: bool = False,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run the fused quantizer on a 2-D ``x``; returns (row data, row scale, col data,
    col scale), with empty tensors for copies not requested, then (row FP32 scale, col
    FP32 scale) when ``scale_fp32``.

    Layouts: row data ``(M, K)`` row-major; row scale logical ``(M, nbK)`` stored
    ``(nbK, M)``; col data logical ``(M, K)`` stored ``(K, M)``; col scale ``(nbM, K)``
    row-major (MX4 halves the packed dim); the FP32 scales as the E8M0 ones.
    ``hadamard`` (0 or ``None``: off, 16, 32) and ``hadamard_seed`` select the block
    random Hadamard transform ``H_n diag(s)`` of the column-wise copy; ``seed`` a
    one-element int64 tensor on ``x``'s device enabling stochastic rounding; ``config``
    forces ``(BLOCK_M, BLOCK_K, num_warps)``; ``out`` passes the output tensors (as
    ``_ops.alloc_quantized`` makes them).
    """
    if out is None:
        from hyperrec.mxfp8._ops import alloc_quantized

        out = alloc_quantized(x, fmt, block_size, rowwise, colwise, scale_fp32)
    m, k = x.shape
    if m == 0 or k == 0:
        return out
    rd, rs, cd, cs = out[:4]
    rsf, csf = (out[4], out[5]) if scale_fp32 else (rs, cs)
    interp = interpreting()
    hw = (not interp) if hw_cast is None else hw_cast
    had_n = hadamard or 0
    meta, candidates, key = _static(
        fmt,
        block_size,
        rceil,
        rowwise,
        colwise,
        act,
        had_n,
        x.dtype,
        seed is not None,
        hw,
        scale_fp32,
        interp,
    )
    hmat = x
    if had_n:
        from hyperrec.mxfp8.hadamard import seeded_block_diag

        hmat = seeded_block_diag(had_n, hadamard_seed, _H_SIZE, x.dtype, x.device)
    args = [
        x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        rd,
        rs,
        rsf,
        rd.stride(0) if rowwise else 0,
        rd.stride(1) if rowwise else 0,
        rs.stride(0) if rowwise else 0,
        rs.stride(1) if rowwise else 0,
        cd,
        cs,
        csf,
        cd.stride(0) if colwise else 0,
        cd.stride(1) if colwise else 0,
        cs.stride(0) if colwise else 0,
        cs.stride(1) if colwise else 0,
        hmat,
        _H_SIZE,
        seed if seed is not None else x,
    ]
    if config is None:
        config = _pick_config((*key, _bucket(m), _bucket(k)), candidates, args, meta, m, k)
    _launch(args, meta, m, k, config)
    return out
