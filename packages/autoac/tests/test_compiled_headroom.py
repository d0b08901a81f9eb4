"""``apply(compile=True)``: plans raised into the memory their compiled graphs leave
unused, and recomputation priced as Inductor runs it by default (0.1.20).

A compiled region saves what AOTAutograd's partitioner chooses, which for element-wise
chains is far less than the eager step the profile measured (the partitioner keeps the
matmul outputs and recomputes the chain). A plan made on the eager prices then
recomputes whole regions while its graphs, priced, sit well under the budget: on an
H100 the plans asked for compiled no-AC's peak recomputed 3-5 of 8-12 regions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import mlp_tower, step_for
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import runtime as rt

FLOPS = autoac.ProfileConfig(cost="flops", steps=1, formats=())
PARTITION = {"backend": "aot_eager_decomp_partition"}


class ChainBlock(nn.Module):
    """Two matmuls around an element-wise chain: eager saves every link of the chain,
    the partitioner's graph only the first matmul's output (and recomputes the rest)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        a = nn.functional.gelu(h) * torch.sigmoid(h)
        return x + self.fc2(torch.tanh(a) * h)


class ChainTower(nn.Module):
    def __init__(self, n: int = 4, dim: int = 64, block: type[nn.Module] = ChainBlock) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([block(dim) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _chain_case(frac: float):
    model = ChainTower()
    step = step_for(torch.randn(64, 64))
    prof = autoac.profile(model, step, config=FLOPS)
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    return model, step, prof, free.floor + frac * (free.no_ac_peak - free.floor)


def _spy_pricing(monkeypatch) -> list:
    priced: list = []
    real = rt.price_compiled

    def spy(*a, **k):
        priced.append(real(*a, **k))
        return priced[-1]

    monkeypatch.setattr(rt, "price_compiled", spy)
    return priced


def test_compiled_plan_is_raised_into_the_headroom_its_graphs_leave(monkeypatch):
    model, step, prof, budget = _chain_case(0.6)
    priced = _spy_pricing(monkeypatch)
    h = autoac.apply(model, budget=budget, step_fn=step, profile_=prof, compile=True,
                     compile_kwargs=PARTITION)  # fmt: skip
    try:
        first = priced[0]
        # the eager prices made the first plan recompute a region its graph, priced,
        # had room to keep
        assert any(r.mode == "sac" for r in first.regions)
        assert first.predicted_peak < (1 - rt.PEAK_TOLERANCE) * budget
        assert len(priced) >= 2
        assert h.plan.added_s < first.added_s
        assert h.plan.predicted_peak <= budget
        assert h.plan.pricing == "compiled"
        # the planner's budget it ended with is above the one asked for, and the
        # measured step of the raised plan is within the budget
        assert h.verification["planned_budget"] > budget
        assert h.verification["within_budget"]
    finally:
        h.remove()


def price_over_after(monkeypatch, budget: float, n: int, seen=None) -> list:
    """``price_compiled`` priced as is for its first ``n`` calls and just over ``budget``
    after; the plans priced, in order (``seen(handle)`` called before each pricing)."""
    priced: list = []
    real = rt.price_compiled

    def spy(handle, *a, **k):
        if seen is not None:
            seen(handle)
        p = real(handle, *a, **k)
        if len(priced) >= n:
            p = dataclasses.replace(p, predicted_peak=int(budget) + 1)
        priced.append(p)
        return p

    monkeypatch.setattr(rt, "price_compiled", spy)
    return priced


def test_a_raised_plan_priced_over_the_budget_is_not_kept(monkeypatch):
    model, step, prof, budget = _chain_case(0.6)
    priced = price_over_after(monkeypatch, budget, 1)  # every replanned plan over
    h = autoac.apply(model, budget=budget, step_fn=step, profile_=prof, compile=True,
                     compile_kwargs=PARTITION, verify=False)  # fmt: skip
    try:
        assert len(priced) == 2  # one raise tried, then no more
        assert rt._decisions(h.plan) == rt._decisions(priced[0])
        assert h.plan.predicted_peak == priced[0].predicted_peak
    finally:
        h.remove()


@pytest.mark.parametrize("case", ["no_replan", "region_budgets"])
def test_no_raise_without_replanning_or_with_region_budgets(monkeypatch, case):
    model, step, prof, budget = _chain_case(0.6)
    kwargs: dict = {"replan_peak": False} if case == "no_replan" else {}
    if case == "region_budgets":
        # generous per-region budgets beside the step's: only the step budget is raised
        kwargs["region_budgets"] = {r.name: 10 * r.noac_held_bytes
                                    for r in autoac.plan(prof, budget=1e15).regions}  # fmt: skip
    priced = _spy_pricing(monkeypatch)
    h = autoac.apply(model, budget=budget, step_fn=step, profile_=prof, compile=True,
                     compile_kwargs=PARTITION, verify=False, **kwargs)  # fmt: skip
    try:
        assert len(priced) == 1
        assert any(r.mode == "sac" for r in h.plan.regions)
    finally:
        h.remove()


# --------------------------------------------------------------------------- fused_recompute
class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("compile_kwargs", "fused_recompute", "expected"),
    [
        (None, None, True),  # torch.compile's default backend is Inductor
        ({"backend": "inductor"}, None, True),
        (PARTITION, None, False),
        ({"backend": "inductor"}, False, False),
        (PARTITION, True, True),
    ],
)
def test_fused_recompute_defaults_to_inductor(monkeypatch, compile_kwargs, fused_recompute,
                                              expected):  # fmt: skip
    model = mlp_tower(n=2, dim=16)
    step = step_for(torch.randn(4, 16))
    prof = autoac.profile(model, step, config=FLOPS)
    seen = []

    def stop(p, *, fused_recompute=False):
        seen.append(fused_recompute)
        raise _Stop

    monkeypatch.setattr(rt, "for_compiled_packing", stop)
    with pytest.raises(_Stop):
        autoac.apply(model, budget=1e12, step_fn=step, profile_=prof, compile=True,
                     compile_kwargs=compile_kwargs, fused_recompute=fused_recompute)  # fmt: skip
    assert seen == [expected]


def test_fused_recompute_prices_the_fused_ops_free_in_the_handle_profile():
    model = mlp_tower(n=2, dim=16)
    step = step_for(torch.randn(4, 16))
    prof = autoac.profile(model, step, config=FLOPS)
    h = autoac.apply(model, budget=1e12, step_fn=step, profile_=prof, compile=True,
                     compile_kwargs=PARTITION, fused_recompute=True, verify=False)  # fmt: skip
    try:
        ops = [o for r in h.profile.regions for o in r.ops if not o.is_input]
        fused = [o for o in ops if rt.fuses(o.op)]
        assert fused and all(o.time_s == 0.0 for o in fused)
        assert any(o.time_s > 0 for o in ops if not rt.fuses(o.op))
    finally:
        h.remove()


def test_fused_recompute_checks():
    model = mlp_tower(n=2, dim=16)
    step = step_for(torch.randn(4, 16))
    with pytest.raises(ValueError, match="fused_recompute=True needs compile=True"):
        autoac.apply(model, budget=1e12, step_fn=step, fused_recompute=True)
    with pytest.raises(TypeError, match="fused_recompute"):
        autoac.apply(model, budget=1e12, step_fn=step, compile=True, fused_recompute=1)
    # False without compile is the eager default, not an error
    h = autoac.apply(model, budget=1e12, step_fn=step, fused_recompute=False, verify=False,
                     profile_config=FLOPS)  # fmt: skip
    h.remove()
