"""Baselines every run is scored against: item popularity and a logistic regression.

**Popularity**: each item's smoothed click (and conversion) rate.

Counts come from the training impressions actually consumed (this rank's; summed over
ranks before use). An item's CTR estimate is shrunk towards the global rate,
``(clicks + a * global_ctr) / (impressions + a)`` with ``a = prior_strength``, so rare
items do not get extreme scores; the CVR estimate is ``(conversions + a * global_cvr) /
(clicks + a)``. It is the strongest non-personalised ranker for this data: it knows
every item's bias but nothing about the user.

**Logistic regression** (:class:`LogisticRegressionBaseline`): the click logit is a
sum of one weight per item, per item category, per user, the mean weight of the
user's tags, and a linear term in the standardised dense features; fitted by up to 100
L-BFGS iterations on training impressions with a unit Gaussian prior on every weight.
It sees the user and the request's dense summary of the history (length,
positive rate) but not the order or content of the history: what the sequence model
adds over it is what reading the history is worth.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from hyperrec.integration.config import DataSchema
from hyperrec.integration.data import Batch

__all__ = ["LogisticRegressionBaseline", "PopularityBaseline"]


class PopularityBaseline:
    """Per-item impression / click / conversion counts and smoothed rates.

    Args:
        num_items: item vocabulary size.
        prior_strength: pseudo-impressions of the global rate added to every item (> 0).
    """

    def __init__(self, num_items: int, *, prior_strength: float = 10.0):
        if not isinstance(num_items, int) or num_items < 1:
            raise ValueError(f"num_items must be a positive int, got {num_items!r}")
        if not prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength!r}")
        self.num_items = num_items
        self.prior_strength = float(prior_strength)
        self.counts = torch.zeros(3, num_items, dtype=torch.int64)
        """int64 [3, num_items]: impressions, clicks, conversions (this rank's)."""

    def update(self, items: torch.Tensor, click: torch.Tensor, conversion: torch.Tensor) -> None:
        """Count one batch of impressions (all [C]; moved to the CPU).

        Raises:
            TypeError: non-tensor inputs, or ``items`` not of an integer dtype.
            ValueError: item ids outside ``[0, num_items)``, inputs not 1-D of one length,
                labels outside {0, 1}, or a conversion without a click.
        """
        for arg, t in (("items", items), ("click", click), ("conversion", conversion)):
            if not torch.is_tensor(t):
                raise TypeError(f"PopularityBaseline.update: {arg} must be a tensor")
        # Float ids were truncated to another item (2.9 -> 2) by the int64 cast.
        if items.dtype.is_floating_point or items.is_complex():
            raise TypeError(f"PopularityBaseline.update: items must be integers, got {items.dtype}")
        if items.dim() != 1 or items.shape != click.shape or items.shape != conversion.shape:
            raise ValueError(
                "PopularityBaseline.update: items, click and conversion must be 1-D of one "
                f"length, got {tuple(items.shape)}, {tuple(click.shape)}, "
                f"{tuple(conversion.shape)}"
            )
        items = items.detach().to("cpu", torch.int64)
        if items.numel() and (int(items.min()) < 0 or int(items.max()) >= self.num_items):
            raise ValueError(f"item ids must lie in [0, {self.num_items})")
        # The labels are summed as counts: a 2 counted two clicks and 0.5 was cast to 0,
        # and a conversion without a click gave an item more conversions than clicks.
        labels = {}
        for arg, t in (("click", click), ("conversion", conversion)):
            v = t.detach().cpu()
            if not bool(((v == 0) | (v == 1)).all()):
                raise ValueError(f"PopularityBaseline.update: {arg} labels must be 0 or 1")
            labels[arg] = v.to(torch.int64)
        if bool((labels["conversion"] > labels["click"]).any()):
            raise ValueError(
                "PopularityBaseline.update: conversion is 1 where click is 0 "
                "(a conversion needs a click)"
            )
        # O(batch) scatter-adds: a bincount of minlength num_items would touch every item
        # (8M in the gem preset, ~50 ms of the trainer's thread per step).
        self.counts[0].index_add_(0, items, torch.ones_like(items))
        self.counts[1].index_add_(0, items, labels["click"])
        self.counts[2].index_add_(0, items, labels["conversion"])

    def global_counts(self, device: torch.device | None = None) -> torch.Tensor:
        """The counts summed over every rank (a collective under torch.distributed)."""
        counts = self.counts.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            buf = counts.to(device) if device is not None else counts
            dist.all_reduce(buf)
            counts = buf.cpu()
        return counts

    @staticmethod
    def rates(
        counts: torch.Tensor, prior_strength: float = 10.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Smoothed (CTR, CVR) per item, float64 [num_items] each, from ``counts`` [3, n]."""
        impressions, clicks, convs = counts.double()
        a = prior_strength
        global_ctr = clicks.sum() / impressions.sum().clamp_min(1.0)
        global_cvr = convs.sum() / clicks.sum().clamp_min(1.0)
        return (clicks + a * global_ctr) / (impressions + a), (convs + a * global_cvr) / (
            clicks + a
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"counts": int64 [3, num_items]}``."""
        return {"counts": self.counts}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore counts saved by :meth:`state_dict`.

        Raises:
            TypeError: counts not an integer tensor.
            ValueError: a different shape, or negative counts.
        """
        counts = state["counts"]
        # copy_ into the int64 counts truncated float counts (2.7 -> 2) without a word.
        if not torch.is_tensor(counts) or counts.dtype.is_floating_point or counts.is_complex():
            got = counts.dtype if torch.is_tensor(counts) else type(counts).__name__
            raise TypeError(f"counts must be an integer tensor, got {got}")
        if tuple(counts.shape) != tuple(self.counts.shape):
            raise ValueError(
                f"counts shape {tuple(counts.shape)} != expected {tuple(self.counts.shape)}"
            )
        if counts.numel() and int(counts.min()) < 0:
            raise ValueError("counts must be non-negative")
        self.counts.copy_(counts)


class LogisticRegressionBaseline:
    """A CTR logistic regression over ids and dense features (see the module docstring).

    Weights exist only for the ids seen while fitting (an unseen id contributes 0, the
    prior mean), so fitting costs O(impressions) whatever the vocabulary sizes.

    Args:
        schema: the data's dense width (vocabularies are not needed).
    """

    _IDS = ("item", "category", "user", "tag")

    def __init__(self, schema: DataSchema):
        if not isinstance(schema, DataSchema):
            raise TypeError(f"schema must be a DataSchema, got {type(schema).__name__}")
        self.schema = schema
        f64 = torch.float64
        empty = torch.zeros(0, dtype=torch.int64)
        self.ids: dict[str, torch.Tensor] = {k: empty for k in self._IDS}
        """Sorted ids that have a weight, per id feature."""
        self.weights: dict[str, torch.Tensor] = {k: torch.zeros(0, dtype=f64) for k in self._IDS}
        self.weights["bias"] = torch.zeros(1, dtype=f64)
        self.weights["dense"] = torch.zeros(schema.num_dense, dtype=f64)
        self.dense_mean = torch.zeros(schema.num_dense, dtype=f64)
        self.dense_std = torch.ones(schema.num_dense, dtype=f64)
        self.fitted_impressions = 0

    @staticmethod
    def _features(batch: Batch) -> dict[str, torch.Tensor]:
        c_owner = torch.repeat_interleave(
            torch.arange(batch.num_requests), batch.candidate_offsets.diff().cpu()
        )
        return {
            "item": batch.candidate_items.cpu(),
            "category": batch.candidate_categories.cpu(),
            "owner": c_owner,
            "user": batch.user_ids.cpu(),
            "tag": batch.tags.cpu(),
            "tag_offsets": batch.tag_offsets.cpu(),
            "dense": batch.dense.cpu().double(),
        }

    def _slots(self, f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per id feature: the row of each id in the weights, or -1 when it has none."""
        out = {}
        for k in self._IDS:
            known, x = self.ids[k], f[k]
            if known.numel() == 0:
                out[k] = torch.full_like(x, -1)
                continue
            pos = torch.searchsorted(known, x).clamp_max(known.numel() - 1)
            out[k] = torch.where(known[pos] == x, pos, -1)
        return out

    def _logit(
        self, f: dict[str, torch.Tensor], slots: dict[str, torch.Tensor], w: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        def take(k: str) -> torch.Tensor:
            padded = torch.cat([w[k], w[k].new_zeros(1)])  # row -1: an unseen id, weight 0
            return padded[slots[k]]

        lengths = f["tag_offsets"].diff()
        request_owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        tag_sum = torch.zeros(lengths.numel(), dtype=torch.float64).index_add(
            0, request_owner, take("tag")
        )
        request = (
            take("user")
            + tag_sum / lengths.clamp_min(1)
            + ((f["dense"] - self.dense_mean) / self.dense_std) @ w["dense"]
        )
        return w["bias"] + take("item") + take("category") + request[f["owner"]]

    def fit(self, batches: Iterable[Batch], *, max_iter: int = 100) -> dict[str, Any]:
        """Fit on the impressions of ``batches`` (CPU, float64, deterministic L-BFGS).

        Returns:
            ``{"impressions", "iterations", "train_log_loss"}``.

        Raises:
            ValueError: no impressions.
        """
        feats, clicks = [], []
        for batch in batches:  # keep only the features: histories are not used
            feats.append(self._features(batch))
            clicks.append(batch.click.cpu().double())
        if not feats or sum(c.numel() for c in clicks) == 0:
            raise ValueError("LogisticRegressionBaseline.fit needs at least one impression")
        f = _concat_features(feats)
        y = torch.cat(clicks)
        self.dense_mean = f["dense"].mean(0)
        self.dense_std = f["dense"].std(0, unbiased=False).clamp_min(1e-6)
        self.ids = {k: torch.unique(f[k]) for k in self._IDS}
        slots = self._slots(f)
        n = y.numel()
        params = {
            k: torch.zeros(self.ids[k].numel(), dtype=torch.float64, requires_grad=True)
            for k in self._IDS
        }
        params["bias"] = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        params["dense"] = torch.zeros(
            self.schema.num_dense, dtype=torch.float64, requires_grad=True
        )
        opt = torch.optim.LBFGS(
            list(params.values()), max_iter=max_iter, line_search_fn="strong_wolfe",
            tolerance_grad=1e-9, tolerance_change=1e-12, history_size=20,
        )  # fmt: skip

        def closure() -> torch.Tensor:
            opt.zero_grad()
            logit = self._logit(f, slots, params)
            # A unit Gaussian prior on every weight but the intercept.
            prior = sum((p * p).sum() for k, p in params.items() if k != "bias")
            loss = F.binary_cross_entropy_with_logits(logit, y, reduction="sum") + 0.5 * prior
            (loss / n).backward()
            return loss / n

        opt.step(closure)
        self.weights = {k: v.detach() for k, v in params.items()}
        self.fitted_impressions = n
        with torch.no_grad():
            ll = F.binary_cross_entropy_with_logits(self._logit(f, slots, self.weights), y)
        return {
            "impressions": n,
            "iterations": int(opt.state[opt._params[0]].get("n_iter", 0)),
            "train_log_loss": float(ll),
        }

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """float64 [C] click probabilities of ``batch``'s candidates."""
        f = self._features(batch)
        return torch.sigmoid(self._logit(f, self._slots(f), self.weights))

    def state_dict(self) -> dict[str, Any]:
        """Ids, weights and the dense standardisation (CPU tensors)."""
        return {
            "ids": dict(self.ids),
            "weights": dict(self.weights),
            "dense_mean": self.dense_mean,
            "dense_std": self.dense_std,
            "fitted_impressions": self.fitted_impressions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (e.g. broadcast from the rank that fitted).

        Raises:
            ValueError: a dense weight of another width; ids that are not sorted and unique,
                or not one weight per id.
        """
        if state["weights"]["dense"].shape != self.weights["dense"].shape:
            raise ValueError(
                f"the dense weights have shape {tuple(state['weights']['dense'].shape)}, this "
                f"schema has {self.schema.num_dense} dense features"
            )
        # predict() finds an id's weight by binary search in ids: unsorted ids, or a weight
        # vector of another length, gave other ids' weights (or the unseen-id 0) silently.
        for k in self._IDS:
            ids, w = state["ids"][k], state["weights"][k]
            if ids.dim() != 1 or w.shape != ids.shape:
                raise ValueError(
                    f"ids[{k!r}] {tuple(ids.shape)} and weights[{k!r}] {tuple(w.shape)} must be "
                    "1-D of one length (one weight per id)"
                )
            if bool((ids[1:] <= ids[:-1]).any()):
                raise ValueError(f"ids[{k!r}] must be sorted and unique")
        self.ids = dict(state["ids"])
        self.weights = dict(state["weights"])
        self.dense_mean, self.dense_std = state["dense_mean"], state["dense_std"]
        self.fitted_impressions = state["fitted_impressions"]


def _concat_features(feats: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, list[torch.Tensor]] = {k: [] for k in feats[0]}
    requests = tag_base = 0
    for f in feats:
        out["owner"].append(f["owner"] + requests)
        out["tag_offsets"].append(f["tag_offsets"][(1 if requests else 0) :] + tag_base)
        for k in ("item", "category", "user", "tag", "dense"):
            out[k].append(f[k])
        requests += f["user"].numel()
        tag_base += int(f["tag_offsets"][-1])
    return {k: torch.cat(v) for k, v in out.items()}
