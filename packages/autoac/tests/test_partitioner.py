"""``partitioner_plan`` and ``apply(partitioner_fractions=...)`` (experimental, 0.1.23):
regions left to AOTAutograd's partitioner at a memory-budget fraction, and the search
that measures those plans against autoac's own and keeps the fastest within the budget.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import step_for
from test_compiled_headroom import FLOPS, PARTITION, ChainTower

from hyperrec import autoac
from hyperrec.autoac import runtime as rt
from hyperrec.autoac.regions import installed_regions


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _case(model=None):
    model = ChainTower() if model is None else model
    step = step_for(torch.randn(64, 64))
    return model, step, autoac.profile(model, step, config=FLOPS)


def _grads(model, step):
    for p in model.parameters():
        p.grad = None
    step(model).backward()
    out = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def _priced(model, step, prof, fraction):
    h = autoac.apply_plan(
        model, autoac.partitioner_plan(prof, fraction), compile=True, compile_kwargs=PARTITION
    )
    h.profile = prof
    try:
        return autoac.price_compiled(h, step), _grads(model, step)
    finally:
        h.remove()


def test_plan_holds_what_no_ac_holds_and_names_the_fraction():
    _, _, prof = _case()
    p = autoac.partitioner_plan(prof, 0.3, budget=10**9)
    assert p.solver == "partitioner" and p.budget == 10**9 and p.added_s == 0.0
    assert [r.mode for r in p.regions] == ["partitioner"] * len(prof.regions)
    assert all(r.fraction == 0.3 and not r.saves for r in p.regions)
    no_ac = autoac.plan(prof, budget=1e18, config=autoac.PlanConfig(formats=()))
    assert p.predicted_peak == no_ac.no_ac_peak
    assert [r.held_bytes for r in p.regions] == [r.noac_held_bytes for r in no_ac.regions]
    assert "p0.30" in p.summary() and "added time not predicted" in p.summary()
    names = [r.name for r in prof.regions]
    mixed = autoac.partitioner_plan(prof, {names[0]: 0.0, names[2]: 1.0})
    assert [r.fraction for r in mixed.regions] == [0.0, None, 1.0, None]
    assert [r.mode for r in mixed.regions] == ["partitioner", "none", "partitioner", "none"]


@pytest.mark.parametrize(
    ("fraction", "err", "match"),
    [
        (1.5, ValueError, r"fraction must be in \[0, 1\]"),
        (-0.1, ValueError, "fraction must be >= 0"),
        (float("nan"), ValueError, "fraction must be finite"),
        ("0.5", TypeError, "fraction must be a real number"),
        ({"nope": 0.5}, ValueError, r"regions \['nope'\] that the profile does not have"),
        ({"layers.0": 2.0}, ValueError, r"fraction\['layers.0'\] must be in \[0, 1\]"),
    ],
)
def test_bad_fractions(fraction, err, match):
    _, _, prof = _case()
    with pytest.raises(err, match=match):
        autoac.partitioner_plan(prof, fraction)


def test_regions_that_stay_whole_are_not_handed_over():
    _, _, prof = _case()
    fixed = dataclasses.replace(prof.regions[1], modes=("none",))
    prof = dataclasses.replace(prof, regions=(prof.regions[0], fixed, *prof.regions[2:]))
    p = autoac.partitioner_plan(prof, 0.5)
    assert [r.mode for r in p.regions] == ["partitioner", "none", "partitioner", "partitioner"]
    with pytest.raises(ValueError, match=r"\['layers.1'\] that stay un-checkpointed"):
        autoac.partitioner_plan(prof, {"layers.1": 0.5})


def test_round_trip_and_corrupt_files():
    _, _, prof = _case()
    p = autoac.partitioner_plan(prof, {"layers.0": 0.25, "layers.3": 1.0})
    q = autoac.Plan.from_dict(p.to_dict())
    assert [(r.mode, r.fraction) for r in q.regions] == [(r.mode, r.fraction) for r in p.regions]
    d = p.to_dict()
    d["regions"][1]["fraction"] = 0.5  # a "none" region with a fraction
    with pytest.raises(ValueError, match="fraction if and only if its mode is 'partitioner'"):
        autoac.Plan.from_dict(d)
    d = p.to_dict()
    del d["regions"][0]["fraction"]
    with pytest.raises(ValueError, match="fraction if and only if"):
        autoac.Plan.from_dict(d)
    d = p.to_dict()
    d["regions"][0]["fraction"] = 7
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        autoac.Plan.from_dict(d)
    d = p.to_dict()
    d["regions"][0]["saves"] = [["aten.mm.default", 0, "keep"]]
    with pytest.raises(ValueError, match="'partitioner' region has no saves"):
        autoac.Plan.from_dict(d)


def test_an_eager_handle_refuses_a_partitioner_plan():
    model, _, prof = _case()
    with pytest.raises(ValueError, match="only a compiled region can run"):
        autoac.apply_plan(model, autoac.partitioner_plan(prof, 0.5))
    assert not installed_regions(model)  # nothing was wrapped


@pytest.mark.parametrize("annotation", [True, False])
def test_each_region_compiles_at_its_own_fraction(monkeypatch, annotation):
    """The graphs save less at a lower fraction, per region, also where identical layers
    share one code object and the torch has no per-region annotation (the global knob,
    read while the region compiles); gradients as without checkpointing."""
    if not annotation:
        monkeypatch.delattr(torch.autograd.graph, "region_activation_memory_budget", raising=False)
    elif not hasattr(torch.autograd.graph, "region_activation_memory_budget"):
        pytest.skip("this torch has no per-region memory budget annotation")
    model, step, prof = _case()
    ref = _grads(model, step)
    whole, g1 = _priced(model, step, prof, 1.0)
    none_, g0 = _priced(model, step, prof, 0.0)
    mixed, gm = _priced(model, step, prof, {"layers.0": 0.0, "layers.1": 1.0, "layers.2": 0.0})
    held = {k: [r.held_bytes for r in p.regions] for k, p in
            (("whole", whole), ("none", none_), ("mixed", mixed))}  # fmt: skip
    assert all(a > b for a, b in zip(held["whole"], held["none"]))
    assert held["mixed"][:3] == [held["none"][0], held["whole"][1], held["none"][2]]
    assert held["mixed"][3] == held["whole"][3]  # left out: the default partition
    assert whole.pricing == "compiled" and whole.predicted_peak > none_.predicted_peak
    for g in (g1, g0, gm):
        for a, b in zip(g, ref):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"partitioner_fractions": [0.5]}, TypeError, "must be a tuple of floats"),
        ({"partitioner_fractions": (1.2,)}, ValueError, r"entry must be in \[0, 1\]"),
        ({"partitioner_fractions": (0.5,), "compile": False}, ValueError, "needs compile=True"),
        (
            {"partitioner_fractions": (0.5,), "budget": None, "region_budgets": {"layers.0": 1e9}},
            ValueError,
            "needs a step budget and no region_budgets",
        ),
    ],
)
def test_bad_search_arguments(kwargs, err, match):
    model, step, _ = _case()
    args = {"budget": 1e9, "step_fn": step, "compile": True, **kwargs}
    with pytest.raises(err, match=match):
        autoac.apply(model, **args)


def test_search_refused_on_several_ranks(monkeypatch):
    """Ranks measure different times and peaks: each could keep another plan."""
    model, step, _ = _case()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    with pytest.raises(ValueError, match="more than one rank"):
        autoac.apply(model, budget=1e9, step_fn=step, compile=True, partitioner_fractions=(0.5,))
    assert not installed_regions(model)


def _search(monkeypatch, budget_at: float, times: dict):
    """``apply`` with the search, step times replaced by ``times[key]`` (key: ``"autoac"``,
    a fraction, or ``"mixed"``) so that the choice does not hang on the CPU's noise; the
    peaks are measured."""
    model, step, prof = _case()
    real = rt._measure_compiled

    def fake(handle, step_fn):
        peak, source, _ = real(handle, step_fn)
        fr = {r.fraction for r in handle.plan.regions if r.fraction is not None}
        key = "autoac" if not fr else fr.pop() if len(fr) == 1 else "mixed"
        return peak, source, [times[key]] * 3

    monkeypatch.setattr(rt, "_measure_compiled", fake)
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    budget = free.floor + budget_at * (free.no_ac_peak - free.floor)
    h = autoac.apply(
        model, budget=budget, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.0, 1.0),
    )  # fmt: skip
    return h, budget


def test_search_keeps_the_fastest_plan_within_the_budget(monkeypatch):
    h, budget = _search(monkeypatch, 0.17, {"autoac": 3.0, 0.0: 2.0, 1.0: 1.0, "mixed": 1.5})
    try:
        rows = h.search
        assert [r["plan"] for r in rows[:3]] == ["autoac", "partitioner", "partitioner"]
        assert [r["fraction"] for r in rows[:3]] == [None, 0.0, 1.0]
        assert rows[2]["fits"] is False  # the default partition holds what no AC holds
        assert all(r["fits"] == (r["peak_bytes"] <= budget) for r in rows)
        chosen = [r for r in rows if r["chosen"]]
        assert len(chosen) == 1
        fitting = [r for r in rows if r["fits"]]
        assert chosen[0]["time_s"] == min(r["time_s"] for r in fitting)
        # mixes of 0.0 and 1.0, each measured within the budget or backed off
        mixes = [r for r in rows if r["plan"] == "mixed"]
        assert mixes and mixes[0]["low"] == 0.0 and mixes[0]["high"] == 1.0
        assert chosen[0]["plan"] == "mixed"
        assert [r.fraction for r in h.plan.regions].count(1.0) == len(chosen[0]["high_regions"])
        v = h.verification
        assert v["within_budget"] and v["measured_peak"] == chosen[0]["peak_bytes"]
    finally:
        h.remove()


def test_search_keeps_autoac_where_it_is_faster(monkeypatch):
    h, _ = _search(monkeypatch, 0.5, {"autoac": 0.3, 0.0: 2.0, 1.0: 0.5, "mixed": 1.5})
    try:
        assert all(r["fits"] for r in h.search)
        assert not any(r["plan"] == "mixed" for r in h.search)  # nothing to mix: 1.0 fits
        assert h.search[0]["chosen"] and h.plan.solver != "partitioner"
        assert all(r.fraction is None for r in h.plan.regions)
    finally:
        h.remove()


def test_search_over_budget_everywhere_keeps_autoac(monkeypatch):
    """Below every measured peak nothing fits: autoac's plan stays (the verification
    then replans it on its measured overshoot, as without the search)."""
    model, step, prof = _case()
    monkeypatch.setattr(rt, "_cpu_compiled_peak", lambda h, s: (10**12, "cpu_events"))
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    h = autoac.apply(
        model, budget=free.floor * 1.01, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.5,), verify=False,
    )  # fmt: skip
    try:
        assert [r["fits"] for r in h.search] == [False, False]
        assert h.search[0]["chosen"] and h.plan.solver != "partitioner"
    finally:
        h.remove()


def test_search_logs_each_plan_it_measures(monkeypatch, caplog):
    with caplog.at_level("INFO", logger="hyperrec.autoac"):
        h, _ = _search(monkeypatch, 0.17, {"autoac": 3.0, 0.0: 2.0, 1.0: 1.0, "mixed": 1.5})
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "hyperrec.autoac"]
        assert len(lines) == len(h.search)
        assert lines[0].startswith("autoac search: autoac: peak ")
        assert any(ln.startswith("autoac search: partitioner 1: ") and "(over the budget)" in ln
                   for ln in lines)  # fmt: skip
        assert any(ln.startswith("autoac search: mixed 0/1 (") for ln in lines)
    finally:
        h.remove()
