"""Adversarial checks of hyperrec.bbs's documented guarantees.

Independent recomputations (brute force, float64 / exact-fraction sums, replays) on
inputs the other test files do not use: sizes 0 and 1, world sizes that do not divide
the data, equal / zero / huge / skewed costs, integer and non-contiguous inputs, and
resumes at every step. Several tests are regressions of bugs fixed in 0.1.4 (named in
their docstrings).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hyperrec.bbs import (
    BalancedBatchSampler,
    BalancedShuffler,
    CostBudgetBatcher,
    CostModel,
    ImbalanceStats,
    balance,
    budget_from_costs,
    global_shuffle_plan,
    per_step_ratios,
    shuffle_plan,
)

_FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _step_sums(costs, plan):
    return [math.fsum(float(costs[i]) for i in step) for step in plan]


def _check_window_plan(costs, plan, k, w):
    """Every documented property of one ``shuffle_plan`` window, recomputed."""
    assert len(plan) == w
    assert all(len(step) == k and step == sorted(step) for step in plan)
    assert sorted(i for step in plan for i in step) == list(range(w * k))
    for s, step in enumerate(plan):
        assert all(abs(s - i // k) <= w - 1 for i in step)
    natural = [list(range(s * k, (s + 1) * k)) for s in range(w)]
    planned, arrival = max(_step_sums(costs, plan)), max(_step_sums(costs, natural))
    # Never worse than arrival order, and arrival order itself where it is as balanced.
    assert planned <= arrival * (1 + 1e-12)
    if planned >= arrival:
        assert plan == natural


# ------------------------------------------------------------------ plans: exhaustive


@pytest.mark.parametrize(("k", "w"), [(1, 2), (1, 3), (2, 2), (1, 4), (2, 3), (3, 2)])
def test_plan_properties_on_every_small_integer_window(k, w):
    """Every cost vector over {0, 1, 3} (zero costs, ties, skew): plan invariants."""
    for costs in itertools.product((0, 1, 3), repeat=w * k):
        plan = shuffle_plan(list(costs), sub_batches_per_step=k, window_steps=w)
        _check_window_plan(costs, plan, k, w)


@pytest.mark.parametrize("value", [0.0, 1.0, 1e-300, 1e300, 7])
@pytest.mark.parametrize(("k", "w"), [(1, 1), (1, 5), (3, 4), (8, 8)])
def test_equal_or_zero_costs_keep_arrival_order(value, k, w):
    plan = shuffle_plan([value] * (k * w), sub_batches_per_step=k, window_steps=w)
    assert plan == [list(range(s * k, (s + 1) * k)) for s in range(w)]
    gplan = global_shuffle_plan(
        [value] * (2 * k * w), world_size=2, sub_batches_per_step=k, window_steps=w
    )
    assert sorted(i for step in gplan for rank in step for i in rank) == list(range(2 * k * w))


@_FAST
@given(
    k=st.integers(1, 4),
    w=st.integers(1, 5),
    data=st.data(),
)
def test_plan_is_the_same_for_every_input_type(k, w, data):
    """Lists, float32/int64/uint16 numpy, strided views, torch tensors: one plan."""
    ints = data.draw(st.lists(st.integers(0, 1000), min_size=k * w, max_size=k * w))
    ref = shuffle_plan([float(c) for c in ints], sub_batches_per_step=k, window_steps=w)
    base = np.array(ints)
    strided = np.repeat(base, 2).astype(np.float64)[::2]
    assert strided.size < 2 or not strided.flags["C_CONTIGUOUS"]
    variants = [
        ints,
        base.astype(np.int64),
        base.astype(np.uint16),
        base.astype(np.float32),
        strided,
        torch.tensor(ints),
        torch.tensor(ints, dtype=torch.float64).repeat_interleave(2)[::2],
        torch.tensor(ints, dtype=torch.float32, requires_grad=True),
    ]
    for v in variants:
        assert shuffle_plan(v, sub_batches_per_step=k, window_steps=w) == ref


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
@pytest.mark.parametrize(
    "wrap",
    [
        list,
        lambda c: np.array(c, dtype=np.float32),
        lambda c: torch.tensor(c, dtype=torch.float16),
        lambda c: np.array(c)[::-1],
    ],
)
def test_non_finite_or_negative_costs_raise_naming_the_argument(bad, wrap):
    costs = wrap([1.0, 2.0, bad, 4.0])
    with pytest.raises(ValueError, match="costs"):
        shuffle_plan(costs, sub_batches_per_step=2, window_steps=2)
    with pytest.raises(ValueError, match="costs"):
        global_shuffle_plan(costs, world_size=2, sub_batches_per_step=1, window_steps=2)
    with pytest.raises(ValueError, match="costs"):
        balance(costs, 2)
    with pytest.raises(ValueError, match="sample_costs"):
        BalancedBatchSampler(costs, samples_per_sub_batch=1, sub_batches_per_step=1, window_steps=1)
    with pytest.raises(ValueError, match="step_costs"):
        per_step_ratios(costs)


def test_balance_with_zero_items_and_one_part():
    assert balance(np.zeros(0), 3).shape == (3, 0)
    assert balance(np.zeros((0, 6)), 3).shape == (0, 3, 2)
    assert balance([5.0], 1).tolist() == [[0]]
    assert balance([3, 1, 2], 1).tolist() == [[0, 1, 2]]


# -------------------------------------------------------------- plans: huge costs


@_FAST
@given(
    k=st.integers(2, 4),
    w=st.integers(2, 5),
    data=st.data(),
)
def test_plans_do_not_change_when_costs_are_scaled_to_near_float_max(k, w, data):
    """Regression (0.1.4): costs near 1e308 are finite and valid, but their step sums
    overflowed to inf; every step then looked equally loaded and balancing silently
    stopped (e.g. [1.5e308, 1.5e308, 1e308, 1e308] stayed in arrival order, one step
    at 3e308 and one at 2e308). A power-of-two scale must not change any plan."""
    costs = np.array(
        data.draw(st.lists(st.floats(0.25, 1.0), min_size=w * k, max_size=w * k)), np.float64
    )  # from 0.25: scaled by 2**1023, a sum of a few of them overflows
    huge = costs * 2.0**1023  # every entry still finite
    assert np.isfinite(huge).all()
    kw = dict(sub_batches_per_step=k, window_steps=w)
    assert shuffle_plan(huge, **kw) == shuffle_plan(costs, **kw)
    assert balance(huge, w).tolist() == balance(costs, w).tolist()
    g = dict(world_size=2, sub_batches_per_step=k, window_steps=w)
    both = np.concatenate([costs, costs[::-1]])
    assert global_shuffle_plan(both * 2.0**1023, **g) == global_shuffle_plan(both, **g)


def test_huge_costs_are_still_balanced():
    costs = [1.5e308, 1.5e308, 1e308, 1e308]
    plan = shuffle_plan(costs, sub_batches_per_step=2, window_steps=2)
    assert plan == [[0, 2], [1, 3]]  # 2.5e308 (in exact arithmetic) on each step
    # 1e300 and 1: the 1e300s must land on different steps.
    plan = shuffle_plan([1e300, 1e300, 1.0, 1.0], sub_batches_per_step=2, window_steps=2)
    assert [sorted(s) for s in plan] == [[0, 2], [1, 3]]


# ------------------------------------------------------------------- partial windows


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 40),
    k=st.integers(1, 5),
    w=st.integers(1, 5),
    seed=st.integers(0, 10**6),
    kind=st.sampled_from(["sized", "index_only"]),
)
@example(n=21, k=5, w=5, seed=143, kind="sized")  # several short steps: 5, 5, 4, 4, 3
def test_short_steps_of_a_partial_window_come_last(n, k, w, seed, kind):
    """Regression (0.1.4): the placeholders padding a short last window could land in
    any step, so a middle step was short (costs [100, 1, 1, 1, 1], k=2, W=4 gave steps
    of 2, 1, 2 items), while the docs promise ``ceil(n / k)`` steps, the last ones
    possibly short (here: never increasing)."""
    costs = np.random.default_rng(seed).lognormal(0, 2, n).tolist()

    class IndexOnly:
        def __getitem__(self, i):
            return costs[i]

    src = costs if kind == "sized" else IndexOnly()
    steps = list(BalancedShuffler(src, sub_batches_per_step=k, window_steps=w))
    full_windows = n // (w * k)
    tail = steps[full_windows * w :]
    rest = n - full_windows * w * k
    assert len(tail) == -(-rest // k)
    sizes = [len(s) for s in tail]
    assert sizes == sorted(sizes, reverse=True)  # full steps first
    assert all(1 <= size <= k for size in sizes)
    assert sum(sizes) == rest
    assert all(len(s) == k for s in steps[: full_windows * w])
    assert sorted(x for s in steps for x in s) == sorted(costs)


def test_short_middle_step_example():
    steps = list(BalancedShuffler([100, 1, 1, 1, 1], sub_batches_per_step=2, window_steps=4))
    assert [len(s) for s in steps] == [2, 2, 1]


# ---------------------------------------------------------------- streaming resume


@_FAST
@given(
    n=st.integers(0, 30),
    k=st.integers(1, 3),
    w=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_shuffler_resume_at_every_step_replays_the_same_stream(n, k, w, drop_last, seed):
    """Float costs with ties and zeros; the state goes through a plain-int copy (as a
    checkpoint would) and is loaded into a fresh shuffler at every step."""
    rng = np.random.default_rng(seed)
    costs = (rng.integers(0, 3, n) * rng.random(n)).tolist()
    kw = dict(sub_batches_per_step=k, window_steps=w, drop_last=drop_last)
    ref = BalancedShuffler(costs, **kw)
    full = [(s, ref.last_step_cost) for s in ref]
    for s, step_cost in full:  # last_step_cost recomputed in float64
        assert step_cost == pytest.approx(math.fsum(s), rel=1e-12, abs=1e-300)
    for cut in range(len(full) + 1):
        first = BalancedShuffler(costs, **kw)
        head = [(s, first.last_step_cost) for s in itertools.islice(iter(first), cut)]
        state = {key: int(v) for key, v in first.state_dict().items()}
        second = BalancedShuffler(list(costs), **kw)
        second.load_state_dict(state)
        assert head + [(s, second.last_step_cost) for s in second] == full


# Non-integer costs whose float sums depend on the order they are added in; resumed at
# the given step, each of these read other items than the uninterrupted run (0.1.3).
_BUDGET_CASES = [
    (
        [0.7, 0.2, 0.6, 0.7, 0.7, 0.7, 0.1, 0.6, 0.6, 0.4, 0.7, 0.4, 0.2, 0.2, 0.2, 0.2],
        1.0,
        2,
        2,
    ),
    (
        [0.6, 0.1, 0.1, 0.4, 0.3, 0.7, 0.1, 0.6, 0.3, 0.6, 0.4, 0.4, 0.2, 0.4, 0.1, 0.7]
        + [0.3, 0.6, 0.2, 0.6, 0.1, 0.7, 0.7, 0.6, 0.2, 0.6, 0.4, 0.6, 0.2, 0.4, 0.6, 0.1],
        1.0,
        2,
        9,
    ),
]


def _budget_resumed(costs, budget, wait, cut, **kw):
    first = CostBudgetBatcher(costs, budget=budget, max_wait_steps=wait, **kw)
    it = iter(first)
    head = [next(it) for _ in range(cut)]
    second = CostBudgetBatcher(costs, budget=budget, max_wait_steps=wait, **kw)
    second.load_state_dict(first.state_dict())
    return head + list(second)


@pytest.mark.parametrize(("costs", "budget", "wait", "cut"), _BUDGET_CASES)
def test_budget_resume_is_exact_with_decimal_costs(costs, budget, wait, cut):
    """Regression (0.1.4): the buffered cost that decides how far to read ahead was a
    slot-order float sum; a resumed batcher holds its items in other slots, the sum
    differed in the last bit and the resumed run read other items."""
    full = list(CostBudgetBatcher(costs, budget=budget, max_wait_steps=wait))
    assert _budget_resumed(costs, budget, wait, cut) == full


@_FAST
@given(
    costs=st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 1.3]), max_size=30),
    budget=st.sampled_from([0.3, 0.9, 1.0, 1.7]),
    wait=st.integers(1, 3),
    data=st.data(),
)
def test_budget_resume_at_any_step_is_exact(costs, budget, wait, data):
    full = list(CostBudgetBatcher(costs, budget=budget, max_wait_steps=wait))
    cut = data.draw(st.integers(0, len(full)))
    assert _budget_resumed(costs, budget, wait, cut) == full
    # Every item exactly once (costs are items: compare as a multiset of positions).
    assert sorted(x for s in full for x in s) == sorted(costs)


def test_budget_batcher_zero_and_huge_costs():
    zeros = list(CostBudgetBatcher([0.0] * 10, budget=1.0, max_wait_steps=1))
    assert [x for s in zeros for x in s] == [0.0] * 10
    huge = [1e300, 1.0, 1e300, 2.0]
    steps = list(CostBudgetBatcher(huge, budget=1.5e300, max_wait_steps=1))
    assert sorted(x for s in steps for x in s) == sorted(huge)
    assert all(s.count(1e300) <= 1 for s in steps)  # two never share a 1.5e300 budget


# --------------------------------------------------------------- sampler resume


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 90),
    old=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),
    s=st.integers(1, 3),
    mode=st.sampled_from(["local", "global"]),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_sampler_resume_on_any_shape_trains_everything_once(n, old, new, s, mode, shuffle, data):
    """Shapes that do not divide ``n``; after the resume every sample is trained at
    most once and fewer than one new step's worth is left untrained."""
    costs = np.random.default_rng(n).integers(0, 4, n)  # int costs with zeros and ties

    def ranks(world, k, w):
        return [
            BalancedBatchSampler(
                costs,
                samples_per_sub_batch=s,
                sub_batches_per_step=k,
                window_steps=w,
                mode=mode,
                rank=r,
                world_size=world,
                shuffle=shuffle,
                seed=3,
            )
            for r in range(world)
        ]

    try:
        before, after = ranks(*old), ranks(*new)
    except ValueError:  # fewer samples than one step of that shape
        return
    cut = data.draw(st.integers(0, len(before[0])))
    trained = []
    for smp in before:
        trained += [i for b in itertools.islice(iter(smp), cut) for i in b]
    state = before[0].state_dict()
    for smp in after:
        smp.load_state_dict(dict(state))
    assert len({len(smp) for smp in after}) == 1  # every rank agrees on the epoch's length
    for smp in after:
        trained += [i for b in smp for i in b]
    counts = np.bincount(trained, minlength=n)
    assert counts.max(initial=0) <= 1
    per_new_step = new[0] * new[1] * s
    assert (counts == 0).sum() < per_new_step


@pytest.mark.parametrize(("key", "value"), [("shuffle", False), ("method", "snake")])
def test_sampler_state_of_another_shuffle_or_method_is_rejected(key, value):
    """Regression (0.1.4): states did not record ``shuffle`` or ``method``; resumed
    under another value the sampler silently continued another order/plan."""
    kw = dict(samples_per_sub_batch=1, sub_batches_per_step=2, window_steps=2, rank=0)
    saver = BalancedBatchSampler(np.arange(16.0), **kw, world_size=1)
    it = iter(saver)
    next(it)
    state = saver.state_dict()
    other = BalancedBatchSampler(np.arange(16.0), **kw, world_size=1, **{key: value})
    with pytest.raises(ValueError, match=key):
        other.load_state_dict(state)
    # A state saved before the key existed still loads.
    legacy = {k: v for k, v in state.items() if k not in ("shuffle", "method")}
    same = BalancedBatchSampler(np.arange(16.0), **kw, world_size=1)
    same.load_state_dict(legacy)
    assert list(same) == list(it)


# ---------------------------------------------------------------- metrics / costs


def _exact_excess(c):
    rows = [[Fraction(x) for x in row] for row in c]
    top = sum(max(row) for row in rows)
    mean = sum(sum(row) / len(row) for row in rows)
    return float(top / mean - 1) if mean else 0.0


@pytest.mark.parametrize(
    "c",
    [
        [[1e308, 1e308, 1e308]],
        [[1e308, 0.0, 1e308], [0.0, 0.0, 0.0], [1e308, 1e308, 1e308]],
        [[1.7e308, 1.6e308], [1e-300, 3e-300]],
        [[5e-324, 0.0], [1e-320, 1e-320]],
        [[3.0, 1.0, 2.0]],
    ],
)
def test_imbalance_metrics_match_exact_arithmetic_on_extreme_costs(c):
    """Regression (0.1.4): the mean of three 1e308 costs overflowed to inf, so their
    max/mean ratio came out 0 and the excess -1 (balanced steps reported as
    impossible)."""
    stats = ImbalanceStats.from_step_costs(c)
    assert stats.excess == pytest.approx(_exact_excess(c), rel=1e-12, abs=1e-15)
    assert stats.excess >= 0 and stats.worst_step_excess >= 0
    ratio, p99 = per_step_ratios(c)
    for row, r, p in zip(c, ratio, p99):
        mean = sum(Fraction(x) for x in row) / len(row)
        want = float(max(Fraction(x) for x in row) / mean) if mean else 1.0
        assert r == pytest.approx(want, rel=1e-12)
        assert 1.0 <= p <= r * (1 + 1e-12)
    exact_mean = sum(Fraction(x) for row in c for x in row) / (len(c) * len(c[0]))
    assert stats.mean_cost == pytest.approx(float(exact_mean), rel=1e-12)


def test_budget_from_huge_costs():
    """Regression (0.1.4): mean([1e308, 1e308]) overflowed, so the budget came out inf
    (half of it, 1e308, is representable); a budget that really overflows raises."""
    assert budget_from_costs([1e308, 1e308], 0.5) == pytest.approx(5e307)
    assert budget_from_costs(np.full(3, 1.5e308), 1) == pytest.approx(1.5e308)
    with pytest.raises(ValueError, match="items_per_step"):
        budget_from_costs([1e308, 1e308], 4)


def test_cost_model_overflow_raises_naming_lengths():
    """Regression (0.1.4): finite lengths whose cost overflows returned inf silently."""
    with pytest.raises(ValueError, match="lengths"):
        CostModel(quadratic=1.0).sample_costs([1.0, 1e200])
    with pytest.raises(ValueError, match="lengths"):
        CostModel(linear=1.0)([1e308, 1e308])  # each finite, their sum is not
    # Zero lengths and zero coefficients are fine.
    assert CostModel(linear=0.0).sample_costs([0, 5]).tolist() == [0.0, 0.0]
    assert CostModel(quadratic=1.0).from_offsets(torch.tensor([0, 0, 3])) == 3.0 + 9.0


# ------------------------------------------------------------------ state validation


def test_shuffler_state_out_of_window_is_rejected():
    """Regression (0.1.4): ``steps_done_in_window >= window_steps`` silently skipped the
    whole window (here items 0-3 were never yielded); a mid-window position off the
    window grid planned windows shifted against the saved run."""
    kw = dict(sub_batches_per_step=2, window_steps=2)
    good = BalancedShuffler(list(range(8)), **kw).state_dict()
    for key, value in [("steps_done_in_window", 2), ("window_start", 3)]:
        bad = {**good, "steps_done_in_window": 1, key: value}
        with pytest.raises(ValueError, match=key):
            BalancedShuffler(list(range(8)), **kw).load_state_dict(bad)
    # The end-of-data position of a short last window is valid (not on the grid).
    s = BalancedShuffler(list(range(5)), **kw)
    steps = list(itertools.islice(iter(s), 3))
    assert s.state_dict()["window_start"] == 5
    resumed = BalancedShuffler(list(range(5)), **kw)
    resumed.load_state_dict(s.state_dict())
    assert list(resumed) == [] and sorted(sum(steps, [])) == list(range(5))


@pytest.mark.parametrize(
    ("pending", "err"),
    [([[0.5, 0]], TypeError), ([[0, 0, 0]], ValueError), ([[1, 0], [1, 0]], ValueError)],
)
def test_budget_state_with_malformed_pending_is_rejected(pending, err):
    """Regression (0.1.4): a float position was truncated, a 3-entry one failed with an
    unnamed unpacking error, and a duplicate was merged silently."""
    b = CostBudgetBatcher([1, 2, 3, 4, 5], budget=4)
    state = dict(b.state_dict(), pending=pending, next_read=2)
    with pytest.raises(err, match="pending"):
        b.load_state_dict(state)


@pytest.mark.parametrize("replay", [list, iter])
def test_budget_resume_on_a_shorter_source_raises_value_error(replay):
    """Regression (0.1.4): a source shorter than the saved position raised
    ``RuntimeError: generator raised StopIteration`` (PEP 479), naming nothing."""
    first = CostBudgetBatcher(list(range(1, 20)), budget=10)
    it = iter(first)
    next(it), next(it)
    resumed = CostBudgetBatcher(replay(range(1, 5)), budget=10)
    resumed.load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="next_read"):
        list(resumed)


def test_uniform_length_distribution_with_low_above_high_is_rejected():
    """Regression (0.1.4): ``a > b`` drew the constant ``b`` for every sample."""
    from hyperrec.bbs.lengths import LengthDistribution, sample_lengths

    with pytest.raises(ValueError, match="b"):
        LengthDistribution(kind="uniform", a=10.0, b=5.0)
    one = sample_lengths(
        LengthDistribution(kind="uniform", a=7.0, b=7.0), 50, np.random.default_rng(0)
    )
    assert set(one.tolist()) == {7.0}
    lens = sample_lengths("uniform", 20000, np.random.default_rng(0), max_len=4096)
    assert lens.min() == 1 and lens.max() == 1024  # both ends of [1, 1024] drawn


def _sampler_16(**kw):
    return BalancedBatchSampler(
        np.arange(16.0),
        samples_per_sub_batch=1,
        sub_batches_per_step=2,
        window_steps=2,
        rank=0,
        world_size=1,
        **kw,
    )


@pytest.mark.parametrize(
    "change",
    [
        dict(step=99, epoch=5),  # step beyond this layout's epoch
        dict(step=99, epoch=5, world_size=2),  # step beyond the saved layout's epoch
        dict(epoch=3, segments=[[1, 2, 2, 99]]),  # a replayed segment out of range
    ],
)
def test_rejected_sampler_state_leaves_the_sampler_unchanged(change):
    """Regression (0.1.4): a state rejected by ``load_state_dict`` still switched the
    sampler to its epoch (a caller that caught the error trained epoch 5's order) or
    left segments that raised at every later iteration."""
    ref = _sampler_16()
    ref.set_epoch(1)
    it = iter(ref)
    next(it)
    expected = list(it)
    s = _sampler_16()
    s.set_epoch(1)
    it = iter(s)
    next(it)
    with pytest.raises(ValueError, match="step"):
        s.load_state_dict({**s.state_dict(), **change})
    assert s.epoch == 1 and len(s) == 8
    assert list(s) == expected


def test_rejected_stream_states_leave_the_position_unchanged():
    shuffler = BalancedShuffler(list(range(12)), sub_batches_per_step=2, window_steps=2)
    it = iter(shuffler)
    next(it)
    before = shuffler.state_dict()
    with pytest.raises(ValueError, match="epoch"):
        shuffler.load_state_dict(
            {**before, "window_start": 4, "steps_done_in_window": 0, "epoch": -1}
        )
    assert shuffler.state_dict() == before
    batcher = CostBudgetBatcher([1, 2, 3, 4, 5, 6], budget=4)
    bit = iter(batcher)
    next(bit)
    before = batcher.state_dict()
    with pytest.raises(ValueError, match="epoch"):
        batcher.load_state_dict({**before, "step": 0, "next_read": 0, "pending": [], "epoch": -1})
    assert batcher.state_dict() == before
