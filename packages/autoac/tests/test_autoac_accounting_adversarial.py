"""Adversarial checks of autoac's memory accounting and planner against independent
computations: the measured CPU peak (live tensor storages, the documented exact count),
brute force over every plan, and byte counts computed by hand.

The first five tests below failed before the fixes they name:

* ``allow_none=False`` reported full recompute as the no-AC baseline;
* unpacking one packed storage for two saves of one autograd node made two copies;
* an un-checkpointed region's packed copy was counted only up to its first backward use;
* the floor was full recompute's peak even where leaving a region un-checkpointed
  lowers the peak.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from autoac_cases import measure_under, mlp_tower, step_for
from torch import nn

from hyperrec import autoac
from hyperrec.autoac.formats import pack_storage, packed_nbytes
from hyperrec.autoac.model import Assignment, build_problem, compress, profile_of
from hyperrec.autoac.reference import live_bytes

FLOPS = autoac.ProfileConfig(cost="flops", steps=1)


# --------------------------------------------------------------------------- no-AC baseline
def test_no_ac_baseline_without_the_none_mode():
    """``PlanConfig(allow_none=False)`` forbids leaving regions un-checkpointed in the
    *plan*; the no-AC baseline it reports must still be no AC. It was full recompute:
    ``no_ac_peak == floor``, every region's ``noac_held_bytes`` its inputs, so
    ``saved_fraction`` was 1.0 for a fully recomputed region (the ``memory_budget``
    compile fallback then kept everything)."""
    model = mlp_tower()
    x = torch.randn(128, 32)
    step = step_for(x)
    noac = autoac.measure_step(model, step).peak_bytes
    prof = autoac.profile(model, step, config=FLOPS)
    ref = autoac.plan(prof, budget=1e15)
    strict = autoac.PlanConfig(allow_none=False)
    free = autoac.plan(prof, budget=1e15, config=strict)
    assert ref.no_ac_peak == noac  # the model is exact here (independent measurement)
    assert free.no_ac_peak == noac
    assert free.no_ac_peak > free.floor
    floor_plan = autoac.plan(prof, budget=free.floor, config=strict)
    for r, r_ref in zip(floor_plan.regions, ref.regions):
        assert r.noac_held_bytes == r_ref.noac_held_bytes > r.input_bytes
        if r.mode == "sac" and not r.saves:  # recomputes everything: holds nothing saved
            assert r.saved_fraction == 0.0


# --------------------------------------------------------------------------- packed saves
def test_dequantize_shared_reuses_the_storage_autograd_holds():
    """Autograd keeps what an unpack hook returns as a tensor of its own on the same
    storage; the next unpack of the same packed storage must reuse it, not dequantize a
    second full copy."""
    x = torch.randn(64, 64)
    p = pack_storage(x, "mxfp8")
    a = p.dequantize_shared()
    view = a.as_strided((64, 64), (64, 1), 0)
    held = torch.empty(0).set_(view.untyped_storage(), 0, (64, 64), (64, 1))
    del a, view
    b = p.dequantize_shared()
    assert b.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
    assert torch.equal(b.view(64, 64), held)
    del held, b
    c = p.dequantize_shared()  # nothing holds it any more: a fresh copy, same values
    assert torch.equal(c, p.dequantize())


class _SquareBlock(nn.Module):
    """``tanh``'s output is saved by ``tanh``'s backward and twice by ``a * a``'s."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.fc(x).tanh()
        return x + self.fc2(a * a)


class _SquareTower(nn.Module):
    def __init__(self, n: int = 2, d: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SquareBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _square_case():
    torch.manual_seed(0)
    model = _SquareTower()
    x = torch.randn(256, 64)
    cfg = dataclasses.replace(FLOPS, formats=("mxfp8",), min_pack_bytes=0, max_grad_error=10.0)
    prof = autoac.profile(model, step_for(x), config=cfg)
    return model, step_for(x), prof


def _forced_plan(prof, mode: str, op: str, fmt: str):
    """The plan with every region in ``mode``, ``op`` packed in ``fmt``, the rest at the
    mode's default; and the model's predicted peak of it."""
    raw = build_problem(prof, formats=(fmt,))
    modes = tuple(mode for _ in raw.regions)
    default = ("keep", "drop") if mode == "none" else ("recompute",)
    picks, saves = [], {}
    for g in raw.groups:
        opts = g.choices[mode]
        want = fmt if g.op.op == op else None
        k = next((i for i, c in enumerate(opts) if c.kind == want), None)
        if k is None:
            k = next(i for i, c in enumerate(opts) if c.kind in default)
        else:
            saves.setdefault(g.region, {})[g.op.key] = fmt
        picks.append(k)
    pred = int(profile_of(raw, Assignment(modes, tuple(picks))).max())
    base = autoac.plan(prof, budget=1e15)
    regions = tuple(
        dataclasses.replace(r, mode=mode, saves=saves.get(i, {}))
        for i, r in enumerate(base.regions)
    )
    assert saves, "the forced plan packs nothing"
    return dataclasses.replace(base, regions=regions, predicted_peak=pred)


@pytest.mark.parametrize("mode", ["none", "sac"])
def test_packed_save_of_a_twice_saved_tensor_within_its_predicted_peak(mode):
    """Un-checkpointed with ``tanh`` packed, the measured peak was 63,488 bytes over the
    prediction and above no AC's own peak (a second dequantized copy for ``a * a``)."""
    model, step, prof = _square_case()
    p = _forced_plan(prof, mode, "aten.tanh.default", "mxfp8")
    m = measure_under(model, step, p)
    assert m.peak_bytes <= p.predicted_peak
    assert m.peak_bytes < autoac.plan(prof, budget=1e15).no_ac_peak


def test_uncheckpointed_packed_copy_held_until_the_last_backward_use():
    """The packed copy is held by every node that saved the storage (``a * a`` and
    ``tanh``'s backward) until the last releases it, where the trace frees the
    recomputed copy: the option must count it there, not only up to the first use."""
    _, _, prof = _square_case()
    raw = build_problem(prof, formats=("mxfp8",))
    checked = 0
    for g in raw.groups:
        if g.op.op != "aten.tanh.default":
            continue
        (lv,) = g.op.storages
        assert lv.bwd_use is not None and lv.rc_free > lv.bwd_use + 1
        packed = next(c for c in g.choices["none"] if c.kind == "mxfp8")
        at = lv.rc_free - 1  # after the first use, before the last holder lets go
        delta = sum(d for s, e, d in packed.intervals if s <= at < e)
        assert delta == packed_nbytes(lv.numel, "mxfp8")
        checked += 1
    assert checked == 2


# --------------------------------------------------------------------------- the floor
class _ChunkPass(nn.Module):
    """Returns its input as a second output: checkpointing it raises the peak."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.unused = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, -1)
        return x + torch.cat([a * b, a + b], -1), x


class _TopTanh(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        v, ix = x.topk(4, dim=-1)
        h = x + torch.zeros_like(x).scatter(-1, ix, v)
        return x + self.lin(h.tanh().tanh()), None


class _FloorTower(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ChunkPass(d), _TopTanh(d)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(x)


def test_floor_is_the_least_peak_not_full_recompute():
    """Here no AC peaks lower than full recompute (measured): budgets between the two
    were refused with an error naming full recompute's peak as the smallest feasible."""
    torch.manual_seed(4)
    model = _FloorTower()
    step = step_for(torch.randn(32, 32))
    noac = autoac.measure_step(model, step).peak_bytes
    prof = autoac.profile(model, step, config=FLOPS)
    free = autoac.plan(prof, budget=1e15)
    assert free.floor <= free.no_ac_peak
    # Brute force over every plan of the model: the floor is the least peak of any.
    prob = compress(build_problem(prof, formats=()))
    least = min(
        int(live_bytes(prob, Assignment(modes, picks)).max())
        for modes in itertools.product(*[sorted(r.fixed_s) for r in prob.regions])
        for picks in itertools.product(
            *[range(len(g.choices[modes[g.region]])) for g in prob.groups]
        )
    )
    assert free.floor == least + prof.device_offset
    p = autoac.plan(prof, budget=noac)  # was a ValueError
    m = measure_under(model, step, p)
    assert m.peak_bytes <= p.predicted_peak <= noac
    with pytest.raises(ValueError, match=str(free.floor)):
        autoac.plan(prof, budget=free.floor - 1)


# --------------------------------------------------------------------------- odd saves
class _OddBlock(nn.Module):
    """Bool masks, int64 indices, float64, a transposed save, an empty tensor,
    ``no_grad`` inside: none of it may be packed, every byte counted once."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.where(h > 0, h, 0.1 * h)  # bool mask saved
        v, ix = h.topk(4, dim=-1)  # int64 indices saved by scatter
        h = h + torch.zeros_like(h).scatter(-1, ix, v)
        h = (h.double().sin()).float()  # float64 save
        h = (h.t() * 1.5).t()  # non-contiguous
        with torch.no_grad():
            c = h.abs().mean()
        z = h[:, :0] * 3  # zero-size
        return x + self.fc2(F.gelu(h * c) + z.sum())


class _OddTower(nn.Module):
    def __init__(self, n: int = 2, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_OddBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_odd_saves_exact_peak_and_never_packed():
    torch.manual_seed(0)
    model = _OddTower()
    step = step_for(torch.randn(64, 32))
    ref = autoac.measure_step(model, step, keep_grads=True)
    cfg = dataclasses.replace(FLOPS, formats=("mxfp8",), min_pack_bytes=0, max_grad_error=10.0)
    prof = autoac.profile(model, step, config=cfg)
    for r in prof.regions:
        for o in r.ops:
            for lv in o.storages:
                assert lv.nbytes == lv.numel * torch.empty((), dtype=lv.dtype).element_size()
            if all(lv.dtype not in (torch.float32,) for lv in o.storages):
                assert o.formats == (), o.op  # bool, int64, float64: never packable
    free = autoac.plan(prof, budget=1e15, config=autoac.PlanConfig(formats=()))
    assert free.no_ac_peak == ref.peak_bytes
    for f in (0.0, 0.5):
        b = free.floor + f * (free.no_ac_peak - free.floor)
        p = autoac.plan(prof, budget=b, config=autoac.PlanConfig(formats=()))
        m = measure_under(model, step, p)
        assert m.peak_bytes == p.predicted_peak <= b
        for g0, g1 in zip(ref.grads, m.grads):
            assert torch.equal(g0, g1)


def test_budget_edges_name_the_floor():
    model = mlp_tower()
    step = step_for(torch.randn(64, 32))
    prof = autoac.profile(model, step, config=FLOPS)
    floor = autoac.plan(prof, budget=1e15).floor
    assert autoac.plan(prof, budget=floor).predicted_peak <= floor
    assert autoac.plan(prof, budget=np.int64(floor)).predicted_peak <= floor
    for bad in (floor - 1, floor - 0.5, -1.0, float("nan"), float("-inf"), float("inf")):
        with pytest.raises(ValueError, match=rf"budget .*{floor}"):
            autoac.plan(prof, budget=bad)


def test_floor_never_above_full_recompute_or_no_ac_on_random_instances():
    """The floor assignment meets every bound it claims on random instances (with
    un-checkpointed modes that drop recomputed copies), and the greedy started from it
    stays within a cap at the floor."""
    from test_solve import random_problem

    from hyperrec.autoac.model import least_peak, min_memory, peak_of
    from hyperrec.autoac.solve import solve_greedy

    lower = 0
    for seed in range(200):
        prob = random_problem(seed, regions=3)
        a = least_peak(prob)
        floor = peak_of(prob, a)
        full = peak_of(prob, min_memory(prob))
        # no checkpoint: every region un-checkpointed, each group at its first option
        no_ac = Assignment(tuple("none" for _ in prob.regions), tuple(0 for _ in prob.groups))
        assert floor <= min(full, peak_of(prob, no_ac))
        lower += floor < full
        prob.cap = floor
        prob.region_caps = {}
        g = solve_greedy(prob, start=a)
        assert peak_of(prob, g.assignment) <= floor
    assert lower > 0  # the instances do exercise a floor below full recompute
