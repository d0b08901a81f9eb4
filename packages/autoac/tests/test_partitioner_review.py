"""Review of ``partitioner_plan`` and ``apply(partitioner_fractions=...)`` (0.1.23):
the state a handle is left in, the plan in force against the search's chosen row,
copies and saved states of partitioner plans, candidates that fail, regions left whole,
and the fraction each region compiles at. Five bugs it found were fixed before the
release (a refused ``set_plan`` took the plan in force off; mixes never tried beside a
region left whole; the verification replaced the plan the search chose on the CPU; a
candidate failing other than in its backend failed ``apply``; a region that graph-breaks
ran a later plan's fraction with the first one's graphs).
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from test_compiled_headroom import PARTITION, ChainBlock, ChainTower
from test_partitioner import _case, _grads
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import runtime as rt
from hyperrec.autoac.regions import installed_regions

ANNOTATION = "region_activation_memory_budget"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class BreakBlock(ChainBlock):
    """A ChainBlock whose forward graph-breaks before its body."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        torch._dynamo.graph_break()
        return super().forward(x)


class TanhBlock(nn.Module):
    """Not a ChainBlock: another code object, other saves."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return x + self.out(torch.tanh(h) * torch.sigmoid(h) * h)


class MixedTower(nn.Module):
    """Regions that are not identical: two block classes, alternating."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([ChainBlock(dim), TanhBlock(dim), ChainBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _held(handle, step):
    return [r.held_bytes for r in autoac.price_compiled(handle, step).regions]


def _saves(handle, step):
    """Region name -> bytes its compiled graph saves (a loaded plan cannot be priced)."""
    return rt._graph_saves(handle, step, 0)


def _priced(model, step, prof, fraction):
    """Per-region graph-priced held bytes and the compiled CPU peak of a partitioner plan."""
    h = autoac.apply_plan(
        model, autoac.partitioner_plan(prof, fraction), compile=True, compile_kwargs=PARTITION
    )
    h.profile = prof
    try:
        priced = autoac.price_compiled(h, step)
        return priced, rt._cpu_compiled_peak(h, step)[0]
    finally:
        h.remove()


def _key(p):
    """What a plan decides, per region."""
    return [(r.name, r.mode, dict(r.saves), r.fraction) for r in p.regions]


def _spy_search(monkeypatch, times):
    """Record the plan measured for each row of the search; step times from ``times``
    (``"autoac"``, a fraction or ``"mixed"``), peaks measured."""
    real = rt._measure_compiled
    measured = []

    def fake(handle, step_fn):
        peak, source, _ = real(handle, step_fn)
        measured.append(handle.plan)
        fr = {r.fraction for r in handle.plan.regions if r.fraction is not None}
        key = "autoac" if not fr else fr.pop() if len(fr) == 1 else "mixed"
        return peak, source, [times[key]] * 3

    monkeypatch.setattr(rt, "_measure_compiled", fake)
    return measured


def _measured_of_rows(rows, measured):
    """Row index -> the plan measured for it (rows with an error measured nothing)."""
    out, it = {}, iter(measured)
    for i, r in enumerate(rows):
        if "error" not in r:
            out[i] = next(it)
    return out


# ------------------------------------------------------------------ handles and states
def test_set_plan_refused_on_an_eager_handle_keeps_the_plan_in_force():
    model, _, prof = _case()
    before = autoac.plan(prof, budget=1e15)
    h = autoac.apply_plan(model, before)
    try:
        with pytest.raises(ValueError, match="only a compiled region can run"):
            h.set_plan(autoac.partitioner_plan(prof, 0.5))
        assert h.plan is before
        assert len(installed_regions(model)) == len(before.regions)
    finally:
        h.remove()


def test_load_state_dict_refused_on_an_eager_handle_keeps_the_plan_in_force():
    model, _, prof = _case()
    h = autoac.apply_plan(model, autoac.plan(prof, budget=1e15))
    saved = {"plan": autoac.partitioner_plan(prof, 0.5).to_dict()}
    try:
        with pytest.raises(ValueError, match="only a compiled region can run"):
            h.load_state_dict(saved)
        assert len(installed_regions(model)) == len(h.plan.regions)
    finally:
        h.remove()


def test_copies_and_saved_states_of_a_partitioner_handle_keep_each_fraction():
    model, step, prof = _case()
    mix = {"layers.0": 0.0, "layers.1": 1.0, "layers.2": 0.0, "layers.3": 1.0}
    h = autoac.apply_plan(
        model, autoac.partitioner_plan(prof, mix), compile=True, compile_kwargs=PARTITION
    )
    h.profile = prof
    ref = _grads(model, step)
    held = _saves(h, step)
    assert held["layers.1"] > held["layers.2"] < held["layers.3"]  # 1.0 holds more
    buf = io.BytesIO()
    torch.save(h, buf)
    buf.seek(0)
    copies = [copy.deepcopy(h), torch.load(buf, weights_only=False)]
    other = ChainTower()
    h2 = autoac.apply_plan(
        other, autoac.plan(prof, budget=1e15), compile=True, compile_kwargs=PARTITION
    )
    h2.profile = prof
    h2.load_state_dict(h.state_dict())
    try:
        assert _key(h2.plan) == _key(h.plan)
        for c in (*copies, h2):
            assert c.model is not model
            assert _saves(c, step) == held
            for a, b in zip(_grads(c.model, step), ref):
                torch.testing.assert_close(a, b)
    finally:
        for c in (h, *copies, h2):
            c.remove()


def test_regions_that_are_not_identical_each_compile_at_their_own_fraction():
    model, step, prof = _case(MixedTower())
    zero, _ = _priced(model, step, prof, 0.0)
    one, _ = _priced(model, step, prof, 1.0)
    mixed, _ = _priced(model, step, prof, {"layers.0": 1.0, "layers.1": 0.0, "layers.2": 0.0})
    lo = [r.held_bytes for r in zero.regions]
    hi = [r.held_bytes for r in one.regions]
    assert [r.held_bytes for r in mixed.regions] == [hi[0], lo[1], lo[2]]
    assert hi[0] > lo[0] and hi[2] > lo[2]


@pytest.mark.parametrize("annotation", [True, False])
def test_a_region_that_graph_breaks_is_refused_not_run_at_a_stale_fraction(monkeypatch, annotation):
    """Behind a graph break the frames after it would not be guarded on the fraction (a
    later fraction reused the first one's graphs) and the annotation would run eagerly:
    a partitioner region compiles as one graph, so the break is an error at its first
    call, and the search records it and keeps autoac's plan."""
    if not annotation:
        monkeypatch.delattr(torch.autograd.graph, ANNOTATION, raising=False)
    elif not hasattr(torch.autograd.graph, ANNOTATION):
        pytest.skip("this torch has no per-region memory budget annotation")
    model, step, prof = _case(ChainTower(block=BreakBlock))
    with pytest.raises(Exception, match="(?i)graph break|unsupported|fullgraph"):
        _priced(model, step, prof, 0.0)


# ------------------------------------------------------------------------- the search
def test_search_with_verify_off_leaves_the_chosen_plan_and_the_state_as_given(monkeypatch):
    measured = _spy_search(monkeypatch, {"autoac": 3.0, 0.0: 2.0, 1.0: 1.0, "mixed": 1.5})
    model, step, prof = _case()
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    budget = free.floor + 0.17 * (free.no_ac_peak - free.floor)
    grads = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    rng = torch.get_rng_state()
    knob = torch._functorch.config.activation_memory_budget
    h = autoac.apply(
        model, budget=budget, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.0, 1.0), verify=False,
    )  # fmt: skip
    try:
        assert h.verification is None
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch._functorch.config.activation_memory_budget == knob
        rows = h.search
        chosen = [i for i, r in enumerate(rows) if r["chosen"]]
        assert len(chosen) == 1 and rows[chosen[0]]["fits"]
        assert rows[chosen[0]]["plan"] != "autoac"
        assert _key(h.plan) == _key(_measured_of_rows(rows, measured)[chosen[0]])
        assert h.plan.pricing == "compiled"
        # the plan in force runs its regions at the chosen fractions: its graphs save
        # what the row's measured plan priced
        assert _held(h, step) == [r.held_bytes for r in h.plan.regions]
        for p in model.parameters():
            p.grad = None
        ref_model = ChainTower()
        for a, b in zip(_grads(model, step), _grads(ref_model, step)):
            torch.testing.assert_close(a, b)
    finally:
        h.remove()


def test_verification_keeps_the_plan_the_search_chose(monkeypatch):
    measured = _spy_search(monkeypatch, {"autoac": 0.5, 0.0: 2.0, 1.0: 2.0, "mixed": 2.0})
    model, step, prof = _case()
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    budget = free.floor + 0.5 * (free.no_ac_peak - free.floor)
    h = autoac.apply(
        model, budget=budget, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.0, 1.0),
    )  # fmt: skip
    try:
        rows = h.search
        assert rows[0]["chosen"] and rows[0]["fits"]
        assert _key(h.plan) == _key(_measured_of_rows(rows, measured)[0])
        assert h.verification["peak_replans"] == 0
    finally:
        h.remove()


def test_a_candidate_that_does_not_compile_is_recorded_and_skipped(monkeypatch):
    """A backend failing at one fraction (the global knob's path, where the backend can
    read it): the row records the error, the others are measured, the chosen plan is in
    force and the knob is back to what it was."""
    monkeypatch.delattr(torch.autograd.graph, ANNOTATION, raising=False)
    from torch._dynamo.backends.registry import lookup_backend

    fconfig = torch._functorch.config
    inner = lookup_backend(PARTITION["backend"])

    def backend(gm, example_inputs):
        if fconfig.activation_memory_budget == 0.5:
            raise RuntimeError("no graph at 0.5")
        return inner(gm, example_inputs)

    measured = _spy_search(monkeypatch, {"autoac": 3.0, 0.0: 1.0, 0.5: 0.1, 1.0: 2.0, "mixed": 2.5})
    model, step, prof = _case()
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    budget = free.floor + 0.17 * (free.no_ac_peak - free.floor)
    knob = fconfig.activation_memory_budget
    h = autoac.apply(
        model, budget=budget, step_fn=step, profile_=prof, compile=True,
        compile_kwargs={"backend": backend}, partitioner_fractions=(0.0, 0.5, 1.0),
    )  # fmt: skip
    try:
        rows = h.search
        bad = [r for r in rows if "error" in r]
        assert len(bad) == 1 and bad[0]["fraction"] == 0.5 and "no graph at 0.5" in bad[0]["error"]
        assert not bad[0]["chosen"] and "peak_bytes" not in bad[0]
        chosen = [i for i, r in enumerate(rows) if r["chosen"]]
        assert len(chosen) == 1 and rows[chosen[0]]["fraction"] == 0.0
        assert _key(h.plan) == _key(_measured_of_rows(rows, measured)[chosen[0]])
        assert all(r.fraction == 0.0 for r in h.plan.regions)
        assert fconfig.activation_memory_budget == knob
        assert h.verification["measured_peak"] == rows[chosen[0]]["peak_bytes"]
        ref = _grads(ChainTower(), step)
        for a, b in zip(_grads(model, step), ref):
            torch.testing.assert_close(a, b)
    finally:
        h.remove()


def test_a_candidate_that_fails_to_run_does_not_fail_apply():
    model, step, prof = _case(ChainTower(block=BreakBlock))
    free = autoac.plan(autoac.for_compiled_packing(prof), budget=1e15)
    if not hasattr(torch.autograd.graph, ANNOTATION):
        pytest.skip("this torch has no per-region memory budget annotation")
    h = autoac.apply(
        model, budget=2 * free.no_ac_peak, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.5,), verify=False,
    )  # fmt: skip
    try:
        assert "error" in h.search[1] and h.search[0]["chosen"]
        assert all(r.mode != "partitioner" for r in h.plan.regions)
    finally:
        h.remove()
    assert not installed_regions(model)


def _with_layer_left_whole(prof, index=1):
    fixed = dataclasses.replace(prof.regions[index], modes=("none",))
    regions = list(prof.regions)
    regions[index] = fixed
    return dataclasses.replace(prof, regions=tuple(regions))


def test_mixes_are_tried_with_a_region_left_whole(monkeypatch):
    model, step, prof = _case()
    prof = _with_layer_left_whole(prof)
    compiled_prof = autoac.for_compiled_packing(prof)
    _, lo = _priced(model, step, compiled_prof, 0.0)
    mix = {"layers.0": 0.0, "layers.2": 1.0, "layers.3": 1.0}
    _, mid = _priced(model, step, compiled_prof, mix)
    _, hi = _priced(model, step, compiled_prof, 1.0)
    assert lo == mid < hi  # switching the last layers to 1.0 costs nothing at the peak
    torch._dynamo.reset()
    _spy_search(monkeypatch, {"autoac": 3.0, 0.0: 2.0, 1.0: 1.0, "mixed": 1.5})
    budget = hi - 1  # (the planner's own floor, leaving layers.1 whole, lies above lo)
    h = autoac.apply(
        model, budget=budget, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.0, 1.0), verify=False,
    )  # fmt: skip
    try:
        rows = h.search
        assert rows[1]["fits"] and not rows[2]["fits"]
        assert h.plan.regions[1].mode == "none"  # left whole in every candidate
        mixes = [r for r in rows if r["plan"] == "mixed"]
        assert mixes and mixes[0]["fits"] and mixes[0]["chosen"]
    finally:
        h.remove()


def test_a_profile_that_checkpoints_nothing_searches_without_error(monkeypatch):
    """Every region left whole: the partitioner plans hand nothing over; the search
    measures them and keeps a plan that fits."""
    _spy_search(monkeypatch, {"autoac": 1.0, 0.0: 2.0, 1.0: 2.0, "mixed": 2.0})
    model, step, prof = _case()
    for i in range(len(prof.regions)):
        prof = _with_layer_left_whole(prof, i)
    p = autoac.partitioner_plan(prof, 0.5)
    assert all(r.mode == "none" and r.fraction is None for r in p.regions)
    h = autoac.apply(
        model, budget=2 * p.predicted_peak, step_fn=step, profile_=prof, compile=True,
        compile_kwargs=PARTITION, partitioner_fractions=(0.0, 1.0), verify=False,
    )  # fmt: skip
    try:
        assert [r["plan"] for r in h.search] == ["autoac", "partitioner", "partitioner"]
        assert h.search[0]["chosen"]
        assert all(r.mode == "none" for r in h.plan.regions)
    finally:
        h.remove()


@pytest.mark.parametrize(
    ("fractions", "err"),
    [((True,), TypeError), ((0.5, "1"), TypeError), ((float("inf"),), ValueError)],
)
def test_bad_fraction_entries_are_refused_before_profiling(fractions, err):
    model, step, _ = _case()
    with pytest.raises(err, match="partitioner_fractions entry"):
        autoac.apply(model, budget=1e9, step_fn=step, compile=True, partitioner_fractions=fractions)
    assert not installed_regions(model)


def test_duplicate_and_signed_zero_fractions_are_measured_once(monkeypatch):
    _spy_search(monkeypatch, {"autoac": 1.0, 0.0: 2.0, "mixed": 2.0})
    model, step, prof = _case()
    h = autoac.apply(
        model, budget=1e12, step_fn=step, profile_=prof, compile=True, region_budgets={},
        compile_kwargs=PARTITION, partitioner_fractions=(0.0, -0.0, 0.0), verify=False,
    )  # fmt: skip
    try:
        assert [r["plan"] for r in h.search] == ["autoac", "partitioner"]
    finally:
        h.remove()
