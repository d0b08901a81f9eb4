"""Review of 0.1.16's ``strategy="pack_all"``: budget checks and a failed ``apply``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import regions as _regions
from hyperrec.autoac import runtime

PACK_ALL = autoac.PlanConfig(strategy="pack_all")
CFG = autoac.ProfileConfig(
    cost="flops", steps=1, formats=("mxint8",), min_pack_bytes=4096, max_grad_error=1.0
)


class _Wide(nn.Module):
    """A saved activation (``a``'s output, saved by ``b``) and a large temporary that a
    checkpoint recomputes: packing alone peaks below full recompute."""

    def __init__(self, d: int = 64, w: int = 2048) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(d, d), nn.Linear(d, w), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        t = self.c(x).sum(-1, keepdim=True)
        return x + self.b(a) + t


class _Tower(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_pack_all_budget_at_its_peak_accepted_when_below_the_floor():
    torch.manual_seed(0)
    model = _Tower([_Wide() for _ in range(2)])
    x = torch.randn(1024, 64)
    prof = autoac.profile(model, lambda m: m(x).square().mean(), config=CFG)
    p = autoac.plan(prof, config=PACK_ALL)
    assert p.predicted_peak < p.floor  # the case: least_peak does not try packed saves
    same = autoac.plan(prof, budget=p.predicted_peak, config=PACK_ALL)
    assert same.regions == p.regions
    with pytest.raises(ValueError, match=rf"budget must be >= {p.predicted_peak} .*pack_all"):
        autoac.plan(prof, budget=p.predicted_peak - 1, config=PACK_ALL)


def test_failed_apply_leaves_no_region_installed(monkeypatch):
    """A pack_all plan whose verification drops a class packs less, so a budget that held
    the first plan no longer does: apply raises, and must not leave the model wrapped."""
    torch.manual_seed(0)
    model = _Tower(
        [nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 64)) for _ in range(3)]
    )
    x = torch.randn(512, 64)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    p = autoac.plan(autoac.profile(model, step, config=CFG), config=PACK_ALL)
    assert p.packed
    # every measured error over the bound: the verification drops packed classes
    monkeypatch.setattr(runtime, "grad_error", lambda ref, got: 1e9)
    with pytest.raises(ValueError, match="pack_all"):
        autoac.apply(
            model,
            budget=p.predicted_peak,
            step_fn=step,
            formats=("mxint8",),
            profile_config=CFG,
            plan_config=PACK_ALL,
        )
    assert not list(_regions.installed_regions(model))
