import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.integration import TrainStream
from hyperrec.integration.data import TRAIN
from hyperrec.integration.pipeline import (
    RequestOrder,
    SubBatchReader,
    default_cost_model,
    permute,
    reshard_streams,
)


def _stream(data, *, rank=0, world=1, k=3, w=4, s=8):
    return TrainStream(
        data,
        sub_batch_size=s,
        sub_batches_per_step=k,
        window_steps=w,
        rank=rank,
        world_size=world,
        cost=default_cost_model(16),
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_cover_every_request_once_within_the_delay_bound(micro_data, world):
    k, w, s, steps = 3, 4, 8, 12
    seen = []
    for rank in range(world):
        stream = _stream(micro_data, rank=rank, world=world, k=k, w=w, s=s)
        for step in range(steps):
            item = stream.next()
            assert len(item.sub_batches) == k
            ids = item.batch.sample_ids.numpy()
            assert len(ids) == k * s
            seen.append(ids)
            for j in item.sub_batches:
                assert j % world == rank
                arrival_step = (j // world) // k
                assert abs(step - arrival_step) <= w - 1
    seen = np.concatenate(seen)
    assert len(seen) == len(set(seen.tolist())) == world * steps * k * s
    assert set(seen.tolist()) == set(range(world * steps * k * s))


def test_bbs_flattens_step_costs(micro_data):
    stream = _stream(micro_data, k=4, w=8, s=4)
    items = [stream.next() for _ in range(64)]
    bbs = np.array([i.cost for i in items]).reshape(8, 8)
    arrival = np.array([i.arrival_cost for i in items]).reshape(8, 8)
    # Same work per window, spread far more evenly over its steps.
    np.testing.assert_allclose(bbs.sum(axis=1), arrival.sum(axis=1))
    excess = lambda c: (c.max(axis=1) / c.mean(axis=1) - 1).mean()  # noqa: E731
    assert excess(bbs) < 0.5 * excess(arrival), (excess(bbs), excess(arrival))


def test_resume_mid_window_replays_the_same_batches(micro_data):
    a = _stream(micro_data, rank=1, world=2)
    for _ in range(5):  # 5 = one window of 4 + 1 step into the next
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(6)]
    b = _stream(micro_data, rank=1, world=2)
    b.load_state_dict(state)
    got = [b.next() for _ in range(6)]
    for x, y in zip(expected, got):
        assert x.sub_batches == y.sub_batches
        assert np.array_equal(x.batch.sample_ids.numpy(), y.batch.sample_ids.numpy())
        assert x.arrival_cost == y.arrival_cost


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_arrival_cost_is_the_arrival_order_steps_cost(micro_data, rank, world):
    k, w, s = 3, 4, 8
    stream = _stream(micro_data, rank=rank, world=world, k=k, w=w, s=s)
    model = default_cost_model(16)
    for step in range(2 * w + 1):
        item = stream.next()
        # Arrival order trains this rank's local sub-batches [step k, (step+1) k).
        arrival = [rank + n * world for n in range(step * k, (step + 1) * k)]
        lengths = [
            micro_data.history_lengths(TRAIN, np.arange(j * s, (j + 1) * s)) for j in arrival
        ]
        assert item.arrival_cost == pytest.approx(sum(model(x) for x in lengths))


def test_resume_reads_only_the_interrupted_window(micro_data, monkeypatch):
    k, w = 3, 4
    a = _stream(micro_data, rank=1, world=2, k=k, w=w)
    assert a.shuffler.source_kind == "index_only"  # resumed by index, never re-read
    for _ in range(2 * w + 1):  # one step into the third window
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(w - 1)]  # the rest of that window
    reads = []
    original = SubBatchReader.__getitem__

    def recording(self, n):
        reads.append(n)
        return original(self, n)

    monkeypatch.setattr(SubBatchReader, "__getitem__", recording)
    b = _stream(micro_data, rank=1, world=2, k=k, w=w)
    b.load_state_dict(state)
    got = [b.next() for _ in range(w - 1)]
    assert [x.sub_batches for x in got] == [x.sub_batches for x in expected]
    assert [(x.cost, x.arrival_cost) for x in got] == [(x.cost, x.arrival_cost) for x in expected]
    # The window is re-read to re-plan it, and nothing else: no step before it and no
    # second pass over arrival order for the costs.
    assert reads == list(range(2 * w * k, 3 * w * k))


def test_reader_is_endless_and_index_only(micro_data):
    reader = SubBatchReader(micro_data, sub_batch_size=4, rank=2, world_size=3)
    assert not hasattr(reader, "__len__")
    far = reader[10**12]
    assert far.index == 2 + 3 * 10**12
    assert far.requests.tolist() == list(range(far.index * 4, far.index * 4 + 4))
    with pytest.raises(IndexError, match="sub-batch index"):
        reader[-1]


def test_state_from_another_layout_is_rejected(micro_data):
    state = _stream(micro_data, rank=0, world=2).state_dict()
    with pytest.raises(ValueError, match="stream state was saved with"):
        _stream(micro_data, rank=1, world=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rank": 2, "world": 2}, "rank"), ({"s": 0}, "sub_batch_size"), ({"w": 0}, "window_steps")],
)
def test_bad_stream_arguments(micro_data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _stream(micro_data, **kwargs)


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 5000), st.integers(0, 2**32))
def test_permute_is_a_bijection_of_the_range(n, seed):
    out = permute(np.arange(n), n, (seed, 7))
    assert np.array_equal(np.sort(out), np.arange(n))
    # The same key gives the same order, element by element.
    pick = np.array([0, n - 1, n // 2])
    assert np.array_equal(permute(pick, n, (seed, 7)), out[pick])


def test_request_order_visits_each_request_once_per_epoch():
    order = RequestOrder(10, shuffle=True, seed=3)
    ids = order(np.arange(35))
    for e in range(3):
        assert sorted(ids[10 * e : 10 * e + 10].tolist()) == list(range(10))
    assert ids[:10].tolist() != ids[10:20].tolist()  # a fresh order each epoch
    assert RequestOrder(10, shuffle=False)(np.arange(12)).tolist() == [*range(10), 0, 1]
    assert RequestOrder(None)(np.arange(5)).tolist() == list(range(5))
    assert order.epoch(25) == 2.5
    with pytest.raises(ValueError, match="training split is empty"):
        RequestOrder(0)


@pytest.mark.parametrize(("old", "new", "w"), [(2, 3, 4), (3, 1, 2), (1, 4, 3), (4, 2, 1)])
def test_reshard_streams_loses_and_repeats_no_sub_batch(micro_data, old, new, w):
    k_global = 12  # sub-batches per global step: divisible by every world size here
    seen = []
    streams = [_stream(micro_data, rank=r, world=old, k=k_global // old, w=w, s=4)
               for r in range(old)]  # fmt: skip
    for s in streams:
        for _ in range(5):  # 5 steps: in the middle of a window for most W
            seen += list(s.next().sub_batches)
    backlogs, frontier = reshard_streams(
        [s.state_dict() for s in streams], micro_data, world_size=new, cost=default_cost_model(16)
    )
    assert max(map(len, backlogs)) - min(map(len, backlogs)) <= 1
    resumed = [
        TrainStream(micro_data, sub_batch_size=4, sub_batches_per_step=k_global // new,
                    window_steps=w, rank=r, world_size=new, cost=default_cost_model(16),
                    backlog=backlogs[r], frontier=frontier)
        for r in range(new)
    ]  # fmt: skip
    for s in resumed:
        for _ in range(6):
            seen += list(s.next().sub_batches)
    assert len(seen) == len(set(seen)) == 11 * k_global
    assert set(range(frontier)) <= set(seen)  # everything below the old read position
    # A second change of world size starts from streams that still hold a backlog.
    backlogs2, frontier2 = reshard_streams(
        [s.state_dict() for s in resumed], micro_data, world_size=old,
        cost=default_cost_model(16),
    )  # fmt: skip
    for r in range(old):
        s = TrainStream(micro_data, sub_batch_size=4, sub_batches_per_step=k_global // old,
                        window_steps=w, rank=r, world_size=old, cost=default_cost_model(16),
                        backlog=backlogs2[r], frontier=frontier2)  # fmt: skip
        for _ in range(12):  # enough to read the whole backlog whatever the window
            seen += list(s.next().sub_batches)
    assert len(seen) == len(set(seen)) == 23 * k_global
    assert set(range(frontier2)) <= set(seen)
    # The new layout survives a checkpoint of its own.
    state = resumed[0].state_dict()
    again = TrainStream(
        micro_data,
        sub_batch_size=4,
        sub_batches_per_step=k_global // new,
        window_steps=w,
        rank=0,
        world_size=new,
        cost=default_cost_model(16),
    )
    again.load_state_dict(state)
    assert again.next().sub_batches == resumed[0].next().sub_batches


def _fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def _epoch_streams(data, *, n, world, k, w, s, end, seed):
    order = RequestOrder(n, shuffle=True, seed=seed)
    return [
        TrainStream(data, sub_batch_size=s, sub_batches_per_step=k, window_steps=w, rank=r,
                    world_size=world, cost=default_cost_model(16), order=order, end=end)
        for r in range(world)
    ]  # fmt: skip


def test_an_end_trains_every_request_of_every_pass_whatever_the_window(micro_data):
    # Before: the last BBS window was planned as a full one of W steps, so with a step
    # count not a multiple of W some sub-batches of the last pass were dealt to steps
    # after the run's end and never trained (sub-batches of the next pass took their
    # place). Now the reader ends before `end` and the last window is a short one.
    rng, seed = _fresh_rng()
    for _ in range(6):
        world = int(rng.integers(1, 4))
        k, s = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        w = int(rng.integers(2, 6))
        n, epochs = int(rng.integers(20, 200)), int(rng.integers(1, 4))
        per_step = world * k  # global sub-batches per step
        steps = -(-epochs * n // (per_step * s))
        end = steps * per_step
        where = dict(seed=seed, world=world, k=k, s=s, w=w, n=n, epochs=epochs, steps=steps)
        counts = np.zeros(n, dtype=np.int64)
        for stream in _epoch_streams(micro_data, n=n, world=world, k=k, w=w, s=s, end=end,
                                     seed=seed):  # fmt: skip
            for step in range(steps):
                plan = stream.next_plan()
                assert len(plan.sub_batches) == k, where
                assert max(plan.sub_batches) < end, where
                for j in plan.sub_batches:  # the delay bound still holds
                    assert abs(step - (j // world) // k) <= w - 1, where
                np.add.at(counts, plan.requests, 1)
            before = stream.state_dict()
            with pytest.raises(StopIteration):
                stream.next_plan()
            assert stream.state_dict() == before, where  # stays at the end
        assert counts.min() >= epochs, where  # every request read `epochs` times...
        assert counts.sum() - epochs * n < per_step * s, where  # ...less than a batch more
        assert counts.sum() == end * s, where


def test_an_ended_stream_resumes_inside_its_short_last_window(micro_data):
    rng, seed = _fresh_rng()
    k, w, s, world = 2, 4, 4, 2
    steps = int(rng.integers(1, 4)) * w + int(rng.integers(1, w))  # steps % W != 0
    end = steps * k * world
    stop = steps - int(rng.integers(1, steps % w + 1))  # inside the last (short) window
    a = _epoch_streams(micro_data, n=97, world=world, k=k, w=w, s=s, end=end, seed=seed)[1]
    for _ in range(stop):
        a.next_plan()
    state = a.state_dict()
    assert state["end"] == end
    expected = [a.next_plan().sub_batches for _ in range(steps - stop)]
    b = _epoch_streams(micro_data, n=97, world=world, k=k, w=w, s=s, end=end, seed=seed)[1]
    b.load_state_dict(state)
    assert [b.next_plan().sub_batches for _ in range(steps - stop)] == expected, seed
    with pytest.raises(StopIteration):
        b.next_plan()
    # Another end is refused inside a window it changes, accepted at a window boundary.
    other = _epoch_streams(micro_data, n=97, world=world, k=k, w=w, s=s, end=end + k * world,
                           seed=seed)[1]  # fmt: skip
    if state["shuffler"]["steps_done_in_window"]:
        with pytest.raises(ValueError, match="inside a BBS window"):
            other.load_state_dict(state)
        assert other.reader.backlog == () and other.reader.frontier == 0  # left as it was
    boundary = _epoch_streams(micro_data, n=97, world=world, k=k, w=w, s=s, end=end,
                              seed=seed)[1]  # fmt: skip
    for _ in range(w):
        boundary.next_plan()
    other.load_state_dict(boundary.state_dict())
    assert len(other.next_plan().sub_batches) == k


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (1, 4), (4, 1), (2, 4)])
def test_reshard_with_an_end_gives_every_new_rank_the_same_steps(micro_data, old, new):
    # Before: the backlog was dealt round-robin and then each rank continued its stride,
    # so ranks could hold unequal numbers of sub-batches below the end (one ran out
    # before the others, another trained past the end).
    rng, seed = _fresh_rng()
    k_global, w, s = 12, int(rng.integers(1, 5)), 4
    steps = int(rng.integers(6, 12))
    end = steps * k_global
    cut = int(rng.integers(1, steps))
    streams = _epoch_streams(micro_data, n=89, world=old, k=k_global // old, w=w, s=s, end=end,
                             seed=seed)  # fmt: skip
    seen = [j for st in streams for _ in range(cut) for j in st.next_plan().sub_batches]
    backlogs, frontier = reshard_streams(
        [st.state_dict() for st in streams], micro_data, world_size=new,
        cost=default_cost_model(16), order=streams[0].reader.order, end=end,
    )  # fmt: skip
    for r in range(new):
        st = TrainStream(micro_data, sub_batch_size=s, sub_batches_per_step=k_global // new,
                         window_steps=w, rank=r, world_size=new, cost=default_cost_model(16),
                         order=streams[0].reader.order, backlog=backlogs[r], frontier=frontier,
                         end=end)  # fmt: skip
        for _ in range(steps - cut):
            plan = st.next_plan()
            assert len(plan.sub_batches) == k_global // new, (seed, w, steps, cut)
            seen += plan.sub_batches
        with pytest.raises(StopIteration):
            st.next_plan()
    assert sorted(seen) == list(range(end)), (seed, w, steps, cut)
