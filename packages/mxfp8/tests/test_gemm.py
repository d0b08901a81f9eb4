"""GEMM kernels (interpreted on CPU) against dequantize-then-FP32-matmul."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mx_helpers import needs_interpreter

from hyperrec.mxfp8 import mx_mm, to_mx
from hyperrec.mxfp8.gemm import native_mx_supported
from hyperrec.testing import snr_db


def _operands(m, n, k, block_size=32, a_elem=torch.float8_e4m3fn, b_elem=torch.float8_e4m3fn):
    x = torch.randn(m, k, dtype=torch.bfloat16) * torch.exp(torch.randn(m, 1))
    w = torch.randn(n, k, dtype=torch.bfloat16)
    a = to_mx(x, block_size=block_size, elem_dtype=a_elem)
    b = to_mx(w, block_size=block_size, elem_dtype=b_elem).t()
    return x, w, a, b


def test_reference_gemm_is_the_dequantized_product():
    x, w, a, b = _operands(40, 24, 96)
    bias = torch.randn(24)
    out = mx_mm(a, b, out_dtype=torch.float32, bias=bias, alpha=0.25, backend="torch")
    want = 0.25 * (a.dequantize(torch.float64) @ b.dequantize(torch.float64)) + bias.double()
    assert snr_db(out, want) > 120
    # and it approximates the high-precision product of the inputs (MXFP8: ~30 dB)
    exact = 0.25 * (x.double() @ w.double().t()) + bias.double()
    assert 22 < snr_db(out, exact) < 45


@needs_interpreter
@pytest.mark.parametrize(
    ("kernel", "block_size"), [("fixup", 32), ("fixup", 128), ("upcast", 32), ("dot_scaled", 32)]
)
@pytest.mark.parametrize(("m", "n", "k"), [(64, 48, 256), (33, 40, 200)])
def test_kernels_match_dequantized_fp32_matmul(kernel, block_size, m, n, k):
    _, _, a, b = _operands(m, n, k, block_size)
    bias = torch.randn(n)
    got = mx_mm(a, b, out_dtype=torch.float32, bias=bias, alpha=0.5, kernel=kernel,
                backend="triton")  # fmt: skip
    want = mx_mm(a, b, out_dtype=torch.float32, bias=bias, alpha=0.5, backend="torch")
    assert got.shape == (m, n) and torch.isfinite(got).all()
    assert snr_db(got, want) >= 80.0


@needs_interpreter
@settings(deadline=None, max_examples=6)
@given(
    st.integers(1, 40),
    st.integers(1, 40),
    st.integers(1, 160),
    st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
    st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
)
def test_fixup_kernel_sweep(m, n, k, a_elem, out_dtype):
    _, _, a, b = _operands(m, n, k, 32, a_elem=a_elem)
    got = mx_mm(a, b, out_dtype=out_dtype, kernel="fixup", backend="triton")
    want = mx_mm(a, b, out_dtype=torch.float32, backend="torch")
    assert got.dtype == out_dtype
    floor = 80.0 if out_dtype == torch.float32 else 40.0  # 16-bit outputs round
    assert snr_db(got.float(), want) >= floor


@needs_interpreter
def test_nan_block_poisons_only_its_outputs():
    x = torch.randn(32, 64)
    x[3, 40] = float("nan")
    a, b = to_mx(x), to_mx(torch.randn(16, 64)).t()
    out = mx_mm(a, b, out_dtype=torch.float32, kernel="fixup", backend="triton")
    assert torch.isnan(out[3]).all()
    assert torch.isfinite(out[torch.arange(32) != 3]).all()


def test_native_mx_probe_is_false_without_blackwell():
    if not torch.cuda.is_available():
        assert native_mx_supported() is False
    assert native_mx_supported(torch.device("cpu")) is False


def test_empty_and_zero_k():
    _, _, a, b = _operands(0, 8, 64)
    assert mx_mm(a, b).shape == (0, 8)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda a, b: mx_mm(a.t(), b), ValueError, "axis=1"),
        (lambda a, b: mx_mm(a, b.t()), ValueError, "axis=0"),
        (lambda a, b: mx_mm(a, to_mx(torch.randn(8, 32)).t()), ValueError, "inner dims"),
        (lambda a, b: mx_mm(a, to_mx(torch.randn(8, 64), block_size=128).t()), ValueError,
         "block sizes"),
        (lambda a, b: mx_mm(a.data, b), TypeError, "MXTensor"),
        (lambda a, b: mx_mm(a, b, out_dtype=torch.int8), TypeError, "out_dtype"),
        (lambda a, b: mx_mm(a, b, bias=torch.ones(3)), ValueError, "bias"),
        (lambda a, b: mx_mm(a, b, kernel="cutlass"), ValueError, "kernel"),
        (lambda a, b: mx_mm(a, b, alpha="2"), TypeError, "alpha"),
    ],
)  # fmt: skip
def test_mx_mm_rejects_bad_arguments(make, exc, match):
    _, _, a, b = _operands(16, 8, 64)
    with pytest.raises(exc, match=match):
        make(a, b)


@needs_interpreter
def test_kernel_choice_errors():
    _, _, a, b = _operands(16, 8, 128, block_size=128)
    with pytest.raises(ValueError, match="block_size=32"):
        mx_mm(a, b, kernel="upcast", backend="triton")
    q4 = to_mx(torch.randn(16, 64), elem_dtype="e2m1")
    with pytest.raises(ValueError, match="MX4"):
        mx_mm(q4, to_mx(torch.randn(8, 64), elem_dtype="e2m1").t(), backend="triton")
    # MX4 GEMMs run on the reference
    out = mx_mm(q4, to_mx(torch.randn(8, 64), elem_dtype="e2m1").t(), backend="torch")
    assert out.shape == (16, 8)
