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


def test_other_layouts_fall_back_to_the_reference():
    """Column-wise copies (blocked dim not last) and MX4 run the reference even when the
    Triton backend is asked for; a non-contiguous leading layout still works."""
    x = torch.randn(64, 96)
    col = to_mx(x, block_size=32, axis=0)
    _same_bits(col.dequantize(backend="triton"), col.dequantize(backend="torch"))
    mx4 = to_mx(x, elem_dtype="e2m1", block_size=32)
    _same_bits(mx4.dequantize(backend="triton"), mx4.dequantize(backend="torch"))
    q = to_mx(torch.randn(6, 4, 64))
    sliced = type(q)(**{**q.__dict__, "data": q.data.transpose(0, 1).contiguous().transpose(0, 1)})
    _same_bits(sliced.dequantize(backend="triton"), q.dequantize(backend="torch"))


def test_bad_backend():
    q = to_mx(torch.randn(2, 32))
    with pytest.raises(ValueError, match="backend"):
        q.dequantize(backend="cuda")
