import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.bbs import global_shuffle_plan, natural_steps, shuffle_plan
from hyperrec.bbs.reference import reference_delays, reference_optimal_makespan

costs_st = st.floats(0, 1e4, allow_nan=False, allow_infinity=False)


@settings(deadline=None, max_examples=50)
@given(k=st.integers(1, 8), w=st.integers(1, 16), data=st.data())
def test_plan_is_permutation_with_k_per_step_and_bounded_delay(k, w, data):
    costs = data.draw(st.lists(costs_st, min_size=w * k, max_size=w * k))
    plan = shuffle_plan(costs, sub_batches_per_step=k, window_steps=w)
    assert len(plan) == w
    assert all(len(step) == k for step in plan)
    assert sorted(i for step in plan for i in step) == list(range(w * k))
    assert all(abs(d) <= w - 1 for d in reference_delays(plan, k))
    assert all(isinstance(i, int) for step in plan for i in step)
    # Deterministic.
    assert shuffle_plan(costs, sub_batches_per_step=k, window_steps=w) == plan


def test_window_one_is_arrival_order():
    rng = np.random.default_rng()
    assert shuffle_plan(rng.random(5), sub_batches_per_step=5, window_steps=1) == [[0, 1, 2, 3, 4]]


def test_equal_costs_keep_arrival_order():
    plan = shuffle_plan(np.full(12, 3.0), sub_batches_per_step=3, window_steps=4)
    assert plan == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_plan_never_worse_than_arrival_order():
    rng = np.random.default_rng()
    for _ in range(200):
        costs = rng.integers(0, 5, 12).astype(float)  # many ties
        plan = shuffle_plan(costs, sub_batches_per_step=3, window_steps=4)
        assert max(costs[p].sum() for p in plan) <= costs.reshape(4, 3).sum(axis=1).max()


def test_plan_near_lower_bound_and_far_better_than_arrival_order():
    rng = np.random.default_rng()
    k, w = 8, 8
    to_bound, before, after = [], [], []
    for _ in range(100):
        costs = rng.lognormal(0, 1, w * k)
        plan = shuffle_plan(costs, sub_batches_per_step=k, window_steps=w)
        steps = np.array([costs[p].sum() for p in plan])
        natural = costs.reshape(w, k).sum(axis=1)
        # No plan beats the mean step, nor the largest item with the k-1 lightest.
        s = np.sort(costs)
        bound = max(costs.sum() / w, s[-1] + s[: k - 1].sum())
        to_bound.append(steps.max() / bound)
        before.append(natural.max() / bound - 1)
        after.append(steps.max() / bound - 1)
    assert min(to_bound) >= 1 - 1e-12
    assert np.mean(to_bound) < 1.03
    # The slowest step's excess over what any plan could reach: arrival order keeps it,
    # the plan removes >= 90% of it (measured over 300 seeded repetitions of this test:
    # at most 2.6% left). Excess over the MEAN step is not a stable yardstick: when one
    # item outweighs the mean step, no plan can get close to the mean.
    assert np.mean(after) < 0.1 * np.mean(before)


def test_plan_matches_brute_force_oracle_on_small_windows():
    rng = np.random.default_rng()
    ratios = []
    for _ in range(30):
        costs = rng.pareto(1.5, 8) + 1
        plan = shuffle_plan(costs, sub_batches_per_step=2, window_steps=4)
        got = max(costs[p].sum() for p in plan)
        ratios.append(got / reference_optimal_makespan(list(costs), 4))
    assert np.mean(ratios) <= 1.03 and max(ratios) <= 1.2


def test_steps_ordered_by_mean_arrival():
    rng = np.random.default_rng()
    plan = shuffle_plan(rng.random(64), sub_batches_per_step=8, window_steps=8)
    means = [np.mean(step) for step in plan]
    assert means == sorted(means)


def test_accepts_numpy_and_torch():
    rng = np.random.default_rng()
    c = rng.integers(0, 1000, 24)
    a = shuffle_plan(c, sub_batches_per_step=np.int64(4), window_steps=6)
    b = shuffle_plan(torch.as_tensor(c), sub_batches_per_step=4, window_steps=6)
    assert a == b == shuffle_plan(list(c.astype(float)), sub_batches_per_step=4, window_steps=6)


@pytest.mark.parametrize(
    ("costs", "kwargs", "err", "match"),
    [
        ([1.0, -2.0], {}, ValueError, "costs.*non-negative"),
        ([1.0, float("nan")], {}, ValueError, "costs.*finite"),
        ([1.0, 2.0, 3.0], {}, ValueError, r"costs must have .* = 2 entries, got 3"),
        ([1.0], {}, ValueError, "costs must have"),
        ([[1.0, 2.0]], {}, ValueError, "costs must have 1 dim"),
        ([1.0, 2.0], {"window_steps": 0}, ValueError, "window_steps"),
        ([1.0, 2.0], {"window_steps": -1}, ValueError, "window_steps"),
        ([1.0, 2.0], {"sub_batches_per_step": 0}, ValueError, "sub_batches_per_step"),
        ([1.0, 2.0], {"window_steps": 2.0}, TypeError, "window_steps"),
        ([1.0, 2.0], {"sub_batches_per_step": "1"}, TypeError, "sub_batches_per_step"),
        ([1.0, 2.0], {"window_steps": True}, TypeError, "window_steps"),
        ([1 + 1j, 2.0], {}, TypeError, "costs"),
        (None, {}, TypeError, "costs"),
        ([1.0, 2.0], {"method": "best"}, ValueError, "method"),
    ],
)
def test_bad_input(costs, kwargs, err, match):
    args = {"sub_batches_per_step": 1, "window_steps": 2, **kwargs}
    with pytest.raises(err, match=match):
        shuffle_plan(costs, **args)


@settings(deadline=None, max_examples=25)
@given(r=st.integers(1, 6), k=st.integers(1, 4), w=st.integers(1, 6), data=st.data())
def test_global_plan_partition_and_delay(r, k, w, data):
    n = w * r * k
    costs = data.draw(st.lists(costs_st, min_size=n, max_size=n))
    plan = global_shuffle_plan(costs, world_size=r, sub_batches_per_step=k, window_steps=w)
    assert len(plan) == w and all(len(step) == r for step in plan)
    assert all(len(part) == k for step in plan for part in step)
    flat = [i for step in plan for part in step for i in part]
    assert sorted(flat) == list(range(n))
    nat = natural_steps(n, r * k)
    assert all(abs(s - nat[i]) <= w - 1 for s, step in enumerate(plan) for p in step for i in p)
    assert plan == global_shuffle_plan(
        list(costs), world_size=r, sub_batches_per_step=k, window_steps=w
    )


def test_global_plan_beats_local_plans():
    rng = np.random.default_rng()
    r, k, w = 16, 4, 4
    glob, loc = [], []
    for _ in range(20):
        costs = rng.lognormal(0, 1, (w, r, k))  # natural (step, rank, sub-batch)
        plan = global_shuffle_plan(
            costs.ravel(), world_size=r, sub_batches_per_step=k, window_steps=w
        )
        flat = costs.ravel()
        g = np.array([[flat[p].sum() for p in step] for step in plan])  # (w, r)
        glob.append(g.max(axis=1).sum() / g.mean(axis=1).sum() - 1)
        per_rank = costs.transpose(1, 0, 2).reshape(r, w * k)
        lp = [shuffle_plan(c, sub_batches_per_step=k, window_steps=w) for c in per_rank]
        loc_steps = np.array([[c[p].sum() for p in plan_r] for c, plan_r in zip(per_rank, lp)])
        loc.append(loc_steps.max(axis=0).sum() / loc_steps.mean(axis=0).sum() - 1)
    assert np.mean(glob) < 0.5 * np.mean(loc)


def test_global_plan_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        global_shuffle_plan([1.0], world_size=0, sub_batches_per_step=1, window_steps=1)
    with pytest.raises(ValueError, match=r"world_size \* sub_batches_per_step"):
        global_shuffle_plan([1.0] * 5, world_size=2, sub_batches_per_step=1, window_steps=2)
    with pytest.raises(ValueError, match="per_step"):
        natural_steps(3, 0)
