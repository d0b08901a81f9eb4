"""Argument checks shared by the public entry points.

Every error names the offending argument, so a bad call fails at the boundary with a
message the caller can act on instead of deep inside numpy.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np

__all__ = ["as_costs", "check_float", "check_int"]


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as a Python int; rejects bools and floats (even ``2.0``).

    Raises:
        TypeError: ``value`` is not an integer (numpy integers are accepted).
        ValueError: ``value < minimum``.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    out = operator.index(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_float(
    name: str, value: Any, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """``value`` as a finite Python float.

    Raises:
        TypeError: ``value`` is not a real number (bools are rejected).
        ValueError: ``value`` is NaN/inf, or violates ``positive``/``nonnegative``.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real | np.floating):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    if positive and out <= 0:
        raise ValueError(f"{name} must be > 0, got {out}")
    if nonnegative and out < 0:
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def as_costs(name: str, costs: Any, *, ndim: int | tuple[int, ...] = 1) -> np.ndarray:
    """Costs as a float64 numpy array (a copy), validated.

    Accepts a sequence of real numbers, a numpy array or a torch tensor of a real
    (integer or floating) dtype.

    Raises:
        TypeError: not array-like, or a bool/complex/object dtype.
        ValueError: wrong number of dims, or any entry negative, NaN or infinite.
    """
    try:
        import torch

        if isinstance(costs, torch.Tensor):
            if costs.dtype == torch.bool or costs.is_complex():
                raise TypeError(f"{name} must have a real dtype, got {costs.dtype}")
            costs = costs.detach().cpu().double().numpy()
    except ImportError:  # pragma: no cover - torch is a declared dependency
        pass
    if isinstance(costs, str | bytes) or costs is None:
        raise TypeError(f"{name} must be array-like of real numbers, got {type(costs).__name__}")
    try:
        arr = np.asarray(costs)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be array-like of real numbers: {exc}") from None
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if arr.ndim not in dims:
        raise ValueError(
            f"{name} must have {' or '.join(map(str, dims))} dim(s), got shape {arr.shape}"
        )
    out = arr.astype(np.float64, copy=True)
    if out.size and not np.isfinite(out).all():
        raise ValueError(f"{name} must be finite; found NaN or inf")
    if out.size and (out < 0).any():
        bad = int(np.flatnonzero(out.ravel() < 0)[0])
        raise ValueError(f"{name} must be non-negative; entry {bad} is {out.ravel()[bad]}")
    return out
