"""Triton kernels for jagged softmax attention and GDPA, forward and backward.

The math is :mod:`hyperrec.jagged_attn.spec` under the mask of :mod:`hyperrec.jagged_attn.masks`
(``s = scale * q.k``; ``w = softmax(s)`` over allowed keys or ``act(s)`` on allowed pairs;
``o = coef * sum_j w_ij v_j`` with ``coef = output_scale * normalisation``).

Layout: ``q`` is ``(total_q, H, D)``, ``k`` ``(total_kv, H, D)``, ``v`` ``(total_kv, H, DV)``,
last dim contiguous; query sequence ``b`` owns rows ``q_offsets[b]:q_offsets[b+1]`` and reads
kv rows ``kv_offsets[kb]:kv_offsets[kb+1]``, ``kb = kv_index[b]`` (``b`` without a map). No
padding is read or written.

Kernels:

* ``_fwd_kernel``: a work item is one ``BLOCK_M`` tile of queries x one head, streaming its
  key range in ``BLOCK_N`` tiles. Softmax keeps FlashAttention-2's online (max, sum) state in
  base 2; element-wise activations need no running state and accumulate ``act(S) @ V``.
* ``_bwd_dkdv_kernel``: a work item is one ``BLOCK_N`` tile of keys x one head, streaming
  the query tiles of every query sequence mapped to its kv sequence; dK and dV accumulate in
  fp32 registers and are written once (no atomics: deterministic).
* dQ, two ways, both accumulating in fp32. ``_bwd_dq_kernel`` runs the forward's schedule
  again, recomputes ``S`` and ``dP`` and accumulates dQ in registers: two more GEMMs per
  tile than FlashAttention-2's scheme, but deterministic and free of atomics. With
  ``DQ_ATOMIC`` the dK/dV kernel instead adds each tile's ``dS^T K`` share into a zeroed
  fp32 buffer with atomics (5 GEMMs per tile; run-to-run bit differences possible).
* ``_bwd_delta_kernel``: ``delta = rowsum(dO * O)``, the softmax backward's row term.

Forward variants (``KernelConfig`` flags, constexprs here; off by default, except TMA in the
shipped sm90 forward entries; ``bench/sweep_forward.py`` measures them): ``PREFETCH`` reads
work items from a precomputed tile table one item ahead; ``TMA`` (a bitmask) moves Q, K/V of
mask-free tiles, K of masked tiles and O of in-sequence tiles through tensor descriptors;
``FMA`` folds the softmax scale into one fused multiply-add per score; ``LAZY`` skips the
accumulator rescale while no row's max grew by more than 2**8; ``WARP_SPEC`` asks Triton to
warp-specialise the key loops.

Scheduling. The three main kernels are *persistent*: the host launches at most as many
programs as fit on the GPU at once and each program walks the work list with a stride of
the grid size, so a batch of a thousand short sequences costs no more launches or idle
programs than one long one. The work list (``_schedule.py``) is a device-side table of
tiles sorted by estimated cost, heaviest first (longest-processing-time-first: long
sequences, and for causal the tiles below the longest stretch of the diagonal, start early;
short ones fill the tail). Rounds alternate direction ("snake") so that no program always
takes the most expensive item of its round. A program reads its tile's sequence and index
with two independent loads, so a work item starts after one memory round trip; the host
never reads a length, and nothing compiled depends on the lengths.

Masking. Only tiles that cross the causal diagonal or the ragged end of a sequence evaluate
an element-wise mask; interior tiles run mask-free. Any other mask rule (window, block,
targets, contextual prefix) evaluates the mask on every visited tile, but the visited key
(or query) range is first narrowed to the band the rules allow, so block and window
attention cost O(L * band), not O(L^2). Softmax sets disallowed scores to -inf *before* the
running max and sum are updated, so masked keys never enter the denominator; a row with no
allowed key outputs 0 and stores LSE = +inf, which makes its backward exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyperrec.jagged_attn._triton import interpreting
from hyperrec.jagged_attn.activations import GELU_POLY_COEFFS, GELU_POLY_RANGE

# Activation codes (the ``ACT`` constexpr); the launcher maps names to these.
ACT_SOFTMAX = 0
ACT_SILU = 1
ACT_GELU = 2
ACT_GELU_TANH = 3
ACT_GELU_POLY = 4
ACT_RELU = 5
ACT_SIGMOID = 6
ACT_IDENTITY = 7

# Normalisation by the kv length is the one rule not folded into the runtime ``coef``.
NORM_KV_LEN = 2

# Constants are pre-multiplied and written after the tensor operand (x * C, not C * x):
# the Triton interpreter mistypes a product that starts with a constexpr global.
_LOG2E = tl.constexpr(1.4426950408889634)
_TWO_LOG2E = tl.constexpr(2.8853900817779268)
_NEG_HALF_LOG2E = tl.constexpr(-0.7213475204444817)
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_CUBIC = tl.constexpr(0.044715)
_GP_RANGE = tl.constexpr(GELU_POLY_RANGE)
_GP1 = tl.constexpr(GELU_POLY_COEFFS[0])
_GP2 = tl.constexpr(GELU_POLY_COEFFS[1])
_GP3 = tl.constexpr(GELU_POLY_COEFFS[2])
_GP4 = tl.constexpr(GELU_POLY_COEFFS[3])
_GP5 = tl.constexpr(GELU_POLY_COEFFS[4])
_GP6 = tl.constexpr(GELU_POLY_COEFFS[5])
_GP7 = tl.constexpr(GELU_POLY_COEFFS[6])
_GP8 = tl.constexpr(GELU_POLY_COEFFS[7])
_DGP2 = tl.constexpr(2.0 * GELU_POLY_COEFFS[1])
_DGP3 = tl.constexpr(3.0 * GELU_POLY_COEFFS[2])
_DGP4 = tl.constexpr(4.0 * GELU_POLY_COEFFS[3])
_DGP5 = tl.constexpr(5.0 * GELU_POLY_COEFFS[4])
_DGP6 = tl.constexpr(6.0 * GELU_POLY_COEFFS[5])
_DGP7 = tl.constexpr(7.0 * GELU_POLY_COEFFS[6])
_DGP8 = tl.constexpr(8.0 * GELU_POLY_COEFFS[7])
_THREE_TANH_CUBIC = tl.constexpr(3.0 * 0.044715)
assert len(GELU_POLY_COEFFS) == 8, "the kernel's Horner scheme is written for 8 coefficients"

# Triton's CPU interpreter gets bf16 wrong in two places: it multiplies bf16 tiles as if
# their bits were another type, and it rounds fp32 -> bf16 incorrectly. Under
# TRITON_INTERPRET the GEMM operands are therefore widened to fp32 (they already hold
# bf16/fp16 values, so this reproduces the tensor cores' exact products with fp32
# accumulation) and fp32 -> bf16 casts round to nearest-even by hand. On a GPU none of this
# is compiled: the kernels use the native tensor-core GEMMs and conversions.
_WIDEN_GEMM = tl.constexpr(interpreting())


@triton.jit
def _to(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even (see ``_WIDEN_GEMM``)."""
    if _WIDEN_GEMM and DTYPE == tl.bfloat16:  # noqa: SIM300 (DTYPE is an argument)
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _mm(a, b):
    """a @ b with fp32 accumulation."""
    if _WIDEN_GEMM:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _mma(a, b, acc):
    """acc + a @ b with fp32 accumulation."""
    if _WIDEN_GEMM:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


# ----------------------------------------------------------------------------------------
# Element-wise math
# ----------------------------------------------------------------------------------------


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:
        # One MUFU op (max rel. error ~2^-11, below bf16's 2^-8 rounding of P).
        y = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        # 1 - 2 / (e^{2x} + 1): exact to fp32 rounding and saturates cleanly at +-1.
        y = 1.0 - 2.0 / (tl.exp2(x * _TWO_LOG2E) + 1.0)
    return y


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    # sigmoid(x) = (1 + tanh(x/2)) / 2: one MUFU op instead of exp + reciprocal.
    return 0.5 + 0.5 * _tanh(0.5 * x, FAST)


@triton.jit
def _gelu_poly_q(u):
    # Q(u) = sum_k c_k u^k (Horner), the even part of the ALU-only GELU: FMAs only.
    acc = u * _GP8 + _GP7
    acc = acc * u + _GP6
    acc = acc * u + _GP5
    acc = acc * u + _GP4
    acc = acc * u + _GP3
    acc = acc * u + _GP2
    acc = acc * u + _GP1
    return acc * u


@triton.jit
def _gelu_poly_dq(u):
    # Q'(u) = sum_k k c_k u^(k-1)
    acc = u * _DGP8 + _DGP7
    acc = acc * u + _DGP6
    acc = acc * u + _DGP5
    acc = acc * u + _DGP4
    acc = acc * u + _DGP3
    acc = acc * u + _DGP2
    return acc * u + _GP1


@triton.jit
def _act(x, ACT: tl.constexpr, FAST: tl.constexpr):
    """The element-wise activation (fp32 in, fp32 out); see ``activations.py``."""
    if ACT == 1:  # silu(x) = x * sigmoid(x) = h + h * tanh(h), h = x / 2
        h = 0.5 * x
        y = h + h * _tanh(h, FAST)
    elif ACT == 2:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.math.erf(x * _INV_SQRT2))
    elif ACT == 3:  # gelu (tanh approximation)
        y = 0.5 * x * (1.0 + _tanh((x + x * x * x * _TANH_CUBIC) * _SQRT_2_OVER_PI, FAST))
    elif ACT == 4:  # gelu_poly: 0.5 x + Q(x^2) inside the range, relu outside; no MUFU
        xc = tl.minimum(tl.maximum(x, -_GP_RANGE), _GP_RANGE)
        inside = 0.5 * x + _gelu_poly_q(xc * xc)
        y = tl.where(tl.abs(x) < _GP_RANGE, inside, tl.maximum(x, 0.0))
    elif ACT == 5:  # relu
        y = tl.maximum(x, 0.0)
    elif ACT == 6:  # sigmoid
        y = _sigmoid(x, FAST)
    else:  # identity
        y = x
    return y


@triton.jit
def _act_grad(x, ACT: tl.constexpr, FAST: tl.constexpr):
    """d act / dx at ``x`` (fp32)."""
    if ACT == 1:
        s = _sigmoid(x, FAST)
        g = s * (1.0 + x * (1.0 - s))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.math.erf(x * _INV_SQRT2))
        pdf = tl.exp2(x * x * _NEG_HALF_LOG2E) * _INV_SQRT_2PI
        g = cdf + x * pdf
    elif ACT == 3:
        t = _tanh((x + x * x * x * _TANH_CUBIC) * _SQRT_2_OVER_PI, FAST)
        dinner = (1.0 + x * x * _THREE_TANH_CUBIC) * _SQRT_2_OVER_PI
        g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    elif ACT == 4:
        xc = tl.minimum(tl.maximum(x, -_GP_RANGE), _GP_RANGE)
        inside = 0.5 + 2.0 * xc * _gelu_poly_dq(xc * xc)
        g = tl.where(tl.abs(x) < _GP_RANGE, inside, tl.where(x > 0.0, 1.0, 0.0))
    elif ACT == 5:
        g = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 6:
        s = _sigmoid(x, FAST)
        g = s * (1.0 - s)
    else:
        g = tl.full(x.shape, 1.0, tl.float32)
    return g


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr, FAST: tl.constexpr):
    """(act(x), act'(x)), sharing the sigmoid where the activation has one."""
    if ACT == 1:
        s = _sigmoid(x, FAST)
        y = x * s
        g = s * (1.0 + x * (1.0 - s))
    elif ACT == 6:
        y = _sigmoid(x, FAST)
        g = y * (1.0 - y)
    else:
        y = _act(x, ACT, FAST)
        g = _act_grad(x, ACT, FAST)
    return y, g


# ----------------------------------------------------------------------------------------
# Scheduling and sequence geometry
# ----------------------------------------------------------------------------------------


@triton.jit
def _work_item(r, pid, nprog):
    # Round r of the persistent loop; odd rounds run backwards ("snake") so the program that
    # took the most expensive item of one round takes the cheapest of the next.
    return r * nprog + tl.where(r % 2 == 0, pid, nprog - 1 - pid)


@triton.jit
def _query_tile(
    w, tile_seq, tile_idx, q_offsets, kv_offsets, kv_index, num_targets,
    H: tl.constexpr, HAS_MAP: tl.constexpr, HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Decode work item ``w`` of a query-tile schedule (forward and dQ passes).

    Heads vary fastest, so programs running at the same time read the same sequences.
    Returns (head, query sequence, its start and length, its kv sequence's start and
    length, its number of HSTU targets, the tile's first query row).
    """
    h = w % H
    b = tl.load(tile_seq + w // H)
    t = tl.load(tile_idx + w // H)
    q_start = tl.load(q_offsets + b)
    Lq = tl.load(q_offsets + b + 1) - q_start
    kb = b
    if HAS_MAP:
        kb = tl.load(kv_index + b)
    k_start = tl.load(kv_offsets + kb)
    Lk = tl.load(kv_offsets + kb + 1) - k_start
    n_targets = 0
    if HAS_TARGETS:
        n_targets = tl.load(num_targets + b)
    return h, b, q_start, Lq, k_start, Lk, n_targets, t * BLOCK_M


@triton.jit
def _floordiv(a, b):
    # Triton's // truncates toward zero; positions before the first key can be negative.
    return tl.where(a >= 0, a // b, -((b - 1 - a) // b))


@triton.jit
def _allowed(
    offs_m,
    offs_n,
    Lq,
    Lk,
    n_targets,
    wl,
    wr,
    ctx,
    bsz,
    CAUSAL: tl.constexpr,
    GENERIC: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    BLOCK_PREV: tl.constexpr,
    TRANSPOSED: tl.constexpr = False,
):
    """Boolean (BLOCK_M, BLOCK_N), or (BLOCK_N, BLOCK_M) if ``TRANSPOSED``: may query
    ``offs_m`` attend to key ``offs_n``.

    Exactly :func:`hyperrec.jagged_attn.masks.allowed`: query i sits at key-timeline
    position p = i + Lk - Lq (bottom-right alignment); with targets, e = min(p, t0),
    t0 = Lk - n_targets; history keys (j < t0) follow the causal/window/block rules, or the
    contextual override; a target key is visible to its own query only. The transposed
    form is built directly (no register transpose) for the dK/dV kernel's S^T tiles.
    """
    if TRANSPOSED:
        i = offs_m[None, :]
        j = offs_n[:, None]
    else:
        i = offs_m[:, None]
        j = offs_n[None, :]
    p = i + (Lk - Lq)
    ok = (i < Lq) & (j < Lk)
    if GENERIC:
        t0 = Lk
        if HAS_TARGETS:
            t0 = Lk - n_targets
        e = tl.minimum(p, t0)
        base = ok
        if CAUSAL:
            base = base & (j <= e)
        if HAS_WL:
            base = base & (j >= e - wl)
        if HAS_WR:
            base = base & (j <= e + wr)
        if HAS_BLOCK:
            q_blk = _floordiv(e, bsz)
            k_blk = j // bsz
            same = k_blk == q_blk
            if BLOCK_PREV:
                same = same | (k_blk == q_blk - 1)
            base = base & same
        if HAS_CONTEXT:
            base = base | (j < ctx) | ((p >= 0) & (p < ctx))
        if HAS_TARGETS:
            ok = ok & ((base & (j < t0)) | ((j >= t0) & (j == p)))
        else:
            ok = ok & base
    elif CAUSAL:
        ok = ok & (j <= p)
    return ok


@triton.jit
def _kv_range(
    m0,
    Lq,
    Lk,
    n_targets,
    wl,
    wr,
    ctx,
    bsz,
    CAUSAL: tl.constexpr,
    GENERIC: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    BLOCK_PREV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys visited by query tile [m0, m0 + BLOCK_M): ``[lo, full)`` mask-free, then
    ``[full, hi)`` masked. Every allowed key lies in [lo, hi); the bounds follow from the
    rules of :func:`_allowed` (e <= p, both non-decreasing in the row)."""
    first_p = m0 + (Lk - Lq)
    last_p = tl.minimum(m0 + BLOCK_M, Lq) - 1 + (Lk - Lq)
    if GENERIC:
        lo = first_p * 0
        hi = Lk
        if CAUSAL:
            hi = tl.minimum(hi, last_p + 1)
        if HAS_WR:
            hi = tl.minimum(hi, last_p + wr + 1)
        if HAS_BLOCK:
            hi = tl.minimum(hi, (_floordiv(last_p, bsz) + 1) * bsz)
        e_first = first_p
        if HAS_TARGETS:
            e_first = tl.minimum(first_p, Lk - n_targets)
        if HAS_WL:
            lo = tl.maximum(lo, e_first - wl)
        if HAS_BLOCK:
            if BLOCK_PREV:
                lo = tl.maximum(lo, (_floordiv(e_first, bsz) - 1) * bsz)
            else:
                lo = tl.maximum(lo, _floordiv(e_first, bsz) * bsz)
        if HAS_CONTEXT:
            lo = lo * 0  # every query sees the contextual keys
            if first_p < ctx:
                hi = Lk  # contextual queries see every history key
        hi = tl.minimum(tl.maximum(hi, 0), Lk)
        lo = tl.minimum(tl.maximum(lo, 0), hi) // BLOCK_N * BLOCK_N
        full = lo
    elif CAUSAL:
        lo = first_p * 0
        hi = tl.minimum(tl.maximum(last_p + 1, 0), Lk)
        # every row of the tile sees key n iff n <= first_p
        full = tl.minimum(tl.maximum(first_p + 1, 0), Lk) // BLOCK_N * BLOCK_N
    else:
        lo = first_p * 0
        hi = Lk
        full = Lk // BLOCK_N * BLOCK_N
    return lo, full, hi


@triton.jit
def _q_range(
    n0,
    Lq,
    Lk,
    n_targets,
    wl,
    wr,
    ctx,
    bsz,
    CAUSAL: tl.constexpr,
    GENERIC: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    BLOCK_PREV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Queries visited by key tile [n0, n0 + BLOCK_N): ``[lo, mid)`` masked, then
    ``[mid, hi)`` mask-free (the transpose of :func:`_kv_range`)."""
    diag = Lk - Lq
    last_j = tl.minimum(n0 + BLOCK_N, Lk) - 1
    if GENERIC:
        # Necessary conditions on the query position p = i + diag (see _allowed): a lower
        # bound from causal / right window / block, an upper bound on e from left window /
        # block. Row i of position p is i = p - diag.
        lo_p = diag  # p of row 0
        if CAUSAL:
            lo_p = tl.maximum(lo_p, n0)
        if HAS_WR:
            lo_p = tl.maximum(lo_p, n0 - wr)
        if HAS_BLOCK:
            lo_p = tl.maximum(lo_p, n0 // bsz * bsz)
        lo = tl.maximum(lo_p - diag, 0)
        hi = Lq
        if HAS_WL or HAS_BLOCK:
            e_hi = Lk + Lq  # effectively unbounded
            if HAS_WL:
                e_hi = tl.minimum(e_hi, last_j + wl)
            if HAS_BLOCK:
                if BLOCK_PREV:
                    e_hi = tl.minimum(e_hi, (last_j // bsz + 2) * bsz - 1)
                else:
                    e_hi = tl.minimum(e_hi, (last_j // bsz + 1) * bsz - 1)
            t0 = Lk
            if HAS_TARGETS:
                t0 = Lk - n_targets
            if t0 > e_hi:  # e = min(p, t0) <= e_hi needs p <= e_hi
                hi = tl.minimum(hi, e_hi - diag + 1)
        if HAS_CONTEXT:
            lo = lo * 0  # contextual queries see every history key
            if n0 < ctx:
                hi = Lq  # every query sees the contextual keys
        hi = tl.minimum(tl.maximum(hi, 0), Lq)
        lo = tl.minimum(lo, hi)
        mid = hi
    elif CAUSAL:
        # rows that see at least one key of the tile: p >= n0
        lo = tl.minimum(tl.maximum(n0 - diag, 0), Lq)
        # rows that see the whole tile: p >= n0 + BLOCK_N - 1
        full = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - diag, lo), Lq)
        mid = lo + tl.cdiv(full - lo, BLOCK_M) * BLOCK_M
        hi = Lq
    else:
        lo = n0 * 0
        mid = lo
        hi = Lq
    return lo, mid, hi


@triton.jit
def _load_rows(ptrs, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Load a (rows x cols) tile, zero-filling rows >= n_rows and cols >= N_COLS."""
    mask = rows[:, None] < n_rows
    if BLOCK_COLS != N_COLS:
        mask = mask & (cols[None, :] < N_COLS)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    mask = rows[:, None] < n_rows
    if BLOCK_COLS != N_COLS:
        mask = mask & (cols[None, :] < N_COLS)
    tl.store(ptrs, _to(x, ptrs.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------

# Lazy rescaling (``LAZY``): the accumulator is rescaled only when a row's running max grew
# by more than this many powers of two since the last rescale, so unnormalised weights stay
# below 2**8 (exact in fp32; bf16/fp16 keep their relative precision at that magnitude).
_LAZY_LOG2_THRESHOLD = tl.constexpr(8.0)


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, k_base, v_base, K_desc, V_desc, k_row0, k_col, v_col, stride_kt,
    stride_vt, offs_m, lo, hi, Lq, Lk, qk_scale, n_targets, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    K_TMA: tl.constexpr, V_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, FMA: tl.constexpr,
    LAZY: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if K_TMA:
            # Rows past the sequence belong to the next one (or are zero past the tensor):
            # harmless for K, whose scores the mask replaces below (tl.where, so even a NaN
            # there never reaches this sequence), but V rows are multiplied by P = 0, and
            # 0 * NaN = NaN; so V goes through descriptors only in mask-free tiles, which
            # lie inside the sequence.
            k = K_desc.load([k_row0 + start_n, k_col])
        else:
            k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                           offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        if V_TMA:
            v = V_desc.load([k_row0 + start_n, v_col])
        else:
            v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                           offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        s = _mm(q, tl.trans(k))  # fp32 accumulation on the tensor cores
        if MASKED:
            ok = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                          CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                          HAS_BLOCK, BLOCK_PREV)  # fmt: skip
        if ACT == 0:
            # Online softmax in base 2: qk_scale = scale * log2(e).
            if FMA:
                # max(s) * c == max(s * c) for c > 0 (rounding is monotone); the exp2
                # argument below is then one fused multiply-add per score.
                if MASKED:
                    s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            else:
                s = s * qk_scale
                if MASKED:
                    s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
            if LAZY:
                # One decision for the whole tile: rescale only if some row's max grew by
                # more than the threshold (a row's first finite max counts as infinite
                # growth); otherwise every row keeps its previous, slightly stale max.
                up = m_new > m_i  # never true where m_new = -inf: no (-inf) - (-inf)
                grow = tl.max(tl.where(up, m_new, 0.0) - tl.where(up, m_i, 0.0), 0)
                if grow > _LAZY_LOG2_THRESHOLD:
                    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_i - m_shift)
                    l_i = l_i * alpha
                    acc = acc * alpha[:, None]
                    m_i = m_new
                m_use = m_i
                if MASKED:
                    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            else:
                if MASKED:
                    # A row with nothing allowed so far keeps m = -inf; shift by 0 instead
                    # so exp2 gives exact zeros rather than NaN from (-inf) - (-inf).
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_use = m_new
                alpha = tl.exp2(m_i - m_use)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            if FMA:
                p = tl.exp2(s * qk_scale - m_use[:, None])
            else:
                p = tl.exp2(s - m_use[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            p = _act(s * qk_scale, ACT, FAST)
            if MASKED:
                p = tl.where(ok, p, 0.0)
        # P is rounded to the input dtype for the second GEMM, as in every flash kernel.
        acc = _mma(_to(p, v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _fwd_item(
    Q, K, V, O, LSE, Q_desc, K_desc, V_desc, O_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lh, h, q_start, Lq, k_start, Lk, n_targets, m0,
    qk_scale, coef, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    ACT: tl.constexpr, NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    TMA: tl.constexpr, WARP_SPEC: tl.constexpr, FMA: tl.constexpr, LAZY: tl.constexpr,
):  # fmt: skip
    """One work item of the forward: query rows [m0, m0 + BLOCK_M) of one sequence and head."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
    k_base = K + k_start.to(tl.int64) * stride_kt + h * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + h * stride_vh
    if TMA & 1:
        # Rows past the sequence hold the next sequence's queries: their results are
        # computed and never stored (each score row depends on its own query only).
        q = Q_desc.load([q_start + m0, h * HEAD_DIM])
    else:
        q = _load_rows(q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                       offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, full, hi = _kv_range(
        m0, Lq, Lk, n_targets, wl, wr, ctx, bsz,
        CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
        BLOCK_PREV, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _fwd_tiles(
        acc, m_i, l_i, q, k_base, v_base, K_desc, V_desc, k_start, h * HEAD_DIM,
        h * HEAD_DIM_V, stride_kt, stride_vt, offs_m, lo, full,
        Lq, Lk, qk_scale, n_targets, wl, wr, ctx, bsz,
        CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
        BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, FAST,
        TMA & 2, TMA & 2, WARP_SPEC, FMA, LAZY,
    )  # fmt: skip
    acc, m_i, l_i = _fwd_tiles(
        acc, m_i, l_i, q, k_base, v_base, K_desc, V_desc, k_start, h * HEAD_DIM,
        h * HEAD_DIM_V, stride_kt, stride_vt, offs_m, full, hi,
        Lq, Lk, qk_scale, n_targets, wl, wr, ctx, bsz,
        CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
        BLOCK_PREV, ACT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, FAST,
        TMA & 4, False, WARP_SPEC, FMA, LAZY,
    )  # fmt: skip
    c = coef
    if NORM == 2:
        c = coef / tl.maximum(Lk, 1).to(tl.float32)
    if ACT == 0:
        # A row with no allowed key (l == 0) outputs 0 and stores LSE = +inf.
        has_key = l_i > 0.0
        l_safe = tl.where(has_key, l_i, 1.0)
        o = acc * (c / l_safe)[:, None]
        lse = tl.where(has_key, m_i + tl.log2(l_safe), float("inf"))
        tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=offs_m < Lq)
    else:
        o = acc * c
    o_ptrs = (O + q_start.to(tl.int64) * stride_ot + h * stride_oh
              + offs_m[:, None] * stride_ot + offs_dv[None, :])  # fmt: skip
    if TMA & 8:
        # A tile inside the sequence is one bulk store; the last, partial tile of a
        # sequence must not write the next sequence's rows, so it takes the masked path.
        if m0 + BLOCK_M <= Lq:
            O_desc.store([q_start + m0, h * HEAD_DIM_V], _to(o, O.dtype.element_ty))
        else:
            _store_rows(o_ptrs, o, offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)
    else:
        _store_rows(o_ptrs, o, offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def _tile_meta(META, w, total, H: tl.constexpr):
    """Work item ``w``'s row of the precomputed tile table (``_schedule.q_tile_meta``):
    (head, q start, Lq, kv start, Lk, targets, first row). Independent loads of one 32-byte
    row, so an item costs one memory round trip; ``w`` past the end reads a valid row."""
    row = META + tl.maximum(tl.minimum(w, total - 1), 0) // H * 8
    return (w % H, tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 5), tl.load(row + 4))  # fmt: skip


# Integer arguments that vary from batch to batch: never specialised (Triton compiles a
# separate variant for an int that is divisible by 16 or equal to 1). The strides left
# specialised depend on the head count and head dims only.
FWD_NOT_SPECIALISED = ("stride_lh", "n_q_rows", "n_kv_rows", "wl", "wr", "ctx", "bsz")


@triton.jit(do_not_specialize=list(FWD_NOT_SPECIALISED))
def _fwd_kernel(
    Q, K, V, O, LSE, Q_desc, K_desc, V_desc, O_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lh, n_q_rows, n_kv_rows,
    q_offsets, kv_offsets, kv_index, num_targets, tile_seq, tile_idx, tile_total, tile_meta,
    work_counter, qk_scale, coef, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_MAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    PREFETCH: tl.constexpr = False, TMA: tl.constexpr = 0, TMA_IN_KERNEL: tl.constexpr = False,
    WARP_SPEC: tl.constexpr = False, FMA: tl.constexpr = False, LAZY: tl.constexpr = False,
    DYNAMIC: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(tile_total) * H
    if TMA_IN_KERNEL:
        # The descriptors (over the whole (tokens, H * D) tensors) are built once per
        # program here instead of on the host at every call.
        if TMA & 1:
            Q_desc = tl.make_tensor_descriptor(Q, shape=[n_q_rows, H * HEAD_DIM],
                                               strides=[stride_qt, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])  # fmt: skip
        if TMA & 6:
            K_desc = tl.make_tensor_descriptor(K, shape=[n_kv_rows, H * HEAD_DIM],
                                               strides=[stride_kt, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])  # fmt: skip
        if TMA & 2:
            V_desc = tl.make_tensor_descriptor(V, shape=[n_kv_rows, H * HEAD_DIM_V],
                                               strides=[stride_vt, 1],
                                               block_shape=[BLOCK_N, BLOCK_DV])  # fmt: skip
        if TMA & 8:
            O_desc = tl.make_tensor_descriptor(O, shape=[n_q_rows, H * HEAD_DIM_V],
                                               strides=[stride_ot, 1],
                                               block_shape=[BLOCK_M, BLOCK_DV])  # fmt: skip
    if PREFETCH:
        # Software pipelining across work items: the next item's table row is requested
        # before the current item computes, and has arrived by the time it is needed.
        w = _work_item(0, pid, nprog)
        h_n, qs_n, lq_n, ks_n, lk_n, nt_n, m0_n = _tile_meta(tile_meta, w, total, H)
        for r in range(0, tl.cdiv(total, nprog)):
            h, q_start, Lq, k_start, Lk, n_targets, m0 = h_n, qs_n, lq_n, ks_n, lk_n, nt_n, m0_n
            w_cur = w
            w = _work_item(r + 1, pid, nprog)
            h_n, qs_n, lq_n, ks_n, lk_n, nt_n, m0_n = _tile_meta(tile_meta, w, total, H)
            if w_cur < total:
                _fwd_item(
                    Q, K, V, O, LSE, Q_desc, K_desc, V_desc, O_desc,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, stride_lh, h, q_start, Lq, k_start, Lk, n_targets,
                    m0, qk_scale, coef, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, ACT, NORM, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    BLOCK_N, FAST, TMA, WARP_SPEC, FMA, LAZY,
                )  # fmt: skip
    elif DYNAMIC:
        # Greedy list scheduling: each program takes the next unclaimed item of the
        # cost-sorted list (one scalar atomic per item) until the list is exhausted.
        w = tl.atomic_add(work_counter, 1)
        while w < total:
            h, b, q_start, Lq, k_start, Lk, n_targets, m0 = _query_tile(
                w, tile_seq, tile_idx, q_offsets, kv_offsets, kv_index, num_targets,
                H, HAS_MAP, HAS_TARGETS, BLOCK_M,
            )  # fmt: skip
            _fwd_item(
                Q, K, V, O, LSE, Q_desc, K_desc, V_desc, O_desc,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ot, stride_oh, stride_lh, h, q_start, Lq, k_start, Lk, n_targets,
                m0, qk_scale, coef, wl, wr, ctx, bsz,
                CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                BLOCK_PREV, ACT, NORM, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                BLOCK_N, FAST, TMA, WARP_SPEC, FMA, LAZY,
            )  # fmt: skip
            w = tl.atomic_add(work_counter, 1)
    else:
        for r in range(0, tl.cdiv(total, nprog)):
            w = _work_item(r, pid, nprog)
            if w < total:
                h, b, q_start, Lq, k_start, Lk, n_targets, m0 = _query_tile(
                    w, tile_seq, tile_idx, q_offsets, kv_offsets, kv_index, num_targets,
                    H, HAS_MAP, HAS_TARGETS, BLOCK_M,
                )  # fmt: skip
                _fwd_item(
                    Q, K, V, O, LSE, Q_desc, K_desc, V_desc, O_desc,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, stride_lh, h, q_start, Lq, k_start, Lk, n_targets,
                    m0, qk_scale, coef, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, ACT, NORM, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    BLOCK_N, FAST, TMA, WARP_SPEC, FMA, LAZY,
                )  # fmt: skip


@triton.jit
def _packed_keys(
    acc, m_i, l_i, poisoned, q, seq_m, offs_m, lo, hi, K, V, row_seq, h, stride_kt,
    stride_kh, stride_vt, stride_vh, qk_scale, CAUSAL: tl.constexpr, ACT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    """The key loop of ``_fwd_packed_kernel`` over keys ``[lo, hi)``; ``GUARD``: zero
    non-finite V rows in the product and mark (``poisoned``) the rows of their own
    sequence that attend to them."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_rows = offs_n[:, None].to(tl.int64)
        k = _load_rows(K + h * stride_kh + k_rows * stride_kt + offs_d[None, :],
                       offs_n, hi, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        v = _load_rows(V + h * stride_vh + k_rows * stride_vt + offs_dv[None, :],
                       offs_n, hi, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        seq_n = tl.load(row_seq + offs_n, mask=offs_n < hi, other=-2)
        ok = seq_m[:, None] == seq_n[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        s = _mm(q, tl.trans(k))
        if ACT == 0:
            s = tl.where(ok, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = tl.where(ok, _act(s * qk_scale, ACT, FAST), 0.0)
        if GUARD:
            # A non-finite V row must not reach rows of other sequences through 0 * NaN
            # in the product: zero it there and mark the rows of its own sequence that
            # attend to it (NaN in the caller), as a per-sequence tile would.
            finite = tl.abs(v) < float("inf")  # NaN compares false
            bad_n = tl.max(tl.where(finite, 0, 1), 1)
            poisoned = tl.maximum(poisoned, tl.max(tl.where(ok, bad_n[None, :], 0), 1))
            v = tl.where(finite, v, 0.0)
        acc = _mma(_to(p, v.dtype), v, acc)
    return acc, m_i, l_i, poisoned


@triton.jit(do_not_specialize=["stride_lh", "n_rows"])
def _fwd_packed_kernel(
    Q, K, V, O, LSE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lh, n_rows, offsets, row_seq, qk_scale, coef,
    CAUSAL: tl.constexpr, H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Forward over packed rows (``KernelConfig.pack_rows``): self-attention, no mask but
    causal. A work item is ``BLOCK_M`` consecutive token rows of the whole batch, whatever
    sequences they belong to, x one head; it streams the keys of those sequences (from the
    first row's sequence start to the last row's sequence end) and masks pairs of different
    sequences. Many short sequences then fill whole tiles instead of one tile each. The
    work list is the row spans in order (their costs differ by at most two sequences), so
    no schedule table is needed beyond each row's sequence (``row_seq``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.cdiv(n_rows, BLOCK_M) * H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for r in range(0, tl.cdiv(total, nprog)):
        w = _work_item(r, pid, nprog)
        if w < total:
            h = w % H
            r0 = (w // H) * BLOCK_M
            offs_m = r0 + tl.arange(0, BLOCK_M)
            seq_m = tl.load(row_seq + offs_m, mask=offs_m < n_rows, other=-1)
            lo = tl.load(offsets + tl.load(row_seq + r0))
            hi = tl.load(offsets + tl.load(row_seq + tl.minimum(r0 + BLOCK_M, n_rows) - 1) + 1)
            if CAUSAL:
                hi = tl.minimum(hi, r0 + BLOCK_M)  # no key after the span's last row
            q_rows = offs_m[:, None].to(tl.int64)
            q = _load_rows(Q + h * stride_qh + q_rows * stride_qt + offs_d[None, :],
                           offs_m, n_rows, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            poisoned = tl.zeros([BLOCK_M], dtype=tl.int32)
            # The plain loop first. A non-finite V row in the span reaches every row of it
            # through 0 * NaN (or leaves Inf in its own sequence's rows), so a finite
            # result proves none was read: keep it. Otherwise redo the tile with the
            # guarded loop, which keeps such a row inside its own sequence (for a span with
            # no bad V row it computes the same bits). Guarding every tile cost 2.3x on
            # the H200 (the select on V takes it off the direct shared-memory path into the
            # tensor cores); a reduction over V before the launch (0.2.23) cost a launch
            # and a read of V on host-bound calls.
            acc, m_i, l_i, poisoned = _packed_keys(
                acc, m_i, l_i, poisoned, q, seq_m, offs_m, lo, hi, K, V, row_seq, h,
                stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, CAUSAL, ACT,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, FAST, False,
            )  # fmt: skip
            bad = tl.max(tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), 1), 0)
            if bad > 0:
                acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
                m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                poisoned = tl.zeros([BLOCK_M], dtype=tl.int32)
                acc, m_i, l_i, poisoned = _packed_keys(
                    acc, m_i, l_i, poisoned, q, seq_m, offs_m, lo, hi, K, V, row_seq, h,
                    stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, CAUSAL, ACT,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, FAST, True,
                )  # fmt: skip
            acc = tl.where(poisoned[:, None] > 0, float("nan"), acc)
            c = coef
            if NORM == 2:
                first = tl.load(offsets + seq_m, mask=seq_m >= 0, other=0)
                last = tl.load(offsets + seq_m + 1, mask=seq_m >= 0, other=1)
                c = coef / tl.maximum(last - first, 1).to(tl.float32)
            if ACT == 0:
                has_key = l_i > 0.0
                l_safe = tl.where(has_key, l_i, 1.0)
                o = acc * (c / l_safe)[:, None]
                lse = tl.where(has_key, m_i + tl.log2(l_safe), float("inf"))
                tl.store(LSE + h * stride_lh + offs_m, lse, mask=offs_m < n_rows)
            elif NORM == 2:
                o = acc * c[:, None]
            else:
                o = acc * c
            _store_rows(O + h * stride_oh + q_rows * stride_ot + offs_dv[None, :],
                        o, offs_m, n_rows, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_dh", "n_tokens"])
def _bwd_delta_kernel(
    O, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, stride_dh, n_tokens,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """delta[h, t] = sum_d O[t, h, d] * dO[t, h, d] in fp32 (softmax only).

    With ``o = coef * sum_j w v``, rowsum(dW * w) of the reference equals rowsum(dO * o):
    the stored output already carries ``coef``.
    """
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_DV)
    rows = offs_t[:, None].to(tl.int64)
    o = _load_rows(O + h * stride_oh + rows * stride_ot + offs_d[None, :],
                   offs_t, n_tokens, offs_d, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
    do = _load_rows(DO + h * stride_doh + rows * stride_dot + offs_d[None, :],
                    offs_t, n_tokens, offs_d, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * stride_dh + offs_t, delta, mask=offs_t < n_tokens)


@triton.jit
def _bwd_dkdv_tiles(
    dk, dv, k_ptrs, v_ptrs, q_base, do_base, lse_base, delta_base, dqa_base, stride_qt,
    stride_dot,
    stride_dqat, offs_n, lo, hi, Lq, Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz,
    Q_desc, DO_desc, DQA_desc, q_row0, q_col, do_col,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, FAST: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr = False, TMA_REDUCE: tl.constexpr = False,
):  # fmt: skip
    # Everything is computed transposed (keys x queries) so that P^T and dS^T come out of
    # the first GEMMs in the layout the dV and dK GEMMs consume, with no register transpose.
    # Query rows past the sequence load as q = dO = 0 and LSE = +inf, so they add nothing
    # even in the mask-free loop.
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # The key/value tile stays in registers across the whole loop (the A operand of the
    # S^T and dP^T GEMMs).
    k = _load_rows(k_ptrs, offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)
    v = _load_rows(v_ptrs, offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if TMA:
            # ``TMA`` ranges hold whole tiles inside the query sequence and no mask: bulk
            # copies read exactly this sequence's rows.
            q = Q_desc.load([q_row0 + start_m, q_col])
            do = DO_desc.load([q_row0 + start_m, do_col])
        else:
            q = _load_rows(q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                           offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            do = _load_rows(do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
                            offs_m, Lq, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        s_t = _mm(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
        dp_t = _mm(v, tl.trans(do))  # dO V^T, transposed
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
            # dS = w * (dW - rowsum(dW * w)), dW = c * dO V^T, rowsum(dW * w) = delta
            ds_t = p_t * (dp_t * c - delta[None, :])
        else:
            p_t, g_t = _act_and_grad(s_t * qk_scale, ACT, FAST)
            # c folded in before dS is rounded to the input dtype, as softmax's: fp16
            # overflowed on an unscaled dS (loss-scaled dO) that c would bring in range
            ds_t = dp_t * c * g_t
            if MASKED:
                p_t = tl.where(ok_t, p_t, 0.0)
                ds_t = tl.where(ok_t, ds_t, 0.0)
        dv = _mma(_to(p_t, do.dtype), do, dv)
        ds_in = _to(ds_t, q.dtype)
        dk = _mma(ds_in, q, dk)
        if DQ_ATOMIC:
            # dQ rows of this query tile get this key tile's share, added in fp32 into a
            # zeroed buffer (FlashAttention-2's scheme): 5 GEMMs per tile instead of 7.
            dq_part = _mm(tl.trans(ds_in), k)
            if TMA_REDUCE:
                # One bulk reduce-add of the whole tile (FlashAttention-3's dQ
                # accumulation): the L2 does the adds, no per-element atomics.
                DQA_desc.atomic_add([q_row0 + start_m, q_col], dq_part)
            else:
                dqa_mask = offs_m[:, None] < Lq
                if BLOCK_D != HEAD_DIM:
                    dqa_mask = dqa_mask & (offs_d[None, :] < HEAD_DIM)
                tl.atomic_add(dqa_base + offs_m[:, None] * stride_dqat + offs_d[None, :],
                              dq_part, mask=dqa_mask, sem="relaxed")  # fmt: skip
    return dk, dv


@triton.jit(do_not_specialize=["stride_lh", "wl", "wr", "ctx", "bsz", "n_q_rows"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQA,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqat, stride_dqah, stride_lh,
    q_offsets, kv_offsets, inv_ptr, inv_idx, num_targets, tile_seq, tile_idx, tile_total,
    qk_scale, scale, coef, wl, wr, ctx, bsz, n_q_rows,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_MAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr = False,
    TMA_REDUCE: tl.constexpr = False,
):  # fmt: skip
    """``TMA``: query and dO tiles of the mask-free part that lie wholly inside their
    sequence are read through tensor descriptors built here (and, with ``TMA_REDUCE``, dQ
    shares of those tiles are added with one bulk reduce each); the other tiles take the
    masked pointer path."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(tile_total) * H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Q_desc = Q
    DO_desc = DO
    DQA_desc = DQA
    if TMA:
        Q_desc = tl.make_tensor_descriptor(Q, shape=[n_q_rows, H * HEAD_DIM],
                                           strides=[stride_qt, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])  # fmt: skip
        DO_desc = tl.make_tensor_descriptor(DO, shape=[n_q_rows, H * HEAD_DIM_V],
                                            strides=[stride_dot, 1],
                                            block_shape=[BLOCK_M, BLOCK_DV])  # fmt: skip
        if TMA_REDUCE:
            DQA_desc = tl.make_tensor_descriptor(DQA, shape=[n_q_rows, H * HEAD_DIM],
                                                 strides=[stride_dqat, 1],
                                                 block_shape=[BLOCK_M, BLOCK_D])  # fmt: skip
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
            k_ptrs = K + h * stride_kh + k_rows * stride_kt + offs_d[None, :]
            v_ptrs = V + h * stride_vh + k_rows * stride_vt + offs_dv[None, :]
            c = coef
            if NORM == 2:
                c = coef / tl.maximum(Lk, 1).to(tl.float32)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
            # The query sequences that read this kv sequence: its own, or a CSR list.
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
                q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
                do_base = DO + q_start.to(tl.int64) * stride_dot + h * stride_doh
                lse_base = LSE + h * stride_lh + q_start
                delta_base = DELTA + h * stride_lh + q_start
                dqa_base = DQA + q_start.to(tl.int64) * stride_dqat + h * stride_dqah
                q_col = h * HEAD_DIM
                do_col = h * HEAD_DIM_V
                dk, dv = _bwd_dkdv_tiles(
                    dk, dv, k_ptrs, v_ptrs, q_base, do_base, lse_base, delta_base, dqa_base,
                    stride_qt,
                    stride_dot, stride_dqat, offs_n, lo, mid, Lq, Lk, qk_scale, c, n_targets, wl,
                    wr, ctx, bsz, Q_desc, DO_desc, DQA_desc, q_start, q_col, do_col,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                    HAS_BLOCK, BLOCK_PREV, ACT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                    BLOCK_M, FAST, DQ_ATOMIC,
                )  # fmt: skip
                tail = mid
                if TMA:
                    # whole tiles first (descriptors), then the sequence's partial last tile
                    tail = mid + (hi - mid) // BLOCK_M * BLOCK_M
                    dk, dv = _bwd_dkdv_tiles(
                        dk, dv, k_ptrs, v_ptrs, q_base, do_base, lse_base, delta_base,
                        dqa_base, stride_qt, stride_dot, stride_dqat, offs_n, mid, tail, Lq,
                        Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz, Q_desc, DO_desc,
                        DQA_desc, q_start, q_col, do_col,
                        CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                        HAS_BLOCK, BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                        BLOCK_DV, BLOCK_M, FAST, DQ_ATOMIC, True, TMA_REDUCE,
                    )  # fmt: skip
                dk, dv = _bwd_dkdv_tiles(
                    dk, dv, k_ptrs, v_ptrs, q_base, do_base, lse_base, delta_base, dqa_base,
                    stride_qt,
                    stride_dot, stride_dqat, offs_n, tail, hi, Lq, Lk, qk_scale, c, n_targets,
                    wl, wr, ctx, bsz, Q_desc, DO_desc, DQA_desc, q_start, q_col, do_col,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                    HAS_BLOCK, BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                    BLOCK_M, FAST, DQ_ATOMIC,
                )  # fmt: skip
            # dK = scale * dS^T Q (dS already holds c); dV = c * W^T dO
            dk = dk * scale
            dv = dv * c
            _store_rows(DK + h * stride_dkh + k_rows * stride_dkt + offs_d[None, :],
                        dk, offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            _store_rows(DV + h * stride_dvh + k_rows * stride_dvt + offs_dv[None, :],
                        dv, offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip


@triton.jit
def _bwd_dq_tiles(
    dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, lo, hi, Lq, Lk,
    qk_scale, c, n_targets, wl, wr, ctx, bsz, K_desc, V_desc, k_row0, k_col, v_col,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    TMA: tl.constexpr = False,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            # mask-free tiles lie inside the key sequence (as in the forward)
            k = K_desc.load([k_row0 + start_n, k_col])
            v = V_desc.load([k_row0 + start_n, v_col])
        else:
            k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                           offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
            v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                           offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        s = _mm(q, tl.trans(k))
        dp = _mm(do, tl.trans(v))
        if ACT == 0:
            p = tl.exp2(s * qk_scale - lse[:, None])
            ds = p * (dp * c - delta[:, None])
        else:
            ds = dp * c * _act_grad(s * qk_scale, ACT, FAST)
        if MASKED:
            ok = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                          CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                          HAS_BLOCK, BLOCK_PREV)  # fmt: skip
            ds = tl.where(ok, ds, 0.0)
        dq = _mma(_to(ds, k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_stats_tiles(
    m_i, l_i, u_i, q, do, k_base, v_base, stride_kt, stride_vt, offs_m, lo, hi, Lq, Lk,
    qk_scale, n_targets, wl, wr, ctx, bsz,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Softmax statistics of the backward's own scores (``STATS``): running max ``m``,
    ``l = sum exp2(s - m)`` and ``u = sum exp2(s - m) * dP`` over the keys ``[lo, hi)``."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                       offs_n, Lk, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
        v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                       offs_n, Lk, offs_dv, HEAD_DIM_V, BLOCK_DV)  # fmt: skip
        s = _mm(q, tl.trans(k)) * qk_scale
        dp = _mm(do, tl.trans(v))
        if MASKED:
            ok = _allowed(offs_m, offs_n, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                          CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT,
                          HAS_BLOCK, BLOCK_PREV)  # fmt: skip
            s = tl.where(ok, s, float("-inf"))
        m_i, l_i, u_i = _stats_update(m_i, l_i, u_i, s, dp)
    return m_i, l_i, u_i


@triton.jit
def _stats_update(m_i, l_i, u_i, s, dp):
    """One key tile of the statistics pass: base-2 scores ``s`` (masked ones ``-inf``)
    and ``dP`` fold into the running ``(m, l, u)`` (see ``_bwd_stats_tiles``)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # masked pairs: p = 0 (a NaN dP there must not leak: where, not a product)
    u_i = u_i * alpha + tl.sum(tl.where(p > 0.0, p * dp, 0.0), 1)
    return m_new, l_i, u_i


@triton.jit
def _finish_stats(m_i, l_i, u_i, c, LSE, DELTA, rows, n_rows):
    """Store ``lse = m + log2(l)`` (+inf for a row without keys) and ``delta = c * u / l``
    (0 there); return them."""
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log2(l_safe), float("inf"))
    delta = tl.where(has, c * u_i / l_safe, 0.0)
    tl.store(LSE + rows, lse, mask=rows < n_rows)
    tl.store(DELTA + rows, delta, mask=rows < n_rows)
    return lse, delta


@triton.jit(do_not_specialize=["stride_lh", "wl", "wr", "ctx", "bsz", "n_kv_rows"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    q_offsets, kv_offsets, kv_index, num_targets, tile_seq, tile_idx, tile_total,
    qk_scale, scale, coef, wl, wr, ctx, bsz, n_kv_rows,
    CAUSAL: tl.constexpr, GENERIC: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_BLOCK: tl.constexpr, BLOCK_PREV: tl.constexpr,
    H: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_MAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    STATS: tl.constexpr = False, TMA: tl.constexpr = False,
):  # fmt: skip
    """``STATS`` (softmax): first recompute each row's log-sum-exp and ``delta`` from this
    backward's own scores and ``dP`` (a pass over the keys) and write them to ``LSE`` and
    ``DELTA`` for the dK/dV kernel, instead of reading the forward's. ``TMA``: K and V of
    the mask-free key tiles are read through tensor descriptors built here."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(tile_total) * H
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    K_desc = K
    V_desc = V
    if TMA:
        K_desc = tl.make_tensor_descriptor(K, shape=[n_kv_rows, H * HEAD_DIM],
                                           strides=[stride_kt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])  # fmt: skip
        V_desc = tl.make_tensor_descriptor(V, shape=[n_kv_rows, H * HEAD_DIM_V],
                                           strides=[stride_vt, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])  # fmt: skip
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
            c = coef
            if NORM == 2:
                c = coef / tl.maximum(Lk, 1).to(tl.float32)
            k_base = K + k_start.to(tl.int64) * stride_kt + h * stride_kh
            v_base = V + k_start.to(tl.int64) * stride_vt + h * stride_vh
            lo, full, hi = _kv_range(
                m0, Lq, Lk, n_targets, wl, wr, ctx, bsz,
                CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                BLOCK_PREV, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            if STATS:
                m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                u_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                m_i, l_i, u_i = _bwd_stats_tiles(
                    m_i, l_i, u_i, q, do, k_base, v_base, stride_kt, stride_vt, offs_m, lo,
                    full, Lq, Lk, qk_scale, n_targets, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                )  # fmt: skip
                m_i, l_i, u_i = _bwd_stats_tiles(
                    m_i, l_i, u_i, q, do, k_base, v_base, stride_kt, stride_vt, offs_m, full,
                    hi, Lq, Lk, qk_scale, n_targets, wl, wr, ctx, bsz,
                    CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                    BLOCK_PREV, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                )  # fmt: skip
                lse, delta = _finish_stats(m_i, l_i, u_i, c, LSE + h * stride_lh + q_start,
                                           DELTA + h * stride_lh + q_start, offs_m, Lq)  # fmt: skip
            elif ACT == 0:
                # rows past the sequence get LSE = +inf, hence P = 0
                lse = tl.load(LSE + h * stride_lh + q_start + offs_m, mask=offs_m < Lq,
                              other=float("inf"))  # fmt: skip
                delta = tl.load(DELTA + h * stride_lh + q_start + offs_m, mask=offs_m < Lq,
                                other=0.0)  # fmt: skip
            else:
                lse = tl.zeros([BLOCK_M], dtype=tl.float32)
                delta = lse
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            dq = _bwd_dq_tiles(
                dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, lo, full,
                Lq, Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz, K_desc, V_desc, k_start,
                h * HEAD_DIM, h * HEAD_DIM_V,
                CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                BLOCK_PREV, ACT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, FAST,
                TMA,
            )  # fmt: skip
            dq = _bwd_dq_tiles(
                dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, full, hi,
                Lq, Lk, qk_scale, c, n_targets, wl, wr, ctx, bsz, K_desc, V_desc, k_start,
                h * HEAD_DIM, h * HEAD_DIM_V,
                CAUSAL, GENERIC, HAS_TARGETS, HAS_WL, HAS_WR, HAS_CONTEXT, HAS_BLOCK,
                BLOCK_PREV, ACT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, FAST,
            )  # fmt: skip
            # dQ = scale * dS K (dS already holds c)
            dq = dq * scale
            _store_rows(DQ + h * stride_dqh + q_rows * stride_dqt + offs_d[None, :],
                        dq, offs_m, Lq, offs_d, HEAD_DIM, BLOCK_D)  # fmt: skip
