"""Argument checks for the public entry points: hyperrec's validation dialect.

Each helper names the argument as the caller spelled it and returns the checked value.
A wrong type raises ``TypeError``, a wrong value ``ValueError``; messages read
``"<name> must be <expectation>, got <what>"``. Every hyperrec package carries the same
helpers in its private ``_validate.py`` (a runtime package never imports the dev-only
``hyperrec.testing``); ``nox -s lint`` checks that the copies are identical, so copy
them from here into a new package and add package-specific checks below them.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Collection
from typing import Any, cast

import torch

__all__ = ["check_bool", "check_choice", "check_float", "check_int", "check_tensor"]


def _what(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (numpy integers accepted; bools and floats, even ``2.0``,
    are not). A ``torch.SymInt`` (under ``torch.compile``) or an ``int`` is returned as
    it is.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value < minimum``.
    """
    if isinstance(value, torch.SymInt):
        out = cast(int, value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_what(value)}")
    elif isinstance(value, int):
        # A plain int passes through: while Dynamo traces, a dynamic int reports itself as
        # an int (not a SymInt), and operator.index would specialise the graph on it.
        out = value
    else:
        out = operator.index(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    exclusive: bool = False,
    finite: bool = True,
) -> float:
    """``value`` (any real number but a bool) as a Python float; a ``torch.SymFloat`` or a
    ``float`` is returned as it is. ``minimum`` is inclusive unless ``exclusive``
    (``> minimum``).

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: NaN or infinite (with ``finite``), or below ``minimum``.
    """
    if isinstance(value, torch.SymFloat | torch.SymInt):
        out = cast(float, value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_what(value)}")
    elif isinstance(value, float):
        out = value  # passes through, as in check_int
    else:
        out = float(value)
    # Comparisons rather than math.isfinite: they also trace symbolic floats.
    if finite and not -float("inf") < out < float("inf"):
        raise ValueError(f"{name} must be finite, got {out}")
    if minimum is not None:
        if exclusive and not out > minimum:
            raise ValueError(f"{name} must be > {minimum}, got {out}")
        if not exclusive and not out >= minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1] (a ``TypeError`` for a non-number, a
    ``ValueError`` outside the range or NaN)."""
    out = check_float(name, value, minimum=0.0)
    if not out <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {out}")
    return out


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (ints, even 0 and 1, are not).

    Raises:
        TypeError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_what(value)}")
    return value


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices`` (strings for modes, or e.g. ints for sizes).

    Raises:
        TypeError: ``value`` is not of the choices' type (a bool is never an int here).
        ValueError: another value of that type.
    """
    options = tuple(choices)
    kinds = tuple({type(c) for c in options})
    if isinstance(value, bool) != any(isinstance(c, bool) for c in options) or not isinstance(
        value, kinds
    ):
        raise TypeError(f"{name} must be one of {options}, got {_what(value)}")
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def check_tensor(
    name: str,
    t: Any,
    *,
    dtypes: Collection[torch.dtype] | None = None,
    ndim: int | Collection[int] | None = None,
) -> torch.Tensor:
    """``t`` if it is a tensor of one of ``dtypes`` with ``ndim`` dims (an int or a set).

    Raises:
        TypeError: ``t`` is not a tensor, or has another dtype.
        ValueError: another number of dims.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        want = " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))
        got = str(t.dtype).removeprefix("torch.")
        article = "an" if want[0] in "aeiou" else "a"
        raise TypeError(f"{name} must be {article} {want} tensor, got {got}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in dims:
            want = " or ".join(f"{d}-D" for d in dims)
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t
