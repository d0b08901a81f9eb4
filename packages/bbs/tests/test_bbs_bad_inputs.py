"""Bad-input catalogue of hyperrec.bbs: one line per case, plus fuzzing.

Each case names the exception type and a substring of the message that names the
argument as the caller spelled it; every type must also be listed in the ``Raises:``
section of the public function's docstring.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrec.bbs import (
    BalancedBatchSampler,
    BalancedShuffler,
    BBSConfig,
    BudgetConfig,
    CostBudgetBatcher,
    CostModel,
    ImbalanceStats,
    balance,
    budget_from_costs,
    global_shuffle_plan,
    natural_steps,
    per_step_ratios,
    shuffle_plan,
)
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
nan, inf = math.nan, math.inf
C8 = [1.0, 5.0, 2.0, 7.0, 3.0, 1.0, 4.0, 2.0]
SP = dict(sub_batches_per_step=2, window_steps=4)
GP = dict(world_size=2, sub_batches_per_step=2, window_steps=2)
BS = dict(samples_per_sub_batch=2, sub_batches_per_step=2, window_steps=2)
STATS = ImbalanceStats.from_step_costs([[1.0, 2.0], [2.0, 2.0]])
FLAT = ImbalanceStats.from_step_costs([[1.0, 1.0]])


def _drain(it):
    return list(it)


def _shuffler_load(state):
    s = BalancedShuffler(list(range(8)), sub_batches_per_step=2, window_steps=2)
    s.load_state_dict(state)


def _sampler_load(state):
    s = BalancedBatchSampler(np.ones(64), **BS, rank=0, world_size=1)
    s.load_state_dict(state)


CASES = [
    # shuffle_plan
    case(T, "costs", shuffle_plan, "abcdefgh", **SP),
    case(T, "costs", shuffle_plan, None, **SP),
    case(T, "costs", shuffle_plan, [True] * 8, **SP),
    case(T, "costs", shuffle_plan, torch.ones(8, dtype=torch.bool), **SP),
    case(T, "costs", shuffle_plan, [1j] * 8, **SP),
    case(V, "costs", shuffle_plan, [1.0] * 7, **SP),
    case(V, "costs", shuffle_plan, [-1.0] + [1.0] * 7, **SP),
    case(V, "costs", shuffle_plan, [nan] + [1.0] * 7, **SP),
    case(V, "costs", shuffle_plan, [inf] + [1.0] * 7, **SP),
    case(V, "costs", shuffle_plan, np.ones((2, 4)), **SP),
    case(T, "sub_batches_per_step", shuffle_plan, C8, sub_batches_per_step=2.0, window_steps=4),
    case(V, "sub_batches_per_step", shuffle_plan, C8, sub_batches_per_step=0, window_steps=4),
    case(T, "window_steps", shuffle_plan, C8, sub_batches_per_step=2, window_steps="4"),
    case(V, "window_steps", shuffle_plan, C8, sub_batches_per_step=2, window_steps=-1),
    case(T, "window_steps", shuffle_plan, C8, sub_batches_per_step=2, window_steps=True),
    case(V, "method", shuffle_plan, C8, **SP, method="greedy?"),
    # global_shuffle_plan / natural_steps
    case(V, "costs", global_shuffle_plan, [1.0] * 7, **GP),
    case(
        T,
        "world_size",
        global_shuffle_plan,
        C8,
        world_size=2.0,
        sub_batches_per_step=2,
        window_steps=2,
    ),
    case(
        V,
        "world_size",
        global_shuffle_plan,
        C8,
        world_size=0,
        sub_batches_per_step=2,
        window_steps=2,
    ),
    case(V, "method", global_shuffle_plan, C8, **GP, method=""),
    case(V, "num_items", natural_steps, -1, 2),
    case(T, "num_items", natural_steps, 4.0, 2),
    case(V, "per_step", natural_steps, 4, 0),
    case(T, "per_step", natural_steps, 4, None),
    # balance
    case(V, "num_parts", balance, C8, 3),
    case(V, "num_parts", balance, C8, 0),
    case(T, "num_parts", balance, C8, 2.0),
    case(V, "method", balance, C8, 2, method="x"),
    case(T, "max_swaps", balance, C8, 2, max_swaps=1.5),
    case(V, "max_swaps", balance, C8, 2, max_swaps=-1),
    case(V, "costs", balance, np.ones((2, 2, 2)), 2),
    case(V, "costs", balance, [1.0, -2.0], 2),
    # CostModel
    case(V, "linear", CostModel, linear=-1.0),
    case(V, "quadratic", CostModel, quadratic=nan),
    case(V, "constant", CostModel, constant=inf),
    case(T, "linear", CostModel, linear="1"),
    case(T, "quadratic", CostModel, quadratic=True),
    case(V, "lengths", CostModel().sample_costs, [3, -1]),
    case(T, "lengths", CostModel().sample_costs, "abc"),
    case(V, "lengths", CostModel().sample_costs, [[1, 2]]),
    case(V, "offsets", CostModel().from_offsets, []),
    case(V, "offsets", CostModel().from_offsets, [1, 3]),
    case(V, "offsets", CostModel().from_offsets, [0, 3, 2]),
    case(V, "offsets", CostModel().from_offsets, [[0, 1]]),
    case(T, "offsets", CostModel().from_offsets, None),
    case(V, "d_model", CostModel.transformer, 0),
    case(T, "d_model", CostModel.transformer, 64.0),
    case(V, "layers", CostModel.transformer, 64, layers=0),
    case(V, "per_sample", CostModel.transformer, 64, per_sample=-1.0),
    # metrics
    case(V, "step_costs", per_step_ratios, []),
    case(V, "step_costs", per_step_ratios, np.ones((2, 0))),
    case(V, "step_costs", per_step_ratios, [[1.0, -1.0]]),
    case(T, "step_costs", per_step_ratios, "x"),
    case(V, "step_costs", ImbalanceStats.from_step_costs, [1.0, 2.0]),
    case(V, "step_costs", ImbalanceStats.from_step_costs, [[nan, 1.0]]),
    case(T, "baseline", STATS.reduction_vs, 0.5),
    case(V, "baseline", STATS.reduction_vs, FLAT),
    # budget
    case(V, "costs", budget_from_costs, [], 4),
    case(V, "costs", budget_from_costs, [0.0, 0.0], 4),
    case(V, "items_per_step", budget_from_costs, [1.0], 0),
    case(V, "items_per_step", budget_from_costs, [1.0], nan),
    case(T, "items_per_step", budget_from_costs, [1.0], "4"),
    case(V, "budget", BudgetConfig, budget=0.0),
    case(V, "budget", BudgetConfig, budget=inf),
    case(T, "budget", BudgetConfig, budget=None),
    case(V, "max_wait_steps", BudgetConfig, budget=1.0, max_wait_steps=0),
    case(T, "max_wait_steps", BudgetConfig, budget=1.0, max_wait_steps=1.5),
    case(V, "lookahead_steps", BudgetConfig, budget=1.0, lookahead_steps=0.5),
    case(V, "lookahead_steps", BudgetConfig, budget=1.0, lookahead_steps=nan),
    case(V, "max_buffer_items", BudgetConfig, budget=1.0, max_buffer_items=0),
    case(V, "swap_rounds", BudgetConfig, budget=1.0, swap_rounds=-1),
    case(T, "source", CostBudgetBatcher, 5, budget=1.0),
    case(V, "budget", CostBudgetBatcher, [1.0], budget=-1.0),
    case(T, "cost", CostBudgetBatcher, [1.0], budget=1.0, cost="tokens"),
    case(V, "cost", _drain, CostBudgetBatcher([1.0, -2.0], budget=1.0), doc=CostBudgetBatcher),
    # BBSConfig / BalancedShuffler
    case(V, "sub_batches_per_step", BBSConfig, sub_batches_per_step=0, window_steps=2),
    case(T, "window_steps", BBSConfig, sub_batches_per_step=1, window_steps=2.0),
    case(V, "method", BBSConfig, sub_batches_per_step=1, window_steps=2, method="x"),
    case(T, "source", BalancedShuffler, 5, **SP),
    case(T, "drop_last", BalancedShuffler, [1.0], **SP, drop_last="no"),
    case(T, "cost", BalancedShuffler, [1.0], **SP, cost=3),
    case(
        V, "sub_batches_per_step", BalancedShuffler, [1.0], sub_batches_per_step=0, window_steps=1
    ),
    case(
        V,
        "cost",
        _drain,
        BalancedShuffler([1.0, nan, 1.0, 1.0], sub_batches_per_step=2, window_steps=2),
        doc=BalancedShuffler,
    ),
    case(
        T,
        "cost",
        _drain,
        BalancedShuffler(["a", "b"], sub_batches_per_step=1, window_steps=2),
        doc=BalancedShuffler,
    ),
    case(T, "state", _shuffler_load, [1, 2], doc=BalancedShuffler.load_state_dict),
    case(V, "state", _shuffler_load, {"position": 3}, doc=BalancedShuffler.load_state_dict),
    # BalancedBatchSampler
    case(V, "sample_costs", BalancedBatchSampler, np.ones(3), **BS),
    case(V, "sample_costs", BalancedBatchSampler, [-1.0] * 16, **BS),
    case(T, "sample_costs", BalancedBatchSampler, "x" * 16, **BS),
    case(
        V,
        "samples_per_sub_batch",
        BalancedBatchSampler,
        np.ones(16),
        samples_per_sub_batch=0,
        sub_batches_per_step=1,
        window_steps=1,
    ),
    case(V, "mode", BalancedBatchSampler, np.ones(16), **BS, mode="both"),
    case(V, "rank", BalancedBatchSampler, np.ones(16), **BS, rank=2, world_size=2),
    case(V, "rank", BalancedBatchSampler, np.ones(16), **BS, rank=-1, world_size=2),
    case(V, "world_size", BalancedBatchSampler, np.ones(16), **BS, rank=0, world_size=0),
    case(T, "shuffle", BalancedBatchSampler, np.ones(16), **BS, shuffle=1),
    case(V, "seed", BalancedBatchSampler, np.ones(16), **BS, seed=-1),
    case(T, "seed", BalancedBatchSampler, np.ones(16), **BS, seed=0.5),
    case(V, "method", BalancedBatchSampler, np.ones(16), **BS, method="?"),
    case(
        V,
        "epoch",
        BalancedBatchSampler(np.ones(16), **BS, rank=0, world_size=1).set_epoch,
        -1,
    ),
    case(T, "state", _sampler_load, "x", doc=BalancedBatchSampler.load_state_dict),
    case(V, "state", _sampler_load, {"epoch": 0}, doc=BalancedBatchSampler.load_state_dict),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 90


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_COST = st.one_of(st.floats(0, 1e6), st.sampled_from([-1.0, nan, inf, -inf]), st.integers(0, 100))


@_FUZZ
@given(
    costs=st.lists(_COST, max_size=24),
    k=st.one_of(st.integers(-1, 4), st.just(2.0)),
    w=st.one_of(st.integers(-1, 4), st.just("2")),
)
def test_fuzz_shuffle_plan(costs, k, w):
    ok_int = [isinstance(v, int) and v >= 1 for v in (k, w)]
    good = all(ok_int) and len(costs) == k * w and all(math.isfinite(c) and c >= 0 for c in costs)
    err = rejects_cleanly(shuffle_plan, costs, sub_batches_per_step=k, window_steps=w)
    assert (err is None) == good, err
    if good:
        plan = shuffle_plan(costs, sub_batches_per_step=k, window_steps=w)
        assert sorted(i for step in plan for i in step) == list(range(k * w))


@_FUZZ
@given(costs=st.lists(_COST, max_size=16), parts=st.integers(-1, 5))
def test_fuzz_balance(costs, parts):
    good = (
        parts >= 1 and len(costs) % parts == 0 and all(math.isfinite(c) and c >= 0 for c in costs)
    )
    err = rejects_cleanly(balance, costs, parts)
    assert (err is None) == good, err


@_FUZZ
@given(offsets=st.lists(st.integers(-3, 20), max_size=8))
def test_fuzz_from_offsets(offsets):
    good = (
        len(offsets) >= 1 and offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    )
    err = rejects_cleanly(CostModel().from_offsets, offsets)
    assert (err is None) == good, err
