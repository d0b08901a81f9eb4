"""CPU checks of the Gluon backward kernels' schedules and synchronisation protocols.

As ``test_gluon_protocol.py`` does for the forward: the partitions of
``_gluon/_bwd_kernel.py`` (dK/dV and dQ) re-written as Python generators that perform the
same mbarrier operations in the same order, run under a random scheduler with
asynchronous TMA completions. The model flags a deadlock, a TMA load (or the producer's
store of a tile's LSE/delta) into a buffer a consumer may still read, a consumer reading a
buffer that does not hold its tile, an epilogue staging its output through a buffer that a
load may still overwrite, rows of dK/dV or dQ not written exactly once per head, and a
(key, query) tile pair that an allowed entry needs but no warpgroup visits.

Keep the model in step with the kernels when changing either.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_gluon_protocol import (
    Barrier,
    Buffer,
    Deadlock,
    DynamicSource,
    Race,
    Sim,
    StaticSource,
    n_kv_tiles,
    run_all,
    snake,
)

from hyperrec.jagged_attn._gluon._bwd_launch import BLOCK_N, block_m

WG_ROWS = 64
Q_BLOCK = 128  # the dQ kernel's work items: the forward's 128-row query tiles


class BwdSim(Sim):
    """Buffers and barriers of either backward kernel: ``fixed`` (two halves, one per
    consumer: K/V in dK/dV, Q/dO in dQ) and a ``ring`` of ``stages`` streamed tiles."""

    def __init__(self, stages: int, ring_count: int, rng: random.Random, depth: int = 4):
        self.rng = rng
        self.inflight = []
        # the dynamic schedule's item-index ring (``Sim.publish``)
        self.item_ready = [Barrier(1) for _ in range(depth)]
        self.item_slots: list = [None] * depth
        self.item_unread: list[set] = [set() for _ in range(depth)]
        self.fixed_ready = [Barrier(1) for _ in range(2)]
        self.fixed_empty = [Barrier(1) for _ in range(2)]
        self.ring_ready = [Barrier(1) for _ in range(stages)]
        self.ring_empty = [Barrier(ring_count) for _ in range(stages)]
        self.fixed = [Buffer() for _ in range(2)]
        self.ring = [Buffer() for _ in range(stages)]
        self.stats = [Buffer() for _ in range(stages)]
        # the fused dQ (dK/dV kernel): dS^T halves in two alternating buffers per
        # warpgroup, the per-tile meeting point and the K-half hand-back
        self.ds = [Buffer() for _ in range(4)]
        self.ds_ready = [Barrier(2) for _ in range(2)]
        self.k_sync = Barrier(2)
        self.k_free = [Barrier(1) for _ in range(2)]  # the first version's hand-back
        self.dq_stage = [Buffer() for _ in range(2)]  # fp32 dQ, read by the reduce-add

    def store(self, who: str, buf: Buffer, tag: object) -> None:
        """A generic-proxy store (producer's statistics, a consumer's epilogue)."""
        if buf.readers - {who} or not buf.landed:
            raise Race(f"{who} stores {tag} into a buffer read by {buf.readers} "
                       f"(landed={buf.landed})")  # fmt: skip
        buf.tag = tag


def q_tiles(n0: int, lq: int, lk: int, causal: bool, bm: int) -> range:
    """The kernel's ``_q_tiles``."""
    lo = max(n0 - (lk - lq), 0) // bm if causal else 0
    hi = (lq + bm - 1) // bm
    return range(lo, max(hi, lo))


def key_tiles(qo, ko, causal) -> list[tuple[int, int]]:
    """(sequence, key tile) work items: the package's key-tile schedule under the
    interpreter (the dK/dV kernel's own), else every key tile, built here."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from hyperrec.jagged_attn._triton._schedule import work_upper_bound
        from hyperrec.jagged_attn._triton._tiles import tile_schedule

        lq = (qo[1:] - qo[:-1]).tolist()
        upper = work_upper_bound(int(ko[-1]), ko.numel() - 1, BLOCK_N)
        _, _, seq, idx, total = tile_schedule(qo, ko, None, BLOCK_N, causal, upper,
                                              max(lq + [1]), kv_tiles=True)  # fmt: skip
        return list(zip(seq[: int(total)].tolist(), idx[: int(total)].tolist()))
    lk = (ko[1:] - ko[:-1]).tolist()
    return [(b, t) for b, n in enumerate(lk) for t in range(-(-n // BLOCK_N))]


def dkdv_producer(sim, source, causal, bm, stages, softmax):
    it = 0
    item_i = 0
    item = source.claim(sim, 0)
    while item is not None:
        (_h, _qs, lq, _ks, lk, n0) = item
        for c in range(2):
            yield lambda c=c, i=item_i: sim.fixed_empty[c].passed((i & 1) ^ 1)
            sim.fixed_ready[c].expect(1)
            sim.tma_load(sim.fixed_ready[c], sim.fixed[c], ("kv", item_i, c))
        item_next = source.claim(sim, item_i + 1)
        for i in q_tiles(n0, lq, lk, causal, bm):
            st, ph = it % stages, (it // stages) & 1
            yield lambda st=st, ph=ph: sim.ring_empty[st].passed(ph ^ 1)
            if softmax:  # stored before the arrival that publishes them
                sim.store("producer", sim.stats[st], ("stats", item_i, i))
            sim.ring_ready[st].expect(1)
            sim.tma_load(sim.ring_ready[st], sim.ring[st], ("q", item_i, i))
            it += 1
        item_i += 1
        item = item_next


def dkdv_consumer(sim, wg, source, causal, bm, stages, softmax, written, visited,
                  fused=False, k_sync=True, pairwise=False, clear=True,
                  store_wait=True):  # fmt: skip
    me, it, item_i = f"wg{wg}", 0, 0
    item = yield from source.take(sim, me, 0)
    while item is not None:
        h, _qs, lq, k_start, lk, n0 = item
        r0 = n0 + wg * WG_ROWS
        yield lambda i=item_i: sim.fixed_ready[wg].passed(i & 1)
        sim.read(me, sim.fixed[wg], ("kv", item_i, wg))
        if fused and clear and r0 + WG_ROWS > lk:
            # the key rows past the sequence zeroed in this warpgroup's K half (a tag of
            # its own: the other warpgroup's dQ must read the cleared half)
            sim.store(me, sim.fixed[wg], ("kv-cleared", item_i, wg))
        tiles = q_tiles(n0, lq, lk, causal, bm)
        for i in tiles:
            st, ph = it % stages, (it // stages) & 1
            yield lambda st=st, ph=ph: sim.ring_ready[st].passed(ph)
            sim.read(me, sim.ring[st], ("q", item_i, i))
            if softmax:
                sim.read(me, sim.stats[st], ("stats", item_i, i))
                sim.release(me, sim.stats[st])
            if fused:
                # dS^T half out, meet the other warpgroup, dQ = dS K over both halves of
                # dS and of K (the MMA retires within the tile)
                db = it % 2
                sim.store(me, sim.ds[2 * db + wg], ("ds", item_i, i, wg))
                sim.ds_ready[db].arrive()
                yield lambda db=db, ph2=(it // 2) & 1: sim.ds_ready[db].passed(ph2)
                for c in range(2):
                    sim.read(me, sim.ds[2 * db + c], ("ds", item_i, i, c))
                other = n0 + (1 - wg) * WG_ROWS + WG_ROWS > lk
                sim.read(me, sim.fixed[1 - wg], ("kv-cleared" if other else "kv", item_i, 1 - wg))
                for c in range(2):
                    sim.release(me, sim.ds[2 * db + c])
                sim.release(me, sim.fixed[1 - wg])
                # staged for the reduce-add once the previous one has read the buffer
                if store_wait:
                    sim.release(f"tma-{me}", sim.dq_stage[wg])
                sim.store(me, sim.dq_stage[wg], ("dq", item_i, i, wg))
                sim.dq_stage[wg].readers.add(f"tma-{me}")
            visited.add((k_start, h, r0, i))
            sim.release(me, sim.ring[st])
            sim.ring_empty[st].arrive()
            it += 1
        if fused and pairwise:
            # the first version: hand the other's K half back, wait for this one's
            sim.k_free[1 - wg].arrive()
            yield lambda i=item_i: sim.k_free[wg].passed(i & 1)
        elif fused:
            # both warpgroups done reading each other's K half before either stages dK
            sim.k_sync.arrive()
            if k_sync:
                yield lambda i=item_i: sim.k_sync.passed(i & 1)
        item_next = yield from source.take(sim, me, item_i + 1)
        # epilogue: dK/dV staged through this warpgroup's K/V buffers
        sim.store(me, sim.fixed[wg], ("dkdv", item_i, wg))
        written.extend((k_start + r, h) for r in range(r0, min(r0 + WG_ROWS, lk)))
        sim.release(me, sim.fixed[wg])
        sim.fixed_empty[wg].arrive()
        item_i += 1
        item = item_next


def dq_producer(sim, source, causal, block_n, stages):
    it = 0
    item_i = 0
    item = source.claim(sim, 0)
    while item is not None:
        (_h, _qs, lq, _ks, lk, m0) = item
        for c in range(2):
            yield lambda c=c, i=item_i: sim.fixed_empty[c].passed((i & 1) ^ 1)
            sim.fixed_ready[c].expect(1)
            sim.tma_load(sim.fixed_ready[c], sim.fixed[c], ("q", item_i, c))
        item_next = source.claim(sim, item_i + 1)
        n = max(n_kv_tiles(m0, lq, lk, causal, block_n),
                n_kv_tiles(m0 + WG_ROWS, lq, lk, causal, block_n))  # fmt: skip
        for j in range(n):
            st, ph = it % stages, (it // stages) & 1
            yield lambda st=st, ph=ph: sim.ring_empty[st].passed(ph ^ 1)
            sim.ring_ready[st].expect(1)
            sim.tma_load(sim.ring_ready[st], sim.ring[st], ("kv", item_i, j))
            it += 1
        item_i += 1
        item = item_next


def dq_consumer(sim, wg, source, causal, block_n, stages, written, visited):
    me, it, item_i = f"wg{wg}", 0, 0
    item = yield from source.take(sim, me, 0)
    while item is not None:
        h, q_start, lq, _ks, lk, m0 = item
        r0 = m0 + wg * WG_ROWS
        n = max(n_kv_tiles(m0, lq, lk, causal, block_n),
                n_kv_tiles(m0 + WG_ROWS, lq, lk, causal, block_n))  # fmt: skip
        yield lambda i=item_i: sim.fixed_ready[wg].passed(i & 1)
        sim.read(me, sim.fixed[wg], ("q", item_i, wg))
        for j in range(n):
            st, ph = it % stages, (it // stages) & 1
            yield lambda st=st, ph=ph: sim.ring_ready[st].passed(ph)
            sim.read(me, sim.ring[st], ("kv", item_i, j))
            visited.add((q_start, h, r0, j))
            sim.release(me, sim.ring[st])
            sim.ring_empty[st].arrive()
            it += 1
        item_next = yield from source.take(sim, me, item_i + 1)
        # epilogue: dQ staged through this warpgroup's Q buffer
        sim.store(me, sim.fixed[wg], ("dq", item_i, wg))
        written.extend((q_start + r, h) for r in range(r0, min(r0 + WG_ROWS, lq)))
        sim.release(me, sim.fixed[wg])
        sim.fixed_empty[wg].arrive()
        item_i += 1
        item = item_next


def run_kernel(kind, q_lens, kv_lens, causal, heads, nprog, stages, seed, softmax=True,
               dynamic=True, depth=4, fused=False, k_sync=True, pairwise=False, clear=True,
               store_wait=True):  # fmt: skip
    rng = random.Random(seed)
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    ko = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    if kind == "dkdv":
        tiles = key_tiles(qo, ko, causal)
        block = BLOCK_N
    else:
        tiles = [(b, t) for b, n in enumerate(q_lens) for t in range(-(-n // Q_BLOCK))]
        block = Q_BLOCK
    meta = [(int(qo[b]), int(qo[b + 1] - qo[b]), int(ko[b]), int(ko[b + 1] - ko[b]), t * block)
            for b, t in tiles]  # fmt: skip
    n_items = len(meta) * heads
    written, visited = [], set()
    bm = 64 if fused else block_m(128, softmax)
    ctas = []
    counter = [0]  # the dynamic schedule's item counter, shared by every CTA
    for pid in range(nprog):
        if dynamic:
            source = DynamicSource(meta, n_items, heads, counter)
        else:
            work = []
            for r in range((n_items + nprog - 1) // nprog):
                w = snake(r, pid, nprog)
                if w < n_items:
                    work.append((w % heads, *meta[w // heads]))
            source = StaticSource(work)
        sim = BwdSim(stages, 2, rng, depth)
        if kind == "dkdv":
            procs = {"producer": dkdv_producer(sim, source, causal, bm, stages, softmax)}
            for wg in range(2):
                procs[f"wg{wg}"] = dkdv_consumer(sim, wg, source, causal, bm, stages, softmax,
                                                 written, visited, fused, k_sync,
                                                 pairwise, clear, store_wait)  # fmt: skip
        else:
            procs = {"producer": dq_producer(sim, source, causal, 64, stages)}
            for wg in range(2):
                procs[f"wg{wg}"] = dq_consumer(sim, wg, source, causal, 64, stages, written,
                                               visited)  # fmt: skip
        ctas.append((sim, procs))
    if dynamic:
        run_all(ctas, rng)  # the CTAs compete for items
    else:
        for cta in ctas:
            run_all([cta], rng)
    tokens = int(ko[-1]) if kind == "dkdv" else int(qo[-1])
    assert sorted(written) == sorted((t, h) for t in range(tokens) for h in range(heads))
    # every allowed (query i, key j) entry lies in a visited tile pair
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for h in range(heads):
            for i in range(lq):
                for j in range(lk):
                    if causal and j > i + lk - lq:
                        continue
                    if kind == "dkdv":
                        key = (int(ko[b]), h, j // WG_ROWS * WG_ROWS, i // bm)
                    else:
                        key = (int(qo[b]), h, i // WG_ROWS * WG_ROWS, j // 64)
                    assert key in visited, (kind, b, h, i, j)


CASES = [
    ((300, 0, 10, 390), None),  # ragged, an empty sequence, a 10-token one
    ((1, 64, 65, 128, 129, 257), None),  # around the 64-row halves and 128-row tiles
    ((200, 50, 0), (130, 300, 7)),  # Lq != Lk both ways, an empty query sequence
    ((0, 0, 5), (0, 3, 0)),  # empty key sequences
    ((40,), (520,)),  # Lq < Lk: causal keys no query sees
]


@pytest.mark.parametrize("softmax", [True, False])
@pytest.mark.parametrize("kind", ["dkdv", "dq"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_backward_protocols_have_no_deadlock_race_or_gap(case, causal, kind, softmax):
    q_lens, kv_lens = case
    kv_lens = q_lens if kv_lens is None else kv_lens
    for seed, stages, dynamic in ((0, 1, True), (1, 3, True), (2, 3, False)):
        run_kernel(kind, q_lens, kv_lens, causal, heads=2, nprog=3, stages=stages, seed=seed,
                   softmax=softmax, dynamic=dynamic)  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_fused_dq_protocol_has_no_deadlock_race_or_gap(case, causal):
    # the dK/dV kernel with the fused dQ (FUSED_DQ): 64-row query tiles, dS^T halves
    # exchanged every tile, each warpgroup reading the other's K half
    q_lens, kv_lens = case
    kv_lens = q_lens if kv_lens is None else kv_lens
    for seed, stages, dynamic in ((0, 1, True), (1, 3, True), (2, 3, False), (3, 2, True)):
        run_kernel("dkdv", q_lens, kv_lens, causal, heads=2, nprog=3, stages=stages,
                   seed=seed, dynamic=dynamic, fused=True)  # fmt: skip


def test_fused_dq_without_the_k_sync_wait_races():
    """The checks can fail: without waiting for the other warpgroup to finish reading its
    K half (``k_sync``), a warpgroup stages dK there while the other's dQ product may
    still read it."""

    def run_seeds():
        for seed in range(40):
            run_kernel("dkdv", (300, 129, 300), (300, 129, 300), False, 1, 1, stages=2,
                       seed=seed, dynamic=False, fused=True, k_sync=False)  # fmt: skip

    with pytest.raises(Race):
        run_seeds()


@pytest.mark.parametrize("mutation", ["clear", "store_wait"])
def test_fused_dq_model_catches_a_missing_clear_or_store_wait(mutation):
    """The checks can fail: without zeroing the key rows past a sequence's end, the other
    warpgroup's dQ reads an uncleared K half (a non-finite key of the next sequence would
    reach this one's dQ); without waiting for the previous reduce-add, the dQ staging
    buffer is overwritten while it is read."""

    def run_seeds():
        for seed in range(5):
            run_kernel("dkdv", (200, 50, 37), (130, 100, 7), False, heads=1, nprog=2,
                       stages=2, seed=seed, dynamic=False, fused=True,
                       **{mutation: False})  # fmt: skip

    with pytest.raises(Race):
        run_seeds()


def test_fused_dq_with_per_warpgroup_hand_back_deadlocks():
    """The model found this: the first fused version handed each K half back through a
    count-1 barrier per warpgroup; an item with no query tile (here the third sequence's,
    Lq = 0) lets one warpgroup run an item ahead and complete the other's barrier twice
    before it waits: a deadlock. The kernel uses one count-2 barrier instead (above)."""

    def run_seeds():
        for seed in range(10):
            run_kernel("dkdv", (200, 50, 0), (130, 300, 7), False, heads=2, nprog=3, stages=3,
                       seed=seed, dynamic=False, fused=True, pairwise=True)  # fmt: skip

    with pytest.raises(Deadlock):
        run_seeds()


@pytest.mark.parametrize("kind", ["dkdv", "dq"])
def test_dynamic_ring_of_one_races(kind):
    """The item-index ring: the kernels' four slots are safe (above); with one the producer
    publishes over an index a consumer has not read (the check can fail)."""
    lens = (300, 700, 5, 129, 1000, 64)

    def one_slot():
        for seed in range(30):
            run_kernel(kind, lens, lens, True, 2, 2, stages=2, seed=seed, depth=1)

    with pytest.raises(Race, match="published over"):
        one_slot()


def test_model_detects_an_early_release(monkeypatch):
    """The checks can fail: a dK/dV consumer that frees its K/V half before staging its
    output there lets the next item's load race with the epilogue."""
    import test_gluon_bwd_protocol as me

    def early(sim, wg, source, causal, bm, stages, softmax, written, visited, *_):
        me_, it = f"wg{wg}", 0
        for item_i, (h, _qs, lq, k_start, lk, n0) in enumerate(source.work):
            r0 = n0 + wg * WG_ROWS
            yield lambda i=item_i: sim.fixed_ready[wg].passed(i & 1)
            sim.read(me_, sim.fixed[wg], ("kv", item_i, wg))
            sim.fixed_empty[wg].arrive()  # released before the item is done with it
            for i in q_tiles(n0, lq, lk, causal, bm):
                st, ph = it % stages, (it // stages) & 1
                yield lambda st=st, ph=ph: sim.ring_ready[st].passed(ph)
                sim.read(me_, sim.ring[st], ("q", item_i, i))
                if softmax:
                    sim.read(me_, sim.stats[st], ("stats", item_i, i))
                    sim.release(me_, sim.stats[st])
                visited.add((k_start, h, r0, i))
                sim.release(me_, sim.ring[st])
                sim.ring_empty[st].arrive()
                it += 1
            sim.store(me_, sim.fixed[wg], ("dkdv", item_i, wg))
            written.extend((k_start + r, h) for r in range(r0, min(r0 + WG_ROWS, lk)))
            sim.release(me_, sim.fixed[wg])

    monkeypatch.setattr(me, "dkdv_consumer", early)

    def run_seeds():
        for seed in range(20):
            run_kernel("dkdv", (300, 300, 300), (300, 300, 300), False, 1, 1, stages=2,
                       seed=seed, dynamic=False)  # fmt: skip

    with pytest.raises(Race):
        run_seeds()
