"""The fused MX quantizer: one read of ``x`` writes a row-wise copy (blocks along K) and
a column-wise copy (blocks along M, stored K-major) plus their E8M0 scales.

Options fused into the same pass: a producer activation, a block random Hadamard
transform of the column-wise copy (on the tensor cores), stochastic rounding, and MX4
packing. The spec is ``reference.quantize_2d``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperrec.mxfp8._triton.common import (
    activation,
    e8m0_byte,
    encode,
    hash32,
    interpreting,
    inv_scale,
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
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        tl.store(ptr + rows[:, None] * s_row + cols[None, :] * s_col, code, mask=mask)


@triton.jit
def _mx_quantize_2d_kernel(
    x_ptr,
    M,
    K,
    s_xm,
    s_xk,
    rd_ptr,
    rs_ptr,
    s_rdm,
    s_rdk,
    s_rsm,
    s_rsk,
    cd_ptr,
    cs_ptr,
    s_cdm,
    s_cdk,
    s_csm,
    s_csk,
    h_ptr,
    h_stride,
    seed_ptr,
    m_bucket,
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
    ROW: tl.constexpr,
    COL: tl.constexpr,
    ACT: tl.constexpr,
    HAD: tl.constexpr,
    HAD_F32: tl.constexpr,
    SR: tl.constexpr,
    HW: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x_raw = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk, mask=mask, other=0.0)
    if x_raw.dtype == tl.bfloat16:
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
        idx = (rm.to(tl.int64)[:, None] * K + rk[None, :]).to(tl.uint32)
    if ROW:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        byte = e8m0_byte(tl.max(tl.reshape(bits, [BLOCK_M, NBK, SB]), axis=2), EMAX, MAXV, RCEIL)
        y = tl.reshape(
            tl.reshape(x, [BLOCK_M, NBK, SB]) * inv_scale(byte)[:, :, None], [BLOCK_M, BLOCK_K]
        )
        bad = tl.reshape(
            tl.broadcast_to((byte == 255)[:, :, None], [BLOCK_M, NBK, SB]), [BLOCK_M, BLOCK_K]
        )
        if not HW:
            y = tl.where(bad, 0.0, y)
        r = 0
        if SR:
            r = (hash32(idx ^ hash32(seed)) >> 9).to(tl.int32)
        code = encode(y, r, FMT, MBITS, EMIN, MAXV, SR, HW)
        code = tl.where(bad, NAN_CODE, code).to(tl.uint8)
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
            BLOCK_M,
            BLOCK_K,
        )
        kb = pid_k * NBK + tl.arange(0, NBK)
        smask = (rm < M)[:, None] & (kb < tl.cdiv(K, SB))[None, :]
        tl.store(rs_ptr + rm[:, None] * s_rsm + kb[None, :] * s_rsk, byte.to(tl.uint8), mask=smask)
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
        bits = t.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        byte = e8m0_byte(tl.max(tl.reshape(bits, [NBM, SB, BLOCK_K]), axis=1), EMAX, MAXV, RCEIL)
        y = tl.reshape(
            tl.reshape(t, [NBM, SB, BLOCK_K]) * inv_scale(byte)[:, None, :], [BLOCK_M, BLOCK_K]
        )
        bad = tl.reshape(
            tl.broadcast_to((byte == 255)[:, None, :], [NBM, SB, BLOCK_K]), [BLOCK_M, BLOCK_K]
        )
        if not HW:
            y = tl.where(bad, 0.0, y)
        r = 0
        if SR:
            r = (hash32(idx ^ hash32(seed + _COL_STREAM)) >> 9).to(tl.int32)
        code = encode(y, r, FMT, MBITS, EMIN, MAXV, SR, HW)
        code = tl.where(bad, NAN_CODE, code).to(tl.uint8)
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
            BLOCK_M,
            BLOCK_K,
        )
        mb = pid_m * NBM + tl.arange(0, NBM)
        smask = (mb < tl.cdiv(M, SB))[:, None] & (rk < K)[None, :]
        tl.store(cs_ptr + mb[:, None] * s_csm + rk[None, :] * s_csk, byte.to(tl.uint8), mask=smask)


_H_SIZE = 128  # the stored block-diagonal Hadamard matrix covers BLOCK_M <= 128


def quantize_configs(block_size: int, hadamard: int) -> list[triton.Config]:
    """Autotuning candidates on a GPU: (BLOCK_M, BLOCK_K, num_warps)."""
    bm_min = max(32, block_size, hadamard)
    shapes = [
        (32, 128, 4),
        (32, 256, 4),
        (32, 256, 8),
        (64, 256, 8),
        (128, 128, 4),
        (128, 256, 8),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_K": k}, num_warps=w)
        for m, k, w in shapes
        if m >= bm_min and k >= block_size
    ]


_AUTOTUNED: dict[tuple, object] = {}
#: Autotune on GPUs (set False to always use the first candidate, e.g. in tests).
AUTOTUNE = True


def _tuned(key: tuple, block_size: int, hadamard: int):
    if key not in _AUTOTUNED:
        _AUTOTUNED[key] = triton.autotune(
            configs=quantize_configs(block_size, hadamard), key=["m_bucket", "K"]
        )(_mx_quantize_2d_kernel)
    return _AUTOTUNED[key]


def launch_quantize_2d(
    x: torch.Tensor,
    *,
    fmt: ElemFormat,
    block_size: int,
    rceil: bool,
    rowwise: bool,
    colwise: bool,
    act: str,
    hadamard: torch.Tensor | None,
    seed: torch.Tensor | None,
    hw_cast: bool | None = None,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the fused quantizer on a 2-D ``x``; returns (row data, row scale, col data,
    col scale), with empty tensors for copies not requested.

    Layouts: row data ``(M, K)`` row-major; row scale logical ``(M, nbK)`` stored
    ``(nbK, M)``; col data logical ``(M, K)`` stored ``(K, M)``; col scale ``(nbM, K)``
    row-major (MX4 halves the packed dim). ``hadamard`` is the sign vector (length n) of
    the block random Hadamard transform applied to the column-wise copy; ``seed`` a
    one-element int64 tensor on ``x``'s device enabling stochastic rounding.
    """
    from hyperrec.mxfp8._ops import _alloc_quantized

    m, k = x.shape
    dev = x.device
    rd, rs, cd, cs = _alloc_quantized(x, fmt, block_size, rowwise, colwise)
    if m == 0 or k == 0:
        return rd, rs, cd, cs
    hw = (not interpreting()) if hw_cast is None else hw_cast
    had_n = 0 if hadamard is None else int(hadamard.shape[-1])
    hmat = None
    if had_n:
        from hyperrec.mxfp8.hadamard import block_diag

        hmat = block_diag(hadamard, _H_SIZE, x.dtype, dev)
    rdu = rd.view(torch.uint8)
    cdu = cd.view(torch.uint8)
    args = [
        x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        rdu,
        rs,
        rdu.stride(0) if rowwise else 0,
        rdu.stride(1) if rowwise else 0,
        rs.stride(0) if rowwise else 0,
        rs.stride(1) if rowwise else 0,
        cdu,
        cs,
        cdu.stride(0) if colwise else 0,
        cdu.stride(1) if colwise else 0,
        cs.stride(0) if colwise else 0,
        cs.stride(1) if colwise else 0,
        hmat if hmat is not None else x,
        _H_SIZE,
        seed if seed is not None else x,
        min(triton.next_power_of_2(m), 16384),
    ]
    meta = {
        "SB": block_size,
        "FMT": fmt.code,
        "MBITS": fmt.mbits,
        "EMIN": fmt.emin,
        "EMAX": fmt.emax,
        "MAXV": fmt.max_value,
        "NAN_CODE": 0 if fmt.nan_code is None else fmt.nan_code,
        "RCEIL": rceil,
        "ROW": rowwise,
        "COL": colwise,
        "ACT": ACT_CODES[act],
        "HAD": had_n,
        "HAD_F32": x.dtype == torch.float32 or interpreting(),
        "SR": seed is not None,
        "HW": hw,
    }
    if config is None and interpreting():
        config = (max(32, block_size, had_n), max(32, block_size), 4)
    elif config is None and not AUTOTUNE:
        first = quantize_configs(block_size, had_n)[0]
        config = (first.kwargs["BLOCK_M"], first.kwargs["BLOCK_K"], first.num_warps)
    if config is not None:
        bm, bk, warps = config
        grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
        _mx_quantize_2d_kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        return rd, rs, cd, cs
    key = (block_size, had_n, x.dtype, *meta.values())
    tuned = _tuned(key, block_size, had_n)

    def grid(meta_):
        return (triton.cdiv(m, meta_["BLOCK_M"]), triton.cdiv(k, meta_["BLOCK_K"]))

    tuned[grid](*args, **meta)
    return rd, rs, cd, cs
