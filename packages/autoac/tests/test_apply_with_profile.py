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


# --------------------------------------------------------------------------- fused pricing
@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("aten.silu.default", True),
        ("aten.mul.Tensor", True),
        ("aten.gelu.default", True),
        ("aten.native_layer_norm.default", True),
        ("aten._to_copy.default", True),
        ("aten._safe_softmax.default", True),
        ("aten.native_dropout.default", False),
        ("aten.addmm.default", False),
        ("aten.mm.default", False),
        ("aten._scaled_dot_product_flash_attention.default", False),
        ("aten.no_such_op.default", False),
        ("aten.silu.no_such_overload", False),
        ("mylib.silu.default", False),
        ("<input>", False),
    ],
)
def test_fuses_names_the_ops_inductor_fuses(op, expected):
    assert rt.fuses(op) is expected


def test_fused_pricing_frees_the_fused_ops_only():
    model = attn_tower()
    step = step_for(torch.randn(2, 64, 32))
    prof = autoac.profile(model, step, config=autoac.ProfileConfig(steps=1))
    plain = autoac.for_compiled_packing(prof)
    fused = autoac.for_compiled_packing(prof, fused_recompute=True)
    n_free = 0
    for r0, r1 in zip(plain.regions, fused.regions, strict=True):
        assert r1.fixed_recompute_s == r0.fixed_recompute_s
        for o0, o1 in zip(r0.ops, r1.ops, strict=True):
            assert (o0.key, o0.nbytes, o0.measured_s) == (o1.key, o1.nbytes, o1.measured_s)
            if rt.fuses(o0.op):
                assert o1.time_s == 0.0
                n_free += o0.time_s > 0
            else:
                assert o1.time_s == o0.time_s
    assert n_free > 0  # the tower has element-wise ops and norms with measured times
    # Every price is at most the eager one, so the best plan at a budget adds at most
    # what the best eagerly priced plan adds.
    free = autoac.plan(prof, budget=1e15)
    for f in (0.0, 0.3, 0.6):
        b = free.floor + f * (free.no_ac_peak - free.floor)
        pf = autoac.plan(fused, budget=b)
        pe = autoac.plan(plain, budget=b)
        assert pf.predicted_peak <= b
        assert pf.added_s <= pe.added_s + 1e-12
    with pytest.raises(TypeError, match="fused_recompute"):
        autoac.for_compiled_packing(prof, fused_recompute=1)
