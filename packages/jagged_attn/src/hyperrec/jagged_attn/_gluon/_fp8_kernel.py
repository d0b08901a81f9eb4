"""Warp-specialised Hopper (sm_90) forward of FP8 jagged attention (``precision="fp8"``),
written in Gluon.

The CTA structure is the bf16 forward's (``_kernel.py``): one producer warp streams the
two 64-row query tiles of a work item and its key/value tiles through TMA into a
shared-memory ring; two consumer warpgroups own 64 query rows each, overlap the softmax of
key tile ``j`` with the tensor cores' ``Q K_{j+1}^T`` and ``P_{j-1} V_{j-1}``, and take
turns issuing their GEMMs (``PINGPONG``). The work list, the turn protocol and the mask
rules are shared with that kernel (its helpers are imported); what differs:

* **Operands** are the E4M3 codes of :class:`~hyperrec.jagged_attn.fp8.QuantizedJagged`:
  Q and K as ``(tokens, H * D)`` rows, V transposed as ``(H * D, Tp)`` (FP8 ``wgmma``
  reads both operands K-major, and ``P V`` reduces over the tokens), so a value tile is a
  ``[D, BLOCK_N]`` box at column ``pad_offsets[b] + j * BLOCK_N``.
* **Scales**: ``S = Q8 K8^T`` is scaled per query row (the row's Q block scale) and per
  key tile (the tile's K block scale; ``BLOCK_N`` divides the K block), folded into one
  multiplier ``cr`` so that each exponent is one fused multiply-add.
* **P** is quantized per (row, key tile) to E4M3 with a power-of-two scale ``2**k``
  folded into the exponent, and the accumulator is kept in units of ``2**k / sv`` of the
  current tile (``sv`` the V block scale); a change of units is one per-row factor folded
  into the softmax rescale. These are the numerics of
  :func:`hyperrec.jagged_attn.reference_fp8.attention_forward` and of the Triton FP8
  kernel (``_triton/_fp8_kernels.py``); only the accumulation order differs.
* The E4M3 ``P`` operand is not passed to ``warpgroup_mma_wait`` (Triton 3.6 cannot
  lower 8-bit wait operands); ptxas tracks the registers of in-flight ``wgmma`` operands
  itself (it serialises the pipeline where it cannot, and says so in its log).
* **P without shuffles** (``PERMUTED_P``, the default through the package's launcher):
  a thread holds columns ``{2t, 2t + 1, 8 + 2t, 9 + 2t}`` of every 16 of the ``Q K^T``
  accumulator, while the FP8 ``P V`` operand wants 4 consecutive columns per thread.
  Instead of moving values between threads, P's columns are relabelled (``_p_operand``)
  and the quantizer stores V's tokens in the same order (``fp8.mma_column``): the product
  is unchanged, since both factors are permuted along the reduction.
* **Value isolation is not optional**: the columns between V's sequences are never
  written (their bytes may be E4M3 NaN codes), so the consumers zero the columns of a
  sequence's last value tile past its end in shared memory before the last ``P V``.

``ACT == 1`` is GDPA's SiLU: P is the activation, scaled per (row, tile) to its largest
magnitude, no running state, no LSE.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from hyperrec.jagged_attn._gluon._kernel import (
    CONSUMER_REGS,
    PRODUCER_REGS,
    WG_ROWS,
    _fence_after,
    _fwd_barriers,
    _item,
    _item_barriers,
    _item_tiles,
    _load_q_halves,
    _next_item,
    _pass_turn,
    _row_max,
    _scores,
    _store_out,
    _take,
    _take_turn,
    _tanh_approx,
)
from hyperrec.jagged_attn.fp8 import P_EXP_MAX, P_LOG2_MAX

_P_LOG2_MAX = gl.constexpr(P_LOG2_MAX)
_P_EXP_MAX = gl.constexpr(float(P_EXP_MAX))
_NEG_P_EXP_MAX = gl.constexpr(-float(P_EXP_MAX))


@gluon.jit
def _pow2(e):
    """2**e as float32 for integer-valued float ``e`` in [-126, 127]: exact (a bit shift,
    where ``exp2`` on the MUFU is only approximate)."""
    return ((e.to(gl.int32) + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _v_col(meta, v_off, w, n_items, H: gl.constexpr):
    """Column of V's transposed layout where work item ``w``'s key sequence starts."""
    tile_seq, tile_idx, q_off, kv_off = meta
    t = gl.minimum(w, n_items - 1) // H
    return gl.load(v_off + gl.load(tile_seq + t))


@gluon.jit
def _producer(loads, H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              DYNAMIC: gl.constexpr):  # fmt: skip
    q_desc, k_desc, v_desc, smem, bars, meta, v_off, total_ptr, work, item_ready = loads
    q_smem, k_smem, v_smem, o_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(total_ptr) * H
    kv_it = 0
    item_i = 0
    w = _next_item(work, item_ready, 0, pid, nprog, DYNAMIC)
    while w < n_items:
        h, q_start, Lq, k_start, Lk, m0 = _item(meta, w, n_items, H)
        v_col = _v_col(meta, v_off, w, n_items, H)
        _load_q_halves(q_desc, q_smem, q_ready, q_empty, item_i, q_start + m0, h * HEAD_DIM)
        # the next item (or the end marker), published before this item's key tiles
        w_next = _next_item(work, item_ready, item_i + 1, pid, nprog, DYNAMIC)
        n_tiles = _item_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N)
        for j in range(n_tiles):
            st = kv_it % NUM_STAGES
            ph = (kv_it // NUM_STAGES) & 1
            mbarrier.wait(k_empty.index(st), ph ^ 1)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc, [k_start + j * BLOCK_N, h * HEAD_DIM], k_ready.index(st),
                k_smem.index(st),
            )  # fmt: skip
            mbarrier.wait(v_empty.index(st), ph ^ 1)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                v_desc, [h * HEAD_DIM, v_col + j * BLOCK_N], v_ready.index(st),
                v_smem.index(st),
            )  # fmt: skip
            kv_it += 1
        item_i += 1
        w = w_next


@gluon.jit
def _fp8_weights(s, cr, m_i, l_i, k_i, v_ratio, ACT: gl.constexpr, TREE_MAX: gl.constexpr):
    """(P * 2**k in fp32, running max, running sum, new P exponent ``k``, accumulator
    factor) of one key tile; ``cr`` > 0 the per-row score multiplier, ``v_ratio`` the
    previous tile's V scale over this tile's. reference_fp8._softmax_tiles /
    _activation_tiles, in the Triton kernel's arithmetic."""
    if ACT == 0:
        t_max = _row_max(s, TREE_MAX) * cr
        m_new = gl.maximum(m_i, t_max)
        # A row with nothing allowed so far keeps m = -inf: shift by 0 instead of NaN.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        k_new = gl.minimum(gl.floor(m_use - t_max + _P_LOG2_MAX), _P_EXP_MAX)
        k_new = gl.where(t_max == float("-inf"), k_i, k_new)
        # P * 2**k = exp2(s * cr - (m - k)): the scale costs nothing per element.
        shift = m_use - k_new
        p = gl.exp2(s * cr[:, None] - shift[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_new = l_i * alpha + gl.sum(p, axis=1) * _pow2(0.0 - k_new)
        ratio = alpha * _pow2(k_new - k_i) * v_ratio
    else:
        hs = s * (cr * 0.5)[:, None]
        a = hs + hs * _tanh_approx(hs)
        amax = _row_max(gl.abs(a), TREE_MAX)
        # (a zero row takes log2 of a tiny number and keeps its exponent below)
        k_new = gl.floor((0.0 - gl.log2(gl.maximum(amax, 1e-30))) + _P_LOG2_MAX)
        k_new = gl.minimum(gl.maximum(k_new, _NEG_P_EXP_MAX), _P_EXP_MAX)
        k_new = gl.where(amax > 0.0, k_new, k_i)
        p = a * _pow2(k_new)[:, None]
        ratio = _pow2(k_new - k_i) * v_ratio
        m_new = m_i
        l_new = l_i
    return p, m_new, l_new, k_new, ratio


@gluon.jit
def _p_operand(p, p_layout: gl.constexpr, PERMUTED: gl.constexpr):
    """E4M3 ``P`` as the A operand of ``P V``. ``PERMUTED`` (V stored in
    ``fp8.mma_column`` order): relabel the reduction index the same way, so that every
    thread keeps the values it holds (no shuffles, fewer byte permutes)."""
    p8 = p.to(gl.float8e4nv)
    if PERMUTED:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p8 = gl.reshape(p8, [M, N // 16, 2, 4, 2])
        p8 = gl.permute(p8, (0, 1, 3, 2, 4))
        p8 = gl.reshape(p8, [M, N])
    return gl.convert_layout(p8, p_layout)


@gluon.jit
def _clear_cols(v_smem, st, valid, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, PERMUTED: gl.constexpr):  # fmt: skip
    """Zero columns ``[valid, BLOCK_N)`` of value tile ``st`` (``[HEAD_DIM, BLOCK_N]``
    E4M3, one 128-byte swizzle row per head-dim row) in shared memory.

    Both consumer warpgroups clear the same tile and write identical bytes (columns below
    ``valid`` are written back unchanged), as in ``_kernel._clear_rows``; a loop over
    16-row chunks keeps one 16-byte vector per thread live. ``PERMUTED``: V is stored in
    ``fp8.mma_column`` order, so column ``k`` holds token ``tok(k)`` of the tile.
    """
    CH: gl.constexpr = 16
    N_CH: gl.constexpr = HEAD_DIM // CH
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                      rank=2)  # fmt: skip
    chunks = v_smem._reinterpret(gl.uint8, [NUM_STAGES * N_CH, CH, BLOCK_N], chunk_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, blk))
    if PERMUTED:
        u = cols % 16
        cols = cols - u + 8 * ((u >> 1) & 1) + 2 * ((u >> 2) & 3) + (u & 1)
    keep = (cols < valid)[None, :]
    for c in range(N_CH):
        chunk = chunks.index(st * N_CH + c)
        x = chunk.load(blk)
        chunk.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()


@gluon.jit
def _consumer(
    shared, consts, WG: gl.constexpr, H: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
    PINGPONG: gl.constexpr, PERMUTED_P: gl.constexpr, DYNAMIC: gl.constexpr,
    OVERLAP_PV: gl.constexpr, TREE_MAX: gl.constexpr,
):  # fmt: skip
    o_desc, smem, bars, turn, O, LSE, scales, meta, total_ptr, strides, work, item_ready = shared
    QS, KS, VS = scales
    stride_ot, stride_lh, stride_st = strides
    qk_scale, coef = consts
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    ocol: gl.constexpr = gl.SliceLayout(0, o_layout)
    out_dtype: gl.constexpr = o_desc.dtype
    q_smem, k_smem, v_smem, o_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(total_ptr) * H
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    q_buf = q_smem.index(WG)
    o_buf = o_smem.index(WG)
    kv_it = 0
    item_i = 0
    slot = 0
    w = _take(work, item_ready, 0, pid, nprog, DYNAMIC)
    while w < n_items:
        h, q_start, Lq, k_start, Lk, m0 = _item(meta, w, n_items, H)
        r0 = m0 + WG * WG_ROWS
        n_tiles = _item_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N)
        rows_s = r0 + gl.arange(0, WG_ROWS, layout=srow)
        sq = gl.load(QS + (q_start + rows_s).to(gl.int64) * stride_st + h,
                     mask=rows_s < Lq, other=1.0)  # fmt: skip
        c_row = sq * qk_scale
        # Scales of this item's key tiles (the same row of K's and V's scale tables).
        ks_ptr = KS + k_start.to(gl.int64) * stride_st + h
        vs_ptr = VS + k_start.to(gl.int64) * stride_st + h
        acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, srow)
        l_i = gl.zeros([WG_ROWS], gl.float32, srow)
        k_i = gl.zeros([WG_ROWS], gl.float32, srow)
        sv_prev = qk_scale * 0.0 + 1.0
        mbarrier.wait(q_ready.index(WG), item_i & 1)
        if n_tiles > 0:
            st = kv_it % NUM_STAGES
            ph = (kv_it // NUM_STAGES) & 1
            sk = gl.load(ks_ptr)
            sv = gl.load(vs_ptr)
            # The next tile's scales are loaded one tile ahead: a global load's latency
            # is about one tile's GEMM time, and the softmax waits for them.
            more = n_tiles > 1
            sk_next = gl.load(ks_ptr + BLOCK_N * stride_st, mask=more, other=1.0)
            sv_next = gl.load(vs_ptr + BLOCK_N * stride_st, mask=more, other=1.0)
            _take_turn(turn, slot, WG, PINGPONG)
            mbarrier.wait(k_ready.index(st), ph)
            s = warpgroup_mma(q_buf, k_smem.index(st).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)  # fmt: skip
            _pass_turn(turn, WG, PINGPONG)
            slot += 1
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            mbarrier.arrive(k_empty.index(st), count=1)
            # raw scores, masked (SCALE_IN_EXP: _fp8_weights applies the scales; a
            # masked SiLU score stays far enough below 0 for silu to be exactly 0)
            s = _scores(s, 0, r0, Lq, Lk, qk_scale, CAUSAL, ACT, True, BLOCK_N, s_layout)
            # acc is zero: the first tile's factor is not applied
            p, m_i, l_i, k_i, ratio = _fp8_weights(s, c_row * sk, m_i, l_i, k_i, 1.0, ACT, TREE_MAX)
            sv_prev = sv
            st_prev = st
            ph_prev = ph
            for j in range(1, n_tiles):
                # P of the previous tile becomes the E4M3 operand here, on this side of
                # the loop's back edge: carried across it, the 8-bit operand was split
                # into one register per byte and repacked (~3 integer instructions per
                # value); carried as fp32 it is converted and packed in place.
                p_op = _p_operand(p, p_layout, PERMUTED_P)
                it = kv_it + j
                st = it % NUM_STAGES
                ph = (it // NUM_STAGES) & 1
                sk = sk_next
                sv = sv_next
                more = j + 1 < n_tiles
                sk_next = gl.load(ks_ptr + (j + 1) * BLOCK_N * stride_st, mask=more,
                                  other=1.0)  # fmt: skip
                sv_next = gl.load(vs_ptr + (j + 1) * BLOCK_N * stride_st, mask=more,
                                  other=1.0)  # fmt: skip
                _take_turn(turn, slot, WG, PINGPONG)
                mbarrier.wait(k_ready.index(st), ph)
                s = warpgroup_mma(q_buf, k_smem.index(st).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)  # fmt: skip
                mbarrier.wait(v_ready.index(st_prev), ph_prev)
                acc = warpgroup_mma(p_op, v_smem.index(st_prev).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                _pass_turn(turn, WG, PINGPONG)
                slot += 1
                s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
                mbarrier.arrive(k_empty.index(st), count=1)
                s = _scores(s, j, r0, Lq, Lk, qk_scale, CAUSAL, ACT, True, BLOCK_N, s_layout)
                p, m_i, l_i, k_i, ratio = _fp8_weights(s, c_row * sk, m_i, l_i, k_i,
                                                       sv_prev / sv, ACT, TREE_MAX)  # fmt: skip
                sv_prev = sv
                if OVERLAP_PV:
                    # the softmax before the wait for P_{j-1} V_{j-1} (the bf16 kernel's
                    # _fence_after): the row sum, or SiLU's scale exponent, depends on
                    # every weight of the tile
                    if ACT == 0:
                        l_i = _fence_after(l_i)
                    else:
                        k_i = _fence_after(k_i)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                mbarrier.arrive(v_empty.index(st_prev), count=1)
                acc = acc * gl.convert_layout(ratio, orow)[:, None]
                st_prev = st
                ph_prev = ph
            mbarrier.arrive(q_empty.index(WG), count=1)
            mbarrier.wait(v_ready.index(st_prev), ph_prev)
            tail = Lk - (n_tiles - 1) * BLOCK_N
            if tail < BLOCK_N:
                _clear_cols(v_smem, st_prev, tail, NUM_STAGES, BLOCK_N, HEAD_DIM,
                            PERMUTED_P)  # fmt: skip
            p_op = _p_operand(p, p_layout, PERMUTED_P)
            _take_turn(turn, slot, WG, PINGPONG)
            acc = warpgroup_mma(p_op, v_smem.index(st_prev).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            _pass_turn(turn, WG, PINGPONG)
            slot += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(v_empty.index(st_prev), count=1)
        else:
            mbarrier.arrive(q_empty.index(WG), count=1)
        kv_it += n_tiles
        item_i += 1
        # read before the epilogue, which hides the load's latency
        w_next = _take(work, item_ready, item_i, pid, nprog, DYNAMIC)

        # Epilogue: back from units of 2**k / sv.
        rows = r0 + gl.arange(0, WG_ROWS, layout=orow)
        unit = gl.convert_layout(_pow2(0.0 - k_i), orow) * (coef * sv_prev)
        if ACT == 0:
            l_o = gl.convert_layout(l_i, orow)
            m_o = gl.convert_layout(m_i, orow)
            has_key = l_o > 0.0
            l_safe = gl.where(has_key, l_o, 1.0)
            o = acc * (unit / l_safe)[:, None]
            lse = gl.where(has_key, m_o + gl.log2(l_safe), float("inf"))
            lse = gl.where(l_o != l_o, l_o, lse)  # NaN inputs: NaN, for the backward
            gl.store(LSE + h * stride_lh + q_start + rows, lse, mask=rows < Lq)
        else:
            o = acc * unit[:, None]
        o = o.to(out_dtype)
        _store_out(o, o_buf, o_desc, O, q_start, r0, rows, Lq, h, stride_ot, HEAD_DIM, ocol)
        w = w_next
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["stride_lh"])
def jagged_fp8_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, O, LSE, QS, KS, VS, tile_seq, tile_idx, q_off, kv_off,
    v_off, total_ptr, work, stride_ot, stride_lh, stride_st, qk_scale, coef,
    H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
    PINGPONG: gl.constexpr, PERMUTED_P: gl.constexpr, DYNAMIC: gl.constexpr,
    OVERLAP_PV: gl.constexpr, TREE_MAX: gl.constexpr,
):  # fmt: skip
    """Persistent FP8 jagged attention forward; see the module docstring.

    ``q_desc``/``k_desc``: 2-D ``(tokens, H * HEAD_DIM)`` E4M3 descriptors with
    ``[64, HEAD_DIM]`` / ``[BLOCK_N, HEAD_DIM]`` boxes; ``v_desc``: ``(H * HEAD_DIM, Tp)``
    E4M3 (V transposed; ``PERMUTED_P``: in ``fp8.mma_column`` order) with
    ``[HEAD_DIM, BLOCK_N]`` boxes; ``o_desc``: the bf16/fp16
    output, ``[64, HEAD_DIM]`` boxes. ``QS``/``KS``/``VS``: ``(tokens, H)`` float32 block
    scales (row stride ``stride_st``, head stride 1); ``v_off``: ``(B + 1,)`` int32 column
    offsets of V's sequences. The schedule arguments, ``LSE``, ``qk_scale`` (> 0, with
    ``log2(e)`` for softmax), ``coef`` and ``work`` are the bf16 kernel's.
    """
    fp8: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(fp8, [2, WG_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(fp8, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(fp8, [NUM_STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, WG_ROWS, HEAD_DIM], o_desc.layout)
    bars, turn = _fwd_barriers(NUM_STAGES)
    item_ready = _item_barriers()

    smem = (q_smem, k_smem, v_smem, o_smem)
    meta = (tile_seq, tile_idx, q_off, kv_off)
    shared = (o_desc, smem, bars, turn, O, LSE, (QS, KS, VS), meta, total_ptr,
              (stride_ot, stride_lh, stride_st), work, item_ready)  # fmt: skip
    consts = (qk_scale, coef)
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (shared, consts, 0, H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, ACT,
                         PINGPONG, PERMUTED_P, DYNAMIC, OVERLAP_PV, TREE_MAX)),
            (_consumer, (shared, consts, 1, H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, ACT,
                         PINGPONG, PERMUTED_P, DYNAMIC, OVERLAP_PV, TREE_MAX)),
            (_producer, ((q_desc, k_desc, v_desc, smem, bars, meta, v_off, total_ptr, work,
                          item_ready), H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, DYNAMIC)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
