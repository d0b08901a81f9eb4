import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.bbs import CostModel, ImbalanceStats, per_step_ratios
from hyperrec.bbs.reference import reference_sample_costs


def test_imbalance_stats_by_hand():
    c = np.array([[1.0, 1.0, 2.0, 4.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    st_ = ImbalanceStats.from_step_costs(c)
    assert (st_.steps, st_.ranks) == (3, 4)
    # max sums to 4 + 2 + 0, mean sums to 2 + 2 + 0
    assert st_.excess == pytest.approx(6 / 4 - 1)
    # per-step ratios: 2, 1, and 1 for the all-zero step
    assert st_.mean_step_excess == pytest.approx((1 + 0 + 0) / 3)
    assert st_.worst_step_excess == pytest.approx(1.0)
    p99_first = np.percentile([1, 1, 2, 4], 99) / 2
    assert st_.p99_rank_over_mean == pytest.approx((p99_first + 1 + 1) / 3)
    assert st_.mean_cost == pytest.approx(c.mean())
    assert st_.as_dict()["excess"] == pytest.approx(0.5)


def test_per_step_ratios():
    mx, p99 = per_step_ratios([1.0, 1.0, 2.0, 4.0])
    assert mx.tolist() == [2.0] and p99[0] == pytest.approx(np.percentile([1, 1, 2, 4], 99) / 2)
    mx, _ = per_step_ratios(torch.tensor([[0, 0], [1, 3]]))
    assert mx.tolist() == [1.0, 1.5]
    with pytest.raises(ValueError, match="step_costs"):
        per_step_ratios([])
    with pytest.raises(ValueError, match="step_costs"):
        per_step_ratios([1.0, float("nan")])


def test_reduction_vs():
    rng = np.random.default_rng()
    c = rng.random((10, 8)) + 0.1
    base = ImbalanceStats.from_step_costs(c)
    flat = ImbalanceStats.from_step_costs(np.ones((10, 8)))
    assert flat.excess == 0 and flat.reduction_vs(base) == pytest.approx(1.0)
    assert base.reduction_vs(base) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="baseline"):
        base.reduction_vs(flat)
    with pytest.raises(TypeError, match="baseline"):
        base.reduction_vs(0.3)


@settings(deadline=None, max_examples=30)
@given(steps=st.integers(1, 20), ranks=st.integers(1, 30), seed=st.integers(0, 999))
def test_stats_invariants(steps, ranks, seed):
    c = np.random.default_rng(seed).lognormal(0, 1, (steps, ranks))
    s = ImbalanceStats.from_step_costs(torch.as_tensor(c))
    assert 0 <= s.mean_step_excess <= s.worst_step_excess + 1e-12
    assert 0 <= s.excess <= s.worst_step_excess + 1e-12
    assert 1 - 1e-12 <= s.p99_rank_over_mean <= 1 + s.worst_step_excess + 1e-12


@pytest.mark.parametrize(
    ("value", "err"),
    [
        (np.ones(3), ValueError),
        (np.ones((0, 3)), ValueError),
        (-np.ones((2, 2)), ValueError),
        ([["a"]], TypeError),
    ],
)
def test_stats_bad_input(value, err):
    with pytest.raises(err, match="step_costs"):
        ImbalanceStats.from_step_costs(value)


def test_cost_model_matches_reference():
    rng = np.random.default_rng()
    lengths = torch.as_tensor(rng.integers(0, 4096, 257))
    m = CostModel(linear=1.5, quadratic=1 / 512, constant=3.0)
    ref = reference_sample_costs(lengths, linear=1.5, quadratic=1 / 512, constant=3.0)
    np.testing.assert_allclose(m.sample_costs(lengths), ref.numpy(), rtol=1e-15)
    assert m(lengths) == pytest.approx(float(ref.sum()), rel=1e-12)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    assert m.from_offsets(offsets) == pytest.approx(m(lengths), rel=1e-12)
    assert m([]) == 0.0 and m.from_offsets([0]) == 0.0  # an empty sub-batch costs nothing


def test_transformer_cost_model():
    m = CostModel.transformer(256, layers=2)
    assert m.linear == 24 * 256 * 256 * 2 and m.quadratic == 4 * 256 * 2
    with pytest.raises(ValueError, match="d_model"):
        CostModel.transformer(0)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"linear": -1.0}, ValueError, "linear"),
        ({"quadratic": float("nan")}, ValueError, "quadratic"),
        ({"constant": "1"}, TypeError, "constant"),
        ({"linear": True}, TypeError, "linear"),
    ],
)
def test_cost_model_bad_coefficients(kwargs, err, match):
    with pytest.raises(err, match=match):
        CostModel(**kwargs)


def test_cost_model_bad_lengths_and_offsets():
    m = CostModel()
    with pytest.raises(ValueError, match="lengths"):
        m([3, -1])
    with pytest.raises(ValueError, match="lengths"):
        m([[1, 2]])
    with pytest.raises(ValueError, match="start at 0"):
        m.from_offsets([1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        m.from_offsets([0, 5, 3])
    with pytest.raises(ValueError, match="offsets"):
        m.from_offsets([])
