"""Quantization and dequantization against torchao's MX implementation, byte for byte.

torchao (``torchao.prototype.mx_formats``) is the MX implementation PyTorch users know;
it was written independently of this package, so agreeing with it on fresh inputs is a
check our own spec-derived tests cannot give. Where the two differ on purpose the test
says which behaviour is right and why (see also the README's "Compatibility"):

- A block whose scale is ``2**-127`` (E8M0 byte 0; every element below ``2**-118`` in
  magnitude, all float32 subnormals for E4M3): torchao divides by ``2**-126`` (it clamps
  the divisor to the smallest normal float32) but still writes byte 0, so its elements
  decode to half their value. We divide by the scale we write.
- A block holding an infinity: the OCP spec's conversion makes the scale NaN (byte 255)
  and we do; torchao writes a finite scale.

The test extra pins torchao; without it these tests fail rather than skip in CI
(``HYPERREC_REQUIRE_ORACLES=1``), so the comparison cannot silently stop running.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mx_helpers import INTERPRET

from hyperrec.mxfp8 import E2M1, E4M3, E5M2, MXTensor, to_mx
from hyperrec.mxfp8 import reference as ref

if os.environ.get("HYPERREC_REQUIRE_ORACLES") == "1":
    import torchao  # noqa: F401  (fails loudly when the pinned oracle is missing)
else:
    pytest.importorskip("torchao")

from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype as tao_to_dtype
from torchao.prototype.mx_formats.mx_tensor import to_mx as tao_to_mx

FORMATS = {
    "e4m3": (E4M3, torch.float8_e4m3fn),
    "e5m2": (E5M2, torch.float8_e5m2),
    "e2m1": (E2M1, torch.float4_e2m1fn_x2),
}
MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _torchao(x: torch.Tensor, fmt: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's (scale bytes, data bytes) for 32-element blocks along the last dim."""
    scale, data = tao_to_mx(x, FORMATS[fmt][1], 32, MODES[mode])
    return _bytes(scale).reshape(*x.shape[:-1], -1), _bytes(data)


def _heavy_tailed(rows: int, blocks: int, dtype: torch.dtype, spread: float) -> torch.Tensor:
    """Gaussian elements with a log-normal magnitude per block and per element: scales from
    tiny to huge in one tensor, with blocks whose largest element is an outlier."""
    x = torch.randn(rows, blocks * 32)
    per_block = torch.exp(spread * torch.randn(rows, blocks)).repeat_interleave(32, 1)
    per_elem = torch.exp(0.5 * spread * torch.randn(rows, blocks * 32))
    return (x * per_block * per_elem).to(dtype)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantize_matches_torchao(fmt, mode, dtype):
    """Reference and public quantizer (Triton under the interpreter where enabled) both
    give torchao's scale and element bytes on heavy-tailed data, zeros included."""
    x = _heavy_tailed(24, 6, dtype, spread=6.0)
    x[3, 32:64] = 0.0  # an all-zero block
    x[5, 7] = -x[5, 7].abs() * 1e6  # an outlier that sets its block's scale
    want_scale, want_data = _torchao(x, fmt, mode)
    data, scale = ref.to_mx(x, FORMATS[fmt][0], 32, mode, axis=-1)
    assert torch.equal(_bytes(scale), want_scale)
    assert torch.equal(_bytes(data), want_data)
    backend = "triton" if INTERPRET or x.is_cuda else "torch"
    q = to_mx(x, elem_dtype=FORMATS[fmt][1], block_size=32, scale_mode=mode, backend=backend)
    assert torch.equal(_bytes(q.scale), want_scale)
    assert torch.equal(_bytes(q.data), want_data)


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(list(FORMATS)),
    mode=st.sampled_from(list(MODES)),
    rows=st.integers(1, 9),
    blocks=st.integers(1, 5),
    spread=st.floats(0.0, 12.0),
    shift=st.integers(-100, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_matches_torchao_sweep(fmt, mode, rows, blocks, spread, shift, seed):
    """Shapes, magnitude spreads and overall scales (2**-100 .. 2**100, away from the
    float32 subnormal scale where the two differ on purpose) drawn by hypothesis."""
    torch.manual_seed(seed)
    x = _heavy_tailed(rows, blocks, torch.float32, spread) * 2.0**shift
    x = torch.where(x.abs() < 2.0**-110, torch.zeros_like(x), x)
    x = x.clamp(-(2.0**126), 2.0**126)
    want_scale, want_data = _torchao(x, fmt, mode)
    data, scale = ref.to_mx(x, FORMATS[fmt][0], 32, mode, axis=-1)
    assert torch.equal(_bytes(scale), want_scale)
    assert torch.equal(_bytes(data), want_data)
    if INTERPRET:  # the Triton quantizer too, on the same draws
        q = to_mx(x, elem_dtype=FORMATS[fmt][1], block_size=32, scale_mode=mode, backend="triton")
        assert torch.equal(_bytes(q.scale), want_scale)
        assert torch.equal(_bytes(q.data), want_data)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dequantize_matches_torchao(fmt, out, backend):
    """Every element code under scales from 2**-100 to 2**100: the same values, from the
    reference and from the one-pass Triton kernel (interpreted on the CPU)."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    elem, tao_dtype = FORMATS[fmt]
    n_codes = 16 if elem.packed else 256
    codes = torch.arange(n_codes, dtype=torch.uint8).repeat(64)
    codes = codes[torch.randperm(codes.numel())].reshape(-1, 32 * 4)
    scale = torch.randint(27, 228, (codes.shape[0], 4), dtype=torch.uint8)
    data = ref.pack_fp4(codes) if elem.packed else codes.view(elem.storage_dtype)
    if backend == "torch":
        got = ref.dequantize(data, scale, elem, 32, axis=-1, length=codes.shape[1], dtype=out)
    else:
        mx = MXTensor(data=data, scale=scale, fmt=elem, block_size=32, axis=1,
                      shape=torch.Size(codes.shape), orig_dtype=out)  # fmt: skip
        got = mx.dequantize(out, backend="triton")
    want = tao_to_dtype(
        data,  # MX4: packed uint8 bytes, as torchao keeps them internally
        scale.view(torch.float8_e8m0fnu),
        tao_dtype,
        32,
        out,
    )
    # NaN codes decode to NaN in both: compared by position, the rest by value
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(got)
    assert torch.equal(got[fin], want[fin])


def test_subnormal_scale_block_decodes_to_its_value_unlike_torchao():
    """A block of float32 subnormals gets scale byte 0 (2**-127) from both. We encode the
    elements against that scale, so they decode to within E4M3's rounding of their value;
    torchao encodes them against 2**-126 and decodes them to half their value."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1.0e-39, -3.0e-39, 7.5e-40, 5.0e-39])  # within one block's range
    data, scale = ref.to_mx(x, E4M3, 32, "floor", axis=-1)
    want_scale, want_data = _torchao(x, "e4m3", "floor")
    assert scale.view(torch.uint8)[0, 0].item() == 0 == want_scale[0, 0].item()
    ours = ref.dequantize(data, scale, E4M3, 32, axis=-1, length=32)
    theirs = ref.dequantize(want_data.view(torch.float8_e4m3fn), want_scale, E4M3, 32, -1, 32)
    rel_ours = ((ours - x).abs() / x.abs().clamp_min(1e-45))[0, :4]
    assert (rel_ours <= 2.0**-4).all()  # E4M3 round-to-nearest: half an ulp of 3 bits
    if not torch.equal(_bytes(data), want_data):  # torchao's behaviour as of 0.18
        rel_theirs = ((theirs - x).abs() / x.abs())[0, :4]
        assert (rel_theirs > 0.4).all()


def test_infinite_element_makes_the_block_nan_per_ocp():
    """OCP MX v1.0: a block with an Inf or NaN element gets a NaN scale (byte 255); the
    other blocks are unaffected and still match torchao."""
    x = _heavy_tailed(2, 3, torch.float32, spread=2.0)
    x[1, 40] = float("inf")
    data, scale = ref.to_mx(x, E4M3, 32, "rceil", axis=-1)
    s = _bytes(scale)
    assert s[1, 1].item() == 255
    want_scale, want_data = _torchao(x, "e4m3", "rceil")
    keep = torch.ones_like(s, dtype=torch.bool)
    keep[1, 1] = False
    assert torch.equal(s[keep], want_scale[keep])
    keep_el = keep.repeat_interleave(32, 1)
    assert torch.equal(_bytes(data)[keep_el], want_data[keep_el])
