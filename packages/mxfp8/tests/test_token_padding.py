"""MXLinear pads the token dim with zero rows: exact, and it sends every GEMM of a layer to
cuBLAS's 1x128 path (emulated here) for any number of tokens; autocast semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from mx_helpers import needs_interpreter, u8
from test_fast_path import emulated_cublas  # noqa: F401  (fixture)

from hyperrec.mxfp8 import MXLinear, PrecisionPolicy, mx_mm, mx_quantize
from hyperrec.mxfp8._triton import mm as triton_mm
from hyperrec.mxfp8.linear import padded_rows


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 1 << 20), block=st.sampled_from([32, 128]))
def test_padded_rows(m, block):
    whole = padded_rows(m, block)
    assert whole % block == 0 and m <= whole < m + block


def _ints(*shape, high=8):
    return torch.randint(-high, high + 1, shape).float()


def _layer_and_grads(lin, x, g, autocast=False):
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = lin(xx)
    y.backward(g)
    return y, xx.grad, lin.weight.grad


@pytest.mark.parametrize("m", [1, 100, 127, 129, 300])
def test_padding_is_bit_exact_against_the_unpadded_math(m):
    """Integer data quantizes exactly and sums exactly in FP32, so the padded layer must
    equal the unpadded GEMMs bit for bit, in any summation order; and the padded
    quantization holds the unpadded bytes plus zero rows."""
    torch.manual_seed(m)
    pol = PrecisionPolicy(block_size=128, backend="torch")
    lin = MXLinear(256, 128, bias=False, policy=pol)
    with torch.no_grad():
        lin.weight.copy_(_ints(128, 256))
    x, g = _ints(m, 256), _ints(m, 128)
    y, dx, dw = _layer_and_grads(lin, x, g)
    assert padded_rows(m, 128) > m or m == 128  # the layer did pad

    q = dict(block_size=128, backend="torch")
    xr, xc = mx_quantize(x, colwise=True, **q)
    wr, wc = mx_quantize(lin.weight.detach(), colwise=True, **q)
    gr, gc = mx_quantize(g, colwise=True, **q)
    f32 = dict(out_dtype=torch.float32, backend="torch")
    assert torch.equal(y, mx_mm(xr, wr.t(), **f32))
    assert torch.equal(dx, mx_mm(gr, wc, **f32))
    assert torch.equal(dw, mx_mm(gc.t(), xc, **f32))

    # Random data: the quantized operands of the padded rows are the unpadded bytes.
    x = torch.randn(m, 256) * 3
    pad = padded_rows(m, 128) - m
    _, col = mx_quantize(x, colwise=True, **q)
    _, col_p = mx_quantize(F.pad(x, (0, 0, 0, pad)), colwise=True, **q)
    assert torch.equal(u8(col_p.data[:m]), u8(col.data)) and not u8(col_p.data[m:]).any()
    assert torch.equal(col_p.scale, col.scale)


def test_padded_layer_matches_the_unpadded_math_on_random_data():
    torch.manual_seed(0)
    pol = PrecisionPolicy(block_size=128, backend="torch", hadamard=16)
    lin = MXLinear(256, 192, policy=pol)
    x, g = torch.randn(77, 256), torch.randn(77, 192)
    y, dx, dw = _layer_and_grads(lin, x, g)
    q = dict(block_size=128, backend="torch")
    xr, _ = mx_quantize(x, **q)
    wr, wc = mx_quantize(lin.weight.detach(), colwise=True, **q)
    gr, _ = mx_quantize(g, **q)
    # The transform mixes groups of 16 rows: the layer always padded to whole groups (80
    # rows here). Padding on to whole blocks adds whole zero groups, whose transform is
    # zero: only the FP32 summation order may differ.
    h = dict(colwise=True, rowwise=False, hadamard=16, **q)
    _, xc = mx_quantize(F.pad(x, (0, 0, 0, 3)), **h)
    _, gc = mx_quantize(F.pad(g, (0, 0, 0, 3)), **h)
    f32 = dict(out_dtype=torch.float32, backend="torch")
    torch.testing.assert_close(y, mx_mm(xr, wr.t(), bias=lin.bias.detach(), **f32))
    torch.testing.assert_close(dx, mx_mm(gr, wc, **f32))
    torch.testing.assert_close(dw, mx_mm(gc.t(), xc, alpha=1 / 16, **f32), rtol=1e-5, atol=1e-5)


def test_autocast_computes_like_nn_linear_under_autocast():
    """Under autocast the GEMMs output bf16 (what the same GEMMs give in FP32, rounded
    once): the output is bf16, dx comes back in x's dtype, the weight gradient is the
    bf16 GEMM cast to the FP32 weight. The operands are quantized from the FP32 input
    directly (no bf16 copy of it first)."""
    torch.manual_seed(1)
    lin = MXLinear(256, 128, policy=PrecisionPolicy(block_size=128, backend="torch"))
    # dY arrives in bf16 under autocast: give values it holds exactly.
    x, g = torch.randn(100, 256), torch.randn(100, 128).bfloat16().float()
    y, dx, dw = _layer_and_grads(lin, x, g, autocast=True)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32 and dw.dtype == torch.float32
    db = lin.bias.grad.clone()
    lin.weight.grad = lin.bias.grad = None
    y2, dx2, dw2 = _layer_and_grads(lin, x, g)  # all FP32
    assert torch.equal(y, y2.bfloat16())
    assert torch.equal(dx, dx2.bfloat16().float())
    assert torch.equal(dw, dw2.bfloat16().float())
    assert db.dtype == torch.float32
    torch.testing.assert_close(db, lin.bias.grad, rtol=1e-2, atol=1e-2)  # a bf16 sum


def _no_triton_gemm(*args, **kwargs):
    raise AssertionError("the Triton GEMM ran: a GEMM missed the cuBLAS path")


@needs_interpreter
@pytest.mark.parametrize("m", [100, 200, 300])
def test_every_gemm_takes_cublas_for_any_token_count(emulated_cublas, monkeypatch, m):  # noqa: F811
    """fp32 master weights and fp32 activations under bf16 autocast (the integration
    model's MLP): forward, dgrad and wgrad all reach cuBLAS's 1x128 GEMM."""
    calls = []
    fake = F.scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return fake(a, b, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", counting)
    monkeypatch.setattr(triton_mm, "launch_mm", _no_triton_gemm)
    torch.manual_seed(m)
    lin = MXLinear(256, 128, policy=PrecisionPolicy(block_size=128, backend="triton"))
    x, g = torch.randn(m, 256), torch.randn(m, 128)
    y, dx, dw = _layer_and_grads(lin, x, g, autocast=True)
    rows = padded_rows(m, 128)
    fwd, dgrad = ((rows, 256), (256, 128)), ((rows, 128), (128, 256))
    assert calls == [fwd, dgrad, ((128, rows), (rows, 256))]  # the last: wgrad
    assert y.shape == (m, 128) and dx.shape == (m, 256) and dw.dtype == torch.float32
    ref = MXLinear(256, 128, policy=PrecisionPolicy(block_size=128, backend="torch"))
    ref.load_state_dict(lin.state_dict())
    for a, b in zip((y, dx, dw), _layer_and_grads(ref, x, g, autocast=True)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@needs_interpreter
def test_the_triton_fallback_sees_whole_blocks(monkeypatch):
    """Without cuBLAS (fp32 GEMMs here), the Triton wgrad GEMM reduces over the same
    whole blocks of tokens (its tile comes from the static table, not from tuning)."""
    sizes = []

    def recording(a, a_scale, b, b_scale, *, out_dtype, **kwargs):
        sizes.append(a.shape[1])  # the GEMM itself is not the point here: skip it
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(triton_mm, "launch_mm", recording)
    lin = MXLinear(128, 32, policy=PrecisionPolicy(block_size=128, backend="triton"))
    for m in (1901, 2013, 2390):
        sizes.clear()
        _layer_and_grads(lin, torch.randn(m, 128), torch.randn(m, 32))
        assert sizes[-1] == padded_rows(m, 128) == -(-m // 128) * 128  # the wgrad GEMM's K
