"""Region budgets that were accepted but not held: a region autoac cannot checkpoint
(its held bytes read as its inputs alone), a budgeted region forced checkpointed in the
step's floor (a feasible global budget refused), and compiled regions whose graphs hold
more than their budget (no replan, no report)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from autoac_cases import attn_tower, step_for
from test_autoac_accounting_adversarial import _FloorTower
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import apply_plan

FLOPS = autoac.ProfileConfig(steps=1, cost="flops")
D = 16


class _Blk(nn.Module):
    def __init__(self, h: int, inplace: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.inplace = nn.Linear(D, h), nn.Linear(h, D), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            x.mul_(0.5)  # writes its input: autoac leaves the region as it is
        return x + self.b(torch.tanh(self.a(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList([_Blk(64), _Blk(256, inplace=True), _Blk(64)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x * 1.0)
        return x


def _saved_bytes(model: nn.Module, step, name: str) -> int:
    """Bytes of the distinct storages the region's forward saves for its backward, other
    than its inputs and the parameters."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    sub = model.get_submodule(name)
    fwd = sub.forward

    def wrapped(*a, **k):
        skip.update(x.untyped_storage().data_ptr() for x in a if isinstance(x, torch.Tensor))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return fwd(*a, **k)

    sub.forward = wrapped
    try:
        step(model).backward()
    finally:
        del sub.forward
    return sum(seen.values())


def test_plain_region_budget_counts_what_it_saves() -> None:
    torch.manual_seed(0)
    m = _Model()
    x = torch.randn(512, D)

    def step(mm: nn.Module) -> torch.Tensor:
        return mm(x.clone()).square().mean()

    prof = autoac.profile(m, step, config=FLOPS)
    r1 = prof.regions[1]
    assert r1.modes == ("none",)
    saved = _saved_bytes(m, step, "layers.1")
    assert r1.plain_held_bytes == saved > 10 * r1.input_bytes
    with pytest.raises(ValueError, match=r"region_budgets\['layers.1'\].*cannot checkpoint"):
        autoac.plan(prof, region_budgets={"layers.1": r1.input_bytes})
    held = r1.input_bytes + r1.plain_held_bytes
    p = autoac.plan(prof, region_budgets={"layers.1": held})
    assert p.regions[1].held_bytes == held
    assert p.regions[1].noac_held_bytes == held
    h = apply_plan(m, p)
    try:
        assert autoac.measure_step(m, step).peak_bytes <= p.predicted_peak
    finally:
        h.remove()


def test_budgeted_region_may_stay_unchecked_in_the_floor() -> None:
    """A region whose checkpoint raises the peak, given a budget that its un-checkpointed
    held bytes fit: the step's floor must not force it checkpointed."""
    torch.manual_seed(4)
    model = _FloorTower()
    step = step_for(torch.randn(32, 32))
    prof = autoac.profile(model, step, config=FLOPS)
    free = autoac.plan(prof, budget=1e15)
    lo = autoac.plan(prof, budget=free.floor)
    for r in lo.regions:
        rb = {r.name: 10 * max(r.noac_held_bytes, r.held_bytes)}
        p = autoac.plan(prof, budget=free.floor, region_budgets=rb)  # was a ValueError
        assert p.predicted_peak <= free.floor
        assert p.regions[[x.name for x in p.regions].index(r.name)].held_bytes <= rb[r.name]
        h = apply_plan(model, p)
        try:
            assert autoac.measure_step(model, step).peak_bytes <= free.floor
        finally:
            h.remove()


@pytest.mark.skipif(
    not autoac.compiled_packing_supported(), reason="torch does not inline saved-tensor hooks"
)
def test_compiled_region_budgets_replanned_or_reported() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, step = attn_tower(n=3, dim=64, heads=4), step_for(torch.randn(2, 64, 64))
    cfg = autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",))
    prof = autoac.for_compiled_packing(autoac.profile(model, step, config=cfg))
    free = autoac.plan(prof, budget=1e15)
    eager = autoac.plan(prof, budget=free.floor + 0.1 * (free.no_ac_peak - free.floor))
    # tight for the eager plan; the compiled graphs of these regions save more
    rb = {r.name: r.held_bytes for r in eager.regions}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = autoac.apply(
            copy.deepcopy(model),
            region_budgets=rb,
            step_fn=step,
            formats=("mxint8",),
            profile_config=cfg,
            compile=True,
            compile_kwargs={"backend": "aot_eager"},
            verify=True,
        )
    over = {r.name: r.held_bytes - rb[r.name] for r in h.plan.regions if r.held_bytes > rb[r.name]}
    v = h.verification
    assert v["region_overshoots"] == over
    assert v["within_region_budgets"] is (not over)
    if over:  # not silently: a warning names the regions
        assert any("hold more than their budgets" in str(w.message) for w in caught)
    torch._dynamo.reset()
