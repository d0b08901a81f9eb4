"""Adversarial tests: convert/plan_conversion and compile cases that misbehaved."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from hyperrec.mxfp8 import MXLinear, PrecisionPolicy, convert, plan_conversion

# Every layer eligible: nothing kept for position or size.
_ALL = PrecisionPolicy(min_features=1, keep_first=False, keep_last=False)


class _DoubledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_convert_keeps_a_tied_linear_tied():
    # One nn.Linear reachable under two names (weight tying / shared blocks): after
    # convert both names must still be the same module, running the same recipe.
    shared = nn.Linear(64, 64)
    model = nn.Module()
    model.a = nn.Sequential(shared)
    model.b = nn.Sequential(shared)
    model.c = shared  # a second name in another parent
    convert(model, _ALL)
    assert isinstance(model.a[0], MXLinear)
    assert model.b[0] is model.a[0] and model.c is model.a[0]


def test_convert_keeps_a_linear_registered_twice_in_one_parent():
    model = nn.Module()
    model.l1 = lin = nn.Linear(64, 64)
    model.l2 = lin
    convert(model, _ALL)
    assert isinstance(model.l1, MXLinear) and model.l2 is model.l1


def test_convert_of_a_lone_linear_subclass_keeps_its_forward():
    lin = _DoubledLinear(64, 64)
    x = torch.randn(4, 64)
    want = lin(x)
    out = convert(lin, _ALL)
    # Nested subclasses are left alone; a lone one was swapped for an MXLinear that
    # silently dropped the subclass's forward (here: the factor 2).
    assert type(out) is _DoubledLinear
    torch.testing.assert_close(out(x), want)


def test_plan_reports_what_convert_does_for_subclasses():
    model = nn.Sequential(_DoubledLinear(64, 64), nn.Linear(64, 64))
    plan = plan_conversion(model, _ALL)
    convert(model, _ALL)
    for name, mod in model.named_children():
        assert (plan[name] == "mx") == isinstance(mod, MXLinear), (name, plan[name])


def test_convert_does_not_drop_forward_hooks():
    lin = nn.Linear(64, 64)
    lin.register_forward_hook(lambda mod, inp, out: out * 0)
    model = nn.Sequential(lin)
    convert(model, _ALL)
    assert model(torch.randn(4, 64)).abs().sum() == 0
    assert plan_conversion(model, _ALL)["0"] != "mx"


def test_convert_does_not_drop_legacy_weight_norm_parameters():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = nn.utils.weight_norm(nn.Linear(64, 64))
    model = nn.Sequential(lin)
    keys = set(model.state_dict())
    n_params = len(list(model.parameters()))
    convert(model, _ALL)
    # convert promises unchanged state_dict keys; weight_g/weight_v vanished and the
    # layer kept a stale, non-trainable weight.
    assert set(model.state_dict()) == keys
    assert len(list(model.parameters())) == n_params
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()


def test_fused_activation_compiles_fullgraph_forward_and_backward():
    # The README promises torch.compile(fullgraph=True) traces MXLinear; with an
    # input_activation (every MXMLP's fc2) the backward called torch.autograd.grad,
    # which dynamo refuses to trace.
    torch.manual_seed(0)
    lin = MXLinear(64, 32, input_activation="gelu_tanh")
    x = torch.randn(16, 64, requires_grad=True)
    y0 = lin(x)
    y0.sum().backward()
    dx0, dw0 = x.grad.clone(), lin.weight.grad.clone()
    x.grad = lin.weight.grad = None
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    assert torch.equal(y, y0)
    assert torch.equal(x.grad, dx0) and torch.equal(lin.weight.grad, dw0)
