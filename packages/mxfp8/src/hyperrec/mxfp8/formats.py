"""The OCP MX element formats, the E8M0 scale byte and the scale rules.

An MX block is ``block_size`` consecutive elements (32 in the OCP spec) that share one
power-of-two scale ``X = 2**(byte - 127)`` stored as an E8M0 byte. Element values are
``V / X`` rounded to the element format. This module holds the facts about the formats
that the reference, the kernels and the validators share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hyperrec.mxfp8._validate import check_choice

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "ElemFormat",
    "SCALE_MODES",
    "E8M0_BIAS",
    "E8M0_NAN",
    "get_format",
    "check_scale_mode",
]

#: Exponent bias of the E8M0 scale byte: byte ``b`` encodes ``2**(b - 127)``.
E8M0_BIAS = 127
#: The E8M0 byte that encodes NaN (a block that held NaN or Inf).
E8M0_NAN = 255
#: Scale rules: ``"floor"`` is the OCP v1.0 rule, ``"rceil"`` rounds ``amax / max`` up.
ScaleMode = Literal["floor", "rceil"]
"""E8M0 scale rule (case-insensitive at run time)."""
SCALE_MODES: tuple[ScaleMode, ...] = ("floor", "rceil")


@dataclass(frozen=True, kw_only=True)
class ElemFormat:
    """One MX element format (immutable facts, no behaviour)."""

    name: str
    """Short name: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"``."""
    storage_dtype: torch.dtype
    """dtype of ``MXTensor.data``: the FP8 dtype, or ``uint8`` for MX4 (two codes a byte)."""
    mbits: int
    """Explicit mantissa bits."""
    emax: int
    """Exponent of the largest normal value (8 for E4M3, 15 for E5M2, 2 for E2M1)."""
    emin: int
    """Exponent of the smallest normal value (-6, -14, 0)."""
    max_value: float
    """Largest finite magnitude (448, 57344, 6); values beyond it saturate."""
    nan_code: int | None
    """Byte written for every element of a NaN block; ``None`` if the format has no NaN."""
    code: int
    """Small integer id passed to the kernels."""

    @property
    def packed(self) -> bool:
        """True when two elements share a byte (MX4)."""
        return self.storage_dtype == torch.uint8

    @property
    def bits(self) -> int:
        """Bits per element."""
        return 4 if self.packed else 8


E4M3 = ElemFormat(
    name="e4m3",
    storage_dtype=torch.float8_e4m3fn,
    mbits=3,
    emax=8,
    emin=-6,
    max_value=448.0,
    nan_code=0x7F,
    code=0,
)
E5M2 = ElemFormat(
    name="e5m2",
    storage_dtype=torch.float8_e5m2,
    mbits=2,
    emax=15,
    emin=-14,
    max_value=57344.0,
    nan_code=0x7F,
    code=1,
)
E2M1 = ElemFormat(
    name="e2m1",
    storage_dtype=torch.uint8,
    mbits=1,
    emax=2,
    emin=0,
    max_value=6.0,
    nan_code=None,
    code=2,
)

_BY_NAME = {f.name: f for f in (E4M3, E5M2, E2M1)}
_BY_DTYPE: dict[torch.dtype, ElemFormat] = {
    torch.float8_e4m3fn: E4M3,
    torch.float8_e5m2: E5M2,
}
if hasattr(torch, "float4_e2m1fn_x2"):
    _BY_DTYPE[torch.float4_e2m1fn_x2] = E2M1
_ALIASES = {"mxfp8": E4M3, "mxfp8_e4m3": E4M3, "mxfp8_e5m2": E5M2, "mx4": E2M1, "mxfp4": E2M1}


def get_format(elem_dtype: torch.dtype | str | ElemFormat) -> ElemFormat:
    """Resolve an element format from a torch dtype, a name or an :class:`ElemFormat`.

    Accepted: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.float4_e2m1fn_x2``
    (MX4), or the names ``"e4m3"``, ``"e5m2"``, ``"e2m1"`` (aliases ``"mxfp8"``,
    ``"mx4"``, ``"mxfp4"``).

    Raises:
        TypeError: ``elem_dtype`` is neither a dtype, a string nor a format.
        ValueError: an unsupported dtype or name.
    """
    if isinstance(elem_dtype, ElemFormat):
        return elem_dtype
    if isinstance(elem_dtype, torch.dtype):
        if elem_dtype not in _BY_DTYPE:
            raise ValueError(
                f"elem_dtype must be one of {sorted(map(str, _BY_DTYPE))}, got {elem_dtype}"
            )
        return _BY_DTYPE[elem_dtype]
    if isinstance(elem_dtype, str):
        key = elem_dtype.lower()
        fmt = _BY_NAME.get(key) or _ALIASES.get(key)
        if fmt is None:
            raise ValueError(
                f"elem_dtype must be one of {sorted(_BY_NAME) + sorted(_ALIASES)}, "
                f"got {elem_dtype!r}"
            )
        return fmt
    raise TypeError(
        f"elem_dtype must be a torch.dtype or a format name, got {type(elem_dtype).__name__}"
    )


def check_scale_mode(scale_mode: str) -> str:
    """Validate a scale rule name (case-insensitive); returns it lower-cased.

    Raises:
        TypeError: not a string.
        ValueError: not ``"floor"`` or ``"rceil"``.
    """
    if not isinstance(scale_mode, str):
        raise TypeError(f"scale_mode must be one of {SCALE_MODES}, got {type(scale_mode).__name__}")
    return str(check_choice("scale_mode", scale_mode.lower(), SCALE_MODES))
