"""Packing a region's inputs (0.1.18): an un-checkpointed region may pack the inputs its
ops save, where the profiled trace shows no other holder of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from autoac_cases import measure_under, mlp_tower, step_for
from torch import nn

from hyperrec import autoac
from hyperrec.autoac._exec import INPUT, RegionDecisions, input_storages
from hyperrec.autoac.formats import SAVE_FORMATS
from hyperrec.autoac.planner import restrict
from hyperrec.autoac.profiler import grad_error
from hyperrec.autoac.runtime import _packed_classes

CFG = autoac.ProfileConfig(
    cost="flops", steps=1, formats=("mxint8",), min_pack_bytes=4096, max_grad_error=0.05
)
PACK_ALL = autoac.PlanConfig(strategy="pack_all")
NO_INPUTS = {(INPUT, "mxint8")}


def _inputs(prof):
    return {r.name: [o for o in r.ops if o.is_input] for r in prof.regions}


def test_layer_inputs_are_offered_packed_and_cut_the_measured_peak():
    torch.manual_seed(0)
    model = mlp_tower(n=4, dim=48, seed=3)
    step = step_for(torch.randn(384, 48))
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, config=CFG)
    offered = _inputs(prof)
    # every layer's input is the previous layer's output (or the input projection's),
    # saved by its layer norm alone
    for name, ops in offered.items():
        assert [o.key for o in ops] == [(INPUT, 0)], name
        (o,) = ops
        assert o.op == o.op_class == INPUT and o.needed and not o.recomputed
        assert o.nbytes == 384 * 48 * 4 and o.formats == ("mxint8",)
        lv = o.storages[0]
        assert lv.fwd_alloc < lv.fwd_free < lv.rc_alloc <= lv.rc_free
    assert (INPUT, "mxint8") in prof.pack_errors
    assert prof.pack_errors[(INPUT, "mxint8")] <= CFG.max_grad_error

    with_inputs = autoac.plan(prof, config=PACK_ALL)
    without = autoac.plan(restrict(prof, NO_INPUTS), config=PACK_ALL)
    for r in with_inputs.regions:
        assert r.saves[(INPUT, 0)] == "mxint8"
    assert all(INPUT not in k[0] for r in without.regions for k in r.saves)
    # what each region holds drops by the input's bytes less its packed copy
    for a, b in zip(with_inputs.regions, without.regions):
        assert a.held_bytes < b.held_bytes
    m_in = measure_under(model, step, with_inputs)
    m_out = measure_under(model, step, without)
    assert m_in.peak_bytes < m_out.peak_bytes
    assert abs(m_in.peak_bytes / with_inputs.predicted_peak - 1) <= 0.10
    assert grad_error(ref.grads, m_in.grads) <= CFG.max_grad_error
    # the inputs alone, packed: a small error, not zero (they were quantized)
    assert 0 < prof.pack_errors[(INPUT, "mxint8")] < 0.01


class _Shared(nn.Module):
    """Two regions take the same tensor: packing it in one frees nothing."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.layers[0](h) + self.layers[1](h)


class _Sigmoid(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x))  # its backward needs its own output


class _Chain(nn.Module):
    """Layer 1's input is layer 0's sigmoid output, which layer 0's backward needs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Sigmoid(dim), nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


class _SavedOutside(nn.Module):
    """The caller multiplies by the region's input after the region: the product's
    backward holds the input before the region's backward runs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.layers[0](h) * h


@pytest.mark.parametrize("cls", [_Shared, _Chain, _SavedOutside])
def test_inputs_with_another_holder_are_not_offered(cls):
    torch.manual_seed(1)
    model = cls(64)
    step = step_for(torch.randn(256, 64))
    prof = autoac.profile(model, step, regions=list(model.layers), config=CFG)
    assert all(not ops for ops in _inputs(prof).values()), _inputs(prof)


class _Masked(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x)) + idx.unsqueeze(-1)


class _TwoArgs(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([_Masked(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x[:, 0] > 0).long()
        return self.layers[0](idx, self.inp(x))


def test_input_keys_count_every_distinct_tensor_argument():
    """The key's index counts the call's distinct storages, integer ones included, as
    the runtime numbers them."""
    torch.manual_seed(2)
    model = _TwoArgs(64)
    x = torch.randn(256, 64)
    step = step_for(x)
    ref = autoac.measure_step(model, step, keep_grads=True)
    prof = autoac.profile(model, step, regions=list(model.layers), config=CFG)
    (ops,) = _inputs(prof).values()
    assert [o.key for o in ops] == [(INPUT, 1)]
    p = autoac.plan(prof, config=PACK_ALL)
    assert p.regions[0].saves[(INPUT, 1)] == "mxint8"
    m = measure_under(model, step, p)
    assert grad_error(ref.grads, m.grads) <= CFG.max_grad_error
    idx = (x[:, 0] > 0).long()
    h = model.inp(x)
    assert [t is u for t, u in zip(input_storages(((idx, h), {})), (idx, h))] == [True, True]
    # a view of the same storage is not a second input
    assert len(input_storages(((h, h[:2], {"k": h}), {}))) == 1


def test_checkpointed_plans_never_pack_inputs_and_round_trip():
    torch.manual_seed(0)
    model = mlp_tower(n=3, dim=48, seed=3)
    step = step_for(torch.randn(384, 48))
    prof = autoac.profile(model, step, config=CFG)
    free = autoac.plan(prof, budget=1e18)
    for frac in (0.0, 0.3, 0.7):
        b = free.floor + frac * (free.no_ac_peak - free.floor)
        p = autoac.plan(prof, budget=b, config=autoac.PlanConfig(formats=("mxint8",)))
        for r in p.regions:
            if r.mode == "sac":
                assert all(k[0] != INPUT for k in r.saves), (frac, r.saves)
        assert autoac.Plan.from_dict(p.to_dict()).regions == p.regions
    packed = autoac.plan(prof, config=PACK_ALL)
    assert autoac.Plan.from_dict(packed.to_dict()).regions == packed.regions


def test_bound_ignores_inputs_and_compiled_regions_run_them_eagerly():
    torch.manual_seed(0)
    model = mlp_tower(n=3, dim=48, seed=3)
    step = step_for(torch.randn(384, 48))
    prof = autoac.profile(model, step, config=CFG)
    assert any(_inputs(prof).values())
    budget = autoac.plan(prof, budget=1e18).no_ac_peak
    a = autoac.span_free_bound(prof, budget)
    b = autoac.span_free_bound(
        dataclasses.replace(
            prof,
            regions=tuple(
                dataclasses.replace(r, ops=tuple(o for o in r.ops if not o.is_input))
                for r in prof.regions
            ),
        ),
        budget,
    )
    assert a.lower_bound_s == b.lower_bound_s and a.needed_bytes == b.needed_bytes
    # compiled plans are made from for_compiled_packing's profile: no input offered
    cprof = autoac.for_compiled_packing(prof)
    assert not any(o.formats for r in cprof.regions for o in r.ops if o.is_input)
    assert any(o.formats for r in cprof.regions for o in r.ops if not o.is_input)
    d = RegionDecisions(mode="none", saves={(INPUT, 0): "mxint8", ("aten.mm.default", 0): "mxint8"})
    assert d.quantized and _packed_classes(d) is None
    assert _packed_classes(RegionDecisions(mode="none", saves={("aten.mm.default", 0): "mxint8"}))


def test_saved_tensor_rows_flag_inputs():
    torch.manual_seed(0)
    model = mlp_tower(n=2, dim=48, seed=3)
    step = step_for(torch.randn(384, 48))
    prof = autoac.profile(model, step, config=CFG)
    rows = prof.saved_tensors()
    assert {r["op"] for r in rows if r["input"]} == {INPUT}
    assert all(r["op"] != INPUT for r in rows if not r["input"])
    # no formats asked for: nothing to pack, no input offered
    plain = autoac.profile(model, step, config=dataclasses.replace(CFG, formats=()))
    assert not any(_inputs(plain).values())
    assert all(d not in SAVE_FORMATS for r in autoac.plan(plain, budget=1e18).regions
               for d in r.saves.values())  # fmt: skip
