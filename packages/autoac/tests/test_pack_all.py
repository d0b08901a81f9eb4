"""``PlanConfig(strategy="pack_all")``: every saved tensor packed, nothing recomputed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import mlp_tower, step_for

from hyperrec import autoac
from hyperrec.autoac.formats import SAVE_FORMATS

FLOPS = autoac.ProfileConfig(cost="flops", steps=1)
PACK_ALL = autoac.PlanConfig(strategy="pack_all")


def _profile(model, step, formats=("mxint8",), bound=1.0):
    cfg = dataclasses.replace(FLOPS, formats=formats, min_pack_bytes=4096, max_grad_error=bound)
    return autoac.profile(model, step, config=cfg)


def _expected(prof, formats):
    """What pack_all must decide per region, from the profile alone: every needed op
    packed in the first allowed format it passed, if any of its storages is large enough."""
    out = {}
    for r in prof.regions:
        saves = {}
        for o in r.ops:
            if not o.needed or o.collective:
                continue
            fmt = next((f for f in formats if f in o.formats), None)
            big = any(lv.nbytes >= prof.config.min_pack_bytes for lv in o.storages)
            if fmt is not None and big:
                saves[o.key] = fmt
        out[r.name] = saves
    return out


def test_pack_all_packs_every_allowed_save_and_recomputes_nothing():
    model = mlp_tower(n=3, dim=32)
    step = step_for(torch.randn(256, 32))
    prof = _profile(model, step)
    p = autoac.plan(prof, config=PACK_ALL)
    assert p.solver == "pack_all" and p.budget is None and not p.proven_optimal
    assert all(r.mode == "none" for r in p.regions)
    exp = _expected(prof, ("mxint8",))
    assert any(exp.values())
    for r in p.regions:
        packed = {k: d for k, d in r.saves.items() if d in SAVE_FORMATS}
        assert packed == exp[r.name], r.name
    # nothing recomputed: a region in mode "none" lists only what it packs
    assert all(d in SAVE_FORMATS for r in p.regions for d in r.saves.values())
    # the plan holds less than no AC at the held positions
    assert sum(r.held_bytes for r in p.regions) < sum(r.noac_held_bytes for r in p.regions)


def test_pack_all_prefers_the_first_format_each_class_passed():
    model = mlp_tower(n=2, dim=32)
    step = step_for(torch.randn(256, 32))
    prof = _profile(model, step, formats=("mxfp8", "mxint8"))
    for order in (("mxfp8", "mxint8"), ("mxint8", "mxfp8")):
        p = autoac.plan(prof, config=dataclasses.replace(PACK_ALL, formats=order))
        exp = _expected(prof, order)
        used = {d for r in p.regions for d in r.saves.values() if d in SAVE_FORMATS}
        assert used == {order[0]}
        for r in p.regions:
            assert {k: d for k, d in r.saves.items() if d in SAVE_FORMATS} == exp[r.name]


def test_pack_all_peak_as_predicted_and_gradients_within_bound():
    torch.manual_seed(0)
    model = mlp_tower(n=3, dim=48, seed=3)
    x = torch.randn(384, 48)
    step = step_for(x)
    ref = autoac.measure_step(model, step, keep_grads=True)
    h = autoac.apply(
        model,
        step_fn=step,
        formats=("mxint8",),
        profile_config=dataclasses.replace(FLOPS, min_pack_bytes=4096, max_grad_error=0.05),
        plan_config=PACK_ALL,
    )
    try:
        v = h.verification
        assert h.plan.packed and v["budget"] is None and v["within_budget"] is None
        assert abs(v["peak_ratio"] - 1) <= 0.10
        assert v["measured_peak"] < ref.peak_bytes
        assert v["grad_error"] is not None and v["grad_error"] <= 0.05
    finally:
        h.remove()


def test_pack_all_budget_checked_not_searched():
    model = mlp_tower(n=3, dim=32)
    step = step_for(torch.randn(256, 32))
    prof = _profile(model, step)
    p = autoac.plan(prof, config=PACK_ALL)
    same = autoac.plan(prof, budget=p.predicted_peak, config=PACK_ALL)
    assert same.regions == p.regions and same.budget == p.predicted_peak
    # a budget between the floor and the packed peak: an error naming the packed peak,
    # not a searched plan
    below = (p.floor + p.predicted_peak) // 2
    assert p.floor < below < p.predicted_peak
    with pytest.raises(ValueError, match=rf"budget must be >= {p.predicted_peak} .*pack_all"):
        autoac.plan(prof, budget=below, config=PACK_ALL)
    name = p.regions[0].name
    held = p.regions[0].held_bytes
    with pytest.raises(ValueError, match=rf"region_budgets\['{name}'\] must be >= {held} "):
        autoac.plan(prof, region_budgets={name: held - 1}, config=PACK_ALL)
    ok = autoac.plan(prof, region_budgets={name: held}, config=PACK_ALL)
    assert ok.regions == p.regions


def test_pack_all_needs_a_format_and_a_known_strategy():
    model = mlp_tower(n=2, dim=32)
    step = step_for(torch.randn(128, 32))
    prof = autoac.profile(model, step, config=FLOPS)
    with pytest.raises(ValueError, match="strategy='pack_all' needs a packed format"):
        autoac.plan(prof, config=PACK_ALL)
    with pytest.raises(ValueError, match="budget or region_budgets must be given"):
        autoac.plan(prof)
    with pytest.raises(ValueError, match="strategy"):
        autoac.PlanConfig(strategy="all")
    with pytest.raises(ValueError, match="budget or region_budgets must be given"):
        autoac.apply(model, step_fn=step, profile_config=FLOPS)


def test_step_measurement_base_bytes_and_the_packed_cut():
    """``base_bytes`` counts what the step found (parameters, its input), so
    ``step_bytes`` is what it allocated; pack_all allocates less than no AC."""
    model = mlp_tower(n=3, dim=48, seed=1)
    x = torch.randn(384, 48)
    step = step_for(x)
    m = autoac.measure_step(model, step)
    params = sum(p.nbytes for p in model.parameters())
    assert m.base_bytes is not None and m.base_bytes >= params + x.nbytes
    assert m.step_bytes == m.peak_bytes - m.base_bytes > 0
    prof = _profile(model, step)
    h = autoac.apply_plan(model, autoac.plan(prof, config=PACK_ALL))
    try:
        packed = autoac.measure_step(model, step)
    finally:
        h.remove()
    assert packed.base_bytes == m.base_bytes
    assert packed.step_bytes < m.step_bytes
    untracked = autoac.measure_step(model, step, track=False)
    assert untracked.base_bytes is None and untracked.step_bytes is None
