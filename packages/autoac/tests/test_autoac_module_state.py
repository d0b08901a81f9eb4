"""Module state under a plan in force, on cases an audit found wrong (each test here
failed before 0.1.10):

- ``copy.deepcopy`` of a model with a plan (an EMA or teacher copy) ran the *original's*
  weights in the copy's regions and put gradients on the original; ``torch.save(model)``
  failed (the dispatcher was a closure over the module).
- Buffers a checkpointed region writes through ``.data``, by re-assignment or inside
  ``F.batch_norm`` were updated twice per step (the recomputation wrote them again: only
  version counters and ``nn.BatchNorm`` modules were recognised).
- A region whose ``forward`` was wrapped on the instance (accelerate-style wrappers)
  updated its batch-norm statistics twice.
- ``compile=True`` with a graph break inside a checkpointed region did the same.
- A region that writes into its own input in place made ``apply`` fail.
- autoac's own steps accumulated gradients into input leaves.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hyperrec import autoac

IDIOMS = ("no_grad_inplace", "dot_data", "reassign", "functional_bn", "bn_module", "graph_break")


class Blk(nn.Module):
    def __init__(self, d: int, idiom: str) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.idiom = idiom
        self.register_buffer("stat", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.idiom == "no_grad_inplace":
            with torch.no_grad():
                self.stat.mul_(0.9).add_(0.1 * h.mean(0))
        elif self.idiom == "dot_data":
            self.stat.data.mul_(0.9).add_(0.1 * h.detach().mean(0))
        elif self.idiom == "reassign":
            with torch.no_grad():
                self.stat = 0.9 * self.stat + 0.1 * h.mean(0)
        elif self.idiom == "functional_bn":
            h = F.batch_norm(h, self.stat, self.var, training=True, momentum=0.1)
        else:
            h = self.bn(h)
            if self.idiom == "graph_break" and float(h.detach().mean()) > -1.0:
                h = h * 1.0
        return x + torch.tanh(h)


class Net(nn.Module):
    def __init__(self, idiom: str = "bn_module", d: int = 32, n: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Blk(d, idiom) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


X = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def _step(m: nn.Module) -> torch.Tensor:
    return m(X).square().mean()


def _full_recompute(model: nn.Module) -> autoac.Plan:
    prof = autoac.profile(model, _step, config=autoac.ProfileConfig(cost="flops", steps=1))
    p = autoac.plan(prof, budget=1e15)
    regions = tuple(dataclasses.replace(r, mode="sac", saves={}) for r in p.regions)
    return dataclasses.replace(p, regions=regions)


def _wrap(f):
    @functools.wraps(f)
    def w(*a, **k):
        return f(*a, **k)

    return w


@pytest.mark.parametrize("idiom", IDIOMS)
@pytest.mark.parametrize("wrapped", [False, True])
def test_buffers_are_written_once_per_step(idiom, wrapped):
    def build() -> Net:  # fresh models: a deep copy would share the wrappers' closures
        model = Net(idiom)
        if wrapped:  # an instance-level forward wrapper on every region
            for layer in model.layers:
                layer.forward = _wrap(layer.forward)
        return model

    plan = _full_recompute(build())
    compiled = idiom == "graph_break"
    ref, m = build(), build()
    torch._dynamo.reset()
    h = autoac.apply_plan(m, plan, compile=compiled, compile_kwargs={"backend": "aot_eager"})
    try:
        for _ in range(3):
            _step(ref).backward()
            _step(m).backward()
        for (name, a), b in zip(ref.named_buffers(), m.buffers(), strict=True):
            assert torch.equal(a, b), name
        for a, b in zip(ref.parameters(), m.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    finally:
        h.remove()
    if wrapped:  # the wrapper is back in place
        assert all("forward" in layer.__dict__ for layer in m.layers)


def test_a_deep_copy_runs_its_own_weights():
    model = Net()
    h = autoac.apply_plan(model, _full_recompute(Net()))
    twin = copy.deepcopy(model)
    plain = copy.deepcopy(Net())  # same initial weights, no autoac
    with torch.no_grad():
        for c in (twin, plain):
            for p in c.layers.parameters():
                p.mul_(3.0)
    torch.testing.assert_close(twin(X), plain(X))
    assert not torch.allclose(twin(X), model(X))
    _step(twin).backward()
    assert all(p.grad is not None for p in twin.layers.parameters())
    assert all(p.grad is None for p in model.layers.parameters())
    # the copy carries its own plan: it is removed from the copy alone
    h.remove()
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    autoac.remove(twin)
    twin(X)


def test_a_model_with_a_plan_pickles():
    model = Net()
    h = autoac.apply_plan(model, _full_recompute(Net()), compile=True,
                          compile_kwargs={"backend": "aot_eager"})  # fmt: skip
    try:
        _step(model).backward()  # a compiled region exists
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
        with torch.no_grad():
            torch.testing.assert_close(back(X), model(X))
        _step(back).backward()
        assert all(p.grad is not None for p in back.layers.parameters())
    finally:
        h.remove()


class _InputWriter(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(d) * 0.5)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.pos  # into the region's input
        return x + torch.tanh(self.fc(x))


class _InputWriterNet(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([_InputWriter(d), Blk(d, "bn_module"), _InputWriter(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_region_writing_its_input_is_left_unchecked():
    ref, m = _InputWriterNet(), _InputWriterNet()
    prof = autoac.profile(m, _step, config=autoac.ProfileConfig(cost="flops", steps=1))
    floor = autoac.plan(prof, budget=1e15).floor
    h = autoac.apply(m, budget=floor, step_fn=_step)
    try:
        modes = [r.mode for r in h.plan.regions]
        assert modes[0] == modes[2] == "none" and modes[1] == "sac", modes
        _step(ref).backward()
        m.zero_grad()
        _step(m).backward()
        for a, b in zip(ref.parameters(), m.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    finally:
        h.remove()


def test_autoac_steps_leave_input_gradients_alone():
    """``apply``, ``profile`` and ``measure_step`` run steps of their own: a leaf input
    that requires grad (saliency, adversarial training) kept their gradients (5x a
    step's after ``apply``)."""
    x = X.clone().requires_grad_(True)
    x.grad = torch.full_like(x, 7.0)

    def step(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    model = Net()
    h = autoac.apply(model, budget=1e12, step_fn=step)
    autoac.measure_step(model, step)
    h.remove()
    assert torch.equal(x.grad, torch.full_like(x, 7.0))
    assert all(p.grad is None for p in model.parameters())
