"""What an un-checkpointed region's compiled backward allocates (``calibrate_none``'s
``backward``, 0.1.22): measured per region in a real step, and the planner's model of
that backward fitted to it.

The eager trace the planner prices a plan on has the eager backward's allocations; a
compiled backward fuses element-wise gradients away, or recomputes what its graph did
not save, so it allocates less or more.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_calibrate_none import _case, compiled_peak
from test_compiled_headroom import PARTITION

from hyperrec import autoac
from hyperrec.autoac import model as md
from hyperrec.autoac import runtime as rt
from hyperrec.autoac._backward_mem import _MARK, BackwardProbe
from hyperrec.autoac._compiled_saves import sequence_now


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Allocates(torch.autograd.Function):
    """Its backward allocates a scratch tensor of ``n`` bytes while it runs."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.n = n
        return x * 2

    @staticmethod
    def backward(ctx, g):
        scratch = torch.ones(ctx.n, dtype=torch.uint8)
        out = g * 2 + scratch[:1].float()
        del scratch
        return out, None


def _probe(*sizes: int, watch=None, after=None) -> dict[str, int]:
    """Regions ``r0, r1, ...`` each one ``_Allocates`` (then ``after`` of it)."""
    x = torch.randn(1000, requires_grad=True)
    probe = BackwardProbe(torch.device("cpu"))
    y = x
    for i, n in enumerate(sizes):
        since = sequence_now()
        y = _Allocates.apply(y, n)
        if after is not None:
            y = after(y)
        probe.watch(f"r{i}", [y], since)
    if watch is not None:
        watch(probe, y)
    return probe.run(lambda: y.sum().backward())


def test_cpu_probe_measures_each_backward_from_its_start():
    n0, n1 = 3_000_000, 1_200_000
    got = _probe(n0, n1)
    grad = 1000 * 4
    # the scratch, the incoming and outgoing gradients at most; the markers not counted
    assert n0 <= got["r0"] <= n0 + 3 * grad
    assert n1 <= got["r1"] <= n1 + 3 * grad


def test_cpu_probe_leaves_out_what_it_cannot_tell_apart():
    # a region called twice in one step: which call's backward is which is unknown
    got = _probe(2_000_000, watch=lambda p, y: p.watch("r0", [y * 1], sequence_now()))
    assert "r0" not in got
    # a step that allocates a marker's size itself: not measured, not wrong
    assert "r0" not in _probe(_MARK, 10)
    # outputs from two nodes: no one node is the region's backward
    x = torch.randn(10, requires_grad=True)
    probe = BackwardProbe(torch.device("cpu"))
    since = sequence_now()
    a, b = x * 2, x * 3
    probe.watch("two", [a, b], since)
    # no node made by the call (its output made before), or no sequence number known
    probe.watch("old", [a], sequence_now())
    probe.watch("unknown", [b], None)
    assert probe.run(lambda: (a + b).sum().backward()) == {}


def test_cpu_probe_spans_the_regions_nodes_from_its_outputs_to_its_first():
    """A region of several nodes (an eager one, or a compiled one whose outputs are
    views): from its outputs' node to the earliest node it made."""
    n = 2_000_000
    for after in (lambda y: y.view(10, 100) * 3, lambda y: y[:500]):
        got = _probe(n, after=after)
        assert n <= got["r0"] <= n + 4 * 1000 * 4


def test_probe_removes_its_hooks():
    x = torch.randn(1000, requires_grad=True)
    since = sequence_now()
    y = _Allocates.apply(x, 1_000_000)
    probe = BackwardProbe(torch.device("cpu"))
    probe.watch("r", [y], since)
    probe.run(lambda: y.sum().backward(retain_graph=True))
    # a second backward through the same node makes no marker allocation
    again = BackwardProbe(torch.device("cpu"))
    from hyperrec.autoac._backward_mem import _allocation_events

    events = _allocation_events(lambda: y.sum().backward())
    assert _MARK not in events and _MARK + 2 not in events
    assert again.result == {}


def _span_working_set(prof, live, r):
    a, b = md._backward_span(prof, prof.regions[r])
    return int(np.max(live[a:b]) - live[a - 1])


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_the_fit_makes_the_whole_regions_backward_allocate_the_measured_bytes(scale):
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    assert all(r.mode == "none" for r in whole.regions)
    assert whole.live is not None
    last = len(prof.regions) - 1
    eager = _span_working_set(prof, whole.live, last)
    cap = int(eager * scale)
    regions = list(prof.regions)
    regions[last] = dataclasses.replace(regions[last], none_backward_bytes=cap)
    fitted = dataclasses.replace(prof, regions=tuple(regions))
    again = autoac.plan(fitted, budget=1e18)
    assert again.live is not None
    assert all(r.mode == "none" for r in again.regions)
    assert _span_working_set(prof, again.live, last) == cap
    # the bytes held into the backward are not the fit's business
    assert [r.held_bytes for r in again.regions] == [r.held_bytes for r in whole.regions]
    # a checkpointed region's backward is priced as before
    prob0, prob1 = (md.build_problem(p, formats=()) for p in (prof, fitted))
    sac0, sac1 = md.min_memory(prob0), md.min_memory(prob1)
    assert set(sac0.modes) == set(sac1.modes) == {"sac"}
    assert (md.profile_of(prob0, sac0) == md.profile_of(prob1, sac1)).all()


def test_calibrate_none_takes_the_backward_of_whole_regions_to_identical_ones():
    _, _, _, prof = _case()
    budget = autoac.plan(prof, budget=1e18)
    mixed = autoac.plan(prof, budget=budget.floor + 0.5 * (budget.predicted_peak - budget.floor))
    modes = [r.mode for r in mixed.regions]
    assert "none" in modes and "sac" in modes
    names = [r.name for r in mixed.regions]
    whole = [n for n, m in zip(names, modes, strict=True) if m == "none"]
    ckpt = [n for n, m in zip(names, modes, strict=True) if m == "sac"]
    # measured: one whole region (used) and one checkpointed one (its backward is
    # not an un-checkpointed region's: ignored)
    cal = rt.calibrate_none(prof, mixed, {}, {whole[0]: 12345, ckpt[0]: 99})
    got = {r.name: r.none_backward_bytes for r in cal.regions}
    # the tower's layers are identical: every one takes the whole region's bytes
    assert set(got.values()) == {12345}
    # nothing measured: nothing changes
    assert rt.calibrate_none(prof, mixed, {}, {}).regions == prof.regions
    assert rt.calibrate_none(prof, mixed, {}).regions == prof.regions


def test_calibrate_none_backward_checks():
    _, _, _, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    name = whole.regions[0].name
    with pytest.raises(TypeError, match="backward"):
        rt.calibrate_none(prof, whole, {}, [1])
    with pytest.raises(ValueError, match="backward names regions"):
        rt.calibrate_none(prof, whole, {}, {"nope": 1})
    with pytest.raises(ValueError, match="backward"):
        rt.calibrate_none(prof, whole, {}, {name: -1})


def test_apply_measures_the_whole_regions_backward_in_the_calibration_step():
    model, step, raw, prof = _case()
    whole = autoac.plan(prof, budget=1e18)
    h = rt.AutoAC(model, whole, profile_=prof, compiled=True, compile_kwargs=PARTITION)
    measured = rt._backward_bytes(h, step, 0)
    peak = compiled_peak(model, step) + prof.resident_bytes
    h.remove()
    assert set(measured) == {r.name for r in whole.regions}
    assert all(v > 0 for v in measured.values())
    cal = autoac.apply(model, budget=1e18, step_fn=step, profile_=raw, compile=True,
                       compile_kwargs=PARTITION, verify=False, calibrate_none=True)  # fmt: skip
    try:
        assert {r.none_backward_bytes for r in cal.profile.regions} == set(measured.values())
        # the no-AC plan's predicted peak is its compiled step's
        assert cal.plan.predicted_peak == pytest.approx(peak, rel=0.02)
    finally:
        cal.remove()


def test_cpu_probe_under_a_callers_profiler_measures_nothing():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        assert _probe(1_000_000) == {}
    assert set(_probe(1_000_000)) == {"r0"}
