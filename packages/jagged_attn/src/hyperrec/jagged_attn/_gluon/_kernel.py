"""Warp-specialised Hopper (sm_90) forward of jagged attention, written in Gluon.

Targets Triton 3.6's ``triton.experimental.gluon`` API (the Gluon API changes between
Triton releases; this module is only imported on a GPU whose Triton was probed, see
``_probe.py``).

Structure of one CTA (FlashAttention-3's forward, adapted to jagged work items):

* A **producer** partition (one warp, few registers) walks the work list and issues TMA
  loads: the two 64-row query tiles of a work item, then the key and value tiles of its
  key range into a ``NUM_STAGES`` ring of shared-memory buffers. Each buffer has a
  ``ready`` mbarrier (completed by the TMA transaction count) and an ``empty`` mbarrier
  (two arrivals: one per consumer).
* Two **consumer** partitions (one warpgroup each, most of the registers) own rows
  ``[m0, m0 + 64)`` and ``[m0 + 64, m0 + 128)`` of the work item's 128-row query tile and
  read the same K/V buffers. The source runs the softmax of key tile ``j`` while the
  tensor cores compute ``P_{j-1} V_{j-1}`` (intra-warpgroup overlap: both GEMMs are
  issued asynchronously before the softmax, and waited for just before their results are
  needed); ptxas hoists the wait for ``P V`` above the softmax unless ``OVERLAP_PV``
  fences it (``_fence_after``; measured no faster, so off by default). With ``PINGPONG``
  the two consumers also take turns to *issue* their GEMMs
  (an mbarrier token passed back and forth), so that one warpgroup's softmax runs while
  the other's GEMMs occupy the tensor cores (inter-warpgroup overlap).
* The output tile goes registers -> shared memory -> global memory through a TMA store
  when all 64 rows lie inside the sequence; the last, partial tile of a sequence is
  written with a masked store (a bulk store would overwrite the next sequence's rows).
  The base-2 log-sum-exp is written per row in fp32.

Work items are (128-row query tile, head) pairs from the package forward's query-tile
schedule, sorted by cost (``_triton/_tiles.py``); the grid is persistent. With ``DYNAMIC``
(the default) the producer claims each CTA's next item from a global counter and hands its
index to the consumers through a small ring (``_claim``/``_publish``/``_take``), so a CTA
that drew cheap items takes more; otherwise each CTA takes items in a fixed "snake" order
that every partition computes alike. All partitions read the same table and so agree on the
number of key tiles per item without talking to each other.

Masking: key tiles that cross the end of the key sequence or the causal diagonal
(bottom-right aligned: query ``i`` sees keys ``j <= i + Lk - Lq``) set disallowed scores to
``-inf`` before the running max; other tiles run mask-free. Rows past a sequence's end read
the next sequence's queries (TMA loads whole boxes): their results are never stored. Key
rows past the sequence end are masked (``where``, so a NaN there is dropped too); value
rows there are zeroed in shared memory before the last P V product (``_clear_rows``), so
a non-finite value in one sequence never reaches another's output.

``ACT == 1`` replaces the softmax by GDPA's SiLU: ``o = coef * sum_j silu(s_ij) v_j``, no
running state, no LSE.
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

# Rows of one consumer warpgroup: the M of one wgmma instruction.
WG_ROWS = gl.constexpr(64)
# Registers per thread of the partitions (setmaxnreg): consumers get the most.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _tanh_approx(x):
    # One MUFU instruction (max relative error ~2^-11, below bf16's rounding of P).
    return gl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def _item(meta, w, n_items, H: gl.constexpr):
    """Work item ``w``: (head, q start, Lq, kv start, Lk, first query row)."""
    tile_seq, tile_idx, q_off, kv_off = meta
    t = gl.minimum(w, n_items - 1) // H
    seq = gl.load(tile_seq + t)
    q_start = gl.load(q_off + seq)
    k_start = gl.load(kv_off + seq)
    return (
        w % H,
        q_start,
        gl.load(q_off + seq + 1) - q_start,
        k_start,
        gl.load(kv_off + seq + 1) - k_start,
        gl.load(tile_idx + t) * (2 * WG_ROWS),
    )


@gluon.jit
def _snake(r, pid, nprog):
    # Round r of the persistent loop; odd rounds run backwards so that no program always
    # takes the most expensive item of its round (items are sorted by cost).
    return r * nprog + gl.where(r % 2 == 0, pid, nprog - 1 - pid)


# Depth of the item-index ring of the dynamic schedule (see ``_claim``).
ITEM_DEPTH = gl.constexpr(4)


@gluon.jit
def _claim(work, r, pid, nprog, DYNAMIC: gl.constexpr):
    """The producer's ``r``-th work item: the next unclaimed item of the whole grid
    (``DYNAMIC``: one atomic increment of ``work[0]``) or round ``r`` of the snake order."""
    if DYNAMIC:
        w = gl.atomic_add(work, 1, sem="relaxed")
    else:
        w = _snake(r, pid, nprog)
    return w


@gluon.jit
def _publish(work, item_ready, w, r, pid, DYNAMIC: gl.constexpr):
    """Hand item ``w`` (the CTA's ``r``-th) to the consumers: slot ``r % ITEM_DEPTH`` of the
    CTA's ring in global memory, then its ``item_ready`` barrier (release: the store is
    visible to a consumer that has waited on it).

    No ``empty`` barrier guards the slot: the producer publishes item ``r`` while loading
    item ``r - 1``, after both consumers released the buffers it reloads for item ``r - 1``
    (the forward's ``q_empty``, arrived once a warpgroup's last ``Q K^T`` of item ``r - 2``
    retired; the backward's K/V or Q/dO halves, after an item's epilogue), so all their
    warps have read index ``r - 2``; with four slots item ``r`` overwrites item ``r - 4``'s.
    The protocol models (``tests/test_gluon_protocol.py``, ``test_gluon_bwd_protocol.py``)
    check this, and that one slot would not do."""
    if DYNAMIC:
        slot = r % ITEM_DEPTH
        gl.store(work + 1 + pid * ITEM_DEPTH + slot, w)
        mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def _take(work, item_ready, r, pid, nprog, DYNAMIC: gl.constexpr):
    """A consumer's ``r``-th work item: what the producer published (``DYNAMIC``), else
    round ``r`` of the snake order (every partition computes the same)."""
    if DYNAMIC:
        slot = r % ITEM_DEPTH
        mbarrier.wait(item_ready.index(slot), (r // ITEM_DEPTH) & 1)
        w = gl.load(work + 1 + pid * ITEM_DEPTH + slot, volatile=True)
    else:
        w = _snake(r, pid, nprog)
    return w


@gluon.jit
def _next_item(work, item_ready, r, pid, nprog, DYNAMIC: gl.constexpr):
    """The producer's ``r``-th work item (``_claim``), handed to the consumers
    (``_publish``)."""
    w = _claim(work, r, pid, nprog, DYNAMIC)
    _publish(work, item_ready, w, r, pid, DYNAMIC)
    return w


@gluon.jit
def _load_q_halves(q_desc, q_smem, q_ready, q_empty, item_i, row0, col):
    """TMA loads of a work item's two 64-row query halves (rows ``row0`` and ``row0 + 64``),
    each once its consumer has released the buffer (its last ``Q K^T`` of the previous
    item retired)."""
    for c in gl.static_range(2):
        mbarrier.wait(q_empty.index(c), (item_i & 1) ^ 1)
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0 + c * WG_ROWS, col], q_ready.index(c),
                                        q_smem.index(c))  # fmt: skip


@gluon.jit
def _item_barriers():
    """The dynamic schedule's ``item_ready`` ring (one arrival: the producer's)."""
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    item_ready = gl.allocate_shared_memory(gl.int64, [ITEM_DEPTH, 1], bar)
    for s in gl.static_range(ITEM_DEPTH):
        mbarrier.init(item_ready.index(s), count=1)
    fence_async_shared()
    return item_ready


@gluon.jit
def _n_kv_tiles(r0, Lq, Lk, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tiles that query rows ``[r0, r0 + WG_ROWS)`` of the sequence need (0 if none)."""
    hi = Lk
    if CAUSAL:
        # the last valid row sees keys up to (its index) + Lk - Lq
        hi = gl.minimum(hi, gl.minimum(r0 + WG_ROWS, Lq) + (Lk - Lq))
    hi = gl.where(r0 < Lq, gl.maximum(hi, 0), 0)
    return (hi + BLOCK_N - 1) // BLOCK_N


@gluon.jit
def _item_tiles(m0, Lq, Lk, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tiles of the work item with query rows ``[m0, m0 + 2 * WG_ROWS)``: what either
    of its two warpgroups needs (both visit them all, see ``_consumer``)."""
    return gl.maximum(_n_kv_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N),
                      _n_kv_tiles(m0 + WG_ROWS, Lq, Lk, CAUSAL, BLOCK_N))  # fmt: skip


@gluon.jit
def _fwd_barriers(NUM_STAGES: gl.constexpr):
    """The forward's mbarriers, initialised: ``(q_ready, q_empty, k_ready, k_empty,
    v_ready, v_empty)`` (two query buffers, a ``NUM_STAGES`` K/V ring whose ``empty``
    barriers take one arrival per consumer warpgroup) and the ping-pong ``turn`` pair."""
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar)
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    fence_async_shared()
    return (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty), turn


@gluon.jit
def _store_out(o, o_buf, o_desc, O, q_start, r0, rows, Lq, h, stride_ot,
               HEAD_DIM: gl.constexpr, ocol: gl.constexpr):  # fmt: skip
    """Store a warpgroup's output rows ``rows`` (query rows ``[r0, r0 + WG_ROWS)``): a TMA
    store through ``o_buf`` when all lie in the sequence, else a masked store (a bulk
    store would overwrite the next sequence's rows)."""
    if r0 + WG_ROWS <= Lq:
        tma.store_wait(0)  # the previous item's store has read o_buf
        o_buf.store(o)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_start + r0, h * HEAD_DIM], o_buf)
    elif r0 < Lq:
        cols = gl.arange(0, HEAD_DIM, layout=ocol)
        o_rows = (q_start + rows).to(gl.int64) * stride_ot + h * HEAD_DIM
        o_ptrs = O + o_rows[:, None] + cols[None, :]
        gl.store(o_ptrs, o, mask=(rows < Lq)[:, None])


@gluon.jit
def _producer(loads, H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              DYNAMIC: gl.constexpr):  # fmt: skip
    q_desc, k_desc, v_desc, smem, bars, meta, total_ptr, work, item_ready = loads
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
        _load_q_halves(q_desc, q_smem, q_ready, q_empty, item_i, q_start + m0, h * HEAD_DIM)
        # The next item (or the end marker, an index >= n_items), published before this
        # item's key tiles: the consumers find it ready when they finish this one.
        w_next = _next_item(work, item_ready, item_i + 1, pid, nprog, DYNAMIC)
        n_tiles = _item_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N)
        for j in range(n_tiles):
            st = kv_it % NUM_STAGES
            ph = (kv_it // NUM_STAGES) & 1
            row = k_start + j * BLOCK_N
            mbarrier.wait(k_empty.index(st), ph ^ 1)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc, [row, h * HEAD_DIM], k_ready.index(st), k_smem.index(st)
            )
            mbarrier.wait(v_empty.index(st), ph ^ 1)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                v_desc, [row, h * HEAD_DIM], v_ready.index(st), v_smem.index(st)
            )
            kv_it += 1
        item_i += 1
        w = w_next


@gluon.jit
def _take_turn(turn, slot, WG: gl.constexpr, PINGPONG: gl.constexpr):
    # Slot k of consumer 1 follows slot k of consumer 0, which follows slot k - 1 of
    # consumer 1. Barrier ``turn[c]`` is arrived by the *other* consumer after each of its
    # slots; waiting on parity (k - 1) & 1 of a fresh barrier passes (the phase "before"
    # the first one counts as complete), which lets consumer 0 start.
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(0), (slot & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(1), slot & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _scores(s, j, r0, Lq, Lk, qk_scale, CAUSAL: gl.constexpr, ACT: gl.constexpr,
            SCALE_IN_EXP: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    """Scores of key tile ``j`` (scaled unless ``SCALE_IN_EXP``) with disallowed entries
    set to -inf (softmax) or to a value whose SiLU is exactly 0."""
    if not SCALE_IN_EXP:
        s = s * qk_scale
    n_lo = j * BLOCK_N
    need_mask = n_lo + BLOCK_N > Lk
    if CAUSAL:
        need_mask = need_mask | (n_lo + BLOCK_N - 1 > r0 + (Lk - Lq))
    if need_mask:
        rows = r0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = n_lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = cols[None, :] < Lk
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + (Lk - Lq))
        if ACT == 0:
            s = gl.where(ok, s, float("-inf"))
        else:
            # silu(-inf) would be NaN (-inf + inf); at -1e30, h = -5e29, tanh(h) = -1 and
            # h + h * tanh(h) is exactly 0.
            s = gl.where(ok, s, -1.0e30)
    return s


@gluon.jit
def _row_max(s, TREE: gl.constexpr):
    """``gl.max(s, axis=1)`` with a shallower dependency chain. The in-thread part of a
    reduction is one serial chain (a thread's 32 columns of a row: 32 dependent
    ``FMNMX``); a thread holds columns in both halves of the tile, so two rounds of
    "max of column ``c`` and ``c + N / 2``" (register-local) leave a chain of 8."""
    row: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    if TREE:
        M: gl.constexpr = s.shape[0]
        N: gl.constexpr = s.shape[1]
        a, b = gl.split(gl.permute(gl.reshape(s, [M, 2, N // 2]), (0, 2, 1)))
        t = gl.maximum(a, b)
        c, d = gl.split(gl.permute(gl.reshape(t, [M, 2, N // 4]), (0, 2, 1)))
        m = gl.convert_layout(gl.max(gl.maximum(c, d), axis=1), row)
    else:
        m = gl.max(s, axis=1)
    return m


@gluon.jit
def _weights(s, m_i, l_i, qk_scale, ACT: gl.constexpr, SCALE_IN_EXP: gl.constexpr,
             TREE_MAX: gl.constexpr):  # fmt: skip
    """(P in fp32, new running max, new running sum, accumulator rescale factor)."""
    if ACT == 0:
        if SCALE_IN_EXP:
            # qk_scale > 0: max(s) * c == max(s * c), and each exp2 argument is one fused
            # multiply-add s * c - m instead of a multiply and a subtraction.
            m_new = gl.maximum(m_i, _row_max(s, TREE_MAX) * qk_scale)
        else:
            m_new = gl.maximum(m_i, _row_max(s, TREE_MAX))
        # A row with nothing allowed so far keeps m = -inf; shifting by 0 then gives exact
        # zeros instead of NaN from (-inf) - (-inf).
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        if SCALE_IN_EXP:
            p = gl.exp2(s * qk_scale - m_use[:, None])
        else:
            p = gl.exp2(s - m_use[:, None])
        l_new = l_i * alpha + gl.sum(p, axis=1)
    else:
        # silu(x) = h + h * tanh(h), h = x / 2: one MUFU op per score.
        hs = s * 0.5
        p = hs + hs * _tanh_approx(hs)
        m_new = m_i
        l_new = l_i
        alpha = m_i * 0.0 + 1.0
    return p, m_new, l_new, alpha


@gluon.jit
def _fence_after(x):
    """``x`` unchanged; the GEMM wait that follows stays after the code computing ``x``.

    ptxas hoists ``wgmma.wait_group`` as far up as the registers allow. The wait for
    ``O += P_{j-1} V_{j-1}`` rose above the softmax of tile ``j`` that was meant to run
    while that GEMM does (the softmax touches none of its registers), which cost the
    intra-warpgroup overlap in the SASS. An instruction predicated on ``x`` is a point
    ptxas does not move the wait across: per element one NaN test and a ``nanosleep``
    that runs only for a NaN ``x`` (harmless if it does)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.nan.f32 p, $1, $1; @p nanosleep.u32 1; mov.b32 $0, $1; }",
        "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _clear_rows(v_smem, st, valid, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr):  # fmt: skip
    """Zero rows ``[valid, BLOCK_N)`` of value tile ``st`` of the ring in shared memory.

    TMA reads whole boxes, so the last value tile of a sequence holds the first rows of the
    next sequence. Their weights are exact zeros, but ``0 * NaN`` is NaN: without this a
    non-finite value in one sequence would reach its neighbour's output. Both consumer
    warpgroups clear the same tile; rows below ``valid`` of the chunk that straddles it are
    written back unchanged, so the two write identical bytes and a warpgroup whose GEMM
    already reads the tile sees the same data either way.
    """
    # The ring's 128-byte-swizzled layout stores a tile as panels of 64 columns (one
    # swizzle row each), every panel holding all BLOCK_N rows: viewed as chunks of
    # (CH rows x 64 columns), CH a multiple of the swizzle's 8-row period, it keeps its
    # layout and chunks can be indexed at run time. A loop over chunks, one 16-byte vector
    # per thread each, rather than unrolled static slices: the partition holds the output
    # accumulator and registers are scarce (static slices spilled).
    PANEL: gl.constexpr = 64
    N_PANELS: gl.constexpr = HEAD_DIM // PANEL
    CH: gl.constexpr = 16
    PER_PANEL: gl.constexpr = BLOCK_N // CH
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                      rank=2)  # fmt: skip
    chunks = v_smem._reinterpret(v_smem.dtype, [NUM_STAGES * N_PANELS * PER_PANEL, CH, PANEL],
                                 chunk_layout)  # fmt: skip
    rows = gl.arange(0, CH, layout=gl.SliceLayout(1, blk))
    for c in range(valid // CH, PER_PANEL):
        keep = (c * CH + rows < valid)[:, None]
        for p in gl.static_range(N_PANELS):
            chunk = chunks.index((st * N_PANELS + p) * PER_PANEL + c)
            x = chunk.load(blk)
            chunk.store(gl.where(keep, x, gl.zeros_like(x)))
    # the tensor cores read shared memory through the async proxy
    fence_async_shared()


@gluon.jit
def _consumer(
    shared, consts, WG: gl.constexpr, H: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
    SCALE_IN_EXP: gl.constexpr, PINGPONG: gl.constexpr, ISOLATE_VALUES: gl.constexpr,
    DYNAMIC: gl.constexpr, OVERLAP_PV: gl.constexpr, TREE_MAX: gl.constexpr,
):  # fmt: skip
    o_desc, smem, bars, turn, O, LSE, meta, total_ptr, stride_ot, stride_lh, work, item_ready = (
        shared
    )
    qk_scale, coef = consts
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    ocol: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = o_desc.dtype
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
        # Both warpgroups visit the key tiles either one needs (the producer loads
        # them once for both): a warpgroup whose rows need fewer (one tile less near
        # a causal diagonal, none for rows past the sequence end) computes fully
        # masked or never-stored rows for those. Visiting the same tiles keeps the
        # K/V ring and the turn order identical in both, which is what makes the
        # protocol deadlock-free (see tests/test_gluon_protocol.py).
        n_tiles = _item_tiles(m0, Lq, Lk, CAUSAL, BLOCK_N)
        acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, srow)
        l_i = gl.zeros([WG_ROWS], gl.float32, srow)
        mbarrier.wait(q_ready.index(WG), item_i & 1)
        if n_tiles > 0:
            # Prologue: S_0 = Q K_0^T, its weights P_0.
            st = kv_it % NUM_STAGES
            ph = (kv_it // NUM_STAGES) & 1
            _take_turn(turn, slot, WG, PINGPONG)
            mbarrier.wait(k_ready.index(st), ph)
            s = warpgroup_mma(q_buf, k_smem.index(st).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)  # fmt: skip
            _pass_turn(turn, WG, PINGPONG)
            slot += 1
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            mbarrier.arrive(k_empty.index(st), count=1)
            s = _scores(s, 0, r0, Lq, Lk, qk_scale, CAUSAL, ACT, SCALE_IN_EXP, BLOCK_N,
                        s_layout)  # fmt: skip
            p, m_i, l_i, alpha = _weights(s, m_i, l_i, qk_scale, ACT, SCALE_IN_EXP, TREE_MAX)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            st_prev = st
            ph_prev = ph
            # Steady state: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, then compute
            # P_j on the CUDA cores while the PV GEMM runs on the tensor cores.
            for j in range(1, n_tiles):
                it = kv_it + j
                st = it % NUM_STAGES
                ph = (it // NUM_STAGES) & 1
                _take_turn(turn, slot, WG, PINGPONG)
                mbarrier.wait(k_ready.index(st), ph)
                s = warpgroup_mma(q_buf, k_smem.index(st).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)  # fmt: skip
                mbarrier.wait(v_ready.index(st_prev), ph_prev)
                acc = warpgroup_mma(p_op, v_smem.index(st_prev), acc, is_async=True)
                _pass_turn(turn, WG, PINGPONG)
                slot += 1
                # wgmma groups retire in order: S_j is done, the PV GEMM may still run.
                s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
                mbarrier.arrive(k_empty.index(st), count=1)
                s = _scores(s, j, r0, Lq, Lk, qk_scale, CAUSAL, ACT, SCALE_IN_EXP, BLOCK_N,
                            s_layout)  # fmt: skip
                p, m_i, l_i, alpha = _weights(s, m_i, l_i, qk_scale, ACT, SCALE_IN_EXP, TREE_MAX)
                if OVERLAP_PV:
                    # the whole softmax before the wait: the row sum (softmax) or row
                    # max (SiLU) depends on every weight of the tile
                    if ACT == 0:
                        l_i = _fence_after(l_i)
                    else:
                        _fence_after(gl.max(p, axis=1))
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(st_prev), count=1)
                if ACT == 0:
                    acc = acc * gl.convert_layout(alpha, orow)[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                st_prev = st
                ph_prev = ph
            # Every Q K^T of this item has retired: the producer may reload Q.
            mbarrier.arrive(q_empty.index(WG), count=1)
            # Tail: O += P_last V_last. Only the last key tile can cross the end of
            # the key sequence; its rows past the end are the next sequence's values.
            mbarrier.wait(v_ready.index(st_prev), ph_prev)
            tail_rows = Lk - (n_tiles - 1) * BLOCK_N
            if ISOLATE_VALUES and tail_rows < BLOCK_N:
                _clear_rows(v_smem, st_prev, tail_rows, NUM_STAGES, BLOCK_N, HEAD_DIM)
            _take_turn(turn, slot, WG, PINGPONG)
            acc = warpgroup_mma(p_op, v_smem.index(st_prev), acc, is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            slot += 1
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(st_prev), count=1)
        else:
            mbarrier.arrive(q_empty.index(WG), count=1)
        kv_it += n_tiles
        item_i += 1
        # read before the epilogue, which hides the load's latency
        w_next = _take(work, item_ready, item_i, pid, nprog, DYNAMIC)

        # Epilogue.
        rows = r0 + gl.arange(0, WG_ROWS, layout=orow)
        if ACT == 0:
            l_o = gl.convert_layout(l_i, orow)
            m_o = gl.convert_layout(m_i, orow)
            has_key = l_o > 0.0
            l_safe = gl.where(has_key, l_o, 1.0)
            o = acc * (coef / l_safe)[:, None]
            lse = gl.where(has_key, m_o + gl.log2(l_safe), float("inf"))
            gl.store(LSE + h * stride_lh + q_start + rows, lse, mask=rows < Lq)
        else:
            o = acc * coef
        o = o.to(dtype)
        _store_out(o, o_buf, o_desc, O, q_start, r0, rows, Lq, h, stride_ot, HEAD_DIM, ocol)
        w = w_next
    tma.store_wait(0)


# ``stride_lh`` is the query token count: not specialised, so that a new batch reuses the
# compiled kernel and its direct relaunch (``_triton/_direct.py``).
@gluon.jit(do_not_specialize=["stride_lh"])
def jagged_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, O, LSE, tile_seq, tile_idx, q_off, kv_off, total_ptr,
    work, stride_ot, stride_lh, qk_scale, coef,
    H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACT: gl.constexpr,
    SCALE_IN_EXP: gl.constexpr, PINGPONG: gl.constexpr, ISOLATE_VALUES: gl.constexpr,
    DYNAMIC: gl.constexpr, OVERLAP_PV: gl.constexpr, TREE_MAX: gl.constexpr,
):  # fmt: skip
    """Persistent jagged attention forward; see the module docstring.

    ``q_desc``/``o_desc``: 2-D ``(tokens, H * HEAD_DIM)`` descriptors with ``[64, HEAD_DIM]``
    boxes; ``k_desc``/``v_desc``: the same with ``[BLOCK_N, HEAD_DIM]`` boxes. ``tile_seq``,
    ``tile_idx``: the int32 query-tile schedule of the package's forward (``_triton/_tiles.py``:
    each 128-row tile's sequence and index in it, heaviest first), ``total_ptr``: how many
    entries are real tiles (device); ``q_off``/``kv_off``: int32 ``(B + 1,)`` offsets.
    ``LSE``: ``(H, Tq)`` fp32 (softmax only). ``qk_scale``: ``scale * log2(e)`` for
    softmax, ``scale`` for SiLU; ``coef``: output multiplier. ``work``: int32, ``1 +
    ITEM_DEPTH * grid`` entries, entry 0 zero at launch (``DYNAMIC``: the item counter,
    then each CTA's item ring; unused otherwise).
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], o_desc.layout)
    bars, turn = _fwd_barriers(NUM_STAGES)
    item_ready = _item_barriers()

    smem = (q_smem, k_smem, v_smem, o_smem)
    meta = (tile_seq, tile_idx, q_off, kv_off)
    shared = (o_desc, smem, bars, turn, O, LSE, meta, total_ptr, stride_ot, stride_lh, work,
              item_ready)  # fmt: skip
    consts = (qk_scale, coef)
    # Consumer 0 is the default partition (the kernel's 4 warps); consumer 1 (4 warps) and
    # the producer (1 warp) are workers; setmaxnreg re-balances the registers. (The tuples
    # are spelled out in the call: a tuple bound to a name first loses its constexprs.)
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (shared, consts, 0, H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, ACT,
                         SCALE_IN_EXP, PINGPONG, ISOLATE_VALUES, DYNAMIC, OVERLAP_PV,
                         TREE_MAX)),
            (_consumer, (shared, consts, 1, H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, ACT,
                         SCALE_IN_EXP, PINGPONG, ISOLATE_VALUES, DYNAMIC, OVERLAP_PV,
                         TREE_MAX)),
            (_producer, ((q_desc, k_desc, v_desc, smem, bars, meta, total_ptr, work,
                          item_ready), H, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, DYNAMIC)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
