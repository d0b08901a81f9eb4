"""Load-imbalance metrics over a (steps x ranks) matrix of per-rank step costs.

In synchronous data parallelism a step takes as long as its slowest rank, so the
throughput lost to imbalance is ``sum_s max_r c[s, r] / sum_s mean_r c[s, r] - 1``:
:attr:`ImbalanceStats.excess`, the "excess of max over mean step cost".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hyperrec.bbs._validate import as_costs

__all__ = ["ImbalanceStats", "per_step_ratios"]


def per_step_ratios(step_costs: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ``max_r / mean_r`` and ``p99_r / mean_r`` (for logging every step).

    Args:
        step_costs: ``(ranks,)`` costs of one step, or ``(steps, ranks)``, non-negative
            (e.g. what a training loop all-gathers for its logs).

    Returns:
        Two float64 arrays of shape ``(steps,)`` (``(1,)`` for one step). A step whose
        ranks all cost 0 counts as balanced (ratio 1).

    Raises:
        TypeError / ValueError: non-numeric, negative/NaN/inf, not 1-D/2-D, or empty.
    """
    c = as_costs("step_costs", step_costs, ndim=(1, 2))
    c = c[None] if c.ndim == 1 else c
    if c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"step_costs must have >= 1 step and >= 1 rank, got {c.shape}")
    # The ratios do not depend on each step's scale; taken at the scale of its own max
    # (a power of two, so exact), huge finite costs (1e308) cannot overflow the mean's
    # sum to inf, which read as a ratio of 0.
    c = _power_of_two_scaled(c, axis=1)
    mean = c.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    mx = np.where(mean > 0, c.max(axis=1) / safe, 1.0)
    p99 = np.where(mean > 0, np.percentile(c, 99, axis=1) / safe, 1.0)
    return mx, p99


@dataclass(frozen=True, kw_only=True)
class ImbalanceStats:
    """Summary of per-step, cross-rank imbalance. Build with :meth:`from_step_costs`."""

    steps: int
    """Number of steps summarised."""
    ranks: int
    """Number of ranks per step."""
    excess: float
    """``sum_s max_r / sum_s mean_r - 1``: time lost to waiting for the slowest rank,
    relative to perfect balance (0 = balanced; 0.15 = the slowest rank is 15% over)."""
    mean_step_excess: float
    """Mean over steps of ``max_r / mean_r - 1``."""
    p99_step_excess: float
    """99th percentile over steps of ``max_r / mean_r - 1``."""
    worst_step_excess: float
    """Largest ``max_r / mean_r - 1`` of any step."""
    p99_rank_over_mean: float
    """Mean over steps of ``p99_r / mean_r``: the tail of ranks short of the very max."""
    mean_cost: float
    """Mean per-rank step cost over all steps and ranks."""

    @classmethod
    def from_step_costs(cls, step_costs: Any) -> ImbalanceStats:
        """Summarise ``(steps, ranks)`` non-negative costs (numpy, torch or nested lists).

        A step whose ranks all cost 0 counts as balanced (ratio 1).

        Raises:
            TypeError: non-numeric input.
            ValueError: not 2-D, an empty axis, negative/NaN/inf entries.
        """
        c = as_costs("step_costs", step_costs, ndim=2)
        ratio, p99_ratio = per_step_ratios(c)
        # As in per_step_ratios: sums at the scale of the largest cost (a power of two),
        # so huge finite costs do not overflow to inf; mean_cost is scaled back.
        exponent = _max_exponent(c)
        c = np.ldexp(c, -exponent)
        mean, mx = c.mean(axis=1), c.max(axis=1)
        total_mean = mean.sum()
        return cls(
            steps=int(c.shape[0]),
            ranks=int(c.shape[1]),
            excess=float(mx.sum() / total_mean - 1.0) if total_mean > 0 else 0.0,
            mean_step_excess=float(ratio.mean() - 1.0),
            p99_step_excess=float(np.percentile(ratio, 99) - 1.0),
            worst_step_excess=float(ratio.max() - 1.0),
            p99_rank_over_mean=float(p99_ratio.mean()),
            mean_cost=float(np.ldexp(c.mean(), exponent)),
        )

    def reduction_vs(self, baseline: ImbalanceStats) -> float:
        """Fraction of ``baseline.excess`` removed: ``1 - excess / baseline.excess``.

        Raises:
            TypeError: ``baseline`` is not an :class:`ImbalanceStats`.
            ValueError: the baseline has no excess to remove.
        """
        if not isinstance(baseline, ImbalanceStats):
            raise TypeError(f"baseline must be ImbalanceStats, got {type(baseline).__name__}")
        if baseline.excess <= 0:
            raise ValueError("baseline.excess is 0: nothing to reduce")
        return 1.0 - self.excess / baseline.excess

    def as_dict(self) -> dict[str, float | int]:
        """Plain dict (JSON-ready)."""
        return asdict(self)


def _max_exponent(c: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Binary exponent ``e`` of the largest entry (``max < 2**e``; 0 where all are 0)."""
    return np.frexp(c.max(axis=axis, keepdims=axis is not None))[1]


def _power_of_two_scaled(c: np.ndarray, axis: int) -> np.ndarray:
    """``c`` divided along ``axis`` by a power of two that brings its max into [0.5, 1)."""
    return np.ldexp(c, -_max_exponent(c, axis))
