"""Adversarial inputs for autoac: inputs it accepts but used to handle wrongly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hyperrec import autoac


class _LeakyBlock(nn.Module):
    """Returns an intermediate (``h``) besides its output; the caller mutates it."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc1(x)  # addmm: its backward does not need h
        z = h + 1.0  # add: neither; the recomputation reads h to rebuild z
        return h, self.fc2(torch.sin(z))  # sin saves z


class _Caller(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_LeakyBlock(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, r = self.layers[0](x)
        h.mul_(3.0)  # legal without checkpointing: autograd saved nothing of h
        return (r * h.detach()).sum() + r.sum()


def _case():
    torch.manual_seed(0)
    model, x = _Caller(), torch.randn(32, 64)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x)

    step(model).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return model, step, ref


def _grads(model, step):
    for p in model.parameters():
        p.grad = None
    step(model).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_output_mutated_after_its_region_is_never_kept():
    # The profiler only looked for in-place writes inside the region, so the planner
    # kept fc1's output; the caller's h.mul_ then made torch's selective checkpoint fail
    # in the backward ("Tensor cached during selective activation checkpoint has been
    # mutated") on a plan autoac itself chose.
    model, step, ref = _case()
    prof = autoac.profile(model, step, config=autoac.ProfileConfig(steps=1, cost="flops"))
    (op,) = [o for o in prof.regions[0].ops if o.key == ("aten.addmm.default", 0)]
    assert op.mutated
    cfg = autoac.PlanConfig(allow_none=False)
    p = autoac.plan(prof, budget=10**12, config=cfg)  # as much keeping as it likes
    assert ("aten.addmm.default", 0) not in p.regions[0].saves
    h = autoac.apply_plan(model, p)
    try:
        got = _grads(model, step)
    finally:
        h.remove()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_kept_tensor_mutated_later_is_an_error_with_packed_saves_too():
    # With a packed save in the region autoac runs its own dispatch modes instead of
    # torch's selective checkpoint; they returned the mutated kept tensor to the
    # recomputation: gradients silently off by up to 30 (torch's SAC raises instead).
    model, step, ref = _case()
    prof = autoac.profile(model, step, config=autoac.ProfileConfig(steps=1, cost="flops"))
    base = autoac.plan(prof, budget=10**12)
    saves = {("aten.addmm.default", 0): "keep", ("aten.sin.default", 0): "mxfp8"}
    region = dataclasses.replace(base.regions[0], mode="sac", saves=saves)
    p = dataclasses.replace(base, regions=(region,), min_pack_bytes=0)
    assert p.decisions()[region.name].quantized
    h = autoac.apply_plan(model, p)
    try:
        with pytest.raises(RuntimeError, match="mutated"):
            _grads(model, step)
    finally:
        h.remove()


class _BNBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.fc(x)))


class _BNTower(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_BNBlock(d), _BNBlock(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _bn_case():
    torch.manual_seed(0)
    model, x = _BNTower(), torch.randn(32, 16)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    return model, step


def test_profile_advances_batchnorm_statistics_once_per_profiled_step():
    # What an un-checkpointed step does: one update per step. torch.utils.checkpoint
    # advances them twice (forward + replay); autoac never replays a buffer write.
    model, step = _bn_case()
    autoac.profile(model, step, config=autoac.ProfileConfig(steps=1, cost="flops"))
    assert [int(b.bn.num_batches_tracked) for b in model.layers] == [1, 1]


def test_batchnorm_running_stats_match_no_checkpointing():
    model, step = _bn_case()
    prof = autoac.profile(model, step, config=autoac.ProfileConfig(steps=1, cost="flops"))
    plain = _BNTower()
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        for b in m.layers:
            b.bn.reset_running_stats()
    p = autoac.plan(prof, budget=autoac.plan(prof, budget=10**12).floor)  # full recompute
    h = autoac.apply_plan(model, p)
    try:
        step(model).backward()
    finally:
        h.remove()
    step(plain).backward()
    for a, b in zip(model.layers, plain.layers):
        assert torch.equal(a.bn.running_mean, b.bn.running_mean)
        assert int(a.bn.num_batches_tracked) == int(b.bn.num_batches_tracked)


def test_batchnorm_statistics_with_interleaved_micro_batches():
    # Two forwards before either backward (pipelining, or a gradient accumulation that
    # keeps both graphs): the recomputation of the first must not undo the second's
    # update. With momentum=None (cumulative average) the counter weights each update.
    torch.manual_seed(1)
    model = _BNTower()
    for b in model.layers:
        b.bn.momentum = None
    xs = [torch.randn(32, 16), torch.randn(32, 16)]
    prof = autoac.profile(
        model,
        lambda m: m(xs[0]).square().mean(),
        config=autoac.ProfileConfig(steps=1, cost="flops"),
    )
    plain = _BNTower()
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        for b in m.layers:
            b.bn.reset_running_stats()
            b.bn.momentum = None
    p = autoac.plan(prof, budget=autoac.plan(prof, budget=10**12).floor)
    h = autoac.apply_plan(model, p)
    try:
        losses = [model(x).square().mean() for x in xs]
        for loss in losses:
            loss.backward()
    finally:
        h.remove()
    for loss in [plain(x).square().mean() for x in xs]:
        loss.backward()
    for a, b in zip(model.layers, plain.layers):
        torch.testing.assert_close(a.bn.running_mean, b.bn.running_mean, rtol=0, atol=0)
        torch.testing.assert_close(a.bn.running_var, b.bn.running_var, rtol=0, atol=0)
        assert int(a.bn.num_batches_tracked) == int(b.bn.num_batches_tracked) == 2
    for pa, pb in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


@pytest.mark.parametrize("save", ["keep", "mxfp8"])
def test_batchnorm_statistics_once_through_a_region_with_saved_outputs(save):
    # The selective path (a kept output) and autoac's own packing dispatch modes (a packed
    # output) recompute the region too: its batch-norm statistics must still advance once.
    from hyperrec.autoac._exec import RegionDecisions, run_region

    torch.manual_seed(2)
    block, plain = _BNBlock(32), _BNBlock(32)
    plain.load_state_dict(block.state_dict())
    x = torch.randn(64, 32)
    d = RegionDecisions(mode="sac", saves={("aten.addmm.default", 0): save})
    assert d.quantized == (save == "mxfp8")
    out = run_region(d, block.forward, (x,), {})
    out.square().mean().backward()
    plain(x).square().mean().backward()
    torch.testing.assert_close(block.bn.running_mean, plain.bn.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(block.bn.running_var, plain.bn.running_var, rtol=0, atol=0)
    assert int(block.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == 1
    # exact when the linear's output is kept; within MXFP8's error when it is packed
    tol = {"keep": (0.0, 0.0), "mxfp8": (0.1, 0.05)}[save]
    for a, b in zip(block.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol[0], atol=tol[1])
