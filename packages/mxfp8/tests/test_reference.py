"""The reference against hand-derived bytes, and the properties the spec promises."""

from __future__ import annotations

import math

import mx_cases as C
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mx_helpers import u8

from hyperrec.mxfp8 import E2M1, E4M3, E5M2
from hyperrec.mxfp8 import reference as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_e4m3_conformance_cases(dtype, mode):
    cases = C.e4m3_cases(dtype)
    x, scales, data = C.stack(cases, dtype, mode)
    got_data, got_scale = ref.to_mx(x, E4M3, 32, mode, axis=-1)
    for i, case in enumerate(cases):
        assert got_scale[i, 0].item() == scales[i].item(), f"scale of {case.name}"
        assert torch.equal(u8(got_data[i]), data[i]), f"data of {case.name}"


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_e5m2_conformance_cases(mode):
    cases = C.e5m2_cases()
    x, scales, data = C.stack(cases, torch.float32, mode)
    got_data, got_scale = ref.to_mx(x, E5M2, 32, mode, axis=-1)
    assert torch.equal(got_scale[:, 0], scales)
    assert torch.equal(u8(got_data), data)


@pytest.mark.parametrize("case", C.e2m1_cases(), ids=lambda c: c[0])
def test_e2m1_conformance_cases(case):
    _, values, mode, scale, codes = case
    data, s = ref.to_mx(torch.tensor([values]), E2M1, 32, mode, axis=-1)
    assert s.item() == scale
    assert ref.unpack_fp4(data)[0].tolist() == codes


def _random_blocks(n: int, dtype: torch.dtype) -> torch.Tensor:
    # Magnitudes spread over many binades, so blocks exercise subnormals and saturation.
    return (torch.randn(n, 32) * torch.exp2(torch.randint(-40, 40, (n, 1)).float())).to(dtype)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_roundtrip_error_is_within_half_an_element_ulp(fmt, mode):
    x = _random_blocks(512, torch.float32)
    data, scale = ref.to_mx(x, fmt, 32, mode, axis=-1)
    deq = ref.dequantize(data, scale, fmt, 32, -1, 32)
    s = ref.e8m0_to_fp32(scale)
    y = x / s  # the value the element encodes
    # spacing of the element grid at |y| (subnormal spacing below the smallest normal)
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**fmt.emin))).clamp_min(fmt.emin)
    ulp = torch.exp2(e - fmt.mbits)
    sat = y.abs() > fmt.max_value
    err = ((deq - x) / s).abs()
    assert torch.all(err[~sat] <= ulp[~sat] / 2)
    if mode == "rceil":
        assert not sat.any(), "RCEIL must never saturate"
    assert torch.all(deq[sat].abs() == (fmt.max_value * s.expand_as(x))[sat])


@settings(deadline=None, max_examples=25)
@given(
    st.integers(1, 70),
    st.integers(-30, 30),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_rceil_scale_is_the_smallest_that_fits(n, shift, dtype):
    x = (torch.randn(3, n) * 2.0**shift).to(dtype)
    data, scale = ref.to_mx(x, E4M3, 32, "rceil", axis=-1)
    nb = -(-n // 32)
    assert scale.shape == (3, nb) and data.shape == (3, n)
    xp = torch.nn.functional.pad(x.float(), (0, nb * 32 - n)).reshape(3, nb, 32)
    amax = xp.abs().amax(-1)
    s = ref.e8m0_to_fp32(scale)
    ok = (amax > 0) & torch.isfinite(amax)  # fp16 can overflow to inf here
    assert torch.all(amax[ok] / s[ok] <= 448)
    ok &= scale > 0  # byte 0 (2**-127) is the smallest scale there is
    assert torch.all(amax[ok] / (s[ok] / 2) > 448)  # one power of two less would overflow
    assert torch.all(scale[~torch.isfinite(amax)] == 255)


def test_nan_and_inf_poison_only_their_block():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("-inf")
    data, scale = ref.to_mx(x, E4M3, 32, "rceil", axis=-1)
    assert scale[0, 0] == 255 and scale[1, 1] == 255
    assert scale[0, 1] != 255 and scale[1, 0] != 255
    deq = ref.dequantize(data, scale, E4M3, 32, -1, 64)
    assert torch.isnan(deq[0, :32]).all() and torch.isnan(deq[1, 32:]).all()
    assert torch.isfinite(deq[0, 32:]).all() and torch.isfinite(deq[1, :32]).all()


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    y = torch.full((20000,), 1.0 + 2.0**-5)  # between 1.0 and 1.125 on the E4M3 grid
    bits = ref.sr_bits(torch.arange(y.numel()), ref.sr_keys(5)[0])
    v = ref.round_to_format(y, E4M3, bits)
    assert set(v.unique().tolist()) == {1.0, 1.125}
    # P(up) = 0.25; 20000 draws: std of the mean is ~0.0003.
    assert abs(v.mean().item() - y[0].item()) < 4 * 0.125 * math.sqrt(0.25 * 0.75 / 20000)
    # exactly representable values never move
    grid = ref.decode(torch.arange(0, 0x7F, dtype=torch.uint8), E4M3)
    bits = ref.sr_bits(torch.arange(grid.numel()), 17)
    assert torch.equal(ref.round_to_format(grid, E4M3, bits), grid)


def test_stochastic_rounding_saturates_and_keeps_sign():
    y = torch.tensor([447.0, -447.0, 470.0, -0.0, -(2.0**-12)])
    bits = torch.full(y.shape, (1 << 23) - 1)  # always round up
    v = ref.round_to_format(y, E4M3, bits)
    assert v.tolist()[:3] == [448.0, -448.0, 448.0]
    assert v[3].item() == 0.0 and math.copysign(1, v[3].item()) == -1
    assert v[4].item() == -(2.0**-9)


def test_hash_streams_differ_and_are_deterministic():
    idx = torch.arange(1000)
    k_row, k_col = ref.sr_keys(3)
    a, b = ref.sr_bits(idx, k_row), ref.sr_bits(idx, k_col)
    assert torch.equal(a, ref.sr_bits(idx, ref.sr_keys(3)[0]))
    assert (a != b).float().mean() > 0.99
    assert int(a.max()) < 2**23 and int(a.min()) >= 0
    assert abs(a.double().mean().item() / 2**23 - 0.5) < 0.05


@pytest.mark.parametrize("n", [16, 32])
def test_rht_is_orthogonal_up_to_n(n):
    a, b = torch.randn(4 * n, 7).double(), torch.randn(4 * n, 5).double()
    s = ref.hadamard_signs(n, 0)
    ta, tb = ref.rht(a, n, s).double(), ref.rht(b, n, s).double()
    torch.testing.assert_close(ta.t() @ tb / n, a.t() @ b, rtol=1e-5, atol=1e-5)
    h = ref.hadamard_matrix(n)
    torch.testing.assert_close(h @ h.t(), n * torch.eye(n))


def test_hadamard_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        ref.hadamard_matrix(12)
