"""Byte-level conformance cases for MX quantization (32-element blocks).

Each case is one block with its expected E8M0 scale byte and element bytes under the
FLOOR (OCP) and RCEIL rules, derived by hand from the rules in ``reference.py``'s
docstring. They cover the spec's edges: zeros, the smallest normal, subnormals, +-max,
saturation, mixed NaN/Inf, underflow next to large values, and inputs whose exponent
changes when rounded to BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F32_TINY_SUB = torch.tensor([1], dtype=torch.int32).view(torch.float32).item()  # 2**-149


@dataclass(frozen=True)
class Case:
    name: str
    values: list[float]  # 32 values (before the cast to the input dtype)
    floor: tuple[int, list[int]]  # (scale byte, 32 element bytes)
    rceil: tuple[int, list[int]]


def _fill(v: float) -> list[float]:
    return [v] * 32


def _first(v0: float, rest: float) -> list[float]:
    return [v0] + [rest] * 31


def _bytes(b0: int, rest: int) -> list[int]:
    return [b0] + [rest] * 31


def _f32_bits(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def e4m3_cases(dtype: torch.dtype) -> list[Case]:
    """The E4M3 cases for float32 or bfloat16 inputs (values already representable)."""
    bf16 = dtype == torch.bfloat16
    fin = torch.finfo(dtype)
    tiny_sub = 2.0**-133 if bf16 else F32_TINY_SUB
    sub_byte = 0x08 if bf16 else 0x00  # 2**-133 * 2**127 = 2**-6 (E4M3 min normal)
    # dtype max: FLOOR -> 2**119 and a value near 512 that saturates to 448;
    # RCEIL -> 2**120 and a value that rounds to 256.
    dmax_floor, dmax_rceil = (246, 0x7E), (247, 0x78)
    above_3p5 = _f32_bits(0x40600001)  # 3.5 + 1 ulp; exactly 3.5 in BF16
    below_512 = _f32_bits(0x43FFFFFF)  # largest FP32 below 512; 512 in BF16
    cases = [
        Case(name="zero", values=_fill(0.0), floor=(0, _fill(0)), rceil=(0, _fill(0))),
        Case(
            name="smallest_normal",
            values=_fill(fin.tiny),
            floor=(0, _fill(0x40)),  # 2**-126 / 2**-127 = 2.0
            rceil=(0, _fill(0x40)),
        ),
        Case(
            name="mixed_inf",
            values=_first(float("inf"), 1.0),
            floor=(255, _fill(0x7F)),
            rceil=(255, _fill(0x7F)),
        ),
        Case(
            name="mixed_nan",
            values=_first(float("nan"), 1.0),
            floor=(255, _fill(0x7F)),
            rceil=(255, _fill(0x7F)),
        ),
        Case(
            name="all_nan",
            values=_fill(float("nan")),
            floor=(255, _fill(0x7F)),
            rceil=(255, _fill(0x7F)),
        ),
        Case(
            name="pos_448", values=_fill(448.0), floor=(127, _fill(0x7E)), rceil=(127, _fill(0x7E))
        ),
        Case(
            name="neg_448", values=_fill(-448.0), floor=(127, _fill(0xFE)), rceil=(127, _fill(0xFE))
        ),
        Case(
            name="pos_dtype_max",
            values=_fill(fin.max),
            floor=(dmax_floor[0], _fill(dmax_floor[1])),
            rceil=(dmax_rceil[0], _fill(dmax_rceil[1])),
        ),
        Case(
            name="neg_dtype_max",
            values=_fill(-fin.max),
            floor=(dmax_floor[0], _fill(dmax_floor[1] | 0x80)),
            rceil=(dmax_rceil[0], _fill(dmax_rceil[1] | 0x80)),
        ),
        Case(
            name="pos_smallest_subnormal",
            values=_fill(tiny_sub),
            floor=(0, _fill(sub_byte)),
            rceil=(0, _fill(sub_byte)),
        ),
        Case(
            name="neg_smallest_subnormal",
            values=_fill(-tiny_sub),
            floor=(0, _fill(sub_byte | 0x80)),
            rceil=(0, _fill(sub_byte | 0x80)),
        ),
        Case(
            name="pos_underflow_next_to_one",  # scale 2**-8 from 1.0: 1.0 -> 256
            values=_first(tiny_sub, 1.0),
            floor=(119, _bytes(0x00, 0x78)),
            rceil=(119, _bytes(0x00, 0x78)),
        ),
        Case(
            name="neg_underflow_keeps_sign",
            values=_first(-tiny_sub, 1.0),
            floor=(119, _bytes(0x80, 0x78)),
            rceil=(119, _bytes(0x80, 0x78)),
        ),
        Case(
            name="saturation_and_underflow",
            values=_first(fin.max, 1.0),
            floor=(dmax_floor[0], _bytes(dmax_floor[1], 0x00)),
            rceil=(dmax_rceil[0], _bytes(dmax_rceil[1], 0x00)),
        ),
        Case(
            name="rceil_3p5_plus_ulp",  # (3.5+ulp)/448 rounds to 2**-7 (1 + ulp) -> 2**-6
            values=_fill(above_3p5),
            floor=(120, _fill(0x7E)),
            rceil=(120, _fill(0x7E)) if bf16 else (121, _fill(0x76)),
        ),
        Case(
            name="floor_exponent_from_fp32",  # FLOOR must read 2**8, not BF16's 512
            values=_fill(below_512),
            floor=(128, _fill(0x78)) if bf16 else (127, _fill(0x7E)),
            rceil=(128, _fill(0x78)),
        ),
        Case(
            name="pos_480_saturates",
            values=_fill(480.0),
            floor=(127, _fill(0x7E)),
            rceil=(128, _fill(0x77)),
        ),
        Case(
            name="neg_480_saturates",
            values=_fill(-480.0),
            floor=(127, _fill(0xFE)),
            rceil=(128, _fill(0xF7)),
        ),
    ]
    return cases


def e5m2_cases() -> list[Case]:
    """A few E5M2 cases (float32 inputs)."""
    return [
        Case(
            name="e5m2_max",
            values=_fill(57344.0),
            floor=(127, _fill(0x7B)),
            rceil=(127, _fill(0x7B)),
        ),
        Case(
            name="e5m2_nan",
            values=_first(float("nan"), 1.0),
            floor=(255, _fill(0x7F)),
            rceil=(255, _fill(0x7F)),
        ),
        # 1.0 with FLOOR: 2**-15, element 2**15 = 0x78; RCEIL: 1/57344 -> 2**-15 too.
        Case(
            name="e5m2_one", values=_fill(1.0), floor=(112, _fill(0x78)), rceil=(112, _fill(0x78))
        ),
        # 60000 > 1.75 * 2**15: FLOOR keeps 2**0 and saturates; RCEIL picks 2**1 and
        # 30000 rounds to 28672 = 1.75 * 2**14.
        Case(
            name="e5m2_saturates",
            values=_fill(60000.0),
            floor=(127, _fill(0x7B)),
            rceil=(128, _fill(0x77)),
        ),
    ]


def e2m1_cases() -> list[tuple[str, list[float], str, int, list[int]]]:
    """MX4 cases: (name, 32 values, scale_mode, scale byte, 32 unpacked 4-bit codes)."""
    ties = [4.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0] + [0.0] * 22
    # amax 4: FLOOR and RCEIL both give 2**0; ties go to the even code.
    tie_codes = [6, 0, 2, 2, 4, 6, 6, 0x8, 0xA, 0xE] + [0] * 22
    return [
        ("e2m1_ties_floor", ties, "floor", 127, tie_codes),
        ("e2m1_ties_rceil", ties, "rceil", 127, tie_codes),
        ("e2m1_six", _fill(6.0), "floor", 127, _fill(7)),
        ("e2m1_seven_saturates", _fill(7.0), "floor", 127, _fill(7)),
        ("e2m1_seven_rceil", _fill(7.0), "rceil", 128, _fill(6)),  # 7/2 = 3.5 -> tie -> 4
        ("e2m1_nan", _first(float("nan"), 1.0), "rceil", 255, _fill(0)),
        ("e2m1_zero", _fill(-0.0), "floor", 0, _fill(0x8)),
    ]


def stack(cases: list[Case], dtype: torch.dtype, mode: str):
    """(inputs (n, 32) in ``dtype``, scale bytes (n,), element bytes (n, 32)) for ``mode``."""
    x = torch.tensor([c.values for c in cases], dtype=torch.float32).to(dtype)
    exp = [getattr(c, mode) for c in cases]
    scales = torch.tensor([e[0] for e in exp], dtype=torch.uint8)
    data = torch.tensor([e[1] for e in exp], dtype=torch.uint8)
    return x, scales, data
