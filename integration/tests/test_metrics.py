import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.integration import auc, calibration, gauc, log_loss, normalized_entropy
from hyperrec.integration.metrics import WindowedAUC, task_metrics


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=60).filter(
        lambda xs: 0 < sum(y for _, y in xs) < len(xs)
    )
)
def test_auc_equals_pairwise_count_with_ties(pairs):
    # Scores from a small integer range force many ties.
    scores = [float(s) / 3.0 for s, _ in pairs]
    labels = [float(y) for _, y in pairs]
    got = auc(torch.tensor(scores), torch.tensor(labels))
    assert got == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_auc_reference_points():
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), y) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), y) == 0.0
    assert auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    # Rank-based: any monotone transform gives the same AUC.
    s = torch.randn(500, generator=torch.Generator().manual_seed(0))
    yy = (
        torch.rand(500, generator=torch.Generator().manual_seed(1)) < torch.sigmoid(2 * s)
    ).float()
    assert auc(s, yy) == pytest.approx(auc(torch.sigmoid(3 * s - 1), yy), abs=1e-12)
    assert 0.7 < auc(s, yy) < 0.95


def test_auc_single_class_is_nan():
    assert math.isnan(auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])))


@pytest.mark.parametrize(
    ("scores", "labels", "err", "match"),
    [
        (torch.tensor([0.1, 0.2]), torch.tensor([0.0]), ValueError, "equal length"),
        (torch.tensor([0.1, float("nan")]), torch.tensor([0.0, 1.0]), ValueError, "NaN"),
        (torch.tensor([0.1, 0.2]), torch.tensor([0.0, 2.0]), ValueError, "0 or 1"),
        ([0.1, 0.2], torch.tensor([0.0, 1.0]), TypeError, "scores must be a tensor"),
    ],
)
def test_auc_bad_input(scores, labels, err, match):
    with pytest.raises(err, match=match):
        auc(scores, labels)


@settings(deadline=None, max_examples=30)
@given(
    st.lists(st.tuples(st.floats(0.001, 0.999), st.booleans()), min_size=2, max_size=50).filter(
        lambda xs: 0 < sum(y for _, y in xs) < len(xs)
    )
)
def test_normalized_entropy_matches_formula(pairs):
    p = [q for q, _ in pairs]
    y = [float(b) for _, b in pairs]
    ll = -sum(yi * math.log(pi) + (1 - yi) * math.log(1 - pi) for pi, yi in zip(p, y)) / len(p)
    r = sum(y) / len(y)
    h = -(r * math.log(r) + (1 - r) * math.log(1 - r))
    pt, yt = torch.tensor(p, dtype=torch.float64), torch.tensor(y)
    assert log_loss(pt, yt) == pytest.approx(ll, rel=1e-9)
    assert normalized_entropy(pt, yt) == pytest.approx(ll / h, rel=1e-9)


def test_ne_of_the_base_rate_is_one_and_calibration():
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    base = torch.full((4,), 0.25)
    assert normalized_entropy(base, y) == pytest.approx(1.0)
    assert calibration(base, y) == pytest.approx(1.0)
    assert calibration(base * 2, y) == pytest.approx(2.0)
    assert math.isnan(normalized_entropy(base, torch.zeros(4)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        log_loss(torch.tensor([1.5]), torch.tensor([1.0]))


def test_task_metrics_cvr_uses_clicked_impressions_only():
    click = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    conv = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    p_ctr = torch.tensor([0.9, 0.8, 0.7, 0.2, 0.1])
    # Perfect on clicked impressions, adversarial on unclicked ones (which must not count).
    p_cvr = torch.tensor([0.9, 0.1, 0.2, 0.99, 0.99])
    m = task_metrics(p_ctr, p_cvr, click, conv)
    assert m["ctr_auc"] == 1.0 and m["cvr_auc"] == 1.0
    assert m["ctcvr_auc"] == pytest.approx(brute_force_auc((p_ctr * p_cvr).tolist(), conv.tolist()))


def test_windowed_auc_forgets_old_chunks():
    w = WindowedAUC(2)
    assert math.isnan(w.compute())
    w.update(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0]))  # AUC 0
    w.update(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0]))  # AUC 1
    w.update(torch.tensor([0.2, 0.8]), torch.tensor([0.0, 1.0]))  # AUC 1; the first is dropped
    assert w.compute() == 1.0
    with pytest.raises(ValueError, match="window"):
        WindowedAUC(0)


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.booleans(), st.integers(0, 5)), min_size=1, max_size=60
    )
)
def test_gauc_is_the_impression_weighted_mean_of_per_user_pairwise_aucs(rows):
    scores = torch.tensor([float(s) for s, _, _ in rows])
    labels = torch.tensor([float(y) for _, y, _ in rows])
    users = torch.tensor([u for _, _, u in rows])
    num = den = 0.0
    for u in set(users.tolist()):
        idx = [i for i, x in enumerate(users.tolist()) if x == u]
        ys = [labels[i].item() for i in idx]
        if 0 < sum(ys) < len(ys):  # users with one class have no AUC
            num += brute_force_auc([scores[i].item() for i in idx], ys) * len(idx)
            den += len(idx)
    got = gauc(scores, labels, users)
    if den == 0:
        assert math.isnan(got)
    else:
        assert got == pytest.approx(num / den, abs=1e-12)


def test_gauc_bad_input_and_task_metrics_without_cvr():
    s, y = torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match="gauc: groups must be integers"):
        gauc(s, y, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="gauc: groups must be integers of the scores' shape"):
        gauc(s, y, torch.tensor([1]))
    with pytest.raises(TypeError, match="gauc: groups must be a tensor"):
        gauc(s, y, [1, 2])
    out = task_metrics(s, None, y, None, torch.tensor([3, 3]))
    assert set(out) == {"ctr_auc", "ctr_gauc", "ctr_ne", "ctr_calibration"}
    assert out["ctr_gauc"] == 1.0


def test_uint64_scores_rank_above_2_to_63():
    """Integer scores rank exactly; uint64 ones from 2**63 wrapped to negative int64 and
    ranked below small ones (an audit found AUC 0.5 where the pairwise count is 1)."""
    s = torch.tensor([2**63 + 10, 5, 2**63 + 20, 2**63 + 1, 2**64 - 1, 0], dtype=torch.uint64)
    y = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    pairs = [
        (int(a), int(b))
        for a, la in zip(s.tolist(), y)
        if la
        for b, lb in zip(s.tolist(), y)
        if not lb
    ]
    want = sum((a > b) + 0.5 * (a == b) for a, b in pairs) / len(pairs)
    assert want == 1.0
    assert auc(s, y) == want
    assert gauc(s, y, torch.zeros(6, dtype=torch.long)) == want
    w = WindowedAUC(2)
    w.update(s, y)
    assert w.compute() == want
