"""Argument checks with one message style: ``"<name> must be <expectation>, got <what>"``.

TypeError for a wrong type, ValueError for a wrong value (the names and behaviour every
hyperrec package shares).
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
    """``value`` as a Python int (numpy/torch integers accepted; bools and floats not).

    Raises:
        TypeError: not an integer.
        ValueError: ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        try:
            import numpy as np

            ok = isinstance(value, np.integer)
        except ImportError:  # pragma: no cover - numpy is a declared dependency
            ok = False
        if not ok:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    out = operator.index(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_float(
    name: str, value: Any, *, minimum: float | None = None, finite: bool = True
) -> float:
    """``value`` as a Python float (ints accepted, bools not).

    Raises:
        TypeError: not a real number.
        ValueError: NaN/inf while ``finite``, or ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    out = float(value)
    if finite and not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    if minimum is not None and out < minimum:
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
        ValueError: not one of them (the message lists them).
    """
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
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
        ValueError: another number of dims than ``ndim``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            raise TypeError(f"{name} must have a dtype in {allowed}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    return t
