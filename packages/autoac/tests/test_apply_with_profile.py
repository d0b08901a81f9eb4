"""``apply(..., profile_=...)``: plans for several budgets from one profile."""

from __future__ import annotations

import pytest
import torch
from autoac_cases import attn_tower, mlp_tower, step_for

from hyperrec import autoac
from hyperrec.autoac import runtime as rt

FLOPS = autoac.ProfileConfig(cost="flops", steps=1)


def _no_profiling(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("apply profiled the step although a profile was given")

    monkeypatch.setattr(rt, "profile", fail)


def test_budgets_from_one_profile_match_plans_and_train_exactly(monkeypatch):
    model = attn_tower(p=0.1)
    step = step_for(torch.randn(2, 64, 32))
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=FLOPS)
    free = autoac.plan(prof, budget=1e15)
    _no_profiling(monkeypatch)
    modes = set()
    for f in (0.0, 0.4, 1.0):
        b = free.floor + f * (free.no_ac_peak - free.floor)
        h = autoac.apply(model, budget=b, step_fn=step, profile_=prof)
        try:
            assert h.profile is prof
            expected = autoac.plan(prof, budget=b)
            assert [r.mode for r in h.plan.regions] == [r.mode for r in expected.regions]
            assert h.plan.predicted_peak == expected.predicted_peak
            v = h.verification
            assert v["measured_peak"] <= b * (1 + rt.PEAK_TOLERANCE)
            assert abs(v["peak_ratio"] - 1) <= 0.10
            modes.update(r.mode for r in h.plan.regions)
            m = autoac.measure_step(model, step, keep_grads=True)
        finally:
            h.remove()
        # no packed format was profiled: keep / recompute only, so bit-identical
        for g0, g1 in zip(ref.grads, m.grads):
            assert torch.equal(g0, g1)
    assert "forward" not in model.layers[0].__dict__
    assert len(modes) >= 2  # the budgets gave different plans


def test_formats_limit_the_plan_to_the_profiles_formats(monkeypatch):
    model = mlp_tower(dim=64)
    step = step_for(torch.randn(512, 64))
    cfg = autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",), min_pack_bytes=1024,
                               max_grad_error=1.0)  # fmt: skip
    prof = autoac.profile(model, step, config=cfg)
    free = autoac.plan(prof, budget=1e15)
    b = free.floor  # the least memory: packing pays here if anything does
    _no_profiling(monkeypatch)
    exact = autoac.apply(model, budget=b, step_fn=step, profile_=prof, verify=False,
                         plan_config=autoac.PlanConfig(formats=()))  # fmt: skip
    try:
        assert not exact.plan.packed
    finally:
        exact.remove()
    packed = autoac.apply(model, budget=b, step_fn=step, profile_=prof, verify=False,
                          formats=("mxint8",))  # fmt: skip
    try:
        only_mxint8 = autoac.PlanConfig(formats=("mxint8",))
        assert packed.plan == autoac.plan(prof, budget=b, config=only_mxint8)
    finally:
        packed.remove()


def test_compiled_apply_with_a_profile_prices_from_the_graphs(monkeypatch):
    model = mlp_tower(dim=64)
    step = step_for(torch.randn(256, 64))
    prof = autoac.for_compiled_packing(autoac.profile(model, step, config=FLOPS))
    free = autoac.plan(prof, budget=1e15)
    _no_profiling(monkeypatch)
    h = autoac.apply(model, budget=free.floor + 0.5 * (free.no_ac_peak - free.floor),
                     step_fn=step, profile_=prof, compile=True, verify=False,
                     compile_kwargs={"backend": "aot_eager"})  # fmt: skip
    try:
        assert h.compiled and h.plan.pricing == "compiled"
    finally:
        h.remove()
        torch._dynamo.reset()


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"profile_": "prof"}, TypeError, "profile_ must be a Profile"),
        ({"regions": "layers"}, ValueError, "regions must be left out"),
        ({"profile_config": FLOPS}, ValueError, "profile_config must be left out"),
        ({"formats": ("mxfp8",)}, ValueError, r"formats \['mxfp8'\] were not measured"),
    ],
)
def test_bad_arguments_with_a_profile(mlp_case, kwargs, err, match):
    model, step = mlp_case
    prof = autoac.profile(model, step, config=FLOPS)
    args = {"budget": 1e12, "step_fn": step, "profile_": prof, **kwargs}
    with pytest.raises(err, match=match):
        autoac.apply(model, **args)
    assert "forward" not in model.layers[0].__dict__


def test_formats_and_plan_config_formats_together_are_refused():
    model = mlp_tower(dim=64)
    step = step_for(torch.randn(512, 64))
    cfg = autoac.ProfileConfig(cost="flops", steps=1, formats=("mxint8",), min_pack_bytes=1024)
    prof = autoac.profile(model, step, config=cfg)
    with pytest.raises(ValueError, match="give formats or plan_config.formats"):
        autoac.apply(model, budget=1e12, step_fn=step, profile_=prof, formats=("mxint8",),
                     plan_config=autoac.PlanConfig(formats=()))  # fmt: skip
