"""Argument checks shared by the public entry points (the hyperrec dialect).

TypeError for a wrong type, ValueError for a wrong value; every message reads
``"<name> must be <expectation>, got <what>"`` with the name the caller spelled.
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
        ValueError: below ``minimum``.
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
    """``value`` as a Python float.

    Raises:
        TypeError: not a real number (bools rejected).
        ValueError: NaN (always), infinite (with ``finite``) or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    out = float(value)
    if math.isnan(out) or (finite and math.isinf(out)):
        raise ValueError(f"{name} must be a finite number, got {out}")
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool.

    Raises:
        TypeError: not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: not one of ``choices``.
    """
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_tensor(
    name: str,
    t: Any,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """``t`` if it is a tensor of an allowed dtype and number of dims.

    Raises:
        TypeError: not a tensor, or a dtype outside ``dtypes``.
        ValueError: ``ndim`` mismatch.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name} must have a dtype in {tuple(dtypes)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t
