"""Review of ``calibrate_none`` / ``apply(compile=True, calibrate_none=True)`` (0.1.21):
cases the tests of the feature did not cover."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import step_for
from test_calibrate_none import (
    _case,
    _fresh_dynamo,  # noqa: F401  (autouse: fresh Dynamo)
    _fused_held,
)
from test_compiled_headroom import FLOPS, PARTITION, ChainBlock, ChainTower
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import runtime as rt


def _eager_saves(whole) -> dict[str, int]:
    """Bytes the graphs would save if they recomputed half of what eager saves."""
    return {r.name: (r.held_bytes - r.input_bytes) // 2 for r in whole.regions}


def _assert_whole_held(prof, held) -> None:
    """The plan for an unbounded budget on ``prof`` holds each region at ``held``."""
    for rp in autoac.plan(prof, budget=1e18).regions:
        assert rp.held_bytes - rp.input_bytes == pytest.approx(held[rp.name], rel=1e-3)


def test_calibrating_a_calibrated_profile_keeps_the_fit():
    # calibrate_none(profile_, plan_, saved) with plan_ made from profile_: a profile
    # already calibrated (none_held < 1) was reset to the eager prices (excess 0 ->
    # fraction 1), not held at the saved bytes
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    saved = _eager_saves(whole)
    once = rt.calibrate_none(prof, whole, saved)
    twice = rt.calibrate_none(once, autoac.plan(once, budget=1e18), saved)
    assert _fused_held(twice) == _fused_held(once)
    _assert_whole_held(twice, saved)


def test_a_plan_priced_from_its_graphs_is_refused():
    # a priced plan already holds each region at its graph's bytes: the excess is 0 and
    # nothing was calibrated, silently
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    saved = _eager_saves(whole)
    priced = autoac.price_compiled_saves(whole, prof, saved)
    with pytest.raises(ValueError, match="plan_"):
        rt.calibrate_none(prof, priced, saved)


def test_every_entry_of_saved_is_checked():
    # price_compiled_saves refuses unknown names; calibrate_none ignored them (a typo
    # calibrated nothing) and did not check the bytes of regions it skipped
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    with pytest.raises(ValueError, match="saved"):
        rt.calibrate_none(prof, whole, {"layers.9": 0})
    sac = dataclasses.replace(whole.regions[0], mode="sac")
    p = dataclasses.replace(whole, regions=(sac, *whole.regions[1:]))
    with pytest.raises(ValueError, match=r"saved\['layers.0'\]"):
        rt.calibrate_none(prof, p, {"layers.0": -1})
    with pytest.raises(TypeError, match=r"saved\['layers.0'\]"):
        rt.calibrate_none(prof, p, {"layers.0": "big"})


def test_a_packed_whole_region_is_not_calibrated():
    # a region whose plan packs its saves: its graph's bytes are packed bytes, not what
    # the keep choice (the one none_held scales) holds
    _, _, _, prof = _case(("mxint8",))
    packed = autoac.plan(prof, config=autoac.PlanConfig(strategy="pack_all"))
    assert all(r.mode == "none" and r.saves for r in packed.regions)
    cal = rt.calibrate_none(prof, packed, {r.name: 0 for r in packed.regions})
    assert cal.regions == prof.regions


@pytest.mark.skipif(not rt.compiled_packing_supported(), reason="no packing in graphs")
def test_calibration_under_pack_all_fits_the_unpacked_graphs():
    # _calibrated planned the unbounded plan with plan_config: with "pack_all" that plan
    # packs every save, and its packed graph's bytes were fitted to the keep prices
    # (0.81 of the fused bytes held here instead of the 0.25 the graphs hold)
    model, step, _, prof = _case(("mxint8",))
    plain = rt._calibrated(model, prof, step, None, None, None, PARTITION)
    torch._dynamo.reset()
    config = autoac.PlanConfig(strategy="pack_all", formats=("mxint8",))
    packed = rt._calibrated(model, prof, step, None, None, config, PARTITION)
    assert [sorted(h) for h in _fused_held(plain)] == [[pytest.approx(0.25, abs=1e-3)]] * 4
    assert _fused_held(packed) == _fused_held(plain)


def test_no_calibration_step_without_whole_regions(monkeypatch):
    # allow_none=False: no region may be left whole, the unbounded plan checkpoints
    # every region; its compiled step calibrated nothing
    model, step, raw, _ = _case()
    calls: list[tuple[str, ...]] = []
    real = rt._graph_saves

    def spy(handle, *a, **k):
        calls.append(tuple(r.mode for r in handle.plan.regions))
        return real(handle, *a, **k)

    monkeypatch.setattr(rt, "_graph_saves", spy)
    h = autoac.apply(model, budget=1e18, step_fn=step, profile_=raw, compile=True,
                     compile_kwargs=PARTITION, verify=False, calibrate_none=True,
                     plan_config=autoac.PlanConfig(allow_none=False))  # fmt: skip
    h.remove()
    assert len(calls) == 1  # the plan's own pricing only


def test_a_failing_calibration_step_leaves_the_model_as_given():
    model, _, raw, _ = _case()
    x = torch.randn(64, 64)

    def step(m: nn.Module) -> torch.Tensor:
        loss = m(x).square().mean()
        loss.backward()  # gradients on the parameters, then an error
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        autoac.apply(model, budget=1e18, step_fn=step, profile_=raw, compile=True,
                     compile_kwargs=PARTITION, verify=False, calibrate_none=True)  # fmt: skip
    assert autoac.runtime._regions.installed_regions(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_the_plan_runs_compiled_after_the_calibration_step():
    # the temporary handle's compiles count against Dynamo's recompile limits: the plan
    # put in force afterwards must still run its regions compiled (an eager region
    # saves the whole chain, 5 x 64 KiB, its graph 2 x 64 KiB)
    model, step, raw, _ = _case()
    h = autoac.apply(model, budget=1e18, step_fn=step, profile_=raw, compile=True,
                     compile_kwargs=PARTITION, verify=False, calibrate_none=True)  # fmt: skip
    try:
        assert all(r.mode == "none" for r in h.plan.regions)
        assert set(rt._graph_saves(h, step, 0).values()) == {2 * 4 * 64 * 64 * 4}
    finally:
        h.remove()


class _OutBlock(ChainBlock):
    """The chain block with a ``tanh`` at its end: its output is a save of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


def test_a_region_output_its_graph_saves_stays_priced(monkeypatch):
    # found by review (fixed in _Runner._record_saves): a region's outputs were left out
    # of its graph's saves, which the profile counts where the region's backward keeps
    # them (price_compiled priced such regions low too)
    model = ChainTower(n=2, block=_OutBlock)
    step = step_for(torch.randn(64, 64))
    prof = autoac.for_compiled_packing(autoac.profile(model, step, config=FLOPS))
    cal = rt._calibrated(model, prof, step, None, None, None, PARTITION)
    # what the graphs hold beyond inputs and parameters: outputs they saved included
    real = rt.graph_saves

    def with_outputs(outs, since, exclude):
        outs = list(outs)
        return real(outs, since, exclude - rt.storage_keys(outs))

    monkeypatch.setattr(rt, "graph_saves", with_outputs)
    torch._dynamo.reset()
    whole = autoac.plan(prof, budget=1e18)
    h = rt.AutoAC(model, whole, profile_=prof, compiled=True, compile_kwargs=PARTITION)
    try:
        held = rt._graph_saves(h, step, 0)
    finally:
        h.remove()
    _assert_whole_held(cal, held)


def test_the_span_free_bound_stays_a_bound_on_a_calibrated_profile():
    # found by review (fixed): bound.span_free_bound priced every kept tensor at its
    # full bytes, not at SavedOp.none_held: on a calibrated profile no lower bound
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    cal = rt.calibrate_none(prof, whole, _eager_saves(whole))
    budget = autoac.plan(cal, budget=1e18).no_ac_peak
    p = autoac.plan(cal, budget=budget)
    assert p.added_s == 0.0  # every region whole
    assert autoac.span_free_bound(cal, budget=budget).lower_bound_s <= p.added_s
