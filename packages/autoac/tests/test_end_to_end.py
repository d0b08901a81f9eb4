"""Profile -> plan -> apply on small CPU models: predicted vs measured peak, gradients."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from autoac_cases import attn_tower, measure_under, mlp_tower, step_for
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec import autoac
from hyperrec.autoac.profiler import grad_error
from hyperrec.autoac.runtime import AutoAC, _verify

FLOPS = autoac.ProfileConfig(cost="flops", steps=1)


def _budgets(prof: autoac.Profile, fracs=(0.0, 0.2, 0.5, 0.8, 1.0)) -> list[float]:
    p = autoac.plan(prof, budget=1e15)
    return [p.floor + f * (p.no_ac_peak - p.floor) for f in fracs]


@pytest.mark.parametrize("case", ["mlp", "attn"])
def test_predicted_peak_matches_measured(case):
    model = mlp_tower(p=0.1) if case == "mlp" else attn_tower(p=0.1)
    x = torch.randn(256, 32) if case == "mlp" else torch.randn(2, 64, 32)
    step = step_for(x)
    noac = autoac.measure_step(model, step)
    prof = autoac.profile(model, step, config=FLOPS)
    floor_plan = autoac.plan(prof, budget=1e15)
    # The endpoints of the model are the two measured extremes.
    assert floor_plan.no_ac_peak == pytest.approx(noac.peak_bytes, rel=0.01)
    assert prof.tracked_peak == floor_plan.floor
    prev = None
    for b in _budgets(prof):
        for allow_none in (True, False):
            p = autoac.plan(prof, budget=b, config=autoac.PlanConfig(allow_none=allow_none))
            assert p.predicted_peak <= b
            m = measure_under(model, step, p)
            assert abs(m.peak_bytes / p.predicted_peak - 1) <= 0.10, (b, allow_none)
        # More budget never costs more time.
        if prev is not None:
            assert p.added_s <= prev + 1e-12
        prev = p.added_s


def test_pure_recompute_gradients_bit_identical(attn_case):
    model, step = attn_case
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=FLOPS)
    for b in _budgets(prof, (0.0, 0.3, 0.7)):
        p = autoac.plan(prof, budget=b, config=autoac.PlanConfig(formats=()))
        assert not p.packed
        m = measure_under(model, step, p)
        for g0, g1 in zip(ref.grads, m.grads):
            assert torch.equal(g0, g1)


def _cheap_packing(prof: autoac.Profile) -> autoac.Profile:
    """The same profile with packing priced at zero, so that plans use it (on the CPU
    the reference quantizer is slower than recomputing these small ops)."""
    free = {
        f: {
            **c,
            "pack_per_elem_s": 0.0,
            "pack_call_s": 0.0,
            "unpack_per_elem_s": 0.0,
            "unpack_call_s": 0.0,
        }
        for f, c in prof.pack_costs.items()
    }
    return dataclasses.replace(prof, pack_costs=free)


def test_packed_saves_peak_and_gradient_bound(mlp_case):
    model, step = mlp_case
    cfg = dataclasses.replace(
        FLOPS, formats=("mxfp8", "mx4"), min_pack_bytes=4096, max_grad_error=0.05
    )
    prof = _cheap_packing(autoac.profile(model, step, config=cfg))
    # Per class, the allowed formats are those measured within the bound.
    for r in prof.regions:
        for o in r.ops:
            for f in o.formats:
                assert prof.pack_errors[(o.op_class, f)] <= cfg.max_grad_error
    ref = autoac.measure_step(model, step, keep_grads=True)
    used_pack = False
    for b in _budgets(prof, (0.0, 0.15, 0.4)):
        p = autoac.plan(prof, budget=b)
        used_pack |= p.packed
        m = measure_under(model, step, p)
        assert abs(m.peak_bytes / p.predicted_peak - 1) <= 0.10
        assert m.peak_bytes <= b * 1.001
    assert used_pack
    # Verification replans until the whole plan's gradient error is within the bound.
    for bound in (0.05, 0.004):
        prof_b = dataclasses.replace(prof, config=dataclasses.replace(cfg, max_grad_error=bound))
        b = _budgets(prof_b, (0.15,))[0]
        h = AutoAC(model, autoac.plan(prof_b, budget=b), profile_=prof_b)
        try:
            _verify(h, step, b, None, None)
            v = h.verification
            assert v["measured_peak"] <= b * 1.001
            if h.plan.packed:
                assert v["grad_error"] <= bound
                m = autoac.measure_step(model, step, keep_grads=True)
                assert grad_error(ref.grads, m.grads) == pytest.approx(v["grad_error"], rel=1e-6)
        finally:
            h.remove()


def test_mxint8_saves_pass_a_bound_that_mxfp8_fails(mlp_case):
    """MXINT8 measures a smaller gradient error than MXFP8 on every class of the tower; at
    a bound between the two, only MXINT8 is allowed, the plan packs with it, its peak is
    as predicted and its measured gradient error is within the bound."""
    model, step = mlp_case
    cfg = dataclasses.replace(
        FLOPS, formats=("mxfp8", "mxint8"), min_pack_bytes=4096, max_grad_error=1.0
    )
    prof = _cheap_packing(autoac.profile(model, step, config=cfg))
    # op classes; the layers' inputs (after a layer norm's input, 0.1.18) are gentler on
    # MXFP8 and may pass either format
    classes = {c for c, _ in prof.pack_errors if c != "<input>"}
    assert classes
    for c in classes:
        assert prof.pack_errors[(c, "mxint8")] < 0.6 * prof.pack_errors[(c, "mxfp8")], c
    bound = max(prof.pack_errors[(c, "mxint8")] for c in classes) * 1.5
    assert bound < min(prof.pack_errors[(c, "mxfp8")] for c in classes)
    prof_b = autoac.profile(model, step, config=dataclasses.replace(cfg, max_grad_error=bound))
    prof_b = _cheap_packing(prof_b)
    allowed = {f for r in prof_b.regions for o in r.ops if not o.is_input for f in o.formats}
    assert allowed == {"mxint8"}
    b = _budgets(prof_b, (0.15,))[0]
    h = AutoAC(model, autoac.plan(prof_b, budget=b), profile_=prof_b)
    try:
        assert h.plan.packed
        _verify(h, step, b, None, None)
        v = h.verification
        assert v["grad_error"] <= bound
        assert abs(v["measured_peak"] / h.plan.predicted_peak - 1) <= 0.10
    finally:
        h.remove()


def test_apply_one_call_with_sample_inputs():
    model = mlp_tower()
    x = torch.randn(128, 32)
    noac = autoac.measure_step(model, step_for(x)).peak_bytes
    h = autoac.apply(
        model,
        budget=0.8 * noac,
        sample_inputs=(x,),
        loss_fn=lambda y: y.square().mean(),
        profile_config=FLOPS,
    )
    try:
        v = h.verification
        assert v["measured_peak"] <= 0.8 * noac * 1.001
        assert abs(v["peak_ratio"] - 1) <= 0.10
        assert h.plan.budget == int(0.8 * noac)
        assert "autoac plan" in h.plan.summary()
    finally:
        h.remove()
    assert "forward" not in model.layers[0].__dict__


def test_region_budgets(mlp_case):
    model, step = mlp_case
    prof = autoac.profile(model, step, config=FLOPS)
    names = [r.name for r in prof.regions]
    free = autoac.plan(prof, budget=1e15)
    held = {r.name: r.held_bytes for r in free.regions}
    caps = {
        n: prof.regions[i].input_bytes + (held[n] - prof.regions[i].input_bytes) // 3
        for i, n in enumerate(names)
    }
    p = autoac.plan(prof, region_budgets=caps)
    for r in p.regions:
        assert r.held_bytes <= caps[r.name]
    m = measure_under(model, step, p)
    assert abs(m.peak_bytes / p.predicted_peak - 1) <= 0.10
    assert p.added_s > 0


@pytest.mark.parametrize(
    ("bad", "err"),
    [
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (0, ValueError),
        ("1GB", TypeError),
        (True, TypeError),
    ],
)
def test_bad_budget_names_smallest_feasible(mlp_case, bad, err):
    model, step = mlp_case
    prof = autoac.profile(model, step, config=FLOPS)
    floor = autoac.plan(prof, budget=1e15).floor
    with pytest.raises(err, match="budget") as ei:
        autoac.plan(prof, budget=bad)
    if err is ValueError:
        assert str(floor) in str(ei.value)
    with pytest.raises(ValueError, match=str(floor)):
        autoac.plan(prof, budget=floor - 1)
    autoac.plan(prof, budget=floor)  # the floor itself is feasible


def test_bad_region_budgets(mlp_case):
    model, step = mlp_case
    prof = autoac.profile(model, step, config=FLOPS)
    name = prof.regions[0].name
    with pytest.raises(ValueError, match="unknown region"):
        autoac.plan(prof, region_budgets={"nope": 1e9})
    with pytest.raises(ValueError, match=str(prof.regions[0].input_bytes)):
        autoac.plan(prof, region_budgets={name: prof.regions[0].input_bytes - 1})
    with pytest.raises(ValueError, match="budget or region_budgets"):
        autoac.plan(prof)


def test_plan_round_trip_and_state_dict(mlp_case, tmp_path):
    model, step = mlp_case
    prof = autoac.profile(model, step, config=FLOPS)
    p = autoac.plan(prof, budget=_budgets(prof, (0.4,))[0])
    q = autoac.Plan.from_dict(p.to_dict())
    assert q == p
    h = autoac.apply_plan(model, q)
    peak = autoac.measure_step(model, step).peak_bytes
    assert peak == pytest.approx(p.predicted_peak, rel=0.10)
    # Through torch.distributed.checkpoint (one process, no process group).
    import torch.distributed.checkpoint as dcp

    dcp.save({"autoac": h.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    h.remove()
    h2 = autoac.apply_plan(model, autoac.plan(prof, budget=1e15))
    state = {"autoac": h2.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    h2.load_state_dict(state["autoac"])
    assert h2.plan == p
    assert autoac.measure_step(model, step).peak_bytes == peak
    h2.remove()
    with pytest.raises(ValueError, match="version"):
        autoac.Plan.from_dict({**p.to_dict(), "version": 9})
    with pytest.raises(ValueError, match="plan"):
        h2.load_state_dict({})


def test_profile_reports_saved_tensors(attn_case):
    model, step = attn_case
    prof = autoac.profile(model, step, config=FLOPS)
    rows = prof.saved_tensors()
    ops = {r["op"] for r in rows}
    assert any("scaled_dot_product" in o for o in ops)
    assert any("addmm" in o for o in ops)
    mm = [r for r in rows if "addmm" in r["op"]]
    assert all(r["flops"] > 0 and r["bytes"] > 0 for r in mm)
    assert any(r["needed"] for r in rows) and any(not r["needed"] for r in rows)
    tl = prof.timeline()
    assert max(tl["live_bytes"]) == prof.tracked_peak
    assert set(tl["phase"]) == {0, 1, 2}
    for r in prof.regions:
        assert r.full_recompute_s > 0
        assert r.rc_start is not None and r.rc_end >= r.rc_start


def test_regions_and_step_errors(mlp_case):
    model, step = mlp_case
    with pytest.raises(ValueError, match="matches no module"):
        autoac.profile(model, step, regions=["nothing.*"])
    with pytest.raises(ValueError, match="nested"):
        autoac.profile(model, step, regions=[model.layers[0], model.layers[0].fc1])
    with pytest.raises(TypeError, match="step_fn must return"):
        autoac.profile(model, lambda m: m(torch.randn(4, 32)), config=FLOPS)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        autoac.profile(model, 3)

    def twice(m):
        y = m.layers[0](torch.randn(8, 32))
        return m.layers[0](y).square().mean()

    with pytest.raises(ValueError, match="once per step"):
        autoac.profile(model, twice, regions=[model.layers[0]], config=FLOPS)
    # Nothing left behind by the failed calls.
    assert "forward" not in model.layers[0].__dict__
    with pytest.raises(ValueError, match="step_fn or sample_inputs"):
        autoac.apply(model, budget=1e9)
    with pytest.raises(TypeError, match="steps"):
        autoac.ProfileConfig(steps=1.5)
    with pytest.raises(ValueError, match="solver"):
        autoac.PlanConfig(solver="ilp")


def test_span_region():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 128)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin
            self.span = autoac.Span(lambda x: torch.tanh(self.lin(x)).square())

        def forward(self, x):
            return self.span(x).sum(-1)

    model = M()
    x = torch.randn(64, 32)
    step = step_for(x)
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, regions=["span"], config=FLOPS)
    p = autoac.plan(prof, budget=prof.tracked_peak)
    assert p.regions[0].mode in ("sac", "none")
    m = measure_under(model, step, p)
    assert all(torch.equal(a, b) for a, b in zip(ref.grads, m.grads))
    assert math.isfinite(p.added_s)


@settings(max_examples=5, deadline=None)
@given(
    n=st.integers(1, 3),
    dim=st.sampled_from([16, 32, 48]),
    rows=st.integers(1, 128),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_predicted_peak_matches_measured_sweep(n, dim, rows, frac, seed):
    model = mlp_tower(n=n, dim=dim, p=0.2, seed=seed)
    step = step_for(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)))
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=FLOPS)
    b = _budgets(prof, (frac,))[0]
    p = autoac.plan(prof, budget=b)
    m = measure_under(model, step, p)
    assert p.predicted_peak <= b
    assert abs(m.peak_bytes / p.predicted_peak - 1) <= 0.10
    assert all(torch.equal(a, c) for a, c in zip(ref.grads, m.grads))


def test_empty_batch():
    model = mlp_tower(n=2)
    step = step_for(torch.randn(0, 32))
    prof = autoac.profile(model, step, config=FLOPS)
    p = autoac.plan(prof, budget=autoac.plan(prof, budget=1e15).floor)
    m = measure_under(model, step, p)
    assert m.peak_bytes == p.predicted_peak


@pytest.mark.parametrize("case", ["mlp", "attn"])
def test_allowing_formats_never_predicts_slower(case, request):
    """Packed formats only add choices: the plan that may use them is never predicted
    slower than the keep/recompute-only plan at the same budget (the greedy alone can
    be: its path changes with the extra choices). Pack costs are scaled so that packing
    is sometimes worth it and sometimes not."""
    model, step = request.getfixturevalue(f"{case}_case")
    cfg = dataclasses.replace(FLOPS, formats=("mxfp8",), min_pack_bytes=4096, max_grad_error=1.0)
    base = autoac.profile(model, step, config=cfg)
    plain_cfg = autoac.PlanConfig(formats=(), solver="greedy")
    quant_cfg = autoac.PlanConfig(solver="greedy")
    scale0 = max(o.time_s for r in base.regions for o in r.ops if o.formats)
    checked = 0
    for scale in (0.0, 0.05, 0.2, 0.5, 1.0, 3.0):
        costs = {
            f: {**c, "pack_call_s": scale * scale0, "unpack_call_s": 0.5 * scale * scale0,
                "pack_per_elem_s": 0.0, "unpack_per_elem_s": 0.0}
            for f, c in base.pack_costs.items()
        }  # fmt: skip
        prof = dataclasses.replace(base, pack_costs=costs)
        for b in _budgets(prof, (0.0, 0.1, 0.25, 0.5, 0.75)):
            plain = autoac.plan(prof, budget=b, config=plain_cfg)
            quant = autoac.plan(prof, budget=b, config=quant_cfg)
            assert quant.added_s <= plain.added_s + 1e-12
            assert quant.predicted_peak <= b
            assert quant.lower_bound_s <= quant.added_s + 1e-12
            checked += 1
    assert checked == 30


def test_plan_falls_back_to_the_plan_without_formats(mlp_case, monkeypatch):
    """The guard itself: when the solve that may pack ends on a worse plan (here forced:
    the greedy returns its starting point, full recompute, whenever packing is among the
    choices), ``plan`` returns the keep/recompute-only plan, with the bound of both."""
    from hyperrec.autoac import planner
    from hyperrec.autoac.formats import SAVE_FORMATS
    from hyperrec.autoac.model import time_of
    from hyperrec.autoac.solve import SolveResult

    model, step = mlp_case
    cfg = dataclasses.replace(FLOPS, formats=("mxfp8",), min_pack_bytes=4096, max_grad_error=1.0)
    prof = autoac.profile(model, step, config=cfg)
    b = _budgets(prof, (0.6,))[0]
    plain = autoac.plan(prof, budget=b, config=autoac.PlanConfig(formats=(), solver="greedy"))
    assert plain.added_s < plain.full_recompute_s  # something is kept at this budget
    real = planner.solve_greedy

    def stuck(prob, *, start=None):
        packs = any(c.kind in SAVE_FORMATS for g in prob.groups for o in g.choices.values()
                    for c in o)  # fmt: skip
        if packs:
            return SolveResult(start, time_of(prob, start), False, 0)
        return real(prob, start=start)

    monkeypatch.setattr(planner, "solve_greedy", stuck)
    got = autoac.plan(prof, budget=b, config=autoac.PlanConfig(solver="greedy"))
    assert got.added_s == pytest.approx(plain.added_s)
    assert [r.saves for r in got.regions] == [r.saves for r in plain.regions]
    assert not got.packed and not got.proven_optimal
    assert got.lower_bound_s <= got.added_s
