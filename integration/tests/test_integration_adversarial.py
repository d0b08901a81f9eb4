"""Adversarial checks of the integration's metrics, baselines and batch validation.

Every metric is compared with an independent float64 brute force (AUC as the fraction of
correctly ordered (positive, negative) pairs, ties one half; GAUC as the impression-
weighted mean of per-user AUCs; NE as the clipped mean log-loss over the base-rate
entropy) on inputs the other test files do not use: ties, low-precision and integer
dtypes, probabilities exactly 0 or 1, single classes, empty inputs, a million samples,
streamed chunks, checkpoint round trips and partial states merged as if from ranks.
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.integration import (
    TRAIN,
    LogisticRegressionBaseline,
    PopularityBaseline,
    auc,
    calibration,
    gauc,
    log_loss,
    normalized_entropy,
)
from hyperrec.integration.loader import validate_batch
from hyperrec.integration.metrics import WindowedAUC, task_metrics

_EPS = 1e-7
_SWEEP = settings(deadline=None, max_examples=40)
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


# ----------------------------------------------------------------------- references
def bf_auc(scores, labels) -> float:
    """Pairwise count in float64 (scores already as the metric sees them)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    pos, neg = s[y == 1], s[y == 0]
    if pos.size == 0 or neg.size == 0:
        return math.nan
    d = pos[:, None] - neg[None, :]
    return float(((d > 0).sum() + 0.5 * (d == 0).sum()) / (pos.size * neg.size))


def sorted_count_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Pairwise count by binary search (exact integer counts): for large inputs."""
    neg = np.sort(scores[labels == 0])
    pos = scores[labels == 1]
    below = np.searchsorted(neg, pos, side="left").astype(np.int64)
    equal = np.searchsorted(neg, pos, side="right").astype(np.int64) - below
    wins2 = 2 * int(below.sum()) + int(equal.sum())  # twice the U statistic, exact
    return wins2 / (2.0 * pos.size * neg.size)


def bf_gauc(scores, labels, groups, pair_auc=bf_auc) -> float:
    s, y, g = (np.asarray(x) for x in (scores, labels, groups))
    order = np.argsort(g, kind="stable")
    cuts = np.flatnonzero(np.diff(g[order])) + 1
    num = den = 0.0
    for rows in np.split(order, cuts):
        if 0 < y[rows].sum() < rows.size:  # users with one class have no AUC
            num += pair_auc(s[rows], y[rows]) * rows.size
            den += rows.size
    return num / den if den else math.nan


def bf_log_loss(probs, labels) -> float:
    total = 0.0
    for p, y in zip(probs, labels, strict=True):
        p = min(max(float(p), _EPS), 1.0 - _EPS)
        total -= y * math.log(p) + (1 - y) * math.log(1 - p)
    return total / len(probs)


def bf_ne(probs, labels) -> float:
    r = sum(labels) / len(labels)
    if r in (0.0, 1.0):
        return math.nan
    return bf_log_loss(probs, labels) / -(r * math.log(r) + (1 - r) * math.log(1 - r))


def same(a: float, b: float, tol: float = 1e-12) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol * max(1.0, abs(b))


# ----------------------------------------------------------------------------- AUC
@_SWEEP
@given(
    st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=1, max_size=40),
    st.sampled_from([*_DTYPES, torch.int64, torch.int8]),
)
def test_auc_and_gauc_match_brute_force_in_every_dtype(rows, dtype):
    # Many ties (seven score levels); the brute force sees the values the dtype holds.
    scores = torch.tensor([s / 7.0 if dtype.is_floating_point else s for s, _ in rows]).to(dtype)
    labels = torch.tensor([float(y) for _, y in rows])
    groups = torch.arange(len(rows)) % 3
    ref_s = scores.double().numpy()
    assert same(auc(scores, labels), bf_auc(ref_s, labels.numpy()))
    assert same(gauc(scores, labels, groups), bf_gauc(ref_s, labels.numpy(), groups.numpy()))


def test_auc_degenerate_inputs():
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert auc(torch.full((4,), 0.3), y) == 0.5  # all equal: every pair a tie
    assert auc(torch.tensor([-0.0, 0.0, 0.0, -0.0]), y) == 0.5  # -0.0 ties with 0.0
    for scores, labels in [
        (torch.tensor([0.5]), torch.tensor([1.0])),  # one sample
        (torch.tensor([]), torch.tensor([])),  # empty
        (torch.tensor([0.1, 0.9, 0.4]), torch.zeros(3)),  # one class
        (torch.tensor([0.1, 0.9, 0.4]), torch.ones(3, dtype=torch.bool)),
    ]:
        assert math.isnan(auc(scores, labels))
        assert math.isnan(gauc(scores, labels, torch.zeros(labels.shape, dtype=torch.int64)))
    # Users with one impression have no AUC and no weight.
    s = torch.tensor([0.9, 0.1, 0.5, 0.2, 0.8])
    lab = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    users = torch.tensor([7, 7, 1, 2, 3])
    assert gauc(s, lab, users) == 1.0


def test_auc_of_integer_scores_above_2_pow_53_is_exact():
    # Bug: integer scores (e.g. nanosecond timestamps) went through float64, where
    # 2**53 and 2**53 + 1 are equal: the AUC came out 0.5 instead of 1.
    t = torch.tensor([2**53, 2**53 + 1, 2**60, 2**60 + 1])
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert auc(t, y) == pytest.approx(bf_auc([0, 1, 2, 3], y.numpy()))
    assert gauc(t, y, torch.tensor([0, 0, 1, 1])) == 1.0
    w = WindowedAUC(3)
    w.update(t[:2], y[:2])
    w.update(t[2:], y[2:])
    assert w.compute() == pytest.approx(0.75)


def test_auc_and_gauc_on_a_million_samples_match_an_exact_count():
    gen = torch.Generator().manual_seed(3)
    n = 1_000_000
    logits = torch.randn(n, generator=gen)
    labels = (torch.rand(n, generator=gen) < torch.sigmoid(logits)).float()
    # float32 scores rounded to a 1/512 grid: ~2600 levels, hundreds of ties each.
    scores = (torch.sigmoid(logits + 0.5 * torch.randn(n, generator=gen)) * 512).round() / 512
    s, y = scores.double().numpy(), labels.numpy()
    assert auc(scores, labels) == pytest.approx(sorted_count_auc(s, y), abs=1e-12)
    users = torch.randint(0, 5000, (n,), generator=gen)
    ref = bf_gauc(s, y, users.numpy(), pair_auc=sorted_count_auc)
    assert gauc(scores, labels, users) == pytest.approx(ref, abs=1e-12)


# ---------------------------------------------------------------- log-loss, NE, calibration
@_SWEEP
@given(
    st.lists(
        st.tuples(st.sampled_from([0.0, 1.0, 1e-9, 1 - 1e-9, 0.25, 0.5, 0.9]), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from(_DTYPES),
)
def test_log_loss_and_ne_clip_and_match_brute_force(rows, dtype):
    probs = torch.tensor([p for p, _ in rows], dtype=torch.float64).to(dtype)
    labels = torch.tensor([float(y) for _, y in rows])
    p, y = probs.double().tolist(), labels.tolist()
    assert log_loss(probs, labels) == pytest.approx(bf_log_loss(p, y), rel=1e-12)
    assert same(normalized_entropy(probs, labels), bf_ne(p, y))
    # A confident miss costs exactly -log(1e-7), however it is spelled.
    assert log_loss(torch.tensor([1.0], dtype=dtype), torch.tensor([0.0])) == pytest.approx(
        -math.log(_EPS), rel=1e-6
    )


def test_ne_and_calibration_on_a_million_float32_samples():
    gen = torch.Generator().manual_seed(5)
    n = 1_000_000
    p = torch.rand(n, generator=gen) * 0.2
    y = (torch.rand(n, generator=gen) < p).float()
    pd, yd = p.double().numpy(), y.double().numpy()
    pc = np.clip(pd, _EPS, 1 - _EPS)
    ll = -np.mean(yd * np.log(pc) + (1 - yd) * np.log1p(-pc))
    r = yd.mean()
    assert log_loss(p, y) == pytest.approx(ll, rel=1e-10)
    assert normalized_entropy(p, y) == pytest.approx(
        ll / -(r * np.log(r) + (1 - r) * np.log1p(-r)), rel=1e-10
    )
    assert calibration(p, y) == pytest.approx(pd.sum() / yd.sum(), rel=1e-10)


def test_single_class_and_empty_give_nan_not_a_plausible_number():
    p = torch.tensor([0.2, 0.7])
    assert math.isnan(normalized_entropy(p, torch.ones(2)))
    assert math.isnan(normalized_entropy(p[:1], torch.zeros(1)))
    assert math.isnan(calibration(p, torch.zeros(2)))
    assert math.isnan(calibration(torch.tensor([]), torch.tensor([])))
    with pytest.raises(ValueError, match="log_loss: probs and labels are empty"):
        log_loss(torch.tensor([]), torch.tensor([]))


def test_calibration_rejects_probabilities_outside_the_unit_interval():
    # Bug: calibration summed whatever it got: logits gave -1.0, a plausible-looking ratio.
    y = torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match=r"calibration: probs must lie in \[0, 1\]"):
        calibration(torch.tensor([-3.0, 2.0]), y)
    with pytest.raises(ValueError, match=r"calibration: probs must lie in \[0, 1\]"):
        calibration(torch.tensor([0.5, 1.5]), y)
    assert calibration(torch.tensor([0.0, 1.0]), y) == 1.0  # the bounds are fine


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad_label", [2.0, -1.0, 0.5, _NAN])
@pytest.mark.parametrize("metric", ["auc", "gauc", "log_loss", "ne", "calibration", "window"])
def test_non_binary_labels_are_rejected_naming_the_argument(metric, bad_label):
    p = torch.tensor([0.2, 0.7, 0.4])
    y = torch.tensor([0.0, 1.0, bad_label])
    call = {
        "auc": lambda: auc(p, y),
        "gauc": lambda: gauc(p, y, torch.zeros(3, dtype=torch.int64)),
        "log_loss": lambda: log_loss(p, y),
        "ne": lambda: normalized_entropy(p, y),
        "calibration": lambda: calibration(p, y),
        "window": lambda: WindowedAUC(2).update(p, y),
    }[metric]
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        call()


@pytest.mark.parametrize("bad", [_NAN, _INF, -_INF])
def test_non_finite_predictions_are_rejected(bad):
    p = torch.tensor([0.2, bad, 0.4])
    y = torch.tensor([0.0, 1.0, 1.0])
    for call in (
        lambda: auc(p, y),
        lambda: gauc(p, y, torch.zeros(3, dtype=torch.int64)),
        lambda: WindowedAUC(2).update(p, y),
    ):
        with pytest.raises(ValueError, match="scores contain NaN or Inf"):
            call()
    for call, name in (
        (lambda: log_loss(p, y), "log_loss"),
        (lambda: normalized_entropy(p, y), "normalized_entropy"),
        (lambda: calibration(p, y), "calibration"),
    ):
        with pytest.raises(ValueError, match=f"{name}: probs contain NaN or Inf"):
            call()
    with pytest.raises(ValueError, match="task_metrics: p_cvr contain NaN"):
        task_metrics(y * 0.5, p, y, y)


# ---------------------------------------------------------------------- task_metrics
def test_ctcvr_auc_is_computed_in_float64():
    # Bug: p_ctr * p_cvr was taken in the inputs' dtype: in float16 both products
    # (1e-7, 1.1e-7) round to one subnormal, and the CTCVR AUC came out 0.5, not 1.
    p_ctr = torch.tensor([1e-3, 1.1e-3], dtype=torch.float16)
    p_cvr = torch.tensor([1e-4, 1e-4], dtype=torch.float16)
    click, conv = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])
    assert task_metrics(p_ctr, p_cvr, click, conv)["ctcvr_auc"] == 1.0
    # bfloat16 (8 significant bits): 0.25 (1 + 2**-6 + 2**-14) rounds onto 0.25 (1 + 2**-6).
    a = torch.tensor([0.5 * (1 + 2**-7), 0.5 * (1 + 2**-6)], dtype=torch.bfloat16)
    b = torch.tensor([0.5 * (1 + 2**-7), 0.5], dtype=torch.bfloat16)
    conv = torch.tensor([1.0, 0.0])
    assert task_metrics(a, b, click, conv)["ctcvr_auc"] == 1.0


@_SWEEP
@given(
    st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 8), st.sampled_from([(0, 0), (1, 0), (1, 1)])),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from(_DTYPES),
)
def test_task_metrics_match_brute_force(rows, dtype):
    p_ctr = torch.tensor([a / 8 for a, _, _ in rows]).to(dtype)
    p_cvr = torch.tensor([b / 8 for _, b, _ in rows]).to(dtype)
    click = torch.tensor([float(c) for _, _, (c, _) in rows])
    conv = torch.tensor([float(v) for _, _, (_, v) in rows])
    users = torch.arange(len(rows)) % 4
    m = task_metrics(p_ctr, p_cvr, click, conv, users)
    pc, pv = p_ctr.double().numpy(), p_cvr.double().numpy()
    c, v = click.numpy(), conv.numpy()
    assert same(m["ctr_auc"], bf_auc(pc, c))
    assert same(m["ctr_gauc"], bf_gauc(pc, c, users.numpy()))
    assert same(m["ctr_ne"], bf_ne(pc.tolist(), c.tolist()))
    ref_cal = pc.sum() / c.sum() if c.sum() else math.nan
    assert same(m["ctr_calibration"], ref_cal)
    clicked = c == 1
    cvr_auc = bf_auc(pv[clicked], v[clicked])
    assert same(m["cvr_auc"], cvr_auc)
    cvr_ne = bf_ne(pv[clicked].tolist(), v[clicked].tolist()) if clicked.any() else math.nan
    assert same(m["cvr_ne"], cvr_ne)
    assert same(m["ctcvr_auc"], bf_auc(pc * pv, v))


# ----------------------------------------------------------------------- WindowedAUC
def test_windowed_auc_copies_its_chunks():
    # Bug: update kept a float32 CPU tensor itself (``.float().cpu()`` returns it), so a
    # caller refilling one buffer every step rewrote the chunks already in the window.
    buf = torch.tensor([0.9, 0.1])
    y = torch.tensor([0.0, 1.0])
    w = WindowedAUC(4)
    w.update(buf, y)  # AUC 0
    buf.copy_(torch.tensor([0.1, 0.9]))
    w.update(buf, y)  # AUC 1
    assert w.compute() == pytest.approx(bf_auc([0.9, 0.1, 0.1, 0.9], [0, 1, 0, 1]))  # 0.5


def test_windowed_auc_keeps_float64_precision():
    # Bug: float64 scores were stored as float32, where 1 and 1 + 1e-12 are a tie: 0.5, not 1.
    s = torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64)
    y = torch.tensor([0.0, 1.0])
    w = WindowedAUC(1)
    w.update(s, y)
    assert w.compute() == auc(s, y) == 1.0


@_SWEEP
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=0, max_size=8),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 5),
    st.sampled_from(_DTYPES),
)
def test_windowed_auc_streaming_checkpoint_and_merge(chunks, window, dtype):
    # Scores 1 + k * 2**-30: distinct in float64 only (float32 ties them).
    def tensors(chunk):
        s = torch.tensor([1.0 + k * 2.0**-30 for k, _ in chunk], dtype=torch.float64)
        if dtype != torch.float64:
            s = torch.tensor([k / 5 for k, _ in chunk]).to(dtype)
        return s, torch.tensor([float(y) for _, y in chunk])

    pairs = [tensors(c) for c in chunks]

    def ref(last):
        s = np.concatenate([p[0].double().numpy() for p in last])
        y = np.concatenate([p[1].numpy() for p in last])
        return bf_auc(s, y)

    w = WindowedAUC(window)
    half = len(pairs) // 2
    for s, y in pairs[:half]:
        w.update(s, y)
    # Checkpoint round trip half way: the resumed window continues identically.
    buf = io.BytesIO()
    torch.save(w.state_dict(), buf)
    buf.seek(0)
    resumed = WindowedAUC(window)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for s, y in pairs[half:]:
        w.update(s, y)
        resumed.update(s, y)
    assert same(w.compute(), ref(pairs[-window:]))
    assert same(resumed.compute(), w.compute())
    # Partial windows from several "ranks" merged into one that holds them all.
    ranks = [WindowedAUC(len(pairs)) for _ in range(3)]
    for i, (s, y) in enumerate(pairs):
        ranks[i % 3].update(s, y)
    merged = WindowedAUC(len(pairs))
    merged.load_state_dict({"chunks": [c for r in ranks for c in r.state_dict()["chunks"]]})
    assert same(merged.compute(), ref(pairs))
    # A state with more chunks than the window keeps the newest.
    small = WindowedAUC(1)
    small.load_state_dict(merged.state_dict())
    assert same(small.compute(), ref(merged.state_dict()["chunks"][-1:]))


# ------------------------------------------------------------------------ baselines
def test_popularity_rejects_labels_and_ids_it_would_miscount():
    # Bug: labels were cast to int64 and summed: a 2 counted two clicks, 0.5 none, a
    # conversion without a click made conversions exceed clicks; float item ids were
    # truncated to another item (1.9 -> 1).
    pop = PopularityBaseline(4)
    items, zero = torch.tensor([0, 1]), torch.zeros(2)
    cases = [
        (ValueError, "click labels must be 0 or 1", (items, torch.tensor([2.0, 0.0]), zero)),
        (ValueError, "click labels must be 0 or 1", (items, torch.tensor([0.5, 0.0]), zero)),
        (ValueError, "click labels must be 0 or 1", (items, torch.tensor([-1.0, 0.0]), zero)),
        (ValueError, "conversion labels must be 0 or 1", (items, zero, torch.tensor([0.0, 3]))),
        (ValueError, "conversion needs a click", (items, zero, torch.tensor([0.0, 1.0]))),
        (TypeError, "items must be integers", (torch.tensor([0.7, 1.9]), zero, zero)),
        (ValueError, "1-D", (items[None], zero[None], zero[None])),
        (ValueError, r"\[0, 4\)", (torch.tensor([0, -1]), zero, zero)),
        (TypeError, "click must be a tensor", (items, [0, 1], zero)),
    ]
    for err, match, args in cases:
        with pytest.raises(err, match=match):
            pop.update(*args)
    assert int(pop.counts.sum()) == 0  # a rejected batch counts nothing
    pop.update(items, torch.tensor([True, False]), torch.tensor([True, False]))
    assert pop.counts.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]


def test_popularity_counts_merged_over_ranks_equal_one_pass():
    gen = torch.Generator().manual_seed(7)
    n_items, n = 10, 500
    items = torch.randint(0, n_items, (n,), generator=gen)
    click = (torch.rand(n, generator=gen) < 0.3).float()
    conv = click * (torch.rand(n, generator=gen) < 0.5).float()
    whole = PopularityBaseline(n_items, prior_strength=3.0)
    ranks = [PopularityBaseline(n_items, prior_strength=3.0) for _ in range(3)]
    for lo in range(0, n, 37):  # uneven chunks, round robin over ranks
        sl = slice(lo, lo + 37)
        whole.update(items[sl], click[sl], conv[sl])
        ranks[(lo // 37) % 3].update(items[sl], click[sl], conv[sl])
    merged = sum(r.state_dict()["counts"] for r in ranks)
    assert torch.equal(merged, whole.counts)
    buf = io.BytesIO()
    torch.save(whole.state_dict(), buf)
    buf.seek(0)
    restored = PopularityBaseline(n_items, prior_strength=3.0)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    ctr, cvr = PopularityBaseline.rates(restored.counts, 3.0)
    it, cl, cv = items.tolist(), click.tolist(), conv.tolist()
    g_ctr, g_cvr = sum(cl) / n, sum(cv) / sum(cl)
    for i in range(n_items):
        imp = sum(1 for x in it if x == i)
        clicks = sum(c for x, c in zip(it, cl, strict=True) if x == i)
        convs = sum(c for x, c in zip(it, cv, strict=True) if x == i)
        assert ctr[i].item() == pytest.approx((clicks + 3 * g_ctr) / (imp + 3), rel=1e-12)
        assert cvr[i].item() == pytest.approx((convs + 3 * g_cvr) / (clicks + 3), rel=1e-12)


def test_logistic_regression_chunking_and_brute_force_logits(micro_data):
    schema = micro_data.schema
    first, second = (
        micro_data.batch(TRAIN, np.arange(40)),
        micro_data.batch(TRAIN, np.arange(40, 100)),
    )
    together = micro_data.batch(TRAIN, np.arange(100))
    split_fit, one_fit = LogisticRegressionBaseline(schema), LogisticRegressionBaseline(schema)
    info, one_info = split_fit.fit([first, second]), one_fit.fit([together])
    assert info["impressions"] == one_info["impressions"] == together.num_candidates
    assert info["iterations"] == one_info["iterations"]
    assert info["train_log_loss"] == pytest.approx(one_info["train_log_loss"], rel=1e-12)
    for k, w in split_fit.weights.items():
        assert torch.allclose(w, one_fit.weights[k], rtol=0, atol=1e-12), k
    test = micro_data.batch(1, np.arange(30))
    w, ids = split_fit.weights, split_fit.ids

    def weight(k, x):
        hit = (ids[k] == x).nonzero()
        return float(w[k][hit[0, 0]]) if hit.numel() else 0.0  # unseen id: the prior, 0

    logits = []
    for r in range(test.num_requests):
        tags = test.tags[test.tag_offsets[r] : test.tag_offsets[r + 1]].tolist()
        dense = (test.dense[r].double() - split_fit.dense_mean) / split_fit.dense_std
        request = (
            weight("user", int(test.user_ids[r]))
            + sum(weight("tag", t) for t in tags) / max(1, len(tags))
            + float(dense @ w["dense"])
        )
        for c in range(int(test.candidate_offsets[r]), int(test.candidate_offsets[r + 1])):
            logits.append(
                float(w["bias"][0])
                + weight("item", int(test.candidate_items[c]))
                + weight("category", int(test.candidate_categories[c]))
                + request
            )
    expected = torch.sigmoid(torch.tensor(logits, dtype=torch.float64))
    assert torch.allclose(split_fit.predict(test), expected, rtol=0, atol=1e-12)
    restored = LogisticRegressionBaseline(schema)
    restored.load_state_dict(split_fit.state_dict())
    assert torch.equal(restored.predict(test), split_fit.predict(test))


# ------------------------------------------------------------------- batch validation
def _good(micro_data, n=8):
    batch = micro_data.batch(TRAIN, np.arange(n))
    assert batch.num_requests >= 3 and batch.num_history_events >= 3
    return batch


def _set(name, index, value):
    def change(b):
        t = getattr(b, name).clone()
        t[index] = value
        return {name: t}

    return change


def _unsorted_history(b):
    lengths = b.history_offsets.diff()
    t = b.history_time.clone()
    for r in range(b.num_requests):
        lo, hi = int(b.history_offsets[r]), int(b.history_offsets[r + 1])
        if hi - lo >= 2 and t[lo] < t[hi - 1]:
            t[lo], t[hi - 1] = t[hi - 1].clone(), t[lo].clone()  # still <= request_time
            return {"history_time": t}
    raise AssertionError(f"no history with two distinct times: {lengths.tolist()}")


def _zero_candidates(b):
    off = b.candidate_offsets.clone()
    off[1] = 0  # request 0 has none; request 1 takes its candidates
    return {"candidate_offsets": off}


def _non_monotonic(name):
    def change(b):
        off = getattr(b, name).clone()
        off[1] = off[2] + 1
        return {name: off}

    return change


_INVALID = [
    # (id, change, exception, message)
    ("offsets not from 0", lambda b: {"history_offsets": b.history_offsets + 1}, ValueError,
     r"Batch.history_offsets must start at 0"),
    ("history offsets decrease", _non_monotonic("history_offsets"), ValueError,
     r"Batch.history_offsets must start at 0 and be non-decreasing"),
    ("tag offsets decrease", _non_monotonic("tag_offsets"), ValueError,
     r"Batch.tag_offsets must start at 0 and be non-decreasing"),
    ("candidate offsets decrease", _non_monotonic("candidate_offsets"), ValueError,
     r"Batch.candidate_offsets must start at 0 and be non-decreasing"),
    ("last offset short", lambda b: {"click": b.click[:-1]}, ValueError,
     r"Batch.candidate_offsets\[-1\] = \d+ but Batch.click has"),
    ("tags short", lambda b: {"tags": b.tags[:-1]}, ValueError,
     r"Batch.tag_offsets\[-1\] = \d+ but Batch.tags has"),
    ("offsets wrong length", lambda b: {"candidate_offsets": b.candidate_offsets[:-1]},
     ValueError, r"Batch.candidate_offsets must have B \+ 1"),
    ("zero candidates", _zero_candidates, ValueError, r"candidate_offsets"),
    ("item id too big", _set("candidate_items", 0, 512), ValueError, r"Batch.candidate_items"),
    ("negative history item", _set("history_items", -1, -1), ValueError, r"Batch.history_items"),
    ("category too big", _set("history_categories", 0, 16), ValueError,
     r"Batch.history_categories"),
    ("negative candidate category", _set("candidate_categories", 0, -2), ValueError,
     r"Batch.candidate_categories"),
    ("action too big", _set("history_actions", 1, 4), ValueError, r"Batch.history_actions"),
    ("tag too big", _set("tags", 0, 16), ValueError, r"Batch.tags"),
    ("negative user", _set("user_ids", 2, -5), ValueError, r"Batch.user_ids"),
    ("negative sample id", _set("sample_ids", 1, -1), ValueError, r"Batch.sample_ids"),
    ("NaN dense", _set("dense", (1, 2), _NAN), ValueError, r"Batch.dense contains NaN"),
    ("Inf dense", _set("dense", (0, 0), -_INF), ValueError, r"Batch.dense contains NaN or Inf"),
    ("dense width", lambda b: {"dense": b.dense[:, :-1]}, ValueError, r"Batch.dense must have"),
    ("click 0.5", _set("click", 0, 0.5), ValueError, r"Batch.click labels must be 0 or 1"),
    ("conversion NaN", _set("conversion", 0, _NAN), ValueError, r"Batch.conversion labels"),
    ("unsorted history", _unsorted_history, ValueError,
     r"Batch.history_time must be non-decreasing"),
    ("int32 offsets", lambda b: {"tag_offsets": b.tag_offsets.int()}, TypeError,
     r"Batch.tag_offsets must be a torch.int64"),
    ("float64 dense", lambda b: {"dense": b.dense.double()}, TypeError,
     r"Batch.dense must be a torch.float32"),
    ("float item ids", lambda b: {"candidate_items": b.candidate_items.float()}, TypeError,
     r"Batch.candidate_items must be a torch.int64"),
    ("2-D user ids", lambda b: {"user_ids": b.user_ids[:, None]}, TypeError,
     r"Batch.user_ids has rank 2"),
    ("user ids short", lambda b: {"user_ids": b.user_ids[:-1]}, ValueError,
     r"Batch.user_ids has \d+ rows"),
    ("float max_history_len", lambda b: {"max_history_len": float(b.max_history_len)},
     TypeError, r"Batch.max_history_len must be an int"),
    ("wrong max_history_len", lambda b: {"max_history_len": b.max_history_len + 1},
     ValueError, r"Batch.max_history_len"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "err", "match"), [c[1:] for c in _INVALID], ids=[c[0] for c in _INVALID]
)
def test_invalid_batches_are_rejected_naming_the_field(micro_data, change, err, match):
    good = _good(micro_data)
    validate_batch(good, micro_data.schema)  # the unchanged batch is fine
    bad = dataclasses.replace(good, **change(good))
    with pytest.raises(err, match=match):
        bad.validate(micro_data.schema)
    with pytest.raises(err, match=match):
        validate_batch(bad, micro_data.config)


def test_valid_edge_case_batches_pass(micro_data):
    schema = micro_data.schema
    one = micro_data.batch(TRAIN, [5])  # a batch of one request
    validate_batch(one, schema)
    one.validate(num_items=micro_data.config.num_items, num_topics=micro_data.config.num_topics)
    good = _good(micro_data)
    b = good.num_requests
    empty = torch.zeros(0, dtype=torch.int64)
    no_history = dataclasses.replace(
        good,
        history_offsets=torch.zeros(b + 1, dtype=torch.int64),
        history_items=empty,
        history_categories=empty,
        history_actions=empty,
        history_time=empty,
        tag_offsets=torch.zeros(b + 1, dtype=torch.int64),
        tags=empty,
        max_history_len=0,
    )
    validate_batch(no_history, schema)  # empty histories and no tags
    # Equal timestamps inside a history are chronological (ties allowed).
    t = good.history_time.clone()
    lo, hi = int(good.history_offsets[0]), int(good.history_offsets[1])
    t[lo:hi] = t[lo]
    validate_batch(dataclasses.replace(good, history_time=t), schema)


def test_validate_batch_caps_and_argument_types(micro_data):
    good = _good(micro_data)
    schema = micro_data.schema
    short = dataclasses.replace(schema, max_seqlen=good.max_history_len - 1)
    with pytest.raises(ValueError, match="DataSchema.max_seqlen"):
        validate_batch(good, short)
    most = int(good.candidate_offsets.diff().max())
    with pytest.raises(ValueError, match="DataSchema.max_candidates"):
        validate_batch(good, dataclasses.replace(schema, max_candidates=most - 1))
    with pytest.raises(TypeError, match="validate_batch: data must be a DataSchema"):
        validate_batch(good, {"num_items": 512})
    with pytest.raises(TypeError, match="validate_batch: batch must be a Batch"):
        validate_batch(dataclasses.asdict(good), schema)


def test_baseline_states_that_would_load_silently_wrong_are_rejected(micro_data):
    # Bug: float counts were truncated by copy_ (2.7 -> 2), negative ones accepted.
    pop = PopularityBaseline(3)
    with pytest.raises(TypeError, match="counts must be an integer tensor"):
        pop.load_state_dict({"counts": torch.full((3, 3), 2.7)})
    with pytest.raises(ValueError, match="counts must be non-negative"):
        pop.load_state_dict({"counts": -torch.ones(3, 3, dtype=torch.int64)})
    assert int(pop.counts.abs().sum()) == 0
    # Bug: predict() binary-searches the ids, so an unsorted id list (or one weight too
    # few) scored candidates with other ids' weights, without an error.
    lr = LogisticRegressionBaseline(micro_data.schema)
    lr.fit([micro_data.batch(TRAIN, np.arange(30))])
    state = lr.state_dict()
    shuffled = {**state, "ids": {**state["ids"], "item": state["ids"]["item"].flip(0)}}
    fresh = LogisticRegressionBaseline(micro_data.schema)
    with pytest.raises(ValueError, match=r"ids\['item'\] must be sorted and unique"):
        fresh.load_state_dict(shuffled)
    short = {**state, "weights": {**state["weights"], "user": state["weights"]["user"][:-1]}}
    with pytest.raises(ValueError, match=r"one weight per id"):
        fresh.load_state_dict(short)
    fresh.load_state_dict(state)  # the genuine state loads
