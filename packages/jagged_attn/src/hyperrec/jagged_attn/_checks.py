"""Small argument checks shared by the configs and the public functions.

Every check names the argument as the caller spelled it, so an error points at the
caller's keyword rather than at an internal field.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_bool", "check_choice", "check_float", "check_int"]


def check_int(name: str, value: object, *, minimum: int | None = None) -> None:
    """Raise unless ``value`` is an int (a bool is not) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_float(name: str, value: object) -> None:
    """Raise unless ``value`` is a finite real number (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float | torch.SymFloat):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    # Comparisons rather than math.isfinite: torch.compile(dynamic=True) turns the default
    # scale 1/sqrt(head_dim) into a symbolic float, which isfinite cannot trace.
    if not -math.inf < value < math.inf:
        raise ValueError(f"{name} must be finite, got {value}")


def check_bool(name: str, value: object) -> None:
    """Raise unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise unless ``value`` is one of the strings in ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
