import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.bbs import BalancedShuffler, BBSConfig, CostModel, shuffle_plan


class Replayable:
    """A non-indexable source (like an IterableDataset) that replays on re-iteration."""

    def __init__(self, n):
        self.n = n
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        return iter(range(self.n))


class IndexOnly:
    """An index-only source (``__getitem__`` only, like an endless reader); logs every index read.

    ``n=None`` is endless; otherwise ``source[n]`` raises ``end`` (IndexError or
    StopIteration, the two ends of Python's sequence protocol). Reading below ``low``
    fails the test at once (instead of re-reading an endless past for ever).
    """

    def __init__(self, n=None, *, end=IndexError, low=0):
        self.n, self.end, self.low, self.reads = n, end, low, []

    def __getitem__(self, i):
        assert i >= self.low, f"index {i} read again (resumed at {self.low})"
        self.reads.append(i)
        if self.n is not None and i >= self.n:
            raise self.end(i)
        return i


def _source(kind, n):
    return {"sized": list(range(n)), "index_only": IndexOnly(n), "iterable": Replayable(n)}[kind]


def _table(n, seed=None):
    return np.random.default_rng(seed).lognormal(0, 1, n).round(3)


def _shuffler(n, k, w, *, source=None, drop_last=False, table=None):
    table = _table(n) if table is None else table
    src = list(range(n)) if source is None else source
    return BalancedShuffler(
        src,
        sub_batches_per_step=k,
        window_steps=w,
        cost=lambda i: table[i],
        drop_last=drop_last,
    )


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(0, 70),
    k=st.integers(1, 5),
    w=st.integers(1, 6),
    drop_last=st.booleans(),
)
def test_every_item_once_and_delay_bound(n, k, w, drop_last):
    steps = list(_shuffler(n, k, w, drop_last=drop_last))
    flat = [i for s in steps for i in s]
    kept = n - n % k if drop_last else n
    assert sorted(flat) == list(range(kept))
    for s, step in enumerate(steps):
        assert step == sorted(step)
        assert 1 <= len(step) <= k
        for i in step:
            assert abs(s - i // k) <= w - 1, (s, i, k, w)
    full = kept // (w * k) * w  # steps of complete windows have exactly k
    assert all(len(step) == k for step in steps[:full])
    if drop_last:
        assert all(len(step) == k for step in steps)


def test_matches_shuffle_plan_window_by_window():
    k, w, n = 4, 5, 60
    table = _table(n)
    steps = list(_shuffler(n, k, w, table=table))
    for win in range(n // (w * k)):
        lo = win * w * k
        plan = shuffle_plan(table[lo : lo + w * k], sub_batches_per_step=k, window_steps=w)
        assert steps[win * w : (win + 1) * w] == [[lo + i for i in p] for p in plan]


def _steps_and_costs(shuffler, stop=None):
    """(step, last_step_cost, last_step_arrival_cost) for each step yielded."""
    return [
        (step, shuffler.last_step_cost, shuffler.last_step_arrival_cost)
        for step in itertools.islice(iter(shuffler), stop)
    ]


@settings(deadline=None, max_examples=30)
@given(
    n=st.integers(1, 60),
    k=st.integers(1, 4),
    w=st.integers(1, 5),
    kind=st.sampled_from(["sized", "index_only", "iterable"]),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_resume_neither_skips_nor_repeats(n, k, w, kind, drop_last, data):
    table = _table(n, seed=n)

    def make(src):
        return _shuffler(n, k, w, source=src, table=table, drop_last=drop_last)

    full = _steps_and_costs(make(_source(kind, n)))
    stop = data.draw(st.integers(0, len(full)))
    first = make(_source(kind, n))
    head = _steps_and_costs(first, stop)  # interrupt anywhere, mid-window too
    state = first.state_dict()
    src = _source(kind, n)
    resumed = make(src)
    resumed.load_state_dict(state)
    assert resumed.source_kind == kind
    tail = _steps_and_costs(resumed)
    assert head + tail == full  # the same steps, with the same costs
    if kind == "index_only":
        # Nothing before the interrupted window is read again; each index once, and one
        # probe past the end.
        assert src.reads == list(range(state["window_start"], n + 1))


def test_index_only_resume_mid_window_and_short_last_window():
    n, k, w = 50, 3, 4  # windows of 12: four full ones, then 2 items (one short step)
    table = _table(n)
    full = list(_shuffler(n, k, w, source=IndexOnly(n), table=table))
    assert len(full) == 4 * w + 1 and sorted(full[-1]) == [48, 49]
    first = _shuffler(n, k, w, source=IndexOnly(n), table=table)
    head = list(itertools.islice(iter(first), 6))  # 2 steps into the second window
    state = first.state_dict()
    assert (state["window_start"], state["steps_done_in_window"]) == (12, 2)
    src = IndexOnly(n)
    resumed = _shuffler(n, k, w, source=src, table=table)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    assert src.reads == list(range(12, n + 1))
    # The pass ended at the short window: the next one starts again at index 0.
    assert resumed.state_dict()["window_start"] == 0
    assert resumed.state_dict()["epoch"] == 1


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(0, 70),
    k=st.integers(1, 5),
    w=st.integers(1, 6),
    drop_last=st.booleans(),
    end=st.sampled_from([IndexError, StopIteration]),
)
def test_index_only_source_ends_like_a_sized_one(n, k, w, drop_last, end):
    table = _table(n)
    src = IndexOnly(n, end=end)
    got = list(_shuffler(n, k, w, source=src, table=table, drop_last=drop_last))
    assert got == list(_shuffler(n, k, w, table=table, drop_last=drop_last))
    assert src.reads == list(range(n + 1))  # never indexed past the first end signal


def test_resume_deep_into_an_endless_source_reads_one_window():
    k, w = 4, 3
    cost = lambda i: float(i * 2654435761 % 1009)  # noqa: E731 - any deterministic cost
    start = 10**15 * w * k  # as saved after 10^15 windows: re-reading would never finish
    src = IndexOnly(low=start)
    s = BalancedShuffler(src, sub_batches_per_step=k, window_steps=w, cost=cost)
    state = {**s.state_dict(), "window_start": start, "steps_done_in_window": 1}
    s.load_state_dict(state)
    window = [start + i for i in range(w * k)]
    costs = [cost(i) for i in window]
    plan = shuffle_plan(costs, sub_batches_per_step=k, window_steps=w)
    got = list(itertools.islice(iter(s), w - 1))
    assert got == [[window[i] for i in p] for p in plan[1:]]
    assert src.reads == window
    assert s.last_step_arrival_cost == sum(costs[(w - 1) * k :])


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ([1, 2], "sized"),
        (np.arange(3), "sized"),
        (IndexOnly(), "index_only"),
        (Replayable(3), "iterable"),
        (iter([1, 2]), "iterable"),
        ((i for i in range(2)), "iterable"),
    ],
)
def test_source_kind(source, kind):
    s = BalancedShuffler(source, sub_batches_per_step=1, window_steps=1)
    assert s.source_kind == kind


def test_source_kind_of_torch_datasets_and_ambiguous_classes():
    from torch.utils.data import Dataset, IterableDataset

    class MapNoLen(Dataset):
        def __getitem__(self, i):
            return i

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    class IterAndGetitem:
        # Its __iter__ defines the order; __getitem__ may mean something else.
        def __iter__(self):
            return iter(range(3))

        def __getitem__(self, i):
            return -i

    def kind(src):
        return BalancedShuffler(src, sub_batches_per_step=1, window_steps=1).source_kind

    assert kind(MapNoLen()) == "index_only"
    assert kind(Stream()) == "iterable"
    assert kind(IterAndGetitem()) == "iterable"
    assert list(BalancedShuffler(IterAndGetitem(), sub_batches_per_step=1, window_steps=1)) == [
        [0],
        [1],
        [2],
    ]


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(0, 70),
    k=st.integers(1, 5),
    w=st.integers(1, 6),
    drop_last=st.booleans(),
)
def test_arrival_cost_is_the_natural_steps_cost(n, k, w, drop_last):
    table = _table(n)
    steps = _steps_and_costs(
        _shuffler(n, k, w, source=IndexOnly(n), table=table, drop_last=drop_last)
    )
    kept = n - n % k if drop_last else n
    for s, (step, cost, arrival) in enumerate(steps):
        assert cost == pytest.approx(table[step].sum())
        natural = range(s * k, min((s + 1) * k, kept))  # the step arrival order would build
        assert arrival == pytest.approx(table[list(natural)].sum())
        if w == 1:  # no shuffling: both are the same sum of the same numbers
            assert cost == arrival
    # BBS only moves cost between the steps of a window.
    for lo in range(0, len(steps), w):
        window = steps[lo : lo + w]
        assert sum(c for _, c, _ in window) == pytest.approx(sum(a for _, _, a in window))


def test_new_pass_after_exhaustion_replays_same_steps():
    table = _table(30)
    s = _shuffler(30, 3, 4, table=table)
    first, second = list(s), list(s)
    assert first == second
    assert s.state_dict()["epoch"] == 2
    # A state saved after a finished pass resumes at the start of the next one.
    resumed = _shuffler(30, 3, 4, table=table)
    resumed.load_state_dict(s.state_dict())
    assert list(resumed) == first


def test_cost_model_and_last_step_cost():
    rng = np.random.default_rng()
    items = [rng.integers(1, 500, 16) for _ in range(24)]  # each item: 16 lengths
    model = CostModel(linear=1.0, quadratic=1 / 512)
    s = BalancedShuffler(items, sub_batches_per_step=3, window_steps=4, cost=model)
    assert s.last_step_cost is None and s.last_step_arrival_cost is None
    for t, step in enumerate(s):
        assert s.last_step_cost == pytest.approx(sum(model(x) for x in step))
        natural = items[3 * t : 3 * t + 3]
        assert s.last_step_arrival_cost == pytest.approx(sum(model(x) for x in natural))


def test_numbers_are_their_own_cost():
    steps = list(BalancedShuffler([9, 1, 1, 9], sub_batches_per_step=2, window_steps=2))
    assert sorted(map(sum, steps)) == [10, 10]


@pytest.mark.parametrize(
    ("bad", "err"), [(-1.0, ValueError), (float("nan"), ValueError), ("x", TypeError)]
)
def test_bad_cost_values_raise_when_read(bad, err):
    s = BalancedShuffler([1, 2], sub_batches_per_step=1, window_steps=2, cost=lambda i: bad)
    with pytest.raises(err, match="cost"):
        list(s)


def test_bad_arguments():
    with pytest.raises(ValueError, match="window_steps"):
        BalancedShuffler([1], sub_batches_per_step=1, window_steps=0)
    with pytest.raises(TypeError, match="sub_batches_per_step"):
        BalancedShuffler([1], sub_batches_per_step=1.5, window_steps=1)
    with pytest.raises(TypeError, match="source"):
        BalancedShuffler(3, sub_batches_per_step=1, window_steps=1)
    with pytest.raises(TypeError, match="cost"):
        BalancedShuffler([1], sub_batches_per_step=1, window_steps=1, cost=3)
    with pytest.raises(TypeError, match="drop_last"):
        BalancedShuffler([1], sub_batches_per_step=1, window_steps=1, drop_last=1)
    with pytest.raises(ValueError, match="method"):
        BBSConfig(sub_batches_per_step=1, window_steps=1, method="x")


def test_state_from_other_shape_is_rejected():
    a = _shuffler(20, 2, 3)
    state = a.state_dict()
    with pytest.raises(ValueError, match="window_steps"):
        _shuffler(20, 2, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        a.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="window_start"):
        a.load_state_dict({**state, "window_start": -1})
