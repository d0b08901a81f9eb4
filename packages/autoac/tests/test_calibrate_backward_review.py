"""Review of the backward calibration (0.1.22): the probe on edge cases, the fit's span
and the planner's code paths with the fit's groups (CPU only, small models).

The probe is checked against the eager step itself: regions hooked by forward hooks
(no autoac runner), their backwards measured by :class:`BackwardProbe` in one eager
step. The trace the planner prices is that eager step, so calibrating a profile with
its own eager backwards must not change a no-AC plan's prediction.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_calibrate_none import _case
from test_compiled_headroom import FLOPS, ChainBlock
from torch import nn

from hyperrec import autoac
from hyperrec.autoac import model as md
from hyperrec.autoac import runtime as rt
from hyperrec.autoac._backward_mem import BackwardProbe, module_backward_bytes
from hyperrec.autoac._compiled_saves import sequence_now
from hyperrec.autoac.planner import Plan


class _Pre(nn.Module):
    """A large linear outside any region before two chain blocks: its backward (a 2 MiB
    weight gradient) runs after the first region's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(8192, 64)
        self.layers = nn.ModuleList([ChainBlock(64) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return x


class _Plain(nn.Module):
    """Writes into its input: profiled ``("none",)`` only (no recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 2048)
        self.down = nn.Linear(2048, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.0)
        return self.down(torch.relu(self.up(x)))


class _WithPlain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.p, self.b = ChainBlock(64), _Plain(), ChainBlock(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.p(self.a(x)))


def _step(x):
    return lambda m: m(x).float().square().mean()


def _eager_backwards(model, step, names) -> dict[str, int]:
    """Each region's eager backward, beyond its start (one eager step, forward included
    under the probe, as ``_backward_bytes`` runs it)."""
    for p in model.parameters():
        p.grad = None
    try:
        return module_backward_bytes(model, lambda: step(model).backward(), names)
    finally:
        for p in model.parameters():
            p.grad = None


def _calibrated_with(prof, measured: dict[str, int]):
    regions = tuple(
        dataclasses.replace(r, none_backward_bytes=measured[r.name])
        if r.name in measured and "sac" in r.modes
        else r
        for r in prof.regions
    )
    return dataclasses.replace(prof, regions=regions)


def _pre_case():
    model = _Pre()
    step = _step(torch.randn(64, 8192))
    names = ["layers.0", "layers.1"]
    prof = autoac.profile(model, step, regions=names, config=FLOPS)
    return model, step, names, prof


def test_eager_probe_agrees_with_the_trace_on_a_regions_own_backward():
    """Sanity for the tests below: the last region's span holds its backward only, and
    the probe measures in the eager step what the trace's no-AC plan has there; the
    no-AC plan's prediction is the eager step's tracked peak."""
    model, step, names, prof = _pre_case()
    whole = autoac.plan(prof, budget=1e18)
    assert [r.mode for r in whole.regions] == ["none", "none"]
    got = _eager_backwards(model, step, names)
    assert set(got) == set(names)
    last = prof.regions[1]
    a, b = md._backward_span(prof, last)
    live = np.asarray(whole.live)
    assert got[last.name] == int(live[a:b].max() - live[a - 1])
    h = autoac.apply_plan(model, whole)
    try:
        assert rt.measure_step(model, step).peak_bytes == whole.predicted_peak
    finally:
        h.remove()


def test_fit_leaves_the_backward_of_modules_outside_regions_alone():
    """Found by review (fixed in 0.1.22 before release): a region's span ran to the next
    region's recomputation, or the end of the trace, so the fit clipped the backward of
    a large linear before the first region (predicted ~22% under the eager peak)."""
    model, step, names, prof = _pre_case()
    whole = autoac.plan(prof, budget=1e18)
    again = autoac.plan(_calibrated_with(prof, _eager_backwards(model, step, names)), budget=1e18)
    assert [r.mode for r in again.regions] == ["none", "none"]
    assert again.predicted_peak == pytest.approx(whole.predicted_peak, rel=0.01)


def test_fit_leaves_a_plain_regions_backward_alone():
    """Found by review (fixed in 0.1.22 before release): the span of the region after a
    region profiled ``("none",)`` only ran over that region's whole backward."""
    model = _WithPlain()
    step = _step(torch.randn(64, 64))
    names = ["a", "p", "b"]
    prof = autoac.profile(model, step, regions=names, config=FLOPS)
    assert {r.name: r.modes for r in prof.regions}["p"] == ("none",)
    whole = autoac.plan(prof, budget=1e18)
    again = autoac.plan(_calibrated_with(prof, _eager_backwards(model, step, names)), budget=1e18)
    assert again.predicted_peak == pytest.approx(whole.predicted_peak, rel=0.01)


def test_probe_edge_cases_measure_nothing_and_do_not_raise():
    x = torch.randn(100, requires_grad=True)
    probe = BackwardProbe(torch.device("cpu"))
    # no tensors, a leaf, a tensor without grad, an unknown sequence number
    probe.watch("empty", [], sequence_now())
    probe.watch("leaf", [x], sequence_now())
    with torch.no_grad():
        since = sequence_now()
        probe.watch("nograd", [x * 2], since)
    since = sequence_now()
    y = x * 2
    probe.watch("nosince", [y], None)
    # a region whose output the loss does not use: its backward never runs
    since = sequence_now()
    unused = x * 3
    probe.watch("unused", [unused], since)
    since = sequence_now()
    z = y.exp()
    probe.watch("used", [z], since)
    got = probe.run(lambda: z.sum().backward())
    assert set(got) == {"used"}
    assert got["used"] >= 100 * 4  # exp's gradient at least
    assert probe._handles == []


def test_planner_paths_with_the_fit_groups():
    """Groups without an op (the fit's) in the greedy, exact and pack_all paths, and
    plans of a calibrated profile round-trip through ``Plan.to_dict``."""
    _, _, _, prof = _case(("mxint8",))
    cal = dataclasses.replace(
        prof, regions=tuple(dataclasses.replace(r, none_backward_bytes=1000) for r in prof.regions)
    )
    # where a region may pack, no fit (it is of the unpacked backward)
    assert not [g for g in md.build_problem(cal, formats=("mxint8",)).groups if g.op is None]
    prob = md.build_problem(cal, formats=())
    fits = [g for g in prob.groups if g.op is None]
    assert len(fits) == len(prof.regions)
    assert all(c.kind == "drop" for g in fits for cs in g.choices.values() for c in cs)
    exact = autoac.PlanConfig(formats=())
    top = autoac.plan(cal, budget=1e18, config=exact)
    assert top.predicted_peak < autoac.plan(prof, budget=1e18, config=exact).predicted_peak
    for solver in ("greedy", "exact"):
        for frac in (0.3, 0.9):
            budget = top.floor + frac * (top.no_ac_peak - top.floor)
            cfg = autoac.PlanConfig(solver=solver, formats=())
            p = autoac.plan(cal, budget=budget, config=cfg)
            assert p.predicted_peak <= budget
            assert p.live is not None and int(p.live.max()) == p.predicted_peak
            assert all(set(r.saves.values()) <= {"keep", "mxint8"} for r in p.regions)
            assert Plan.from_dict(p.to_dict()).to_dict() == p.to_dict()
    packed = autoac.plan(cal, config=autoac.PlanConfig(strategy="pack_all"))
    assert {v for r in packed.regions for v in r.saves.values()} == {"mxint8"}
