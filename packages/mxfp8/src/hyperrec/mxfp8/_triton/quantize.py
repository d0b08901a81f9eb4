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
byte for a NaN input, the NaN-block select (``NAN_SEL``). Launch configs are picked
from a committed table by (options, size bucket), not per shape and never by timing
(:mod:`._configs`), and the launch goes straight to the JIT kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from hyperrec.mxfp8._triton import interpreting
from hyperrec.mxfp8._triton._configs import device_arch, select_quantize_config
from hyperrec.mxfp8._triton.common import (
    activation,
    block_amax,
    e8m0_byte,
    e8m0_to_f32,
    encode,
    hash32,
    inv_scale,
    scale_constants,
)
from hyperrec.mxfp8.formats import ElemFormat

__all__ = ["ACT_CODES", "launch_quantize_2d"]

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

_scale_constants = functools.cache(scale_constants)


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
) -> dict[str, Any]:
    """Per-option launch constants (built once): the kernel's meta-parameters."""
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
    return meta


def _launch(
    args: list[Any], meta: dict[str, Any], m: int, k: int, config: tuple[int, int, int]
) -> None:
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
    meta = _static(
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
        config = select_quantize_config(
            arch=device_arch(x.device),
            block_size=block_size,
            hadamard=had_n,
            rowwise=rowwise,
            colwise=colwise,
            m=m,
            k=k,
            interpret=interp,
        ).tile
    _launch(args, meta, m, k, config)
    return out
