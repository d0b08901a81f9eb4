"""CPU checks of the Gluon forward's schedule and synchronisation protocol.

Gluon has no CPU interpreter, so the kernel itself is only tested on the GPU
(``test_gluon_forward.py``). What can go wrong without any arithmetic being wrong (a hang,
a race on a shared-memory buffer, a key tile skipped or a row written twice) is checked
here on a *model*: the three partitions of ``_gluon/_kernel.py`` re-written as Python
generators that perform the same mbarrier operations in the same order (the kernel's
control flow, line for line, minus the arithmetic), run under a random scheduler with
asynchronous TMA completions. With the dynamic schedule (``GluonConfig.dynamic``) all CTAs
run interleaved, claim items from one shared counter, and the producer hands each index to
the consumers through the ring of ``_publish``/``_take``. The model flags

* a deadlock (nobody can make progress),
* a TMA load into a buffer that a consumer may still read, or a consumer reading a buffer
  whose load has not landed or holds another tile; an item index published into a ring
  slot that a consumer has not read yet,
* rows of a sequence not written exactly once per head, a key tile that a row needs but
  its warpgroup never visits, and a tile run without the mask although it needs one.

Keep the model in step with the kernel when changing either.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from dataclasses import dataclass, field

import pytest
import torch

from hyperrec.jagged_attn._gluon._launch import BLOCK_M, GluonConfig, _schedule, shared_memory_bytes

WG_ROWS = 64


def n_kv_tiles(r0: int, lq: int, lk: int, causal: bool, block_n: int) -> int:
    """The kernel's ``_n_kv_tiles``."""
    hi = lk
    if causal:
        hi = min(hi, min(r0 + WG_ROWS, lq) + (lk - lq))
    hi = max(hi, 0) if r0 < lq else 0
    return (hi + block_n - 1) // block_n


def need_mask(j: int, r0: int, lq: int, lk: int, causal: bool, block_n: int) -> bool:
    """The kernel's per-tile mask decision in ``_scores``."""
    n_lo = j * block_n
    flag = n_lo + block_n > lk
    if causal:
        flag = flag or (n_lo + block_n - 1 > r0 + (lk - lq))
    return flag


class Deadlock(Exception):
    pass


class Race(Exception):
    pass


@dataclass
class Barrier:
    count: int
    pending: int = 0
    tx: int = 0
    completed: int = 0

    def _maybe_complete(self) -> None:
        if self.pending == self.count and self.tx == 0:
            self.completed += 1
            self.pending = 0

    def arrive(self) -> None:
        self.pending += 1
        if self.pending > self.count:
            raise Race("more arrivals than the barrier's count in one phase")
        self._maybe_complete()

    def expect(self, nbytes: int) -> None:  # mbarrier.arrive.expect_tx
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_complete()

    def passed(self, parity: int) -> bool:
        # try_wait.parity P succeeds unless the phase in progress has parity P
        return (self.completed & 1) != parity


@dataclass
class Buffer:
    tag: object = None
    landed: bool = True
    readers: set = field(default_factory=set)


class Sim:
    """One CTA: producer + two consumers + in-flight TMA loads, randomly interleaved."""

    def __init__(self, stages: int, rng: random.Random, depth: int = 4):
        self.rng = rng
        self.item_ready = [Barrier(1) for _ in range(depth)]
        self.item_slots: list = [None] * depth
        self.item_unread: list[set] = [set() for _ in range(depth)]
        self.q_ready = [Barrier(1) for _ in range(2)]
        self.q_empty = [Barrier(1) for _ in range(2)]
        self.turn = [Barrier(1) for _ in range(2)]
        self.k_ready = [Barrier(1) for _ in range(stages)]
        self.v_ready = [Barrier(1) for _ in range(stages)]
        self.k_empty = [Barrier(2) for _ in range(stages)]
        self.v_empty = [Barrier(2) for _ in range(stages)]
        self.q_buf = [Buffer() for _ in range(2)]
        self.k_buf = [Buffer() for _ in range(stages)]
        self.v_buf = [Buffer() for _ in range(stages)]
        self.inflight: list[tuple[Barrier, Buffer]] = []

    def tma_load(self, bar: Barrier, buf: Buffer, tag: object) -> None:
        if buf.readers:
            raise Race(f"TMA load of {tag} into a buffer still read by {buf.readers}")
        buf.tag, buf.landed = tag, False
        self.inflight.append((bar, buf))

    def read(self, who: str, buf: Buffer, tag: object) -> None:
        if not buf.landed or buf.tag != tag:
            raise Race(f"{who} reads {tag} but the buffer holds {buf.tag} (landed={buf.landed})")
        buf.readers.add(who)

    def release(self, who: str, buf: Buffer) -> None:
        buf.readers.discard(who)

    def publish(self, r: int, item) -> None:
        """``_publish``: item ``r`` into slot ``r % depth``, then its barrier."""
        slot = r % len(self.item_slots)
        if self.item_unread[slot]:
            raise Race(f"item {r} published over an index {sorted(self.item_unread[slot])} "
                       "not read")  # fmt: skip
        self.item_slots[slot] = item
        self.item_unread[slot] = {"wg0", "wg1"}
        self.item_ready[slot].arrive()


def run_all(ctas: list, rng: random.Random) -> None:
    """Run the partitions of several CTAs (``(sim, procs)`` pairs) randomly interleaved."""
    waiting = {}
    gens = {}
    for c, (_sim, procs) in enumerate(ctas):
        for name, gen in procs.items():
            gens[c, name] = gen
            with contextlib.suppress(StopIteration):  # a CTA may have no work
                waiting[c, name] = next(gen)
    while waiting or any(sim.inflight for sim, _ in ctas):
        ready = [n for n, cond in waiting.items() if cond()]
        choices = [("proc", n) for n in ready] + [
            ("tma", (c, i)) for c, (sim, _) in enumerate(ctas) for i in range(len(sim.inflight))
        ]
        if not choices:
            raise Deadlock(f"blocked: {sorted(waiting)}")
        kind, pick = rng.choice(choices)
        if kind == "tma":
            c, i = pick
            bar, buf = ctas[c][0].inflight.pop(i)
            buf.landed = True
            bar.complete_tx(1)
            continue
        try:
            waiting[pick] = gens[pick].send(None)
        except StopIteration:
            del waiting[pick]


def snake(r: int, pid: int, nprog: int) -> int:
    return r * nprog + (pid if r % 2 == 0 else nprog - 1 - pid)


def items(meta, n_items: int, pid: int, nprog: int, heads: int):
    for r in range((n_items + nprog - 1) // nprog):
        w = snake(r, pid, nprog)
        if w < n_items:
            row = meta[min(w, n_items - 1) // heads]
            yield (w % heads, *row[:5])


class StaticSource:
    """The snake order: every partition computes the same items, nothing is handed over."""

    def __init__(self, work: list):
        self.work = work

    def claim(self, sim, r: int):
        item = self.work[r] if r < len(self.work) else None
        return item

    def take(self, sim, me: str, r: int):
        return self.work[r] if r < len(self.work) else None
        yield  # a generator without waits


class DynamicSource:
    """``_claim`` / ``_publish`` / ``_take``: one counter shared by every CTA."""

    def __init__(self, meta, n_items: int, heads: int, counter: list):
        self.meta, self.n_items, self.heads, self.counter = meta, n_items, heads, counter

    def claim(self, sim, r: int):
        w = self.counter[0]
        self.counter[0] += 1
        item = None
        if w < self.n_items:
            item = (w % self.heads, *self.meta[w // self.heads][:5])
        sim.publish(r, item)
        return item

    def take(self, sim, me: str, r: int):
        slot = r % len(sim.item_slots)
        yield lambda: sim.item_ready[slot].passed((r // len(sim.item_slots)) & 1)
        if me not in sim.item_unread[slot]:
            raise Race(f"{me} reads item {r} from a slot it already read")
        sim.item_unread[slot].discard(me)
        return sim.item_slots[slot]


def producer(sim: Sim, source, causal: bool, block_n: int, stages: int):
    kv_it = 0
    item_i = 0
    item = source.claim(sim, 0)
    while item is not None:
        _h, _qs, lq, _ks, lk, m0 = item
        for c in range(2):
            yield lambda c=c, i=item_i: sim.q_empty[c].passed((i & 1) ^ 1)
            sim.q_ready[c].expect(1)
            sim.tma_load(sim.q_ready[c], sim.q_buf[c], ("q", item_i, c))
        item_next = source.claim(sim, item_i + 1)
        n_tiles = max(n_kv_tiles(m0, lq, lk, causal, block_n),
                      n_kv_tiles(m0 + WG_ROWS, lq, lk, causal, block_n))  # fmt: skip
        for j in range(n_tiles):
            st, ph = kv_it % stages, (kv_it // stages) & 1
            yield lambda st=st, ph=ph: sim.k_empty[st].passed(ph ^ 1)
            sim.k_ready[st].expect(1)
            sim.tma_load(sim.k_ready[st], sim.k_buf[st], ("k", item_i, j))
            yield lambda st=st, ph=ph: sim.v_empty[st].passed(ph ^ 1)
            sim.v_ready[st].expect(1)
            sim.tma_load(sim.v_ready[st], sim.v_buf[st], ("v", item_i, j))
            kv_it += 1
        item_i += 1
        item = item_next


def consumer(sim, wg, source, causal, block_n, stages, pingpong, written, visited, masked):
    me = f"wg{wg}"
    kv_it = slot = 0

    def take_turn(slot):
        if pingpong:
            if wg == 0:
                return lambda: sim.turn[0].passed((slot & 1) ^ 1)
            return lambda: sim.turn[1].passed(slot & 1)
        return lambda: True

    def pass_turn():
        if pingpong:
            sim.turn[1 - wg].arrive()

    item_i = 0
    item = yield from source.take(sim, me, 0)
    while item is not None:
        h, q_start, lq, _ks, lk, m0 = item
        r0 = m0 + wg * WG_ROWS
        n_tiles = max(n_kv_tiles(m0, lq, lk, causal, block_n),
                      n_kv_tiles(m0 + WG_ROWS, lq, lk, causal, block_n))  # fmt: skip
        yield lambda i=item_i: sim.q_ready[wg].passed(i & 1)
        sim.read(me, sim.q_buf[wg], ("q", item_i, wg))
        if n_tiles > 0:
            st, ph = kv_it % stages, (kv_it // stages) & 1
            yield take_turn(slot)
            yield lambda st=st, ph=ph: sim.k_ready[st].passed(ph)
            sim.read(me, sim.k_buf[st], ("k", item_i, 0))
            pass_turn()
            slot += 1
            sim.release(me, sim.k_buf[st])
            sim.k_empty[st].arrive()
            visited.append((q_start, h, r0, 0))
            masked.append((r0, lq, lk, 0, need_mask(0, r0, lq, lk, causal, block_n)))
            st_prev, ph_prev = st, ph
            for j in range(1, n_tiles):
                it = kv_it + j
                st, ph = it % stages, (it // stages) & 1
                yield take_turn(slot)
                yield lambda st=st, ph=ph: sim.k_ready[st].passed(ph)
                sim.read(me, sim.k_buf[st], ("k", item_i, j))
                yield lambda s=st_prev, p=ph_prev: sim.v_ready[s].passed(p)
                sim.read(me, sim.v_buf[st_prev], ("v", item_i, j - 1))
                pass_turn()
                slot += 1
                sim.release(me, sim.k_buf[st])
                sim.k_empty[st].arrive()
                visited.append((q_start, h, r0, j))
                masked.append((r0, lq, lk, j, need_mask(j, r0, lq, lk, causal, block_n)))
                sim.release(me, sim.v_buf[st_prev])
                sim.v_empty[st_prev].arrive()
                st_prev, ph_prev = st, ph
            sim.release(me, sim.q_buf[wg])
            sim.q_empty[wg].arrive()
            yield take_turn(slot)
            yield lambda s=st_prev, p=ph_prev: sim.v_ready[s].passed(p)
            sim.read(me, sim.v_buf[st_prev], ("v", item_i, n_tiles - 1))
            pass_turn()
            slot += 1
            sim.release(me, sim.v_buf[st_prev])
            sim.v_empty[st_prev].arrive()
        else:
            sim.release(me, sim.q_buf[wg])
            sim.q_empty[wg].arrive()
        kv_it += n_tiles
        item_i += 1
        item_next = yield from source.take(sim, me, item_i)
        if r0 < lq:
            for r in range(r0, min(r0 + WG_ROWS, lq)):
                written.append((q_start + r, h))
        item = item_next


def allowed_keys_hi(i: int, lq: int, lk: int, causal: bool) -> int:
    """One past the last key row ``i`` may see (0: none)."""
    return max(0, min(lk, i + lk - lq + 1)) if causal else lk


def all_ok(i: int, j0: int, block_n: int, lq: int, lk: int, causal: bool) -> bool:
    return all(c < lk and (not causal or c <= i + lk - lq) for c in range(j0, j0 + block_n))


def work_rows(qo, ko, causal: bool, total_q: int, max_kv: int) -> tuple[list, int]:
    """What the kernel's ``_item`` reads for each tile: (q start, Lq, kv start, Lk, first
    row), in the schedule's order (the package forward's Triton schedule kernel under the
    interpreter; elsewhere the same tiles, longest key range first, built here)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _, _, tile_seq, tile_idx, total = _schedule(qo, ko, causal, total_q, max_kv)
        total = int(total)
        tiles = list(zip(tile_seq[:total].tolist(), tile_idx[:total].tolist()))
    else:
        lq = (qo[1:] - qo[:-1]).tolist()
        tiles = [(b, t) for b, n in enumerate(lq) for t in range(-(-n // BLOCK_M))]
        tiles.sort(key=lambda bt: -int(ko[bt[0] + 1] - ko[bt[0]]))
        total = len(tiles)
    rows = []
    for b, t in tiles:
        q0, k0 = int(qo[b]), int(ko[b])
        rows.append((q0, int(qo[b + 1]) - q0, k0, int(ko[b + 1]) - k0, t * BLOCK_M))
    return rows, total


def simulate(q_lens, kv_lens, causal, heads, nprog, config: GluonConfig, seed: int,
             depth: int = 4):  # fmt: skip
    rng = random.Random(seed)
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    ko = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    total_q = int(qo[-1])
    meta, total = work_rows(qo, ko, causal, total_q, max(kv_lens))
    n_items = int(total) * heads
    written: list = []
    visited: list = []
    masked: list = []
    ctas = []
    counter = [0]  # the dynamic schedule's item counter, shared by every CTA
    for pid in range(nprog):
        if config.dynamic:
            source = DynamicSource(meta, n_items, heads, counter)
        else:
            source = StaticSource(list(items(meta, n_items, pid, nprog, heads)))
        sim = Sim(config.num_stages, rng, depth)
        args = (source, causal, config.block_n, config.num_stages)
        procs = {"producer": producer(sim, *args)}
        for wg in (0, 1):
            procs[f"wg{wg}"] = consumer(sim, wg, *args, config.pingpong, written, visited, masked)
        ctas.append((sim, procs))
    if config.dynamic:
        run_all(ctas, rng)  # the CTAs compete for items
    else:
        for cta in ctas:
            run_all([cta], rng)
    # every (token, head) written exactly once
    expected = sorted((t, h) for t in range(total_q) for h in range(heads))
    assert sorted(written) == expected
    # every row visits every key tile it needs
    seen = set(visited)
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for h in range(heads):
            for i in range(lq):
                r0 = i // WG_ROWS * WG_ROWS
                need = (allowed_keys_hi(i, lq, lk, causal) + config.block_n - 1) // config.block_n
                for j in range(need):
                    assert (int(qo[b]), h, r0, j) in seen, (b, h, i, j)
    # a tile run without the mask is fully allowed for every valid row of its warpgroup
    for r0, lq, lk, j, flag in masked:
        if not flag:
            for i in range(r0, min(r0 + WG_ROWS, lq)):
                assert all_ok(i, j * config.block_n, config.block_n, lq, lk, causal), (r0, j)


CASES = [
    ((300, 0, 10, 390), None),  # ragged, an empty sequence, a 10-token one
    ((1, 64, 65, 128, 129, 257), None),  # around the 64-row warpgroup and 128-row tile
    ((200, 50, 0), (130, 300, 7)),  # Lq != Lk both ways, an empty query sequence
    ((0, 0, 5), (0, 3, 0)),  # empty key sequences
    ((520,), (1000,)),  # one long pair, Lq < Lk
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "config",
    [
        GluonConfig(block_n=128, num_stages=2, pingpong=True),
        GluonConfig(block_n=64, num_stages=3, pingpong=False),
        GluonConfig(block_n=128, num_stages=1, pingpong=True),
        GluonConfig(block_n=128, num_stages=2, pingpong=True, dynamic=False),
    ],
    ids=["n128-s2-pp", "n64-s3", "n128-s1-pp", "n128-s2-pp-static"],
)
def test_protocol_has_no_deadlock_race_or_gap(case, causal, config):
    q_lens, kv_lens = case
    kv_lens = q_lens if kv_lens is None else kv_lens
    for seed in range(2):
        simulate(q_lens, kv_lens, causal, heads=2, nprog=3, config=config, seed=seed)


def test_dynamic_ring_of_two_suffices_and_one_races():
    """Two slots are the least the publish-after-``q_empty`` order needs (the kernel has
    four); with one, the producer overwrites an index a consumer has not read."""
    lens = (300, 700, 5, 129, 1000, 64)
    for seed in range(4):
        simulate(lens, lens, True, heads=2, nprog=2, config=GluonConfig(), seed=seed, depth=2)

    def one_slot():
        for seed in range(20):
            simulate(lens, lens, True, 2, 2, GluonConfig(), seed, depth=1)

    with pytest.raises(Race, match="published over"):
        one_slot()


def test_model_detects_a_protocol_bug(monkeypatch):
    """The checks can fail: a producer that skips waiting for an empty buffer races."""

    def eager_producer(sim, source, causal, block_n, stages):
        kv_it = 0
        item_i = 0
        while (item := source.claim(sim, item_i)) is not None:
            _h, _qs, lq, _ks, lk, m0 = item
            for c in range(2):
                yield lambda c=c, i=item_i: sim.q_empty[c].passed((i & 1) ^ 1)
                sim.q_ready[c].expect(1)
                sim.tma_load(sim.q_ready[c], sim.q_buf[c], ("q", item_i, c))
            n_tiles = max(n_kv_tiles(m0, lq, lk, causal, block_n),
                          n_kv_tiles(m0 + WG_ROWS, lq, lk, causal, block_n))  # fmt: skip
            for j in range(n_tiles):
                st = kv_it % stages
                sim.k_ready[st].expect(1)
                sim.tma_load(sim.k_ready[st], sim.k_buf[st], ("k", item_i, j))
                sim.v_ready[st].expect(1)
                sim.tma_load(sim.v_ready[st], sim.v_buf[st], ("v", item_i, j))
                kv_it += 1
                yield lambda: True
            item_i += 1

    monkeypatch.setattr(sys.modules[__name__], "producer", eager_producer)

    def run_seeds():
        for seed in range(5):
            simulate((700,), (700,), False, 1, 1, GluonConfig(num_stages=2, dynamic=False), seed)

    with pytest.raises((Race, Deadlock)):
        run_seeds()


def test_shared_memory_budget():
    # head dim 128, 2 stages: Q + O tiles (2 x 2 x 16 KiB) + K/V ring (2 x 2 x 32 KiB)
    assert shared_memory_bytes(128, GluonConfig(num_stages=2)) == 196608
    assert shared_memory_bytes(128, GluonConfig(num_stages=3)) > 232448 - 1024
