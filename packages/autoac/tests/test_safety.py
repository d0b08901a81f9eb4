"""Safe by construction: random ops replay the same numbers; collectives never replay."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from autoac_cases import mlp_tower, step_for
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyperrec import autoac
from hyperrec.autoac import _exec
from hyperrec.autoac.profiler import grad_error

FLOPS = autoac.ProfileConfig(cost="flops", steps=1)


def _grads(model, step, plan_=None):
    h = autoac.apply_plan(model, plan_) if plan_ is not None else None
    try:
        return autoac.measure_step(model, step, keep_grads=True, seed=7).grads
    finally:
        if h is not None:
            h.remove()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_dropout_replays_same_mask_and_guard_is_what_makes_it(monkeypatch):
    model = mlp_tower(p=0.3)
    step = step_for(torch.randn(128, 32))
    ref = _grads(model, step)
    prof = autoac.profile(model, step, config=FLOPS)
    floor = autoac.plan(prof, budget=1e15).floor
    full = autoac.plan(prof, budget=floor, config=autoac.PlanConfig(allow_none=False))
    assert all(r.mode == "sac" for r in full.regions)
    assert _same(ref, _grads(model, step, full))
    mid = autoac.plan(prof, budget=floor * 1.3)
    assert _same(ref, _grads(model, step, mid))
    # Without the guard (no RNG restore before recomputation) the masks differ: the
    # silent corruption of OLMo-core #828.
    monkeypatch.setattr(_exec, "_RNG_GUARD", False)
    bad = _grads(model, step, full)
    assert not _same(ref, bad)
    assert grad_error(ref, bad) > 1e-2


class TwoMasks(nn.Module):
    """Two out-of-place random ops in one region."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h * torch.bernoulli(torch.full_like(h, 0.7))
        h = self.b(h)
        return h * torch.bernoulli(torch.full_like(h, 0.7))


def test_saving_one_random_op_would_shift_the_generator(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(TwoMasks(), TwoMasks())
    step = step_for(torch.randn(64, 32))
    ref = _grads(model, step)
    prof = autoac.profile(model, step, config=FLOPS)
    rnd = [o for r in prof.regions for o in r.ops if o.random]
    assert {o.op for o in rnd} == {"aten.bernoulli.default"}
    # The planner never keeps a random op under checkpointing, at any budget.
    base = autoac.plan(prof, budget=1e15)
    for f in (0.0, 0.3, 0.6, 0.9):
        b = base.floor + f * (base.no_ac_peak - base.floor)
        p = autoac.plan(prof, budget=b, config=autoac.PlanConfig(allow_none=False))
        for r in p.regions:
            assert not any(k[0] == "aten.bernoulli.default" for k in r.saves)
    # A hand-made plan that keeps the first mask: the policy still recomputes it.
    full = autoac.plan(prof, budget=base.floor, config=autoac.PlanConfig(allow_none=False))
    key = ("aten.bernoulli.default", 0)
    unsafe = dataclasses.replace(
        full,
        regions=tuple(
            dataclasses.replace(r, mode="sac", saves={key: "keep"}) for r in full.regions
        ),
    )
    assert _same(ref, _grads(model, step, unsafe))
    monkeypatch.setattr(_exec, "_RNG_GUARD", False)
    assert not _same(ref, _grads(model, step, unsafe))


# --------------------------------------------------------------------------- collectives
class _CountCollectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") in ("_c10d_functional", "c10d"):
            self.n += 1
        return func(*args, **(kwargs or {}))


class StatBlock(nn.Module):
    """A block that scales by a cross-rank statistic (a collective in the region)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        stat = h.detach().square().mean(0)
        if self.inplace:
            stat = stat.clone()
            dist.all_reduce(stat)
        else:
            from torch.distributed import _functional_collectives as fc

            stat = fc.all_reduce(stat, "sum", dist.group.WORLD)
        return x + self.fc2(h * torch.rsqrt(stat + 1.0))


def _backward_collectives(model, step) -> tuple[int, list]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss = step(model)
    counter = _CountCollectives()
    with counter:
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return counter.n, grads


def _collective_worker(inplace: bool) -> dict:
    from torch.utils.checkpoint import checkpoint

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(StatBlock(inplace), StatBlock(inplace))
    torch.manual_seed(100 + rank)
    step = step_for(torch.randn(32, 16))
    n_ref, ref = _backward_collectives(model, step)
    prof = autoac.profile(model, step, config=FLOPS)
    modes = [r.modes for r in prof.regions]
    coll = [o.op for r in prof.regions for o in r.ops if o.collective]
    floor = autoac.plan(prof, budget=1e15).floor
    p = autoac.plan(prof, budget=floor, config=autoac.PlanConfig(allow_none=False))
    h = autoac.apply_plan(model, p)
    n_ac, got = _backward_collectives(model, step)
    h.remove()
    # Plain full checkpointing replays the collective in the backward.
    orig = [m.forward for m in model]
    for m in model:
        m.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(m.forward)
    n_plain, _ = _backward_collectives(model, step)
    for m, f in zip(model, orig):
        m.forward = f
    return {
        "modes": modes,
        "collective_ops": coll,
        "plan_modes": [r.mode for r in p.regions],
        "n_ref": n_ref,
        "n_autoac": n_ac,
        "n_plain": n_plain,
        "equal": all(torch.equal(a, b) for a, b in zip(ref, got)),
    }


def _both_workers() -> list[dict]:
    return [_collective_worker(False), _collective_worker(True)]


def test_collectives_never_recomputed():
    from hyperrec.testing import run_on_ranks

    ranks = run_on_ranks(_both_workers, 2, timeout_s=240)
    for o, inplace in [(o, i) for r in ranks for o, i in zip(r, (False, True))]:
        assert o["n_ref"] == 0  # the plain backward has no collective
        assert o["n_autoac"] == 0  # autoac never replays one
        assert o["n_plain"] >= 2  # vanilla full checkpointing does, once per region
        assert o["equal"]
        if inplace:
            # An in-place collective cannot be replayed safely: those regions stay
            # un-checkpointed.
            assert o["modes"] == [("none",), ("none",)]
            assert o["plan_modes"] == ["none", "none"]
        else:
            assert o["modes"] == [("sac", "none"), ("sac", "none")]
            assert o["plan_modes"] == ["sac", "sac"]
            assert o["collective_ops"].count("_c10d_functional.all_reduce.default") == 2


def test_policy_answers_the_same_when_asked_during_recomputation():
    """Older torch versions ask the policy again while recomputing and pop a saved entry
    for every SAVE answer: the answers must repeat the forward's, op by op."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    saves = {("aten.mm.default", 1): "keep", ("aten.mm.default", 3): "keep"}
    fwd_mode, _ = _exec.sac_context_fn(_exec.RegionDecisions("sac", saves))()
    policy = fwd_mode.policy_fn
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    seq = [mm, add, mm, mm, add, mm, mm]
    x = torch.ones(2, 2)
    fwd = [policy(SelectiveCheckpointContext(is_recompute=False), f, x, x) for f in seq]
    rc = [policy(SelectiveCheckpointContext(is_recompute=True), f, x, x) for f in seq]
    assert fwd == rc
    kept = [i for i, p in enumerate(fwd) if p is _exec.CheckpointPolicy.MUST_SAVE]
    assert kept == [2, 5]  # the 2nd and 4th mm
