"""Argument checks for the sparse subpackage (the dialect's helpers and messages).

Every error names the argument as the caller spelled it: ``"<name> must be
<expectation>, got <what>"``; ``TypeError`` for a wrong type, ``ValueError`` for a wrong
value.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["check_bool", "check_choice", "check_float", "check_int", "check_tensor"]


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (bools and floats rejected, even ``2.0``).

    Raises:
        TypeError: not an integer.
        ValueError: ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    out = operator.index(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_float(
    name: str, value: Any, *, minimum: float | None = None, finite: bool = True
) -> float:
    """``value`` as a Python float (ints accepted, bools rejected).

    Raises:
        TypeError: not a real number.
        ValueError: NaN/inf while ``finite``, or ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    out = float(value)
    if finite and not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    if minimum is not None and not out >= minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool.

    Raises:
        TypeError: anything else (``0``/``1`` included).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: not one of them.
    """
    options = tuple(choices)
    if not isinstance(value, str | int | type(None)) or value not in options:
        raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
    return value


def check_tensor(
    name: str,
    t: Any,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """``t`` if it is a tensor of one of ``dtypes`` with ``ndim`` dims.

    Raises:
        TypeError: not a tensor, or another dtype.
        ValueError: another number of dims.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"{name} must be a {names} tensor, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dim(s), got shape {tuple(t.shape)}")
    return t
