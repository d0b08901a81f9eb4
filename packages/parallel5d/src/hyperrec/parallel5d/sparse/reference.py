"""Single-process specs of the sparse subpackage (readable, float64-capable, CPU).

- :func:`lookup_reference`: every feature's output from full tables with
  ``torch.nn.functional.embedding`` / ``embedding_bag`` (what the collection computes).
- :func:`rowwise_adagrad_reference_`, :func:`lazy_adam_reference_`: the optimizers'
  rules, one row at a time, on a full table and its dense gradient, for an explicit set
  of touched rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from hyperrec.parallel5d.sparse.config import FeatureConfig

__all__ = ["lazy_adam_reference_", "lookup_reference", "rowwise_adagrad_reference_"]


def lookup_reference(
    weights: Mapping[str, torch.Tensor],
    features: Iterable[FeatureConfig],
    inputs: Mapping[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Outputs of every feature: ``[n, dim]`` rows for ``pooling="none"``, else the sum
    or mean of each bag (zeros for an empty bag). Differentiable in ``weights``."""
    out = {}
    for f in features:
        value = inputs[f.name]
        ids, offsets = value if isinstance(value, tuple | list) else (value, None)
        w = weights[f.table]
        if f.pooling == "none":
            out[f.name] = F.embedding(ids.long(), w)
        elif offsets is None:
            raise ValueError(f"inputs[{f.name!r}] must be (ids, offsets): the feature is pooled")
        else:
            out[f.name] = F.embedding_bag(
                ids.long(), w, offsets.long(), mode=f.pooling, include_last_offset=True
            )
    return out


@torch.no_grad()
def rowwise_adagrad_reference_(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    grad: torch.Tensor,
    touched: Iterable[int],
    *,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
    weight_decay_mode: str = "l2",
) -> None:
    """Row-wise Adagrad, one touched row at a time (in place on ``weight``/``momentum``)."""
    for r in sorted(set(int(x) for x in touched)):
        w = weight[r].double()
        g = grad[r].double()
        if weight_decay_mode == "l2":
            g = g + weight_decay * w
        m = float(momentum[r]) + float((g * g).sum()) / g.numel()
        momentum[r] = m
        if weight_decay_mode == "decoupled":
            w = w * (1.0 - lr * weight_decay)
        weight[r] = (w - lr / (math.sqrt(m) + eps) * g).to(weight.dtype)


@torch.no_grad()
def lazy_adam_reference_(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    touched: Iterable[int],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Lazy Adam (``torch.optim.SparseAdam``'s rule + decoupled decay), row by row."""
    c = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    for r in sorted(set(int(x) for x in touched)):
        g = grad[r].double()
        m = beta1 * exp_avg[r].double() + (1.0 - beta1) * g
        v = beta2 * exp_avg_sq[r].double() + (1.0 - beta2) * g * g
        exp_avg[r], exp_avg_sq[r] = m.to(exp_avg.dtype), v.to(exp_avg_sq.dtype)
        w = weight[r].double() * (1.0 - lr * weight_decay)
        weight[r] = (w - c * m / (v.sqrt() + eps)).to(weight.dtype)
