"""Format facts, E8M0 decoding, element encodings and MX4 packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.mxfp8 import E2M1, E4M3, E5M2, get_format
from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8.formats import check_scale_mode


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)],
)
def test_fp8_format_facts_match_torch(fmt, dtype):
    info = torch.finfo(dtype)
    assert fmt.max_value == info.max
    assert 2.0**fmt.emin == info.tiny  # smallest normal
    assert 2.0**fmt.emax <= fmt.max_value < 2.0 ** (fmt.emax + 1)  # emax: exponent of max
    assert fmt.storage_dtype == dtype and not fmt.packed


def test_e2m1_grid():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = ref.decode(codes, E2M1)
    assert vals[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(vals[8:], -vals[:8])
    assert torch.equal(ref.encode(vals, E2M1), codes)  # -0.0 encodes as 0x8
    assert E2M1.packed and E2M1.bits == 4 and E2M1.max_value == 6.0


def test_get_format_accepts_names_dtypes_and_rejects_others():
    assert get_format("e4m3") is E4M3
    assert get_format("MXFP8") is E4M3
    assert get_format(torch.float8_e5m2) is E5M2
    assert get_format("mx4") is E2M1
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert get_format(torch.float4_e2m1fn_x2) is E2M1
    with pytest.raises(ValueError, match="elem_dtype"):
        get_format(torch.bfloat16)
    with pytest.raises(ValueError, match="elem_dtype"):
        get_format("e3m2")
    with pytest.raises(TypeError, match="elem_dtype"):
        get_format(8)
    with pytest.raises(ValueError, match="scale_mode"):
        check_scale_mode("ceil")


def test_e8m0_decode_table():
    b = torch.arange(256, dtype=torch.uint8)
    v = ref.e8m0_to_fp32(b)
    assert torch.isnan(v[255])
    assert v[0].item() == 2.0**-127  # an FP32 subnormal, not zero
    expected = torch.tensor([2.0 ** (i - 127) for i in range(1, 255)], dtype=torch.float64)
    assert torch.equal(v[1:255].double(), expected)


# FP32 bit patterns around RCEIL boundaries (scale of amax / max = the value itself when
# we quantize with a format whose max is 1): (bits, expected byte).
_RCEIL_BOUNDARIES = [
    (0x00000000, 0),  # zero
    (0x00000001, 0),  # smallest subnormal
    (0x00400000, 0),  # exactly 2**-127
    (0x00400001, 1),  # just above 2**-127 -> 2**-126
    (0x007FFFFF, 1),  # largest subnormal
    (0x00800000, 1),  # 2**-126
    (0x3F7FFFFF, 127),  # just below 1
    (0x3F800000, 127),  # 1
    (0x3F800001, 128),  # just above 1
    (0x7F000000, 254),  # 2**127
    (0x7F800000, 255),  # inf
    (0x7FC00000, 255),  # nan
]


@pytest.mark.parametrize(("bits", "byte"), _RCEIL_BOUNDARIES)
def test_rceil_rounds_the_scale_up_exactly(bits, byte):
    unit = E4M3.__class__(**{**E4M3.__dict__, "max_value": 1.0, "name": "unit"})
    block = _f32(bits).expand(1, 32)
    assert ref.e8m0_scale(block, unit, "rceil").item() == byte


@settings(deadline=None, max_examples=60)
@given(st.integers(0x00800000, 0x7F7FFFFF))
def test_floor_scale_is_the_fp32_exponent_minus_emax(bits):
    v = _f32(bits)
    byte = ref.e8m0_scale(v.expand(1, 32), E4M3, "floor").item()
    assert byte == max(((bits >> 23) & 0xFF) - 8, 0)


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_fp4_pack_roundtrip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = ref.pack_fp4(c)
    assert packed.shape[-1] == len(codes) // 2
    assert (packed[0] & 0xF).item() == codes[0] and (packed[0] >> 4).item() == codes[1]
    assert torch.equal(ref.unpack_fp4(packed), c)


def test_fp4_pack_needs_even_length():
    with pytest.raises(ValueError, match="even"):
        ref.pack_fp4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_every_fp8_byte_round_trips_through_encode(fmt):
    b = torch.arange(256, dtype=torch.uint8)
    v = ref.decode(b, fmt)
    finite = torch.isfinite(v)
    assert torch.equal(ref.encode(v[finite], fmt), b[finite])
