import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.bbs import METHODS, balance
from hyperrec.bbs.partition import part_loads
from hyperrec.bbs.reference import reference_optimal_makespan

ALGOS = [m for m in METHODS if m != "auto"]


def _makespan(costs, parts):
    return part_loads(np.asarray(costs, float)[None], parts[None]).max()


@settings(deadline=None, max_examples=40)
@given(
    m=st.integers(1, 7),
    k=st.integers(1, 6),
    method=st.sampled_from(METHODS),
    data=st.data(),
)
def test_balance_is_an_equal_size_partition(m, k, method, data):
    costs = data.draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=m * k, max_size=m * k))
    parts = balance(costs, m, method=method)
    assert parts.shape == (m, k) and parts.dtype == np.int64
    assert sorted(parts.ravel().tolist()) == list(range(m * k))
    # Canonical form: ascending inside a part, parts ordered by their first index.
    assert (np.diff(parts, axis=1) > 0).all()
    assert (np.diff(parts[:, 0]) > 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_balance_is_deterministic_and_batch_independent(method):
    rng = np.random.default_rng()
    costs = rng.lognormal(0, 1.5, (5, 48)).round(1)  # rounding creates ties
    batched = balance(costs, 6, method=method)
    again = balance(costs.copy(), 6, method=method)
    np.testing.assert_array_equal(batched, again)
    for row in range(5):
        np.testing.assert_array_equal(batched[row], balance(costs[row], 6, method=method))


@pytest.mark.parametrize(("m", "k"), [(2, 4), (3, 3), (2, 5), (4, 2)])
def test_kk_swap_close_to_brute_force_optimum(m, k):
    rng = np.random.default_rng()
    ratios = []
    for _ in range(25):
        costs = rng.lognormal(0, 1, m * k)
        opt = reference_optimal_makespan(list(costs), m)
        got = _makespan(costs, balance(costs, m))
        assert got >= opt * (1 - 1e-12)  # nothing beats the exact optimum
        ratios.append(got / opt)
    assert np.mean(ratios) <= 1.04, ratios
    assert max(ratios) <= 1.2, ratios


def test_swaps_never_hurt_and_beat_the_naive_deal():
    rng = np.random.default_rng()
    costs = rng.pareto(1.5, (200, 64)) + 1
    loads = {m: part_loads(costs, balance(costs, 8, method=m)).max(axis=1) for m in ALGOS}
    assert (loads["kk_swap"] <= loads["kk"] + 1e-9).all()
    assert (loads["lpt_swap"] <= loads["lpt"] + 1e-9).all()
    assert loads["kk_swap"].mean() < loads["snake"].mean()
    # Perfect balance is the lower bound.
    assert (loads["kk_swap"] >= costs.sum(axis=1) / 8 - 1e-9).all()


def test_equal_costs_and_trivial_shapes():
    parts = balance(np.ones(6), 3)
    assert sorted(parts.ravel().tolist()) == list(range(6)) and parts.shape == (3, 2)
    np.testing.assert_array_equal(balance([3.0, 1.0, 2.0], 1), [[0, 1, 2]])
    np.testing.assert_array_equal(balance([3.0, 1.0, 2.0], 3), [[0], [1], [2]])
    assert balance(np.zeros((2, 0)), 4).shape == (2, 4, 0)
    # A dominating item ends up with the lightest ones (the optimum).
    parts = balance([1000, 1, 2, 3, 50, 60, 70, 80], 2)
    heavy = next(p for p in parts if 0 in p)
    assert set(heavy.tolist()) == {0, 1, 2, 3}


def test_accepts_torch_and_integer_input():
    t = torch.randint(0, 100, (12,))
    np.testing.assert_array_equal(balance(t, 3), balance(t.numpy().astype(float), 3))


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"costs": [1.0, -1.0], "num_parts": 1}, ValueError, "costs.*non-negative"),
        ({"costs": [1.0, float("nan")], "num_parts": 1}, ValueError, "costs.*finite"),
        ({"costs": [1.0, float("inf")], "num_parts": 2}, ValueError, "costs.*finite"),
        ({"costs": [1.0, 2.0, 3.0], "num_parts": 2}, ValueError, "multiple of num_parts"),
        ({"costs": np.ones((2, 2, 2)), "num_parts": 2}, ValueError, "costs must have"),
        ({"costs": [1.0, 2.0], "num_parts": 0}, ValueError, "num_parts"),
        ({"costs": [1.0, 2.0], "num_parts": 2.0}, TypeError, "num_parts"),
        ({"costs": [1.0, 2.0], "num_parts": True}, TypeError, "num_parts"),
        ({"costs": [True, False], "num_parts": 2}, TypeError, "costs"),
        ({"costs": ["a", "b"], "num_parts": 2}, TypeError, "costs"),
        ({"costs": "ab", "num_parts": 2}, TypeError, "costs"),
        ({"costs": [1.0, 2.0], "num_parts": 2, "method": "greedy"}, ValueError, "method"),
        ({"costs": [1.0, 2.0], "num_parts": 2, "max_swaps": -1}, ValueError, "max_swaps"),
    ],
)
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        balance(**kwargs)
