"""Warp-specialised Hopper (sm_90) dK/dV kernel of jagged attention, written in Gluon.

Targets Triton 3.6's ``triton.experimental.gluon`` API, like the forward (``_kernel.py``).
The roles of the forward are swapped: a CTA holds one 128-row *key* tile of one head and
streams the query tiles that see it.

* A **producer** partition (one warp) loads, per work item, the two 64-row halves of the
  key and value tile (one per consumer), then the item's query and dO tiles (64 rows each)
  into a ``NUM_STAGES`` ring. ``ready`` mbarriers complete on the TMA transaction count,
  ``empty`` ones take one arrival per consumer.
* Two **consumer** partitions (one warpgroup each) own keys ``[n0, n0 + 64)`` and
  ``[n0 + 64, n0 + 128)``. Per query tile: ``S^T = K Q^T`` and ``dP^T = V dO^T`` are issued
  together (the exponentials of ``S^T`` run while ``dP^T`` is on the tensor cores); then
  ``P^T`` and ``dS^T`` go to registers as bf16/fp16 operands of ``dV += P^T dO`` and
  ``dK += dS^T Q``, whose shared-memory operands are the stage's dO and Q tiles. With
  ``EARLY_DV`` the dV product is issued as soon as ``P^T`` is ready, so that it runs while
  ``dS^T`` is computed (a few bytes of register spills at head dim 128); otherwise both
  products are issued after ``dS^T``. dK and dV
  stay in fp32 registers for the whole item and are stored once.

By default dQ is not computed here: ``jagged_bwd_dq_kernel`` (below) runs after this one.
With ``FUSED_DQ`` (an opt-in, slower on every measured case; see the package README,
"Since 0.2.29: dQ fused into the dK/dV kernel") each consumer also computes half of dQ's
columns for the query tile, from both halves of ``dS^T`` (exchanged through shared
memory, the warpgroups meeting at an mbarrier every tile) and of the key tile, and adds
it into an fp32 buffer with one bulk reduce-add (``cp.reduce.async.bulk.tensor``, which
Triton 3.6 builds but does not wrap in Gluon on Hopper: ``_tma_add``): five GEMMs per
tile pair instead of seven.

Masking: tiles that cross the end of the query or key sequence or the causal diagonal
(bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``) select 0 for
disallowed entries of ``P^T`` and ``dS^T`` (``where``, so a NaN there is dropped too).
Query rows past the sequence end hold the next sequence's queries and dO (TMA loads whole
boxes): they are zeroed in shared memory before the products that multiply them
(``_clear_rows``), so a non-finite value in one sequence never reaches another's
gradients. Key rows past the end are never stored.

``ACT == 1``: GDPA's SiLU, ``o = coef * sum_j silu(s_ij) v_j``: ``dV = coef * W^T dO``,
``dS = dP * silu'(s)``, no LSE or delta.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
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
    _clear_rows,
    _item,
    _item_barriers,
    _item_tiles,
    _next_item,
    _take,
    _tanh_approx,
)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Bulk reduce-add of the shared-memory tile ``src`` into the global tile of
    ``tensor_desc`` at ``coord`` (``cp.reduce.async.bulk.tensor ... .add``): the L2 does the
    adds. Triton 3.6's Gluon has the operation in its IR builder but no Python wrapper on
    Hopper; this is that wrapper. Completion is awaited like a TMA store
    (``tma.store_wait``)."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)  # fmt: skip


@gluon.jit
def _q_tiles(n0, Lq, Lk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """``[lo, hi)``: the query tiles that see some key of the tile starting at ``n0``."""
    lo = n0 * 0
    if CAUSAL:
        # query i sees key j iff j <= i + Lk - Lq: the first query seeing key n0
        lo = gl.maximum(n0 - (Lk - Lq), 0) // BLOCK_M
    hi = (Lq + BLOCK_M - 1) // BLOCK_M
    return lo, gl.maximum(hi, lo)


@gluon.jit
def _allowed(r0, m0, Lq, Lk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """Which (key, query) entries of the ``[64, BLOCK_M]`` tile at keys ``r0``, queries
    ``m0`` the mask allows (both inside their sequence; causal: ``j <= i + Lk - Lq``)."""
    rows = r0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    cols = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    ok = (rows[:, None] < Lk) & (cols < Lq)[None, :]
    if CAUSAL:
        ok = ok & (rows[:, None] <= cols[None, :] + (Lk - Lq))
    return ok


@gluon.jit
def _load_pair(a_desc, b_desc, row, col, bar, a_dst, b_dst):
    """Two TMA loads of row ``row``, column ``col`` into ``a_dst``/``b_dst``, completing
    the transaction count of ``bar``."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, col], bar, a_dst)
    tma.async_copy_global_to_shared(b_desc, [row, col], bar, b_dst)


@gluon.jit
def _load_halves(a_desc, b_desc, a_smem, b_smem, ready, empty, item_i, row0, col):
    """The two 64-row halves of a work item's fixed tiles (``a`` and ``b`` at rows ``row0``
    and ``row0 + 64``, one half per consumer), each once its consumer released it."""
    for c in gl.static_range(2):
        mbarrier.wait(empty.index(c), (item_i & 1) ^ 1)
        _load_pair(a_desc, b_desc, row0 + c * WG_ROWS, col, ready.index(c), a_smem.index(c),
                   b_smem.index(c))  # fmt: skip


@gluon.jit
def _bwd_producer(loads, H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
                  DYNAMIC: gl.constexpr):  # fmt: skip
    q_desc, do_desc, k_desc, v_desc, smem, bars, meta, total_ptr, stats, work, item_ready = loads
    k_smem, v_smem, q_smem, do_smem, stat_smem = smem
    LSE, DELTA, stride_lh = stats
    # one warp: BLOCK_M // 32 statistics per thread
    vec: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    kv_ready, kv_empty, q_ready, q_empty = bars
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(total_ptr) * H
    q_it = 0
    item_i = 0
    w = _next_item(work, item_ready, 0, pid, nprog, DYNAMIC)
    while w < n_items:
        h, q_start, Lq, k_start, Lk, n0 = _item(meta, w, n_items, H)
        # the consumers' previous item has retired its last GEMM on these buffers
        _load_halves(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, item_i,
                     k_start + n0, h * HEAD_DIM)  # fmt: skip
        # the next item (or the end marker), published before this item's tiles
        w_next = _next_item(work, item_ready, item_i + 1, pid, nprog, DYNAMIC)
        lo, hi = _q_tiles(n0, Lq, Lk, CAUSAL, BLOCK_M)
        for i in range(lo, hi):
            st = q_it % NUM_STAGES
            ph = (q_it // NUM_STAGES) & 1
            mbarrier.wait(q_empty.index(st), ph ^ 1)
            if ACT == 0:
                # The tile's LSE and delta go through shared memory with it: loaded by
                # the consumers, their latency was exposed at every tile. The arrival
                # below (release) orders these stores before the consumers' wait.
                cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=vec)
                ok = cols < Lq
                base = h * stride_lh + q_start + cols
                stat_smem.index(2 * st).store(gl.load(LSE + base, mask=ok, other=float("inf")))
                stat_smem.index(2 * st + 1).store(gl.load(DELTA + base, mask=ok, other=0.0))
            _load_pair(q_desc, do_desc, q_start + i * BLOCK_M, h * HEAD_DIM,
                       q_ready.index(st), q_smem.index(st), do_smem.index(st))  # fmt: skip
            q_it += 1
        item_i += 1
        w = w_next


@gluon.jit
def _bwd_consumer(
    shared, consts, WG: gl.constexpr, H: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
    ISOLATE_ROWS: gl.constexpr, EARLY_DV: gl.constexpr, DYNAMIC: gl.constexpr,
    FUSED_DQ: gl.constexpr,
):  # fmt: skip
    out, LSE, DELTA, smem, bars, meta, total_ptr, stride_kt, stride_lh, work, item_ready = shared
    dk_desc, dv_desc, DK, DV, fused = out
    dqa_desc, ds_smem, dq_smem, ds_ready, k_sync = fused
    qk_scale, coef, dk_scale = consts
    # S^T / dP^T: [64 keys, 64 queries]; dK / dV: [64 keys, HEAD_DIM]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    scol: gl.constexpr = gl.SliceLayout(0, s_layout)
    # fused dQ: this warpgroup's half of the head dim, [BLOCK_M queries, HEAD_DIM / 2]
    HALF_D: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_D, 16]
    )
    k_smem, v_smem, q_smem, do_smem, stat_smem = smem
    kv_ready, kv_empty, q_ready, q_empty = bars
    dtype: gl.constexpr = k_smem.dtype

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(total_ptr) * H
    s_zero = gl.zeros([WG_ROWS, BLOCK_M], gl.float32, s_layout)
    k_buf = k_smem.index(WG)
    v_buf = v_smem.index(WG)
    q_it = 0
    item_i = 0
    w = _take(work, item_ready, 0, pid, nprog, DYNAMIC)
    while w < n_items:
        h, q_start, Lq, k_start, Lk, n0 = _item(meta, w, n_items, H)
        r0 = n0 + WG * WG_ROWS  # this warpgroup's first key
        # Both warpgroups visit the query tiles either needs (the producer loads them
        # once for both): the ring and its barriers stay in step.
        lo, hi = _q_tiles(n0, Lq, Lk, CAUSAL, BLOCK_M)
        dk = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, g_layout)
        dv = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, g_layout)
        mbarrier.wait(kv_ready.index(WG), item_i & 1)
        if FUSED_DQ:  # noqa: SIM102 (a constexpr, then a run-time condition)
            # dQ += dS K reads both key halves: rows past the key sequence are the next
            # sequence's (0 * NaN is NaN). S^T's rows there are masked anyway.
            if r0 + WG_ROWS > Lk:
                _clear_rows(k_smem, WG, gl.maximum(Lk - r0, 0), 2, WG_ROWS, HEAD_DIM)
        for i in range(lo, hi):
            it = q_it + (i - lo)
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            q_buf = q_smem.index(st)
            do_buf = do_smem.index(st)
            mbarrier.wait(q_ready.index(st), ph)
            s = warpgroup_mma(k_buf, q_buf.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
            dp = warpgroup_mma(v_buf, do_buf.permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)  # fmt: skip
            m0 = i * BLOCK_M
            # A tile crossing the end of either sequence or the causal diagonal selects
            # 0 for disallowed entries (select, not multiply: a NaN computed from
            # another sequence's rows, or from -inf - inf, is dropped).
            need_mask = (m0 + BLOCK_M > Lq) | (r0 + WG_ROWS > Lk)
            if CAUSAL:
                need_mask = need_mask | (r0 + WG_ROWS - 1 > m0 + (Lk - Lq))
            # Column vectors cost 8-16 registers each in the accumulator layout: read
            # from shared memory one at a time, each just before its use (the
            # consumers run at their register cap with dK and dV resident).
            if ACT == 0:
                lse = stat_smem.index(2 * st).load(scol)
            # groups retire in order: S^T is done, dP^T may still run
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
            if ACT == 0:
                p = gl.exp2(s * qk_scale - lse[None, :])
            else:
                x = s * qk_scale
                sg = 0.5 + 0.5 * _tanh_approx(0.5 * x)  # sigmoid(x)
                p = x * sg  # silu(x)
            if need_mask:
                p = gl.where(_allowed(r0, m0, Lq, Lk, CAUSAL, BLOCK_M, s_layout), p, 0.0)
            if ISOLATE_ROWS:  # noqa: SIM102 (a constexpr, then a run-time condition)
                # rows past the query sequence are the next sequence's: zero them
                # before dV += P^T dO and dK += dS^T Q read them
                if m0 + BLOCK_M > Lq:
                    _clear_rows(q_smem, st, Lq - m0, NUM_STAGES, BLOCK_M, HEAD_DIM)
                    _clear_rows(do_smem, st, Lq - m0, NUM_STAGES, BLOCK_M, HEAD_DIM)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            if EARLY_DV:
                # dV += P^T dO runs on the tensor cores while dS^T is computed
                dv = warpgroup_mma(p_op, do_buf, dv, is_async=True)
            if ACT == 0:
                delta = stat_smem.index(2 * st + 1).load(scol)
            if EARLY_DV:
                dp = warpgroup_mma_wait(num_outstanding=1, deps=[dp])
            else:
                dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
            if ACT == 0:
                ds = p * (dp * coef - delta[None, :])
            else:
                # coef folded in before dS is rounded to fp16/bf16 (fp16 overflowed on
                # loss-scaled dO that coef brings back in range), as the Triton kernels
                ds = dp * coef * (sg * (1.0 + x * (1.0 - sg)))
            if need_mask:
                ds = gl.where(_allowed(r0, m0, Lq, Lk, CAUSAL, BLOCK_M, s_layout), ds, 0.0)
            ds_lo = ds.to(dtype)
            if FUSED_DQ:
                # dS^T goes to shared memory: dQ = dS K needs it transposed, and the other
                # warpgroup needs this half (it computes the other half of dQ's columns
                # from both halves of dS and K). Two buffers, alternating by tile: a
                # warpgroup reaches tile t + 2's store only after the other arrived at
                # t + 1, i.e. after its tile-t dQ product retired.
                db = it % 2
                ds_smem.index(2 * db + WG).store(ds_lo)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ds_ready.index(db), count=1)
            ds_op = gl.convert_layout(ds_lo, op_layout)
            if not EARLY_DV:
                dv = warpgroup_mma(p_op, do_buf, dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_buf, dk, is_async=True)
            if FUSED_DQ:
                mbarrier.wait(ds_ready.index(db), (it // 2) & 1)
                # dQ[:, half WG] = dS[:, keys 0-63] K0[:, half] + dS[:, keys 64-127] K1[:, half]
                dq = warpgroup_mma(ds_smem.index(2 * db).permute((1, 0)),
                                   k_smem.index(0).slice(WG * HALF_D, HALF_D, dim=1),
                                   gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout),
                                   use_acc=False, is_async=True)  # fmt: skip
                dq = warpgroup_mma(ds_smem.index(2 * db + 1).permute((1, 0)),
                                   k_smem.index(1).slice(WG * HALF_D, HALF_D, dim=1), dq,
                                   is_async=True)  # fmt: skip
                dv, dk, p_op, ds_op, dq = warpgroup_mma_wait(
                    num_outstanding=0, deps=[dv, dk, p_op, ds_op, dq]
                )
                if m0 + BLOCK_M > Lq:
                    # rows past the query sequence are the next sequence's: their dS is 0,
                    # but 0 times a non-finite key of this sequence is NaN
                    qrows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
                    dq = gl.where((qrows < Lq)[:, None], dq, 0.0)
                # the previous tile's reduce-add has read this warpgroup's staging tile
                # (one thread issued it and waits; the barrier holds the others)
                tma.store_wait(0)
                gl.thread_barrier()
                dq_smem.index(WG).store(dq)
                fence_async_shared()
                gl.thread_barrier()
                _tma_add(dqa_desc, [q_start + m0, h * HEAD_DIM + WG * HALF_D],
                         dq_smem.index(WG))  # fmt: skip
            else:
                dv, dk, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0,
                                                         deps=[dv, dk, p_op, ds_op])  # fmt: skip
            mbarrier.arrive(q_empty.index(st), count=1)
        if FUSED_DQ:
            # the other warpgroup's dQ products read this warpgroup's K half: both have
            # retired theirs before either stages dK in its K buffer. One barrier both
            # arrive at: a warpgroup can run a whole item ahead (an item with no query
            # tile has no meeting at ds_ready), and a hand-back barrier per warpgroup
            # (count 1) then completes twice before the other waits on it: a deadlock
            # (found by the CPU model, tests/test_gluon_bwd_protocol.py).
            mbarrier.arrive(k_sync, count=1)
            mbarrier.wait(k_sync, item_i & 1)
        q_it += hi - lo
        item_i += 1
        # read before the epilogue, which hides the load's latency
        w_next = _take(work, item_ready, item_i, pid, nprog, DYNAMIC)
        # Epilogue: dK = scale * dS^T Q (times coef for SiLU), dV = coef * W^T dO, staged
        # through this warpgroup's K/V buffers (every GEMM on them has retired). A
        # register-side masked store would need a 64-bit pointer per element.
        k_buf.store((dk * dk_scale).to(dtype))
        v_buf.store((dv * coef).to(dtype))
        fence_async_shared()
        if r0 + WG_ROWS <= Lk:
            tma.async_copy_shared_to_global(dk_desc, [k_start + r0, h * HEAD_DIM], k_buf)
            tma.async_copy_shared_to_global(dv_desc, [k_start + r0, h * HEAD_DIM], v_buf)
            tma.store_wait(0)
        else:
            # the tile's rows past the key sequence are the next sequence's: a bulk
            # store would overwrite them
            _store_rows(k_smem, WG, Lk - r0, DK, k_start + r0, h, stride_kt, HEAD_DIM)
            _store_rows(v_smem, WG, Lk - r0, DV, k_start + r0, h, stride_kt, HEAD_DIM)
        # the producer may reload this warpgroup's K/V half
        mbarrier.arrive(kv_empty.index(WG), count=1)
        w = w_next
    if FUSED_DQ:
        # the last reduce-add reads shared memory until it completes
        tma.store_wait(0)


@gluon.jit
def _store_rows(bufs, idx, valid, OUT, row0, h, stride_t, HEAD_DIM: gl.constexpr):
    """Store rows ``[0, valid)`` of the ``[64, HEAD_DIM]`` shared-memory tile ``bufs[idx]``
    to rows ``row0 + r`` of ``OUT`` (``(T, H, HEAD_DIM)``, row stride ``stride_t``), head ``h``.

    Reads the 128-byte-swizzled tile as chunks of 16 rows x 64 columns (see
    ``_clear_rows``): one 16-byte vector per thread and chunk, few registers."""
    PANEL: gl.constexpr = 64
    N_PANELS: gl.constexpr = HEAD_DIM // PANEL
    CH: gl.constexpr = 16
    PER_PANEL: gl.constexpr = WG_ROWS // CH
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                      rank=2)  # fmt: skip
    chunks = bufs._reinterpret(bufs.dtype, [2 * N_PANELS * PER_PANEL, CH, PANEL], chunk_layout)
    rows = gl.arange(0, CH, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, PANEL, layout=gl.SliceLayout(0, blk))
    for c in range(0, (valid + CH - 1) // CH):
        r = c * CH + rows
        base = (row0 + r).to(gl.int64) * stride_t + h * HEAD_DIM
        for p in gl.static_range(N_PANELS):
            x = chunks.index((idx * N_PANELS + p) * PER_PANEL + c).load(blk)
            gl.store(OUT + base[:, None] + (p * PANEL + cols)[None, :], x,
                     mask=(r < valid)[:, None])  # fmt: skip


# ``stride_lh`` is the query token count: not specialised, so that a new batch reuses the
# compiled kernel and its direct relaunch (``_triton/_direct.py``).
@gluon.jit(do_not_specialize=["stride_lh"])
def jagged_bwd_dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dqa_desc, DK, DV, LSE, DELTA, tile_seq,
    tile_idx, q_off, kv_off, total_ptr, work, stride_kt, stride_lh, qk_scale, coef, dk_scale,
    H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, ACT: gl.constexpr, ISOLATE_ROWS: gl.constexpr, EARLY_DV: gl.constexpr,
    DYNAMIC: gl.constexpr, FUSED_DQ: gl.constexpr,
):  # fmt: skip
    """Persistent jagged attention dK/dV; see the module docstring.

    ``q_desc``/``do_desc``: 2-D ``(Tq, H * HEAD_DIM)`` descriptors with ``[BLOCK_M,
    HEAD_DIM]`` boxes (``BLOCK_M`` query rows per streamed tile);
    ``k_desc``/``v_desc``/``dk_desc``/``dv_desc``: ``(Tk, H * HEAD_DIM)`` with ``[64,
    HEAD_DIM]`` boxes. ``DK``/``DV``: the same ``(Tk, H, HEAD_DIM)`` outputs as
    pointers (a sequence's partial last tile), row stride ``stride_kt``. ``LSE``/``DELTA``:
    ``(H, Tq)`` fp32 (softmax only), row stride ``stride_lh``. ``tile_seq``/``tile_idx``:
    the key-tile schedule (128-key tiles) of the package's dK/dV kernel, ``total_ptr``: how
    many entries are real tiles. ``qk_scale``: ``scale * log2(e)`` for softmax, ``scale``
    for SiLU; ``coef``: the output multiplier; ``dk_scale``: dK's multiplier, ``scale``
    (dS already holds ``coef``). ``work``: the dynamic schedule's counter and item rings (see
    ``_kernel.jagged_fwd_kernel``).

    ``FUSED_DQ``: also add each tile pair's share of dQ (``dS K``, unscaled) into
    ``dqa_desc``, a ``(Tq, H * HEAD_DIM)`` fp32 descriptor with ``[BLOCK_M, HEAD_DIM / 2]``
    unswizzled boxes over a zeroed buffer (``BLOCK_M`` must be 64: one warpgroup MMA's
    rows); otherwise ``dqa_desc`` is not read.
    """
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    # per stage: the query tile's LSE and delta (softmax)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    stat_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, BLOCK_M], stat_layout)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    for c in gl.static_range(2):
        mbarrier.init(kv_ready.index(c), count=1)
        mbarrier.init(kv_empty.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        # one arrival per consumer warpgroup
        mbarrier.init(q_empty.index(s), count=2)
    if FUSED_DQ:
        # two dS^T buffers per warpgroup (alternating tiles), one fp32 dQ staging tile per
        # warpgroup for the reduce-add
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [4, WG_ROWS, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2],
                                            dqa_desc.layout)  # fmt: skip
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        k_sync = gl.allocate_shared_memory(gl.int64, [1], bar)
        mbarrier.init(k_sync, count=2)
        for c in gl.static_range(2):
            mbarrier.init(ds_ready.index(c), count=2)
        fused = (dqa_desc, ds_smem, dq_smem, ds_ready, k_sync)
    else:
        fused = (dqa_desc, k_smem, k_smem, kv_ready, kv_ready)  # never read
    fence_async_shared()

    smem = (k_smem, v_smem, q_smem, do_smem, stat_smem)
    bars = (kv_ready, kv_empty, q_ready, q_empty)
    meta = (tile_seq, tile_idx, q_off, kv_off)
    out = (dk_desc, dv_desc, DK, DV, fused)
    item_ready = _item_barriers()
    shared = (out, LSE, DELTA, smem, bars, meta, total_ptr, stride_kt, stride_lh, work,
              item_ready)  # fmt: skip
    consts = (qk_scale, coef, dk_scale)
    # fmt: off
    gl.warp_specialize(
        [
            (_bwd_consumer, (shared, consts, 0, H, HEAD_DIM, BLOCK_M, NUM_STAGES, CAUSAL, ACT,
                             ISOLATE_ROWS, EARLY_DV, DYNAMIC, FUSED_DQ)),
            (_bwd_consumer, (shared, consts, 1, H, HEAD_DIM, BLOCK_M, NUM_STAGES, CAUSAL, ACT,
                             ISOLATE_ROWS, EARLY_DV, DYNAMIC, FUSED_DQ)),
            (_bwd_producer, ((q_desc, do_desc, k_desc, v_desc, smem, bars, meta, total_ptr,
                              (LSE, DELTA, stride_lh), work, item_ready), H, HEAD_DIM, BLOCK_M,
                             NUM_STAGES, CAUSAL, ACT, DYNAMIC)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on


# ----------------------------------------------------------------------------------------
# dQ: the forward's structure (a CTA holds a 128-row query tile, two consumer warpgroups of
# 64 rows, and streams the key/value tiles through a ring), three GEMMs per key tile:
# S = Q K^T, dP = dO V^T, dQ += dS K.
# ----------------------------------------------------------------------------------------


@gluon.jit
def _dq_producer(loads, H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 DYNAMIC: gl.constexpr):  # fmt: skip
    q_desc, do_desc, k_desc, v_desc, smem, bars, meta, total_ptr, work, item_ready = loads
    q_smem, do_smem, k_smem, v_smem = smem
    q_ready, q_empty, kv_ready, kv_empty = bars
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(total_ptr) * H
    kv_it = 0
    item_i = 0
    w = _next_item(work, item_ready, 0, pid, nprog, DYNAMIC)
    while w < n_items:
        h, q_start, Lq, k_start, Lk, m0 = _item(meta, w, n_items, H)
        # the consumers have stored their previous dQ tiles out of their Q buffers
        _load_halves(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, item_i, q_start + m0,
                     h * HEAD_DIM)  # fmt: skip
        # the next item (or the end marker), published before this item's tiles
        w_next = _next_item(work, item_ready, item_i + 1, pid, nprog, DYNAMIC)
        n_tiles = _item_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N)
        for j in range(n_tiles):
            st = kv_it % NUM_STAGES
            ph = (kv_it // NUM_STAGES) & 1
            mbarrier.wait(kv_empty.index(st), ph ^ 1)
            _load_pair(k_desc, v_desc, k_start + j * BLOCK_N, h * HEAD_DIM,
                       kv_ready.index(st), k_smem.index(st), v_smem.index(st))  # fmt: skip
            kv_it += 1
        item_i += 1
        w = w_next


@gluon.jit
def _dq_consumer(
    shared, consts, WG: gl.constexpr, H: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
    ISOLATE_ROWS: gl.constexpr, DYNAMIC: gl.constexpr,
):  # fmt: skip
    dq_desc, DQ, LSE, DELTA, smem, bars, meta, total_ptr, stride_qt, stride_lh, work, item_ready = (
        shared
    )
    qk_scale, coef, dq_scale = consts
    # S / dP: [64 queries, BLOCK_N keys]; dQ: [64 queries, HEAD_DIM]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    scol: gl.constexpr = gl.SliceLayout(0, s_layout)
    q_smem, do_smem, k_smem, v_smem = smem
    q_ready, q_empty, kv_ready, kv_empty = bars
    dtype: gl.constexpr = k_smem.dtype

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(total_ptr) * H
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    q_buf = q_smem.index(WG)
    do_buf = do_smem.index(WG)
    kv_it = 0
    item_i = 0
    w = _take(work, item_ready, 0, pid, nprog, DYNAMIC)
    while w < n_items:
        h, q_start, Lq, k_start, Lk, m0 = _item(meta, w, n_items, H)
        r0 = m0 + WG * WG_ROWS  # this warpgroup's first query row
        n_tiles = _item_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N)
        rows = r0 + gl.arange(0, WG_ROWS, layout=srow)
        if ACT == 0:
            # rows past the sequence get LSE = +inf, hence P = 0
            lse = gl.load(LSE + h * stride_lh + q_start + rows, mask=rows < Lq,
                          other=float("inf"))  # fmt: skip
            delta = gl.load(DELTA + h * stride_lh + q_start + rows, mask=rows < Lq,
                            other=0.0)  # fmt: skip
        dq = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, g_layout)
        mbarrier.wait(q_ready.index(WG), item_i & 1)
        for j in range(n_tiles):
            it = kv_it + j
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            k_buf = k_smem.index(st)
            mbarrier.wait(kv_ready.index(st), ph)
            s = warpgroup_mma(q_buf, k_buf.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
            dp = warpgroup_mma(do_buf, v_smem.index(st).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)  # fmt: skip
            n_lo = j * BLOCK_N
            need_mask = n_lo + BLOCK_N > Lk
            if CAUSAL:
                need_mask = need_mask | (n_lo + BLOCK_N - 1 > r0 + (Lk - Lq))
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
            if ACT == 0:
                p = gl.exp2(s * qk_scale - lse[:, None])
            else:
                x = s * qk_scale
                sg = 0.5 + 0.5 * _tanh_approx(0.5 * x)  # sigmoid(x)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
            if ACT == 0:
                ds = p * (dp * coef - delta[:, None])
            else:
                # coef folded in before dS is rounded to fp16/bf16 (fp16 overflowed on
                # loss-scaled dO that coef brings back in range), as the Triton kernels
                ds = dp * coef * (sg * (1.0 + x * (1.0 - sg)))
            if need_mask:
                # select, not multiply (a NaN from another sequence's keys is dropped);
                # rows past the query sequence are never stored
                cols = n_lo + gl.arange(0, BLOCK_N, layout=scol)
                ok = cols[None, :] < Lk
                if CAUSAL:
                    ok = ok & (cols[None, :] <= rows[:, None] + (Lk - Lq))
                ds = gl.where(ok, ds, 0.0)
            if ISOLATE_ROWS:  # noqa: SIM102 (a constexpr, then a run-time condition)
                # the last key tile's rows past the sequence are the next sequence's:
                # zero them before dQ += dS K reads them (0 * NaN is NaN)
                if n_lo + BLOCK_N > Lk:
                    _clear_rows(k_smem, st, Lk - n_lo, NUM_STAGES, BLOCK_N, HEAD_DIM)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
            dq = warpgroup_mma(ds_op, k_buf, dq, is_async=True)
            dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=[dq, ds_op])
            mbarrier.arrive(kv_empty.index(st), count=1)
        kv_it += n_tiles
        item_i += 1
        # read before the epilogue, which hides the load's latency
        w_next = _take(work, item_ready, item_i, pid, nprog, DYNAMIC)
        # Epilogue: dQ = scale * dS K (times coef for SiLU), staged through this
        # warpgroup's Q buffer (every GEMM on it has retired).
        q_buf.store((dq * dq_scale).to(dtype))
        fence_async_shared()
        if r0 + WG_ROWS <= Lq:
            tma.async_copy_shared_to_global(dq_desc, [q_start + r0, h * HEAD_DIM], q_buf)
            tma.store_wait(0)
        else:
            _store_rows(q_smem, WG, Lq - r0, DQ, q_start + r0, h, stride_qt, HEAD_DIM)
        # the producer may reload this warpgroup's Q and dO
        mbarrier.arrive(q_empty.index(WG), count=1)
        w = w_next


@gluon.jit(do_not_specialize=["stride_lh"])
def jagged_bwd_dq_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc, DQ, LSE, DELTA, tile_seq, tile_idx, q_off,
    kv_off, total_ptr, work, stride_qt, stride_lh, qk_scale, coef, dq_scale,
    H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, ACT: gl.constexpr, ISOLATE_ROWS: gl.constexpr, DYNAMIC: gl.constexpr,
):  # fmt: skip
    """Persistent jagged attention dQ over the forward's 128-row query-tile schedule.

    ``q_desc``/``do_desc``/``dq_desc``: ``(Tq, H * HEAD_DIM)`` descriptors with ``[64,
    HEAD_DIM]`` boxes; ``k_desc``/``v_desc``: ``(Tk, H * HEAD_DIM)`` with ``[BLOCK_N,
    HEAD_DIM]`` boxes. ``DQ``: the same output as a pointer (a sequence's partial last
    tile), row stride ``stride_qt``. ``LSE``/``DELTA``, ``qk_scale``, ``coef``: as for
    :func:`jagged_bwd_dkdv_kernel`; ``dq_scale``: ``scale`` (dS already holds ``coef``);
    ``work``: as for :func:`jagged_bwd_dkdv_kernel`.
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        # one arrival per consumer warpgroup
        mbarrier.init(kv_empty.index(s), count=2)
    fence_async_shared()

    smem = (q_smem, do_smem, k_smem, v_smem)
    bars = (q_ready, q_empty, kv_ready, kv_empty)
    meta = (tile_seq, tile_idx, q_off, kv_off)
    item_ready = _item_barriers()
    shared = (dq_desc, DQ, LSE, DELTA, smem, bars, meta, total_ptr, stride_qt, stride_lh, work,
              item_ready)  # fmt: skip
    consts = (qk_scale, coef, dq_scale)
    # fmt: off
    gl.warp_specialize(
        [
            (_dq_consumer, (shared, consts, 0, H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, ACT,
                            ISOLATE_ROWS, DYNAMIC)),
            (_dq_consumer, (shared, consts, 1, H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, ACT,
                            ISOLATE_ROWS, DYNAMIC)),
            (_dq_producer, ((q_desc, do_desc, k_desc, v_desc, smem, bars, meta, total_ptr, work,
                             item_ready), H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, DYNAMIC)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
