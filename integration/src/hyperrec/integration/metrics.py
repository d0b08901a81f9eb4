"""Ranking metrics: exact AUC, GAUC, normalised entropy, calibration, a sliding-window AUC.

All functions take 1-D tensors of equal length, compute in float64 on the CPU and return
Python floats. Probabilities are clamped to ``[1e-7, 1 - 1e-7]`` inside log-losses.
"""

from __future__ import annotations

import collections
import math

import torch

__all__ = [
    "WindowedAUC",
    "auc",
    "calibration",
    "gauc",
    "log_loss",
    "normalized_entropy",
    "task_metrics",
]

_EPS = 1e-7


def _pair(
    scores: torch.Tensor,
    labels: torch.Tensor,
    name: str,
    score_name: str = "scores",
    label_name: str = "labels",
) -> tuple[torch.Tensor, torch.Tensor]:
    # ``name`` is the public function and ``*_name`` its parameters, so a message names
    # what the caller typed (not a helper it happens to go through).
    for arg, t in ((score_name, scores), (label_name, labels)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")
        if t.is_complex():
            raise TypeError(f"{name}: {arg} must have a real dtype, got {t.dtype}")
    if scores.dim() != 1 or scores.shape != labels.shape:
        raise ValueError(
            f"{name}: {score_name} and {label_name} must be 1-D of equal length, got "
            f"{tuple(scores.shape)} and {tuple(labels.shape)}"
        )
    s = scores.detach().to("cpu", torch.float64)
    y = labels.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name}: {score_name} contain NaN or Inf")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError(f"{name}: {label_name} must be 0 or 1")
    return s, y


def _rank_key(scores: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What to sort ``scores`` by: ``s`` (their float64 copy), or for integer scores the
    integers themselves: float64 merges integers above 2**53 (e.g. nanosecond timestamps)
    into ties."""
    if scores.dtype.is_floating_point:
        return s
    if scores.dtype == torch.uint64:
        # int64 would wrap the values from 2**63 to negative ones: shift the range
        # down by 2**63 instead (order-preserving, exact)
        return scores.detach().to("cpu").view(torch.int64) ^ torch.iinfo(torch.int64).min
    return scores.detach().to("cpu", torch.int64)


def _log_loss(probs: torch.Tensor, labels: torch.Tensor, name: str) -> float:
    p, y = _pair(probs, labels, name, "probs")
    if p.numel() == 0:
        raise ValueError(f"{name}: probs and labels are empty")
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError(f"{name}: probs must lie in [0, 1]")
    p = p.clamp(_EPS, 1.0 - _EPS)
    return float(-(y * p.log() + (1.0 - y) * (-p).log1p()).mean())


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC: P(score of a random positive > score of a random negative).

    Ties count one half (the Mann-Whitney U statistic with average ranks), so the result
    equals the brute-force pairwise count. O(n log n).

    Args:
        scores: [n] any real dtype (probabilities or logits: AUC is rank-based).
        labels: [n] values in {0, 1}.

    Returns:
        The AUC in [0, 1], or NaN when ``labels`` has no positive or no negative.

    Raises:
        TypeError: non-tensor inputs.
        ValueError: shapes differ or are not 1-D, non-finite scores, labels not in {0, 1}.
    """
    s, y = _pair(scores, labels, "auc")
    n_pos = float(y.sum())
    n_neg = float(y.numel()) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    key = _rank_key(scores, s)
    order = torch.argsort(key, stable=True)
    _, inverse, counts = torch.unique_consecutive(
        key[order], return_inverse=True, return_counts=True
    )
    # 1-based rank of a group of tied scores = the mean of the ranks it spans.
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1.0) / 2.0
    rank_sum_pos = float((mean_rank[inverse] * y[order]).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1.0) / 2.0) / (n_pos * n_neg)


def log_loss(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` [n] against ``labels`` [n].

    Raises:
        TypeError: non-tensor or complex inputs.
        ValueError: as :func:`auc`, or ``probs`` outside [0, 1], or empty input.
    """
    return _log_loss(probs, labels, "log_loss")


def normalized_entropy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Normalised entropy (He et al., 2014): log-loss divided by the entropy of the base rate.

    ``NE = log_loss(p, y) / H(mean(y))`` with ``H(r) = -r log r - (1 - r) log(1 - r)``.
    Below 1 means better than always predicting the empirical base rate; lower is better.

    Returns:
        NE, or NaN when every label is equal (the base-rate entropy is 0).

    Raises:
        TypeError: non-tensor or complex inputs.
        ValueError: as :func:`log_loss` (messages name ``normalized_entropy``).
    """
    ll = _log_loss(probs, labels, "normalized_entropy")
    rate = float(labels.detach().double().mean())
    if rate <= 0.0 or rate >= 1.0:
        return math.nan
    return ll / -(rate * math.log(rate) + (1.0 - rate) * math.log(1.0 - rate))


def calibration(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Sum of predicted probabilities over the number of positives (1.0 is calibrated).

    Returns:
        The ratio, or NaN when there is no positive.

    Raises:
        TypeError: non-tensor or complex inputs.
        ValueError: as :func:`auc`, or ``probs`` outside [0, 1].
    """
    p, y = _pair(probs, labels, "calibration", "probs")
    # Logits or other scores would give a finite ratio that looks like a calibration
    # (e.g. -1.0): reject them, as log_loss and task_metrics do.
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError("calibration: probs must lie in [0, 1]")
    positives = float(y.sum())
    return float(p.sum()) / positives if positives > 0 else math.nan


def gauc(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> float:
    """Group AUC: the AUC within each group (user), averaged with impression weights.

    ``sum_g n_g AUC_g / sum_g n_g`` over the groups that hold both a positive and a
    negative (others have no AUC and are left out), with ``n_g`` the group's
    impressions. Each ``AUC_g`` is exact with ties counted one half, as :func:`auc`.
    O(n log n).

    Args:
        scores: [n] real scores.
        labels: [n] values in {0, 1}.
        groups: [n] integer group ids (e.g. user ids).

    Returns:
        The GAUC, or NaN when no group holds both classes.

    Raises:
        TypeError: non-tensor inputs.
        ValueError: as :func:`auc`; ``groups`` of another shape or not integers.
    """
    s, y = _pair(scores, labels, "gauc")
    if not torch.is_tensor(groups):
        raise TypeError("gauc: groups must be a tensor")
    if groups.shape != scores.shape or groups.dtype.is_floating_point or groups.is_complex():
        raise ValueError(
            f"gauc: groups must be integers of the scores' shape {tuple(scores.shape)}, got "
            f"{groups.dtype} {tuple(groups.shape)}"
        )
    if s.numel() == 0:
        return math.nan
    g = groups.detach().to("cpu", torch.int64)
    s = _rank_key(scores, s)
    # Sort by (group, score): stable sorts, the last key first.
    order = torch.argsort(s, stable=True)
    order = order[torch.argsort(g[order], stable=True)]
    g, s, y = g[order], s[order], y[order]
    n = g.numel()
    idx = torch.arange(n, dtype=torch.float64)
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = g[1:] != g[:-1]
    new_run = new_group.clone()
    new_run[1:] |= s[1:] != s[:-1]
    group_id = new_group.cumsum(0) - 1
    run_id = new_run.cumsum(0) - 1
    group_start = idx[new_group][group_id]
    run_first = idx[new_run]
    run_last = torch.cat([run_first[1:] - 1.0, torch.tensor([n - 1.0], dtype=torch.float64)])
    # 1-based rank inside the group, ties sharing the mean of the ranks they span.
    rank = (run_first[run_id] + run_last[run_id]) / 2.0 - group_start + 1.0
    ng = int(group_id[-1]) + 1
    pos = torch.zeros(ng, dtype=torch.float64).index_add_(0, group_id, y)
    size = torch.zeros(ng, dtype=torch.float64).index_add_(0, group_id, torch.ones_like(y))
    rank_pos = torch.zeros(ng, dtype=torch.float64).index_add_(0, group_id, rank * y)
    neg = size - pos
    ok = (pos > 0) & (neg > 0)
    if not bool(ok.any()):
        return math.nan
    per_group = (rank_pos[ok] - pos[ok] * (pos[ok] + 1.0) / 2.0) / (pos[ok] * neg[ok])
    return float((per_group * size[ok]).sum() / size[ok].sum())


def task_metrics(
    p_ctr: torch.Tensor,
    p_cvr: torch.Tensor | None,
    click: torch.Tensor,
    conversion: torch.Tensor | None,
    users: torch.Tensor | None = None,
) -> dict[str, float]:
    """Metrics of the tasks from per-impression predictions and labels (all [n]).

    CTR metrics are over every impression. CVR (P(conversion | click)) metrics are over
    clicked impressions only, the population where the task is defined; CTCVR metrics
    score ``p_ctr * p_cvr`` against conversions over every impression (the ESMM view).

    Args:
        p_ctr, click: CTR predictions and labels.
        p_cvr, conversion: CVR predictions and conversion labels; ``None`` for a
            CTR-only model (the CVR entries are then left out).
        users: int [n] user of each impression, for ``ctr_gauc``; ``None`` leaves it out.

    Returns:
        ``{"ctr_auc", "ctr_gauc", "ctr_ne", "ctr_calibration", "cvr_auc", "cvr_ne",
        "ctcvr_auc"}`` as available (NaN where a population lacks a class).

    Raises:
        TypeError: non-tensor or complex inputs (``conversion`` None while ``p_cvr`` is
            given).
        ValueError: inputs not 1-D of one length, non-finite predictions, predictions
            outside [0, 1], labels not in {0, 1}, ``users`` not integers of that length.
            All checked before any metric.
    """
    _pair(p_ctr, click, "task_metrics", "p_ctr", "click")
    probs = [("p_ctr", p_ctr)]
    if p_cvr is not None:
        if conversion is None:
            raise TypeError(
                "task_metrics: conversion must be a tensor when p_cvr is given, got None"
            )
        _pair(p_cvr, conversion, "task_metrics", "p_cvr", "conversion")
        if p_ctr.shape != p_cvr.shape:
            raise ValueError(
                f"task_metrics: p_ctr and p_cvr must have one length, got "
                f"{tuple(p_ctr.shape)} and {tuple(p_cvr.shape)}"
            )
        probs.append(("p_cvr", p_cvr))
    for arg, p in probs:
        if bool(((p < 0) | (p > 1)).any()):
            raise ValueError(f"task_metrics: {arg} must lie in [0, 1]")
    if users is not None:
        if not torch.is_tensor(users):
            raise TypeError(f"task_metrics: users must be a tensor, got {type(users).__name__}")
        if users.shape != p_ctr.shape or users.dtype.is_floating_point or users.is_complex():
            raise ValueError(
                f"task_metrics: users must be integers of p_ctr's shape {tuple(p_ctr.shape)}, "
                f"got {users.dtype} {tuple(users.shape)}"
            )
    out = {
        "ctr_auc": auc(p_ctr, click),
        "ctr_ne": normalized_entropy(p_ctr, click),
        "ctr_calibration": calibration(p_ctr, click),
    }
    if users is not None:
        out["ctr_gauc"] = gauc(p_ctr, click, users)
    if p_cvr is None or conversion is None:
        return out
    clicked = click.detach().to("cpu") == 1
    cvr_scores, cvr_labels = (
        p_cvr.detach().to("cpu")[clicked],
        conversion.detach().to("cpu")[clicked],
    )
    has_clicks = bool(clicked.any())
    out.update(
        cvr_auc=auc(cvr_scores, cvr_labels) if has_clicks else math.nan,
        cvr_ne=normalized_entropy(cvr_scores, cvr_labels) if has_clicks else math.nan,
        # The product in float64 (as every metric computes): in the inputs' dtype it rounds
        # (float16 / bfloat16 underflow small CTR x CVR products to 0), which creates
        # ties and reorders near-equal products, so the AUC changes.
        ctcvr_auc=auc(
            p_ctr.detach().to("cpu", torch.float64) * p_cvr.detach().to("cpu", torch.float64),
            conversion,
        ),
    )
    return out


class WindowedAUC:
    """AUC over the predictions of the last ``window`` updates (e.g. training steps).

    Cheap enough to call every step at test/CPU scale: it keeps at most ``window``
    chunks and recomputes the exact AUC on demand.

    Raises:
        TypeError: ``window`` is not an int; :meth:`update` with non-tensors.
        ValueError: ``window < 1``; :meth:`update` with inputs :func:`auc` rejects.
    """

    def __init__(self, window: int):
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int, got {type(window).__name__} {window!r}")
        if window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self._chunks: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque(
            maxlen=window
        )

    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """Append one chunk ([n] scores and {0, 1} labels; copied to the CPU).

        Raises:
            TypeError, ValueError: as :func:`auc`, when the chunk is added (not later,
                when the window's AUC is computed).
        """
        for arg, t in (("scores", scores), ("labels", labels)):
            if not torch.is_tensor(t):
                raise TypeError(f"WindowedAUC.update: {arg} must be a tensor, got {type(t)}")
        # A real copy (``.float().cpu()`` of a float32 CPU tensor is the tensor itself, so a
        # caller refilling its buffer rewrote chunks already in the window), in the scores'
        # own dtype (float32 merged float64 scores closer than its precision into ties;
        # integer scores stay exact, as auc() ranks them).
        s = scores.detach().to("cpu", copy=True)
        y = labels.detach().to("cpu", copy=True)
        _pair(s, y, "WindowedAUC.update")  # on the CPU copy: no second transfer
        self._chunks.append((s, y.float()))  # 0 / 1 (checked): exact in float32

    def state_dict(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The chunks in the window (for checkpoints)."""
        return {"chunks": list(self._chunks)}

    def load_state_dict(self, state: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Restore chunks saved by :meth:`state_dict` (the newest ``window`` are kept)."""
        self._chunks.clear()
        self._chunks.extend(state["chunks"])

    def compute(self) -> float:
        """The AUC over the window; NaN if empty or single-class."""
        if not self._chunks:
            return math.nan
        scores = [c[0] for c in self._chunks]
        # Chunks keep their dtype; mixed, they meet in float64 (torch.cat would promote
        # int64 + float32 to float32).
        if len({t.dtype for t in scores}) > 1:
            scores = [t.double() for t in scores]
        s = torch.cat(scores)
        y = torch.cat([c[1] for c in self._chunks])
        return auc(s, y)
