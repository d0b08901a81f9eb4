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


@settings(deadline=None, max_examples=30)
@given(
    n=st.integers(1, 60),
    k=st.integers(1, 4),
    w=st.integers(1, 5),
    indexable=st.booleans(),
    data=st.data(),
)
def test_resume_neither_skips_nor_repeats(n, k, w, indexable, data):
    table = _table(n, seed=n)
    make_src = (lambda: list(range(n))) if indexable else (lambda: Replayable(n))
    full = list(_shuffler(n, k, w, source=make_src(), table=table))
    stop = data.draw(st.integers(0, len(full)))
    first = _shuffler(n, k, w, source=make_src(), table=table)
    head = list(itertools.islice(iter(first), stop))  # interrupt anywhere, mid-window too
    state = first.state_dict()
    resumed = _shuffler(n, k, w, source=make_src(), table=table)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert head + tail == full


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
    for step in s:
        assert s.last_step_cost == pytest.approx(sum(model(x) for x in step))


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
