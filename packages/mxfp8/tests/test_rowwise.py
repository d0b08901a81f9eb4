"""``rowwise_linear``: row-wise FP8 forward/dgrad, against float64 and against torchao.

torchao's ``rowwise_with_gw_hp`` float8 recipe (row-wise E4M3, power-of-two scales, wgrad
in high precision) is the same recipe written independently: on the CPU its output and
both gradients must equal ours bit for bit, and its quantizer must write the same bytes.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.mxfp8 import quantize_rows, rowwise_linear, rowwise_linear_reference

E4M3_MAX = 448.0


def _rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def _scale64(row: torch.Tensor) -> float:
    """The scale rule written out: the smallest power of two s with amax / s <= 448."""
    amax = max(row.double().abs().max().item(), 1e-12)
    e = math.ceil(math.log2(amax / E4M3_MAX))
    while amax / 2.0**e > E4M3_MAX:  # log2 rounding at exact powers
        e += 1
    while amax / 2.0 ** (e - 1) <= E4M3_MAX:
        e -= 1
    return 2.0**e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_scale_rule_and_rounding(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = _rand(37, 96, dtype=dtype) * torch.logspace(-6, 4, 37).unsqueeze(1).to(dtype)
    x[3] = 0  # an all-zero row
    x[4] = x[4] * 1e-9  # below the 1e-12 amax floor (float16 flushes it to zero)
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (37, 1)
    for i in range(x.shape[0]):
        assert s[i, 0].item() == _scale64(x[i]), i
    # Exact scaling: q is x / s rounded to E4M3 once (nothing saturates).
    want = (x.double() / s.double()).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().max() <= E4M3_MAX
    assert torch.equal(q[3].float(), torch.zeros(96))


def test_quantize_rows_nonfinite_rows_are_nan_and_isolated() -> None:
    x = _rand(6, 32)
    x[1, 5] = float("nan")
    x[4, 0] = float("inf")
    q, s = quantize_rows(x)
    for i in (1, 4):
        assert torch.isnan(s[i]).all() and torch.isnan(q[i].float()).all()
    ok = [0, 2, 3, 5]
    assert torch.isfinite(s[ok]).all() and torch.isfinite(q[ok].float()).all()


def test_linear_nonfinite_row_stays_in_its_row() -> None:
    x = _rand(8, 64, dtype=torch.float32).requires_grad_()
    w = _rand(32, 64, scale=0.1, dtype=torch.float32).requires_grad_()
    with torch.no_grad():
        x[2, 7] = float("inf")
    y = rowwise_linear(x, w)
    assert torch.isnan(y[2]).all()
    assert torch.isfinite(y[[0, 1, 3, 4, 5, 6, 7]]).all()


@pytest.mark.parametrize("fp8_dgrad", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torchao_rowwise_recipe_bit_for_bit(fp8_dgrad: bool, bias: bool) -> None:
    """torchao's rowwise_with_gw_hp: same recipe, independent code (dgrad in FP8)."""
    torchao_float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 64, bias=bias).bfloat16()
    theirs = torch.nn.Sequential(copy.deepcopy(lin))
    cfg = torchao_float8.Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    torchao_float8.convert_to_float8_training(theirs, config=cfg)
    x = _rand(3, 29, 128, scale=2.0).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_() if bias else None
    y_ref = theirs(x)
    y = rowwise_linear(x2, w, b, fp8_dgrad=fp8_dgrad)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    assert torch.equal(w.grad, theirs[0].weight.grad)
    if bias:
        assert torch.equal(b.grad, theirs[0].bias.grad)
    if fp8_dgrad:
        assert torch.equal(x2.grad, x.grad)
    else:
        # dgrad in bf16: what nn.Linear computes
        xl = x.detach().clone().requires_grad_()
        lin(xl).backward(g)
        assert torch.equal(x2.grad, xl.grad)


def test_quantizer_writes_torchao_bytes() -> None:
    scaling = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import LinearMMConfig

    torch.manual_seed(2)
    x = _rand(50, 256) * torch.logspace(-4, 4, 50).unsqueeze(1).bfloat16()
    x[7] = 0
    x[8] = x[8] * 1e-13
    t = scaling.hp_tensor_to_float8_dynamic(
        x, torch.float8_e4m3fn, LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
        round_scales_to_power_of_2=True,
    )  # fmt: skip
    q, s = quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), t._data.view(torch.uint8))
    assert torch.equal(s, 1 / t._scale.float())


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 70),
    k=st.sampled_from([16, 48, 128]),
    n=st.sampled_from([16, 32, 80]),
    lead=st.sampled_from([(), (2,)]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_against_float64(m, k, n, lead, scale, seed) -> None:
    torch.manual_seed(seed)
    x = _rand(*lead, m, k, scale=scale).requires_grad_()
    w = _rand(n, k, scale=0.2).requires_grad_()
    b = _rand(n).requires_grad_()
    y = rowwise_linear(x, w, b)
    assert y.shape == (*lead, m, n) and y.dtype == torch.bfloat16
    ref = rowwise_linear_reference(x.detach(), w.detach(), b.detach())
    # The same quantized operands: only accumulation order and two bf16 roundings (the
    # GEMM's output, then the bias add) differ, each relative to its terms' magnitude.
    mag = rowwise_linear_reference(x.detach().abs(), w.detach().abs()) + b.detach().abs()
    assert ((y.double() - ref).abs() <= 2**-7 * mag.double() + 1e-30).all()
    exact = x.detach().double() @ w.detach().double().t() + b.detach().double()
    if m:
        err = (y.double() - exact).norm() / exact.norm().clamp_min(1e-30)
        assert err < 0.08, err  # two E4M3 operands: a few percent
    g = torch.randn_like(y)
    y.backward(g)
    x2 = x.detach().double().requires_grad_()
    w2 = w.detach().double().requires_grad_()
    b2 = b.detach().double().requires_grad_()
    F.linear(x2, w2, b2).backward(g.double())
    assert torch.allclose(b.grad.double(), b2.grad, rtol=2**-7, atol=1e-3 * max(m, 1))
    if m:
        for got, want, bound in ((x.grad, x2.grad, 0.08), (w.grad, w2.grad, 0.01)):
            err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
            assert err < bound, err  # dx from FP8 operands; dW in bf16
    else:
        assert torch.equal(w.grad, torch.zeros_like(w))


def test_compiles_in_one_graph_and_matches_eager() -> None:
    torch.manual_seed(3)
    x = _rand(40, 64).requires_grad_()
    w = _rand(48, 64, scale=0.1).requires_grad_()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.silu(rowwise_linear(F.layer_norm(x, (64,)), w))

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yc, ye = compiled(x, w), f(xe, we)
    assert torch.equal(yc, ye)
    g = torch.randn_like(yc)
    yc.backward(g)
    ye.backward(g)
    assert torch.equal(x.grad, xe.grad) and torch.equal(w.grad, we.grad)


@pytest.mark.parametrize(("k", "n"), [(0, 32), (64, 0), (0, 0)])
@pytest.mark.parametrize("fp8_dgrad", [True, False])
def test_zero_features_give_linear_s_result(k: int, n: int, fp8_dgrad: bool) -> None:
    """No features in or out (``0 % 16 == 0`` passes the shape check): the exact result
    (zeros plus the bias, or an empty tensor) and gradients, as ``F.linear`` gives."""
    x = torch.randn(3, 4, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True)
    y = rowwise_linear(x, w, b, fp8_dgrad=fp8_dgrad)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(rowwise_linear_reference(x, w, b), ref.double())
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None
    assert not x.grad.any() and w.grad.shape == (n, k)
    assert torch.equal(b.grad, torch.full((n,), 12.0))


def test_bad_inputs_name_the_argument() -> None:
    x, w = _rand(4, 32), _rand(16, 32)
    with pytest.raises(TypeError, match="x must be"):
        rowwise_linear(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="w must be"):
        rowwise_linear(x, [[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_features must be a multiple of 16"):
        rowwise_linear(_rand(4, 24), _rand(16, 24))
    with pytest.raises(ValueError, match="out_features must be a multiple of 16"):
        rowwise_linear(x, _rand(20, 32))
    with pytest.raises(ValueError, match="x's last dim"):
        rowwise_linear(_rand(4, 48), w)
    with pytest.raises(ValueError, match="w must be 2-D"):
        rowwise_linear(x, _rand(2, 16, 32))
    with pytest.raises(ValueError, match="b must be"):
        rowwise_linear(x, w, _rand(15))
    with pytest.raises(TypeError, match="fp8_dgrad"):
        rowwise_linear(x, w, fp8_dgrad=1)  # type: ignore[arg-type]


def test_gemm_operands_have_scaled_mm_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch._scaled_mm`` (CUDA) takes a row-major first and a column-major second
    operand. The quantized copies keep their input's layout, so a transposed ``x``, a
    weight held transposed, or an expanded output gradient reached it in the wrong one
    (a CUDA-only error); the CPU emulation is checked against that contract here."""
    from hyperrec.mxfp8 import rowwise

    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    emulate = rowwise._scaled_mm

    def spy(a, a_scale, b, b_scale, out):
        seen.append((a.stride(), b.stride()))
        assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
        return emulate(a, a_scale, b, b_scale, out)

    monkeypatch.setattr(rowwise, "_scaled_mm", spy)
    torch.manual_seed(6)
    cases = [
        (_rand(32, 48).t(), _rand(64, 32)),  # x a transposed view
        (_rand(48, 32), _rand(32, 64).t()),  # w held transposed
        (_rand(48, 32)[:, None].expand(48, 3, 32), _rand(64, 32)),  # x broadcast
    ]
    for x, w in cases:
        x, w = x.requires_grad_(), w.requires_grad_()
        y = rowwise_linear(x, w)
        y.sum().backward()  # dY is an expanded tensor of ones
        xd, wd = x.detach().clone().requires_grad_(), w.detach().contiguous().requires_grad_()
        yd = rowwise_linear(xd, wd)
        yd.sum().backward()
        assert torch.equal(y, yd) and torch.equal(x.grad, xd.grad)
        assert torch.equal(w.grad, wd.grad)
    assert len(seen) == 2 * len(cases) * 2  # forward and dgrad, two passes per case


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scaled_mm_matches_reference() -> None:
    if torch.cuda.get_device_capability()[0] < 9 and not os.environ.get("FORCE"):
        pytest.skip("row-wise _scaled_mm needs sm90+")
    torch.manual_seed(4)
    x = _rand(1000, 256, scale=3.0).cuda().requires_grad_()
    w = _rand(512, 256, scale=0.05).cuda().requires_grad_()
    y = rowwise_linear(x, w)
    ref = rowwise_linear_reference(x.detach(), w.detach())
    # bf16 output rounding relative to the value, plus accumulation error relative to
    # the terms' magnitude (Hopper's FP8 MMA accumulates with fewer than 23 mantissa
    # bits): an element that cancels to near zero is only as exact as its terms.
    mag = rowwise_linear_reference(x.detach().abs(), w.detach().abs())
    assert ((y.double() - ref).abs() <= 2**-8 * ref.abs() + 2**-10 * mag).all()
    g = torch.randn_like(y)
    y.backward(g)
    xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
    rowwise_linear(xc, wc).backward(g.cpu())
    # CPU emulation and cuBLAS: same operands, different accumulation order
    assert torch.allclose(x.grad.cpu().float(), xc.grad.float(), rtol=2**-6, atol=1e-3)
    assert torch.allclose(w.grad.cpu().float(), wc.grad.float(), rtol=2**-6, atol=1e-2)
    # transposed views reach cuBLAS in the layouts it takes (0.4.1 raised here)
    xt = x.detach().t().contiguous().t().requires_grad_()
    wt = w.detach().t().contiguous().t().requires_grad_()
    yt = rowwise_linear(xt, wt)
    assert torch.equal(yt, rowwise_linear(x.detach(), w.detach()))
    yt.sum().backward()


def test_two_calls_in_one_dynamic_graph() -> None:
    """Two row-wise linears in one ``torch.compile(dynamic=True)`` graph (a float
    module constant inside the Function made dynamo fail on the second one)."""
    torch.manual_seed(5)
    x = _rand(2, 20, 32).requires_grad_()
    w1 = torch.nn.Parameter(_rand(32, 32, scale=0.2))
    w2 = torch.nn.Parameter(_rand(16, 32, scale=0.2))

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return rowwise_linear(torch.relu(rowwise_linear(x, w1)), w2, fp8_dgrad=False)

    y = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)(x, w1, w2)
    assert torch.equal(y, f(x, w1, w2))
    y.sum().backward()
    assert x.grad is not None and w1.grad is not None


def test_double_backward_raises() -> None:
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    (dx,) = torch.autograd.grad(rowwise_linear(x, w).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        dx.sum().backward()
