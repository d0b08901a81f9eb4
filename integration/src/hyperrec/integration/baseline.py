"""The popularity baseline: each item's smoothed click (and conversion) rate.

Counts come from the training impressions actually consumed (this rank's; summed over
ranks before use). An item's CTR estimate is shrunk towards the global rate,
``(clicks + a * global_ctr) / (impressions + a)`` with ``a = prior_strength``, so rare
items do not get extreme scores; the CVR estimate is ``(conversions + a * global_cvr) /
(clicks + a)``. It is the strongest non-personalised ranker for this data: it knows
every item's bias but nothing about the user.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["PopularityBaseline"]


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
            ValueError: item ids outside ``[0, num_items)`` or mismatched lengths.
        """
        items = items.detach().to("cpu", torch.int64)
        if items.shape != click.shape or items.shape != conversion.shape:
            raise ValueError("items, click and conversion must have the same shape")
        if items.numel() and (int(items.min()) < 0 or int(items.max()) >= self.num_items):
            raise ValueError(f"item ids must lie in [0, {self.num_items})")
        n = self.num_items
        self.counts[0] += torch.bincount(items, minlength=n)
        self.counts[1] += torch.bincount(
            items, weights=click.detach().cpu().double(), minlength=n
        ).long()
        self.counts[2] += torch.bincount(
            items, weights=conversion.detach().cpu().double(), minlength=n
        ).long()

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
            ValueError: a different shape.
        """
        counts = state["counts"]
        if tuple(counts.shape) != tuple(self.counts.shape):
            raise ValueError(
                f"counts shape {tuple(counts.shape)} != expected {tuple(self.counts.shape)}"
            )
        self.counts.copy_(counts)
