"""Cost models: how expensive a sub-batch of jagged sequences is to train.

The default is the usual transformer split: a per-token term (embeddings, projections,
MLPs: linear in the length ``L``) plus an attention term (quadratic in ``L``). Any
callable ``item -> float`` can be used instead wherever a cost model is accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperrec.bbs._validate import as_costs, check_float, check_int

__all__ = ["CostFn", "CostModel", "resolve_cost_fn"]


CostFn = Callable[[Any], float]
"""Any callable mapping one item (a sub-batch, a sample, ...) to a non-negative cost."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-sample cost ``constant + linear * L + quadratic * L**2``; a batch sums it.

    Calling the model on a sub-batch (its 1-D sequence lengths, or use
    :meth:`from_offsets` for jagged offsets) returns the sub-batch's cost. Fit the
    coefficients to profiled step times, or derive them from FLOPs, e.g. for a
    transformer block of width ``d`` the linear part is about ``24 d^2`` and the
    attention part ``4 d`` per token pair, i.e. ``quadratic / linear = 1 / (6 d)``.

    Raises:
        TypeError: a coefficient that is not a real number (bools rejected).
        ValueError: a negative, NaN or infinite coefficient.
    """

    linear: float = 1.0
    """Cost per token (per unit of length). Default 1: costs are in tokens."""
    quadratic: float = 0.0
    """Cost per squared length (the attention term). Default 0: pure token count."""
    constant: float = 0.0
    """Fixed cost per sample (per-sample features, candidates, heads). Default 0."""

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "constant"):
            check_float(name, getattr(self, name), minimum=0)

    def sample_costs(self, lengths: Any) -> np.ndarray:
        """Per-sample costs.

        Args:
            lengths: ``(n,)`` non-negative sequence lengths (ints or floats; numpy,
                torch or a sequence). Zero-length samples are valid.

        Returns:
            ``(n,)`` float64 costs.

        Raises:
            TypeError / ValueError: as :func:`as_costs` for ``lengths``; ValueError
                also if a cost overflows a float64.
        """
        lens = as_costs("lengths", lengths, ndim=1)
        with np.errstate(over="ignore"):  # an overflow raises below, naming the entry
            out = self.constant + lens * (self.linear + self.quadratic * lens)
        # Finite lengths and coefficients can still overflow (quadratic * 1e200**2): an
        # inf cost would only fail later, far from its cause, or poison sums silently.
        if out.size and not np.isfinite(out).all():
            bad = int(np.flatnonzero(~np.isfinite(out))[0])
            raise ValueError(
                f"lengths: entry {bad} ({lens[bad]!r}) gives a cost that overflows a float64"
            )
        return out

    def __call__(self, lengths: Any) -> float:
        """Cost of one sub-batch given its ``(n,)`` sequence lengths (a float).

        Raises:
            TypeError / ValueError: as :meth:`sample_costs`; ValueError also if the
                sub-batch's total overflows a float64.
        """
        with np.errstate(over="ignore"):  # an overflow raises below
            total = float(self.sample_costs(lengths).sum())
        if not np.isfinite(total):  # finite costs whose sum overflows
            raise ValueError("lengths: the sub-batch's total cost overflows a float64")
        return total

    def from_offsets(self, offsets: Any) -> float:
        """Cost of one jagged sub-batch given its ``(B+1,)`` offsets.

        Raises:
            TypeError: ``offsets`` not array-like of real numbers.
            ValueError: ``offsets`` empty, not 1-D, not starting at 0 or decreasing.
        """
        off = as_costs("offsets", offsets, ndim=1)
        if off.size == 0:
            raise ValueError("offsets must have at least one entry (B+1 with B >= 0)")
        if off[0] != 0:
            raise ValueError(f"offsets must start at 0, got {off[0]}")
        lens = np.diff(off)
        if (lens < 0).any():
            raise ValueError("offsets must be non-decreasing")
        return self(lens)

    @classmethod
    def transformer(cls, d_model: int, *, layers: int = 1, per_sample: float = 0.0) -> CostModel:
        """FLOP-proportional model of ``layers`` transformer blocks of width ``d_model``.

        ``linear = 24 * d_model**2 * layers`` (QKV, output and a 4x MLP, fwd FLOPs/2)
        and ``quadratic = 4 * d_model * layers`` (scores and values). Units: FLOPs/2.

        Raises:
            TypeError: ``d_model``/``layers`` not ints, ``per_sample`` not a number.
            ValueError: ``d_model``/``layers`` < 1, ``per_sample`` negative or not finite.
        """
        d = check_int("d_model", d_model, minimum=1)
        n = check_int("layers", layers, minimum=1)
        check_float("per_sample", per_sample, minimum=0)
        return cls(linear=24.0 * d * d * n, quadratic=4.0 * d * n, constant=per_sample)


def resolve_cost_fn(cost: CostModel | CostFn | None, name: str = "cost") -> CostFn:
    """A callable ``item -> float`` from a :class:`CostModel`, a callable, or ``None``.

    ``None`` means "each item's cost is the item itself" (items are numbers).

    Raises:
        TypeError: ``cost`` is neither ``None``, a :class:`CostModel` nor callable.
    """
    if cost is None:
        return _identity_cost
    if isinstance(cost, CostModel) or callable(cost):
        return cost
    raise TypeError(f"{name} must be a CostModel, a callable or None, got {type(cost).__name__}")


def _identity_cost(item: Any) -> float:
    # Items are their own cost: a non-number (a str that float() would parse included)
    # is a type error of the source, named as the cost it was meant to be.
    if isinstance(item, bool | str | bytes):
        raise TypeError(
            f"cost: with cost=None every item must be a real number, got {type(item).__name__}"
        )
    return float(item)


def checked_cost(fn: CostFn, item: Any, name: str = "cost") -> float:
    """``fn(item)`` as a float, rejecting negative, NaN or non-numeric results."""
    value = fn(item)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} returned {type(value).__name__}, expected a real number") from None
    if not np.isfinite(out) or out < 0:
        raise ValueError(f"{name} returned {out}; costs must be finite and non-negative")
    return out
