"""The one-pass Triton dequantizer (interpreted on CPU) against the reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mx_helpers import needs_interpreter

from hyperrec.mxfp8 import to_mx

pytestmark = needs_interpreter

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT = (torch.float32, torch.bfloat16, torch.float16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    # NaNs compare by position; the rest by value (the bytes of a NaN may differ)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    fin = ~torch.isnan(a)
    assert torch.equal(a[fin], b[fin])


@pytest.mark.parametrize("elem", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out", OUT, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("block", [32, 128])
def test_matches_reference(elem, out, block):
    """Fresh heavy-tailed data (a NaN block, a zero block, a ragged last block, tiny and
    huge scales): the kernel's output equals the reference's."""
    x = torch.randn(37, 300) * torch.exp(4 * torch.randn(37, 300))
    x[3, 40] = float("nan")
    x[5, :block] = 0.0
    x[7] *= 2.0**-90  # small scales (still normal products)
    x[8] *= 2.0**60
    if out == torch.float16:
        x = x.clamp(-6e4, 6e4) * 1e-3  # keep within float16's range: overflow rounds alike
    q = to_mx(x, elem_dtype=elem, block_size=block)
    _same_bits(q.dequantize(out, backend="triton"), q.dequantize(out, backend="torch"))


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=2),
    width=st.integers(1, 700),
    block=st.sampled_from([32, 64, 128]),
    elem=st.sampled_from(FP8),
)
def test_shapes_sweep(lead, width, block, elem):
    """Any leading shape (zero-sized included) and width, ragged last blocks."""
    x = torch.randn(*lead, width) * 3
    q = to_mx(x, elem_dtype=elem, block_size=block)
    got = q.dequantize(torch.bfloat16, backend="triton")
    assert got.shape == x.shape
    _same_bits(got, q.dequantize(torch.bfloat16, backend="torch"))


@pytest.mark.parametrize("out", OUT, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("block", [32, 64])
def test_mx4_matches_reference(out, block):
    """MX4 (E2M1 codes two to a byte): heavy-tailed data, a NaN block, a zero block,
    tiny and huge scales, and a width that is not a multiple of the block."""
    x = torch.randn(21, 266) * torch.exp(3 * torch.randn(21, 266))
    x[2, 10] = float("nan")
    x[4, :block] = 0.0
    x[6] *= 2.0**-100
    x[9] *= 2.0**70
    if out == torch.float16:
        x = x.clamp(-6e4, 6e4) * 1e-3
    q = to_mx(x, elem_dtype="e2m1", block_size=block)
    assert q.fmt.packed and q.data.shape[-1] == 133
    _same_bits(q.dequantize(out, backend="triton"), q.dequantize(out, backend="torch"))


def test_mx4_every_code_and_nibble():
    """All 16 codes in both nibbles of a byte (signed zeros included), scale 2**0."""
    from hyperrec.mxfp8 import MXTensor
    from hyperrec.mxfp8.formats import E2M1

    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # byte b: lo b & 15, hi b >> 4
    scale = torch.full((8, 2), 127, dtype=torch.uint8)
    q = MXTensor(data=codes, scale=scale, fmt=E2M1, block_size=32, axis=1,
                 shape=torch.Size((8, 64)), orig_dtype=torch.float32)  # fmt: skip
    got = q.dequantize(torch.float32, backend="triton")
    want = q.dequantize(torch.float32, backend="torch")
    _same_bits(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 for code 8


@settings(max_examples=20, deadline=None)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
    width=st.integers(1, 300).map(lambda w: 2 * w),
    block=st.sampled_from([32, 64]),
)
def test_mx4_shapes_sweep(lead, width, block):
    x = torch.randn(*lead, width) * 5
    q = to_mx(x, elem_dtype="e2m1", block_size=block)
    got = q.dequantize(torch.bfloat16, backend="triton")
    assert got.shape == x.shape
    _same_bits(got, q.dequantize(torch.bfloat16, backend="torch"))


def test_other_layouts_fall_back_to_the_reference():
    """Column-wise copies (blocked dim not last) run the reference even when the Triton
    backend is asked for; a non-contiguous leading layout still works."""
    x = torch.randn(64, 96)
    col = to_mx(x, block_size=32, axis=0)
    _same_bits(col.dequantize(backend="triton"), col.dequantize(backend="torch"))
    mx4_col = to_mx(x, elem_dtype="e2m1", block_size=32, axis=0)
    _same_bits(mx4_col.dequantize(backend="triton"), mx4_col.dequantize(backend="torch"))
    q = to_mx(torch.randn(6, 4, 64))
    sliced = type(q)(**{**q.__dict__, "data": q.data.transpose(0, 1).contiguous().transpose(0, 1)})
    _same_bits(sliced.dequantize(backend="triton"), q.dequantize(backend="torch"))


def test_bad_backend():
    q = to_mx(torch.randn(2, 32))
    with pytest.raises(ValueError, match="backend"):
        q.dequantize(backend="cuda")
