"""Triton kernels of the FP8 backward (``FP8Config(backward="fp8")``).

The numerics are :func:`hyperrec.jagged_attn.reference_fp8.attention_backward`; the work
lists, key/query ranges and mask rules are those of the bf16 backward
(``_kernels._bwd_dkdv_kernel`` / ``_bwd_dq_kernel``), whose helpers are shared.

* ``_quant_grad_kernel``: Q and K (rotated when the config rotates), V and dO quantized to
  E4M3 per token and head, in one launch (grid axis 2 picks the tensor), with
  ``_fp8_kernels._quant_tile`` (one-token groups, the backward's tiny-amax bound); with
  ``TRANS_B`` the same launch also writes Q, K and dO transposed, the K-major B operands
  of the products that reduce over tokens.
* ``_fp8_bwd_dkdv_kernel``: a program owns a key tile; per query tile of ``GRAD_GROUP``
  rows it forms ``S^T`` and ``dP^T`` on the FP8 tensor cores, scales them by the
  per-token scales, computes ``P^T`` and ``dS^T`` in float32 as the bf16 kernel does, and
  quantizes ``P^T * sdo`` and ``dS^T * sq`` per key row (the query tile is the group)
  before the FP8 ``dV`` and ``dK`` products.
* ``_fp8_bwd_dq_kernel`` (runs first): a program owns a query tile. Softmax: a first pass
  over the keys recomputes the row's log-sum-exp and ``delta = rowsum(P * dP)`` from this
  backward's own FP8 scores and ``dP``, and writes them for the dK/dV kernel (the FP8
  forward's statistics come from other scores; mixing them made dQ wrong on inputs with
  outlier channels). Then per key tile of ``GRAD_GROUP`` keys it quantizes ``dS * sk``
  per query row before the FP8 ``dQ`` product.

dK and dQ of rotated operands are rotated back (Walsh-Hadamard butterflies, then the
signs) before they are stored. Under ``TRITON_INTERPRET`` the E4M3 conversion is done by
hand (see ``_fp8_kernels``); a NaN element always comes with a NaN scale here, so the
interpreter reading the NaN byte as 480 never hides one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyperrec.jagged_attn._triton._fp8_kernels import (
    _block_scale,
    _e4m3_codes,
    _fwht,
    _quant_tile,
)
from hyperrec.jagged_attn._triton._kernels import (
    _act_and_grad,
    _act_grad,
    _allowed,
    _finish_stats,
    _kv_range,
    _load_rows,
    _q_range,
    _query_tile,
    _stats_update,
    _store_rows,
    _work_item,
)
from hyperrec.jagged_attn.fp8 import GRAD_TINY_AMAX

_GRAD_TINY = tl.constexpr(GRAD_TINY_AMAX)


# ----------------------------------------------------------------------------------------
# Operands
# ----------------------------------------------------------------------------------------


@triton.jit
def _quant_grad_kernel(
    Q, K, V, DO, QD, KD, VD, DOD, QS, KS, VS, DOS, SIGNS, SHIFT, q_offsets, kv_offsets,
    q_seq, q_idx, q_total, kv_seq, kv_idx, kv_total,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_qdt, stride_qdh, stride_kdt, stride_kdh, stride_vdt, stride_vdh, stride_dodt,
    stride_dodh, stride_st, stride_sh,
    QT, KT, DOT, XS, q_poffsets, kv_poffsets,
    stride_qtd, stride_qth, stride_ktd, stride_kth, stride_dotd, stride_doth,
    D: tl.constexpr, BD: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
    TILE: tl.constexpr, HADAMARD: tl.constexpr, LOG2D: tl.constexpr, HAS_SHIFT: tl.constexpr,
):  # fmt: skip
    """Grid (tiles, H, 4 or 7): axis 2 = 0 quantizes Q, 1 K, 2 V, 3 dO (rows layout, one
    scale per token and head; all four scale tensors share the strides ``stride_st/sh``);
    4, 5, 6 write Q, K, dO again transposed (``"cols"`` layout ``(H, D, Tp)``, sequences
    at the 16-aligned columns of ``q_poffsets`` / ``kv_poffsets``; their scales go to the
    scratch ``XS``): the K-major operands of the products that reduce over tokens.
    ``HAS_SHIFT``: subtract ``SHIFT`` (B, H, D) from each kv sequence's keys first
    (``smooth_k``)."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    role = tl.program_id(2)
    if role == 0:
        _quant_tile(
            Q, QD, QS, SIGNS, q_offsets, q_offsets, q_seq, q_idx, q_total, w, h,
            stride_qt, stride_qh, stride_qdt, stride_qdh, stride_st, stride_sh,
            D, BD, TILE, 1, 0, False, True, HADAMARD, LOG2D, 0, 0, _GRAD_TINY, SHIFT, False,
        )  # fmt: skip
    elif role == 1:
        _quant_tile(
            K, KD, KS, SIGNS, kv_offsets, kv_offsets, kv_seq, kv_idx, kv_total, w, h,
            stride_kt, stride_kh, stride_kdt, stride_kdh, stride_st, stride_sh,
            D, BD, TILE, 1, 0, False, True, HADAMARD, LOG2D, 0, 0, _GRAD_TINY, SHIFT,
            HAS_SHIFT,
        )  # fmt: skip
    elif role == 2:
        _quant_tile(
            V, VD, VS, SIGNS, kv_offsets, kv_offsets, kv_seq, kv_idx, kv_total, w, h,
            stride_vt, stride_vh, stride_vdt, stride_vdh, stride_st, stride_sh,
            DV, BDV, TILE, 1, 0, False, True, False, 0, 0, 0, _GRAD_TINY, SHIFT, False,
        )  # fmt: skip
    elif role == 3:
        _quant_tile(
            DO, DOD, DOS, SIGNS, q_offsets, q_offsets, q_seq, q_idx, q_total, w, h,
            stride_dot, stride_doh, stride_dodt, stride_dodh, stride_st, stride_sh,
            DV, BDV, TILE, 1, 0, False, True, False, 0, 0, 0, _GRAD_TINY, SHIFT, False,
        )  # fmt: skip
    elif role == 4:
        _quant_tile(
            Q, QT, XS, SIGNS, q_offsets, q_poffsets, q_seq, q_idx, q_total, w, h,
            stride_qt, stride_qh, stride_qtd, stride_qth, stride_st, stride_sh,
            D, BD, TILE, 1, 0, True, True, HADAMARD, LOG2D, 0, 0, _GRAD_TINY, SHIFT, False,
        )  # fmt: skip
    elif role == 5:
        _quant_tile(
            K, KT, XS, SIGNS, kv_offsets, kv_poffsets, kv_seq, kv_idx, kv_total, w, h,
            stride_kt, stride_kh, stride_ktd, stride_kth, stride_st, stride_sh,
            D, BD, TILE, 1, 0, True, True, HADAMARD, LOG2D, 0, 0, _GRAD_TINY, SHIFT,
            HAS_SHIFT,
        )  # fmt: skip
    else:
        _quant_tile(
            DO, DOT, XS, SIGNS, q_offsets, q_poffsets, q_seq, q_idx, q_total, w, h,
            stride_dot, stride_doh, stride_dotd, stride_doth, stride_st, stride_sh,
            DV, BDV, TILE, 1, 0, True, True, False, 0, 0, 0, _GRAD_TINY, SHIFT, False,
        )  # fmt: skip


@triton.jit
def _load_cols(base, col0, cols, n_cols, dims, N_DIMS: tl.constexpr, BLOCK_DIMS: tl.constexpr):
    """A transposed operand tile ``(BLOCK_DIMS, len(cols))`` of a ``"cols"`` buffer: head-dim
    rows ``dims``, token columns ``col0 + cols`` (past ``n_cols`` or ``N_DIMS``: 0; the
    columns between sequences are never written)."""
    mask = (cols < n_cols)[None, :]
    if BLOCK_DIMS != N_DIMS:
        mask = mask & (dims < N_DIMS)[:, None]
    return tl.load(base + (col0 + cols)[None, :], mask=mask, other=0.0)


@triton.jit
def _quant_row_groups(x):
    """``x`` (float32, rows x GRAD_GROUP) quantized per row: (E4M3 tile, row scales);
    reference_fp8.group_quantize."""
    bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)
    scale, inv = _block_scale(bits, True, _GRAD_TINY)
    codes = _e4m3_codes(x * inv[:, None], (bits >= 0x7F800000)[:, None])
    return codes.to(tl.float8e4nv, bitcast=True), scale


@triton.jit
def _load_scales(base, rows, n_rows, stride):
    # rows past the sequence scale their (zero) operand rows by 0
    return tl.load(base + rows * stride, mask=rows < n_rows, other=0.0)


@triton.jit
def _unrotate(x, SIGNS, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, LOG2D: tl.constexpr):
    """``fwht(x) * signs`` along the head dim: the transpose of the forward's rotation."""
    d = tl.arange(0, BLOCK_D)
    return _fwht(x, ROWS, BLOCK_D, LOG2D) * tl.load(SIGNS + d)[None, :]


# ----------------------------------------------------------------------------------------
# dK, dV
# ----------------------------------------------------------------------------------------


@triton.jit
def _fp8_dkdv_tiles(
    dk, dv, k, v, sk, sv, q_base, do_base, qs_base, dos_base, lse_base, delta_base,
    qt_base, dot_base, col0,
    stride_qt, stride_dot, stride_st, offs_n, lo, hi, Lq, Lk, qk_scale, c, n_targets,
    wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, FAST: tl.constexpr,
    TRANS_B: tl.constexpr,
):  # fmt: skip
    # Transposed (keys x queries) as in the bf16 kernel; ``lo`` is a multiple of BLOCK_M
    # (the quantization groups start at the sequence's first query). ``TRANS_B``: the B
    # operands of dV and dK (dO and Q, reduced over the queries) come from their
    # transposed copies, K-major as Hopper's FP8 tensor cores read them.
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                       offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        do = _load_rows(do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
                        offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        sq = _load_scales(qs_base, offs_m, Lq, stride_st)
        sdo = _load_scales(dos_base, offs_m, Lq, stride_st)
        s_t = tl.dot(k, tl.trans(q)) * (sk[:, None] * sq[None, :])  # FP8 x FP8 -> float32
        dp_t = tl.dot(v, tl.trans(do)) * (sv[:, None] * sdo[None, :])
        if MASKED:
            ok_t = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                            CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                            HAS_BLOCK, BLOCK_PREV, True)  # fmt: skip
        if ACT == 0:
            lse = tl.load(lse_base + offs_m, mask=offs_m < Lq, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=offs_m < Lq, other=0.0)
            p_t = tl.exp2(s_t * qk_scale - lse[None, :])
            if MASKED:
                p_t = tl.where(ok_t, p_t, 0.0)
            ds_t = p_t * (dp_t * c - delta[None, :])
        else:
            p_t, g_t = _act_and_grad(s_t * qk_scale, ACT, FAST)
            ds_t = dp_t * g_t
            if MASKED:
                p_t = tl.where(ok_t, p_t, 0.0)
                ds_t = tl.where(ok_t, ds_t, 0.0)
        x8, sx = _quant_row_groups(p_t * sdo[None, :])
        y8, sy = _quant_row_groups(ds_t * sq[None, :])
        if TRANS_B:
            dot_t = _load_cols(dot_base, col0, offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)
            qt = _load_cols(qt_base, col0, offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)
            dv += tl.dot(x8, tl.trans(dot_t)) * sx[:, None]
            dk += tl.dot(y8, tl.trans(qt)) * sy[:, None]
        else:
            dv += tl.dot(x8, do) * sx[:, None]
            dk += tl.dot(y8, q) * sy[:, None]
    return dk, dv


@triton.jit(do_not_specialize=["stride_lh", "wl", "wr", "ctx", "bsz"])
def _fp8_bwd_dkdv_kernel(
    Q, K, V, DO, QS, KS, VS, DOS, LSE, DELTA, DK, DV, SIGNS, QT, DOT, q_poffsets,
    stride_qtd, stride_qth, stride_dotd, stride_doth,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_st, stride_sh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    q_offsets, kv_offsets, inv_ptr, inv_idx, num_targets, tile_seq, tile_idx, tile_total,
    qk_scale, scale, coef, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_MAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    HADAMARD: tl.constexpr, LOG2D: tl.constexpr, TRANS_B: tl.constexpr,
):  # fmt: skip
    """``scale`` already holds the rotation's ``1 / D``; scales are ``(T, H)`` float32;
    ``QT``/``DOT`` the transposed copies (``TRANS_B``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(tile_total) * H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for r in range(0, tl.cdiv(total, nprog)):
        w = _work_item(r, pid, nprog)
        if w < total:
            h = w % H
            kb = tl.load(tile_seq + w // H)
            t = tl.load(tile_idx + w // H)
            k_start = tl.load(kv_offsets + kb)
            Lk = tl.load(kv_offsets + kb + 1) - k_start
            n0 = t * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k_rows = k_start.to(tl.int64) + offs_n[:, None]
            k = _load_rows(K + h * stride_kh + k_rows * stride_kt + offs_d[None, :],
                           offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            v = _load_rows(V + h * stride_vh + k_rows * stride_vt + offs_dv[None, :],
                           offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
            s_rows = (k_start + offs_n) * stride_st + h * stride_sh
            sk = tl.load(KS + s_rows, mask=offs_n < Lk, other=0.0)
            sv = tl.load(VS + s_rows, mask=offs_n < Lk, other=0.0)
            c = coef
            if NORM == 2:
                c = coef / tl.maximum(Lk, 1).to(tl.float32)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
            j_lo = kb * 0
            j_hi = j_lo + 1
            if HAS_MAP:
                j_lo = tl.load(inv_ptr + kb)
                j_hi = tl.load(inv_ptr + kb + 1)
            for j in range(j_lo, j_hi):
                b = kb
                if HAS_MAP:
                    b = tl.load(inv_idx + j)
                q_start = tl.load(q_offsets + b)
                Lq = tl.load(q_offsets + b + 1) - q_start
                n_targets = 0
                if HAS_TARGETS:
                    n_targets = tl.load(num_targets + b)
                lo, mid, hi = _q_range(
                    n0, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                # Query tiles are the quantization groups: align them to the sequence
                # start. The rows added in front see no key of this tile (masked loop).
                # ``mid`` moves up to the next group boundary (rows that were mask-free
                # stay correct in the masked loop; past ``hi`` they see no key).
                lo_aligned = lo // BLOCK_M * BLOCK_M
                mid = lo_aligned + tl.cdiv(mid - lo_aligned, BLOCK_M) * BLOCK_M
                q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
                do_base = DO + q_start.to(tl.int64) * stride_dot + h * stride_doh
                qs_base = QS + q_start * stride_st + h * stride_sh
                dos_base = DOS + q_start * stride_st + h * stride_sh
                lse_base = LSE + h * stride_lh + q_start
                delta_base = DELTA + h * stride_lh + q_start
                qt_base = QT + h * stride_qth + offs_d[:, None] * stride_qtd
                dot_base = DOT + h * stride_doth + offs_dv[:, None] * stride_dotd
                col0 = 0
                if TRANS_B:
                    col0 = tl.load(q_poffsets + b)
                dk, dv = _fp8_dkdv_tiles(
                    dk, dv, k, v, sk, sv, q_base, do_base, qs_base, dos_base, lse_base,
                    delta_base, qt_base, dot_base, col0, stride_qt, stride_dot, stride_st,
                    offs_n, lo_aligned, mid, Lq, Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, ACT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    FAST, TRANS_B,
                )  # fmt: skip
                dk, dv = _fp8_dkdv_tiles(
                    dk, dv, k, v, sk, sv, q_base, do_base, qs_base, dos_base, lse_base,
                    delta_base, qt_base, dot_base, col0, stride_qt, stride_dot, stride_st,
                    offs_n, mid, hi, Lq, Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    FAST, TRANS_B,
                )  # fmt: skip
            if ACT == 0:
                dk = dk * scale
            else:
                dk = dk * (scale * c)
            dv = dv * c
            if HADAMARD:
                dk = _unrotate(dk, SIGNS, BLOCK_N, BLOCK_D, LOG2D)
            _store_rows(DK + h * stride_dkh + k_rows * stride_dkt + offs_d[None, :],
                        dk, offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            _store_rows(DV + h * stride_dvh + k_rows * stride_dvt + offs_dv[None, :],
                        dv, offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip


# ----------------------------------------------------------------------------------------
# dQ
# ----------------------------------------------------------------------------------------


@triton.jit
def _fp8_stats_tiles(
    m_i, l_i, u_i, q, do, sq, sdo, k_base, v_base, ks_base, vs_base, stride_kt, stride_vt,
    stride_st, offs_m, lo, hi, Lq, Lk, qk_scale, n_targets, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The softmax statistics of this backward's own FP8 scores and ``dP`` (see
    ``_kernels._bwd_stats_tiles``)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                       offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                       offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        sk = _load_scales(ks_base, offs_n, Lk, stride_st)
        sv = _load_scales(vs_base, offs_n, Lk, stride_st)
        s = tl.dot(q, tl.trans(k)) * (sq[:, None] * sk[None, :]) * qk_scale
        dp = tl.dot(do, tl.trans(v)) * (sdo[:, None] * sv[None, :])
        if MASKED:
            ok = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                          CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                          HAS_BLOCK, BLOCK_PREV)  # fmt: skip
            s = tl.where(ok, s, float("-inf"))
        m_i, l_i, u_i = _stats_update(m_i, l_i, u_i, s, dp)
    return m_i, l_i, u_i


@triton.jit
def _fp8_dq_tiles(
    dq, q, do, sq, sdo, lse, delta, k_base, v_base, ks_base, vs_base, kt_base, col0,
    stride_kt, stride_vt,
    stride_st, offs_m, lo, hi, Lq, Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    TRANS_B: tl.constexpr,
):  # fmt: skip
    # ``lo`` is a multiple of BLOCK_N (``_kv_range``): key tiles are the groups.
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                       offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                       offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        sk = _load_scales(ks_base, offs_n, Lk, stride_st)
        sv = _load_scales(vs_base, offs_n, Lk, stride_st)
        s = tl.dot(q, tl.trans(k)) * (sq[:, None] * sk[None, :])
        dp = tl.dot(do, tl.trans(v)) * (sdo[:, None] * sv[None, :])
        if ACT == 0:
            p = tl.exp2(s * qk_scale - lse[:, None])
            ds = p * (dp * c - delta[:, None])
        else:
            ds = dp * _act_grad(s * qk_scale, ACT, FAST)
        if MASKED:
            ok = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                          CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                          HAS_BLOCK, BLOCK_PREV)  # fmt: skip
            ds = tl.where(ok, ds, 0.0)
        z8, sz = _quant_row_groups(ds * sk[None, :])
        if TRANS_B:
            kt = _load_cols(kt_base, col0, offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)
            dq += tl.dot(z8, tl.trans(kt)) * sz[:, None]
        else:
            dq += tl.dot(z8, k) * sz[:, None]
    return dq


@triton.jit(do_not_specialize=["stride_lh", "wl", "wr", "ctx", "bsz"])
def _fp8_bwd_dq_kernel(
    Q, K, V, DO, QS, KS, VS, DOS, LSE, DELTA, DQ, SIGNS, KT, kv_poffsets, stride_ktd,
    stride_kth,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_st, stride_sh, stride_dqt, stride_dqh, stride_lh,
    q_offsets, kv_offsets, kv_index, num_targets, tile_seq, tile_idx, tile_total,
    qk_scale, scale, coef, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_MAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    HADAMARD: tl.constexpr, LOG2D: tl.constexpr, TRANS_B: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(tile_total) * H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for r in range(0, tl.cdiv(total, nprog)):
        w = _work_item(r, pid, nprog)
        if w < total:
            h, b, q_start, Lq, k_start, Lk, n_targets, m0 = _query_tile(
                w, tile_seq, tile_idx, q_offsets, kv_offsets, kv_index, num_targets,
                H, HAS_MAP, HAS_TARGETS, BLOCK_M,
            )  # fmt: skip
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q_rows = q_start.to(tl.int64) + offs_m[:, None]
            q = _load_rows(Q + h * stride_qh + q_rows * stride_qt + offs_d[None, :],
                           offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            do = _load_rows(DO + h * stride_doh + q_rows * stride_dot + offs_dv[None, :],
                            offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
            s_rows = (q_start + offs_m) * stride_st + h * stride_sh
            sq = tl.load(QS + s_rows, mask=offs_m < Lq, other=0.0)
            sdo = tl.load(DOS + s_rows, mask=offs_m < Lq, other=0.0)
            c = coef
            if NORM == 2:
                c = coef / tl.maximum(Lk, 1).to(tl.float32)
            k_base = K + k_start.to(tl.int64) * stride_kt + h * stride_kh
            v_base = V + k_start.to(tl.int64) * stride_vt + h * stride_vh
            ks_base = KS + k_start * stride_st + h * stride_sh
            vs_base = VS + k_start * stride_st + h * stride_sh
            kt_base = KT + h * stride_kth + offs_d[:, None] * stride_ktd
            col0 = 0
            if TRANS_B:
                kb = b
                if HAS_MAP:
                    kb = tl.load(kv_index + b)
                col0 = tl.load(kv_poffsets + kb)
            lo, full, hi = _kv_range(
                m0, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                BLOCK_PREV, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            if ACT == 0:
                # This backward's own log-sum-exp and delta (a first pass over the keys),
                # written for the dK/dV kernel: the forward's come from other scores.
                m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                u_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                m_i, l_i, u_i = _fp8_stats_tiles(
                    m_i, l_i, u_i, q, do, sq, sdo, k_base, v_base, ks_base, vs_base,
                    stride_kt, stride_vt, stride_st, offs_m, lo, full, Lq, Lk, qk_scale,
                    n_targets, wl, wr, ctx, bsz, CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR,
                    HAS_CONTEXT, HAS_BLOCK, BLOCK_PREV, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                    BLOCK_DV, BLOCK_N,
                )  # fmt: skip
                m_i, l_i, u_i = _fp8_stats_tiles(
                    m_i, l_i, u_i, q, do, sq, sdo, k_base, v_base, ks_base, vs_base,
                    stride_kt, stride_vt, stride_st, offs_m, full, hi, Lq, Lk, qk_scale,
                    n_targets, wl, wr, ctx, bsz, CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR,
                    HAS_CONTEXT, HAS_BLOCK, BLOCK_PREV, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                    BLOCK_DV, BLOCK_N,
                )  # fmt: skip
                lse, delta = _finish_stats(m_i, l_i, u_i, c, LSE + h * stride_lh + q_start,
                                           DELTA + h * stride_lh + q_start, offs_m, Lq)  # fmt: skip
            else:
                lse = tl.zeros([BLOCK_M], dtype=tl.float32)
                delta = lse
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            dq = _fp8_dq_tiles(
                dq, q, do, sq, sdo, lse, delta, k_base, v_base, ks_base, vs_base, kt_base, col0,
                stride_kt,
                stride_vt, stride_st, offs_m, lo, full, Lq, Lk, qk_scale, c, n_targets, wl,
                wr, ctx, bsz, CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                HAS_BLOCK, BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                BLOCK_N, FAST, TRANS_B,
            )  # fmt: skip
            dq = _fp8_dq_tiles(
                dq, q, do, sq, sdo, lse, delta, k_base, v_base, ks_base, vs_base, kt_base, col0,
                stride_kt,
                stride_vt, stride_st, offs_m, full, hi, Lq, Lk, qk_scale, c, n_targets, wl,
                wr, ctx, bsz, CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                HAS_BLOCK, BLOCK_PREV, ACT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                BLOCK_N, FAST, TRANS_B,
            )  # fmt: skip
            if ACT == 0:
                dq = dq * scale
            else:
                dq = dq * (scale * c)
            if HADAMARD:
                dq = _unrotate(dq, SIGNS, BLOCK_M, BLOCK_D, LOG2D)
            _store_rows(DQ + h * stride_dqh + q_rows * stride_dqt + offs_d[None, :],
                        dq, offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
