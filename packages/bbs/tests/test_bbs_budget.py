import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.bbs import BudgetConfig, CostBudgetBatcher, ImbalanceStats, budget_from_costs
from hyperrec.bbs.budget import budget_select
from hyperrec.bbs.reference import reference_budget_select
from hyperrec.bbs.simulate import _budget_run


class Recorder:
    """A source that records, for every item, how many steps were yielded before it was read."""

    def __init__(self, n, steps):
        self.n, self.steps, self.read_at = n, steps, {}

    def __iter__(self):
        for i in range(self.n):
            self.read_at[i] = len(self.steps)
            yield i


@settings(deadline=None, max_examples=60)
@given(data=st.data(), cap=st.integers(1, 40), rows=st.integers(1, 4))
def test_vectorised_select_matches_reference(data, cap, rows):
    costs = np.array(
        data.draw(st.lists(st.integers(0, 60), min_size=rows * cap, max_size=rows * cap)), float
    ).reshape(rows, cap)
    live = np.array(data.draw(st.lists(st.booleans(), min_size=rows * cap, max_size=rows * cap)))
    live = live.reshape(rows, cap)
    forced = np.array(
        data.draw(st.lists(st.booleans(), min_size=rows * cap, max_size=rows * cap))
    ).reshape(rows, cap)
    seq = np.stack([np.random.default_rng(r).permutation(cap) for r in range(rows)])
    budget = float(data.draw(st.integers(1, 200)))
    rounds = data.draw(st.integers(0, 3))
    got = budget_select(costs, live, seq, forced & live, budget, swap_rounds=rounds)
    assert not (got & ~live).any()
    for r in range(rows):
        pos = np.flatnonzero(live[r])
        want = reference_budget_select(
            costs[r, pos].tolist(),
            seq[r, pos].tolist(),
            (forced[r, pos]).tolist(),
            budget,
            swap_rounds=rounds,
        )
        assert set(pos[sorted(want)].tolist()) == set(np.flatnonzero(got[r]).tolist())


@settings(deadline=None, max_examples=30)
@given(
    n=st.integers(0, 120),
    wait=st.integers(1, 5),
    budget=st.integers(5, 200),
    seed=st.integers(0, 2**16),
)
def test_every_item_once_budget_respected_wait_bounded(n, wait, budget, seed):
    table = np.random.default_rng(seed).integers(0, 60, max(n, 1)).astype(float)
    steps = []
    src = Recorder(n, steps)
    batcher = CostBudgetBatcher(
        src, budget=float(budget), max_wait_steps=wait, cost=lambda i: table[i]
    )
    for step in batcher:
        steps.append(step)
    assert sorted(i for s in steps for i in s) == list(range(n))
    for t, step in enumerate(steps):
        assert step and step == sorted(step)
        assert all(t - src.read_at[i] <= wait for i in step)  # the hard delay bound
        cost = table[step].sum()
        forced = [i for i in step if t - src.read_at[i] >= wait]
        oversized = len(step) == 1 and table[step[0]] > budget
        if not forced and not oversized:
            assert cost <= budget


@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 80), wait=st.integers(1, 4), seed=st.integers(0, 999), data=st.data())
def test_resume_neither_skips_nor_repeats(n, wait, seed, data):
    table = np.random.default_rng(seed).integers(1, 40, n).astype(float)

    def make():
        return CostBudgetBatcher(
            list(range(n)), budget=60.0, max_wait_steps=wait, cost=lambda i: table[i]
        )

    full = list(make())
    stop = data.draw(st.integers(0, len(full)))
    first = make()
    head = list(itertools.islice(iter(first), stop))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + list(resumed) == full


class IndexOnly:
    """``__getitem__`` only, ``IndexError`` at ``n``; logs every index read."""

    def __init__(self, n):
        self.n, self.reads = n, []

    def __getitem__(self, i):
        self.reads.append(i)
        if i >= self.n:
            raise IndexError(i)
        return i


def test_resume_from_an_index_only_source_starts_at_the_oldest_buffered_item():
    n, wait = 60, 3
    table = np.random.default_rng(7).integers(1, 40, n).astype(float)

    def make(src):
        return CostBudgetBatcher(src, budget=60.0, max_wait_steps=wait, cost=lambda i: table[i])

    full = list(make(list(range(n))))
    first = make(IndexOnly(n))
    head = list(itertools.islice(iter(first), 4))
    state = first.state_dict()
    oldest = min(s for s, _ in state["pending"])
    assert oldest > 0  # the resume has a past to leave unread
    src = IndexOnly(n)
    resumed = make(src)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    assert src.reads == list(range(oldest, n + 1))


def test_simulator_runs_the_same_algorithm_as_the_batcher():
    rng = np.random.default_rng()
    ranks, n, k = 3, 200, 4
    costs = rng.integers(1, 1000, (ranks, n)).astype(float)  # integers: exact sums
    budget = float(costs.mean() * k)
    sim, counts = _budget_run(costs, budget, 2, k)
    cap = int(np.ceil(BudgetConfig(budget=budget, max_wait_steps=2).lookahead * k * 4))
    for r in range(ranks):
        b = CostBudgetBatcher(list(costs[r]), budget=budget, max_wait_steps=2, max_buffer_items=cap)
        steps = list(b)
        got = [sum(s) for s in steps[: sim.shape[0]]]
        np.testing.assert_array_equal(got, sim[:, r])
        np.testing.assert_array_equal([len(s) for s in steps[: sim.shape[0]]], counts[:, r])


def test_budget_mode_removes_most_imbalance():
    rng = np.random.default_rng()
    ranks, k, steps = 32, 8, 60
    costs = rng.lognormal(0, 0.6, (ranks, steps * k))
    none = ImbalanceStats.from_step_costs(costs.reshape(ranks, steps, k).sum(axis=2).T)
    out, counts = _budget_run(costs, budget_from_costs(costs.ravel(), k), 2, k)
    got = ImbalanceStats.from_step_costs(out)
    assert got.excess < 0.1 * none.excess
    assert counts.std() > 0  # sample counts do vary


def test_oversized_item_goes_alone_and_zero_cost_items_are_fine():
    steps = list(CostBudgetBatcher([1, 50, 2, 0, 0, 3], budget=10, max_wait_steps=1))
    assert sorted(i for s in steps for i in s) == [0, 0, 1, 2, 3, 50]
    assert [50] in steps


def test_budget_from_costs_and_config_validation():
    assert budget_from_costs([1, 2, 3], 4) == pytest.approx(8.0)
    assert BudgetConfig(budget=1.0, max_wait_steps=1).lookahead == 1.5
    assert BudgetConfig(budget=1.0, max_wait_steps=8).lookahead == 3.0
    with pytest.raises(ValueError, match="budget"):
        BudgetConfig(budget=0.0)
    with pytest.raises(ValueError, match="budget"):
        BudgetConfig(budget=float("nan"))
    with pytest.raises(ValueError, match="max_wait_steps"):
        BudgetConfig(budget=1.0, max_wait_steps=0)
    with pytest.raises(TypeError, match="max_wait_steps"):
        BudgetConfig(budget=1.0, max_wait_steps=1.0)
    with pytest.raises(ValueError, match="lookahead_steps"):
        BudgetConfig(budget=1.0, lookahead_steps=0.5)
    with pytest.raises(ValueError, match="costs must not be empty"):
        budget_from_costs([], 4)
    with pytest.raises(ValueError, match="items_per_step"):
        budget_from_costs([1.0], 0)
    with pytest.raises(ValueError, match="zero mean"):
        budget_from_costs([0.0, 0.0], 4)
    with pytest.raises(TypeError, match="source"):
        CostBudgetBatcher(5, budget=1.0)


def test_state_validation():
    b = CostBudgetBatcher(list(range(10)), budget=5.0)
    it = iter(b)
    next(it)
    state = b.state_dict()
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**state, "version": 0})
    with pytest.raises(ValueError, match="pending"):
        b.load_state_dict({**state, "pending": [[10**6, 0]]})
    with pytest.raises(TypeError, match="state"):
        b.load_state_dict([1, 2])
