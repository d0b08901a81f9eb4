"""MXLinear / MXMLP / PrecisionPolicy / convert on the CPU (reference backend)."""

from __future__ import annotations

import pytest
import torch
from mx_helpers import needs_interpreter
from torch import nn

from hyperrec.mxfp8 import MXMLP, MXLinear, PrecisionPolicy, convert, mx_linear, plan_conversion
from hyperrec.mxfp8 import reference as ref
from hyperrec.testing import snr_db


def _pair(policy, k=256, n=192, activation="none", dtype=torch.float32):
    lin = MXLinear(k, n, policy=policy, input_activation=activation, dtype=dtype)
    hp = nn.Linear(k, n, dtype=torch.float64)
    hp.load_state_dict({key: v.double() for key, v in lin.state_dict().items()})
    return lin, hp


def _grads(lin, hp, x, g, activation="none"):
    xa = x.clone().requires_grad_()
    xb = x.double().clone().requires_grad_()
    y = lin(xa)
    y.backward(g)
    yb = hp(ref.apply_activation(xb, activation).double())
    yb.backward(g.double())
    return (y, yb), (xa.grad, xb.grad), (lin.weight.grad, hp.weight.grad)


# SQNR floors (dB) against an FP64 linear, on Gaussian data; MXFP8 E4M3 sits near 29-30.
@pytest.mark.parametrize(
    ("policy", "floors"),
    [
        (PrecisionPolicy(), (26, 25, 24)),
        (PrecisionPolicy(block_size=128), (25, 24, 23)),
        (PrecisionPolicy(hadamard=16, stochastic_rounding=True), (26, 23, 22)),
        (PrecisionPolicy(grad_dtype=torch.float8_e5m2, hadamard=32), (26, 20, 20)),
        (PrecisionPolicy(wgrad_high_precision=True), (26, 25, 60)),
    ],
    ids=["mx", "bs128", "rht16+sr", "e5m2-grads", "hp-wgrad"],
)
def test_fwd_dgrad_wgrad_sqnr(policy, floors):
    lin, hp = _pair(policy)
    x, g = torch.randn(100, 256), torch.randn(100, 192)  # 100 tokens: not a multiple of 16
    (y, yb), (dx, dxb), (dw, dwb) = _grads(lin, hp, x, g)
    got = (snr_db(y, yb), snr_db(dx, dxb), snr_db(dw, dwb))
    assert all(s >= f for s, f in zip(got, floors)), got
    assert torch.allclose(lin.bias.grad.double(), hp.bias.grad, atol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "relu2", "silu", "gelu_tanh"])
def test_fused_input_activation_and_its_gradient(activation):
    lin, hp = _pair(PrecisionPolicy(), activation=activation)
    x, g = torch.randn(64, 256), torch.randn(64, 192)
    (y, yb), (dx, dxb), (dw, dwb) = _grads(lin, hp, x, g, activation)
    assert snr_db(y, yb) > 24 and snr_db(dx, dxb) > 22 and snr_db(dw, dwb) > 22


def test_stochastic_rounding_is_unbiased_over_steps():
    # Each step draws a new seed, so averaging wgrad over steps cancels part of dY's
    # rounding error (X's deterministic rounding error remains).
    pol = PrecisionPolicy(stochastic_rounding=True)
    lin, hp = _pair(pol, k=64, n=32)
    x, g = torch.randn(64, 64), torch.randn(64, 32) * 1e-3
    acc = torch.zeros_like(lin.weight)
    for _ in range(24):
        lin.weight.grad = None
        lin(x).backward(g)
        acc += lin.weight.grad
    hp(x.double()).backward(g.double())
    one = snr_db(lin.weight.grad, hp.weight.grad)
    avg = snr_db(acc / 24, hp.weight.grad)
    assert avg > one + 3


def test_leading_dims_bf16_and_no_grad():
    lin = MXLinear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad.dtype == torch.bfloat16
    with torch.no_grad():
        assert lin(x).shape == (2, 3, 32)


def test_min_tokens_falls_back_to_plain_linear():
    lin = MXLinear(64, 32, policy=PrecisionPolicy(min_tokens=16))
    x = torch.randn(8, 64)
    torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias))
    assert not torch.equal(lin(torch.randn(16, 64)), torch.zeros(16, 32))


def test_from_linear_shares_parameters_and_state_dict():
    base = nn.Linear(64, 32)
    mx = MXLinear.from_linear(base)
    assert mx.weight is base.weight and mx.bias is base.bias
    assert mx.state_dict().keys() == base.state_dict().keys()
    with pytest.raises(TypeError, match="nn.Linear"):
        MXLinear.from_linear(nn.Conv1d(2, 2, 1))


def _model():
    return nn.Sequential(
        nn.Linear(64, 512),
        nn.ReLU(),
        nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 128)),
        nn.Linear(128, 512),
        nn.Linear(512, 1),
    )


def test_plan_and_convert_follow_the_policy():
    model = _model()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    pol = PrecisionPolicy(min_features=256, keep=("3",))
    plan = plan_conversion(model, pol)
    assert plan["0"] == "first linear" and plan["4"] == "last linear"
    assert plan["2.0"] == "mx"
    assert plan["2.1"].startswith("min(in, out) = 128")
    assert plan["3"] == "matches keep pattern '3'"
    out = convert(model, pol)
    assert out is model and isinstance(model[2][0], MXLinear)
    assert type(model[0]) is nn.Linear and type(model[2][1]) is nn.Linear
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    assert plan_conversion(model, pol)["2.0"] == "mx"  # idempotent
    y = model(torch.randn(4, 64))
    assert y.shape == (4, 1)


def test_convert_a_lone_linear():
    lin = nn.Linear(4096, 4096)
    assert convert(lin) is lin  # first and last: kept by default
    out = convert(lin, PrecisionPolicy(keep_first=False, keep_last=False))
    assert isinstance(out, MXLinear) and out.weight is lin.weight


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"block_size": 48}, ValueError, "block_size"),
        ({"elem_dtype": "e2m1"}, ValueError, "FP8"),
        ({"scale_mode": "up"}, ValueError, "scale_mode"),
        ({"hadamard": 64}, ValueError, "hadamard"),
        ({"hadamard": 32, "block_size": 16}, ValueError, "divide"),
        ({"keep": ["head"]}, TypeError, "keep"),
        ({"min_features": -1}, ValueError, "min_features"),
        ({"kernel": "cutlass"}, ValueError, "kernel"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"stochastic_rounding": "yes"}, TypeError, "stochastic_rounding"),
    ],
)
def test_policy_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        PrecisionPolicy(**kwargs)


def test_policy_is_frozen_and_keyword_only():
    pol = PrecisionPolicy()
    with pytest.raises(AttributeError):
        pol.block_size = 128
    with pytest.raises(TypeError):
        PrecisionPolicy(32)


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="input_activation"):
        MXLinear(8, 8, input_activation="tanh")
    with pytest.raises(TypeError, match="policy"):
        MXLinear(8, 8, policy={"block_size": 32})
    with pytest.raises(ValueError, match="in_features"):
        mx_linear(torch.randn(4, 7), torch.randn(8, 8))
    with pytest.raises(ValueError, match="activation"):
        MXMLP(8, 16, activation="none")
    with pytest.raises(ValueError, match="hidden_dim"):
        MXMLP(8, 0)
    with pytest.raises(TypeError, match="model"):
        convert("model")


def test_mlp_matches_high_precision_mlp():
    mlp = MXMLP(128, 256, activation="gelu_tanh")
    hp = nn.Sequential(nn.Linear(128, 256), nn.GELU("tanh"), nn.Linear(256, 128)).double()
    hp[0].load_state_dict({k: v.double() for k, v in mlp.fc1.state_dict().items()})
    hp[2].load_state_dict({k: v.double() for k, v in mlp.fc2.state_dict().items()})
    x = torch.randn(96, 128)
    xa, xb = x.clone().requires_grad_(), x.double().clone().requires_grad_()
    g = torch.randn(96, 128)
    mlp(xa).backward(g)
    hp(xb).backward(g.double())
    assert snr_db(xa.grad, xb.grad) > 20
    assert snr_db(mlp.fc1.weight.grad, hp[0].weight.grad) > 20
    assert snr_db(mlp.fc2.weight.grad, hp[2].weight.grad) > 20


@needs_interpreter
def test_triton_backend_matches_torch_backend():
    torch.manual_seed(0)
    pols = [PrecisionPolicy(backend=b, hadamard=16) for b in ("torch", "triton")]
    lins = [MXLinear(64, 96, policy=p, input_activation="relu") for p in pols]
    lins[1].load_state_dict(lins[0].state_dict())
    x, g = torch.randn(48, 64), torch.randn(48, 96)
    outs = []
    for lin in lins:
        xx = x.clone().requires_grad_()
        y = lin(xx)
        y.backward(g)
        outs.append((y, xx.grad, lin.weight.grad))
    for a, b in zip(*outs):
        assert snr_db(a, b) > 80  # same bytes; only GEMM summation order differs


def test_compiles_fullgraph_forward_and_backward():
    lin = MXLinear(64, 32)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 64, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, lin(x))
    assert x.grad is not None and lin.weight.grad is not None


def test_double_backward_raises_instead_of_a_silent_wrong_gradient() -> None:
    """``create_graph=True`` through ``MXLinear`` returned a ``dx`` detached from the
    weights: a gradient penalty then trained with a wrong gradient, silently (an audit
    found it). A second derivative of the quantized GEMMs does not exist: it raises."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), MXLinear(64, 32))
    x = torch.randn(8, 64, requires_grad=True)
    (dx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        dx.square().sum().backward()


@needs_interpreter
@pytest.mark.parametrize("spelling", ["RCEIL", "Floor"])
def test_policy_scale_mode_is_case_insensitive_on_every_backend(spelling):
    # Regression: the policy accepted "RCEIL" (its check is case-insensitive) but stored
    # it as given; the Triton quantizer tests `scale_mode == "rceil"` and so silently
    # ran FLOOR scales, while the reference raised.
    assert PrecisionPolicy(scale_mode=spelling).scale_mode == spelling.lower()
    torch.manual_seed(123)
    w = torch.randn(48, 64) * torch.exp(torch.randn(48, 1) * 3)
    x = (torch.randn(40, 64) * torch.exp(torch.randn(40, 1) * 3)).requires_grad_()
    g = torch.randn(40, 48)

    def run(mode, backend):
        lin = MXLinear(64, 48, bias=False, policy=PrecisionPolicy(scale_mode=mode, backend=backend))
        with torch.no_grad():
            lin.weight.copy_(w)
        xx = x.detach().clone().requires_grad_()
        y = lin(xx)
        y.backward(g)
        return y, xx.grad, lin.weight.grad

    want = run(spelling.lower(), "torch")
    other = run("floor" if spelling.lower() == "rceil" else "rceil", "torch")
    assert not torch.equal(want[1], other[1])  # the two rules differ on this data
    for backend in ("torch", "triton"):
        for got, ref_, wrong in zip(run(spelling, backend), want, other):
            # The backends' fp32 GEMMs sum in different orders, which moves a few
            # elements by ~1e-6 relative, more or less depending on the CPU's BLAS
            # kernels (AVX2 vs AVX-512). The other rule moves them by 1e-1 to 1e3.
            torch.testing.assert_close(got, ref_, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(got, wrong, rtol=1e-2, atol=1e-2)
