"""``calibrate_none`` / ``apply(compile=True, calibrate_none=True)`` (experimental,
0.1.21): an un-checkpointed region priced at what its compiled graph saves before the
plan is made, not at the eager step's saves.

The chain tower's compiled graphs save the first matmul's output and recompute the
element-wise chain the eager step saved link by link, so the eager prices hold every
un-checkpointed region at several times its graph's bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import step_for
from test_compiled_headroom import FLOPS, PARTITION, ChainTower

from hyperrec import autoac
from hyperrec.autoac import runtime as rt
from hyperrec.autoac._backward_mem import allocation_peak


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_peak(model, step) -> int:
    """Bytes a compiled step allocates at its peak beyond what it started with (after a
    step that compiled it), from the CPU allocator's events."""
    step(model).backward()
    for p in model.parameters():
        p.grad = None
    peak, _ = allocation_peak(lambda: step(model).backward())
    for p in model.parameters():
        p.grad = None
    return peak


def _case(formats: tuple[str, ...] = ()):
    """The chain tower, its step, its profile and that profile for compiled plans."""
    model = ChainTower()
    step = step_for(torch.randn(64, 64))
    raw = autoac.profile(model, step, config=dataclasses.replace(FLOPS, formats=formats))
    return model, step, raw, autoac.for_compiled_packing(raw)


def _fused(region) -> list:
    return [o for o in region.ops if o.needed and not o.is_input and rt.fuses(o.op)]


def _fused_bytes(region) -> int:
    return sum(lv.nbytes for o in _fused(region) for lv in o.storages if lv.needed)


def _fused_held(profile) -> list[set[float]]:
    """Per region, the ``none_held`` of its fused ops."""
    return [{o.none_held for o in _fused(r)} for r in profile.regions]


def test_fractions_fit_the_saved_bytes_and_stay_in_range():
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    assert all(r.mode == "none" for r in whole.regions)
    r0, r1, r2 = prof.regions[:3]
    eager = {rp.name: rp.held_bytes - rp.input_bytes for rp in whole.regions}
    f0 = _fused_bytes(r0)
    assert f0 > 0
    saved = {
        r0.name: eager[r0.name] - f0 // 4,  # a quarter of the fused bytes recomputed
        r1.name: eager[r1.name] + 10**6,  # more than the eager step: clipped to 1
        r2.name: 0,  # less than the other ops alone: clipped to 0
    }
    cal = rt.calibrate_none(prof, whole, saved)
    held = dict(zip((r.name for r in cal.regions), _fused_held(cal), strict=True))
    (frac,) = held[r0.name]
    assert frac == pytest.approx(0.75, abs=1e-3)
    assert held[r1.name] == {1.0} and held[r2.name] == {0.0}
    # regions not named keep the eager prices; other ops keep everything
    assert cal.regions[3] == prof.regions[3]
    for r in cal.regions:
        assert all(o.none_held == 1.0 for o in r.ops if not rt.fuses(o.op) or o.is_input)
    # the planner now holds region 0 at the saved bytes
    again = autoac.plan(cal, budget=1e18)
    assert again.regions[0].held_bytes - again.regions[0].input_bytes == pytest.approx(
        saved[r0.name], rel=1e-3
    )


def test_a_checkpointed_region_takes_the_fit_of_an_identical_whole_one():
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    sac = dataclasses.replace(whole.regions[0], mode="sac")
    p = dataclasses.replace(whole, regions=(sac, *whole.regions[1:]))
    r1 = prof.regions[1]
    eager = whole.regions[1].held_bytes - whole.regions[1].input_bytes
    # only region 1 measured: a quarter of its fused bytes recomputed by its graph
    cal = rt.calibrate_none(prof, p, {r1.name: eager - _fused_bytes(r1) // 4})
    # the layers are identical: every one gets region 1's fit
    for fused in _fused_held(cal):
        assert len(fused) == 1 and fused.pop() == pytest.approx(0.75, abs=1e-3)
    # a region whose fused ops differ (here: other bytes) keeps the eager prices
    r3 = prof.regions[3]
    i = next(k for k, o in enumerate(r3.ops) if rt.fuses(o.op) and o.needed)
    odd_op = dataclasses.replace(r3.ops[i], nbytes=r3.ops[i].nbytes + 1)
    odd = dataclasses.replace(r3, ops=(*r3.ops[:i], odd_op, *r3.ops[i + 1 :]))
    prof2 = dataclasses.replace(prof, regions=(*prof.regions[:3], odd))
    cal2 = rt.calibrate_none(prof2, p, {r1.name: eager - _fused_bytes(r1) // 4})
    assert cal2.regions[3] == odd
    assert cal2.regions[0] != prof2.regions[0]


def test_calibrate_none_checks():
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    with pytest.raises(TypeError, match="profile_"):
        rt.calibrate_none(whole, whole, {})
    with pytest.raises(TypeError, match="plan_"):
        rt.calibrate_none(prof, prof, {})
    with pytest.raises(TypeError, match="saved"):
        rt.calibrate_none(prof, whole, [1, 2])
    short = dataclasses.replace(whole, regions=whole.regions[:2])
    with pytest.raises(ValueError, match="regions"):
        rt.calibrate_none(prof, short, {})
    with pytest.raises(ValueError, match="saved"):
        rt.calibrate_none(prof, whole, {whole.regions[0].name: -1})


def test_apply_calibrated_prices_whole_regions_as_their_graphs_and_keeps_more_whole():
    model, step, raw, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    # the graphs of the whole plan, priced: what the calibrated planner should predict
    h = rt.AutoAC(model, whole, profile_=prof, compiled=True, compile_kwargs=PARTITION)
    priced = rt.price_compiled(h, step, seed=0)
    # and its compiled step's peak, measured (allocation events: the CPU tracker would
    # run the regions eagerly)
    measured = compiled_peak(model, step) + prof.resident_bytes
    h.remove()
    assert priced.predicted_peak < 0.9 * whole.predicted_peak  # the eager prices are high
    budget = whole.floor + 0.8 * (priced.predicted_peak - whole.floor)
    # No verification: on the CPU the measured step runs the regions eagerly (under the
    # memory tracker's dispatch mode), where an un-checkpointed region saves what the
    # eager step saves. The plans are held to the budget as priced from their graphs.
    common = dict(budget=budget, step_fn=step, profile_=raw, compile=True,
                  compile_kwargs=PARTITION, replan_peak=False, verify=False)  # fmt: skip
    plain = autoac.apply(model, **common)
    plain_plan = plain.plan
    plain.remove()
    cal = autoac.apply(model, calibrate_none=True, **common)
    try:
        assert cal.plan.pricing == "compiled" and plain_plan.pricing == "compiled"
        assert cal.plan.predicted_peak <= budget
        n_whole = sum(r.mode == "none" for r in cal.plan.regions)
        assert n_whole > sum(r.mode == "none" for r in plain_plan.regions)
        assert cal.plan.added_s < plain_plan.added_s
        # the calibrated profile holds an un-checkpointed region at its graph's bytes,
        # and (0.1.22) its backward at what the compiled backward allocated: the whole
        # plan's predicted peak is its compiled step's, which pricing the graphs' saves
        # alone missed (the compiled backwards recompute the chains the eager one read)
        cal_whole = autoac.plan(cal.profile, budget=1e18)
        assert cal_whole.predicted_peak == pytest.approx(measured, rel=0.02)
        assert abs(priced.predicted_peak - measured) > 0.03 * measured
    finally:
        cal.remove()


def test_calibrate_none_argument_checks():
    model, step, _, _ = _case()
    with pytest.raises(ValueError, match="calibrate_none=True needs compile=True"):
        autoac.apply(model, budget=1e9, step_fn=step, calibrate_none=True)
    with pytest.raises(TypeError, match="calibrate_none"):
        autoac.apply(model, budget=1e9, step_fn=step, compile=True, calibrate_none="yes")


def test_the_calibration_step_runs_the_plan_for_the_budget(monkeypatch):
    """Not the plan for an unbounded budget: that step would peak at no AC's memory,
    which the budget exists to avoid."""
    model, step, raw, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    budget = whole.floor + 0.7 * (whole.predicted_peak - whole.floor)
    at_budget = autoac.plan(prof, budget=budget, config=autoac.PlanConfig(formats=()))
    assert {r.mode for r in at_budget.regions} == {"none", "sac"}
    probes: list = []
    real = rt._graph_saves

    def spy(handle, *a, **k):
        probes.append(handle.plan)
        return real(handle, *a, **k)

    monkeypatch.setattr(rt, "_graph_saves", spy)
    h = autoac.apply(model, budget=budget, step_fn=step, profile_=raw, compile=True,
                     compile_kwargs=PARTITION, verify=False, calibrate_none=True)  # fmt: skip
    try:
        probe = probes[0]
        assert rt._decisions(probe) == rt._decisions(at_budget)
        assert probe.predicted_peak <= budget
        # the regions it left whole were measured, the others take their fit
        assert all(len(f) == 1 and f.pop() < 1.0 for f in _fused_held(h.profile))
    finally:
        h.remove()


def test_no_unpacked_plan_within_the_budget_calibrates_nothing(monkeypatch):
    """``pack_all`` may be asked for less than full recompute's floor (packing every
    save can hold less); no unpacked plan fits such a budget: nothing is measured and
    the profile comes back as it was, for the plan itself to accept or refuse."""
    model, step, _, prof = _case()
    floor = autoac.plan(prof, budget=1e18).floor
    steps: list = []
    monkeypatch.setattr(rt, "_graph_saves", lambda *a, **k: steps.append(a) or {})
    cfg = autoac.PlanConfig(strategy="pack_all")
    out = rt._calibrated(model, prof, step, floor * 0.5, None, cfg, PARTITION)
    assert out is prof and not steps
