"""Synthetic sequence-length distributions for the simulator.

Lengths are integers in ``[1, max_len]`` (histories are truncated, as in production
recommenders). Parameters are chosen to resemble user-history lengths: a long-tailed
bulk (log-normal), a heavier power law, and a uniform control with little skew.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperrec.bbs._validate import check_choice, check_float, check_int

__all__ = ["DISTRIBUTIONS", "LengthDistribution", "sample_lengths"]


@dataclass(frozen=True, kw_only=True)
class LengthDistribution:
    """A named length distribution, sampled in float32 for speed (lengths < 2**24)."""

    kind: str
    """``"lognormal"`` | ``"powerlaw"`` | ``"uniform"``."""
    a: float
    """lognormal: median; powerlaw: minimum length ``x_min``; uniform: low."""
    b: float
    """lognormal: sigma of log-length; powerlaw: tail index ``alpha`` (P(L > x) ~
    x^-alpha); uniform: high (inclusive)."""

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "powerlaw", "uniform"):
            raise ValueError(f"kind must be lognormal, powerlaw or uniform, got {self.kind!r}")
        check_float("a", self.a, minimum=0, exclusive=True)
        check_float("b", self.b, minimum=0, exclusive=True)
        # With low > high every draw was clipped to `high`: a constant, not uniform.
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"b (uniform high) must be >= a (low) = {self.a}, got {self.b}")

    def describe(self) -> str:
        """One line for tables and JSON."""
        if self.kind == "lognormal":
            return f"log-normal, median {self.a:g}, sigma {self.b:g}"
        if self.kind == "powerlaw":
            return f"Pareto, x_min {self.a:g}, alpha {self.b:g}"
        return f"uniform integers in [{self.a:g}, {self.b:g}]"


DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "lognormal": LengthDistribution(kind="lognormal", a=200.0, b=1.0),
    "powerlaw": LengthDistribution(kind="powerlaw", a=32.0, b=1.5),
    "uniform": LengthDistribution(kind="uniform", a=1.0, b=1024.0),
}
"""The simulator's built-in distributions, by name."""


def sample_lengths(
    dist: LengthDistribution | str, n: int, rng: np.random.Generator, *, max_len: int = 4096
) -> np.ndarray:
    """``(n,)`` float32 integer-valued lengths in ``[1, max_len]``.

    Raises:
        ValueError: unknown distribution name, or bad ``n`` / ``max_len``.
        TypeError: ``dist`` is neither a name nor a :class:`LengthDistribution`.
    """
    if isinstance(dist, str):
        d = DISTRIBUTIONS[check_choice("dist", dist, sorted(DISTRIBUTIONS))]
    elif isinstance(dist, LengthDistribution):
        d = dist
    else:
        raise TypeError(f"dist must be a name or a LengthDistribution, got {type(dist).__name__}")
    n = check_int("n", n, minimum=0)
    max_len = check_int("max_len", max_len, minimum=1)
    if d.kind == "lognormal":
        x = rng.standard_normal(n, dtype=np.float32)
        x *= np.float32(d.b)
        x += np.float32(np.log(d.a))
        np.exp(x, out=x)
    elif d.kind == "powerlaw":
        # Inverse CDF of the Pareto law; 1 - U keeps the base away from 0.
        x = rng.random(n, dtype=np.float32)
        np.subtract(np.float32(1.0), x, out=x)
        np.power(x, np.float32(-1.0 / d.b), out=x)
        x *= np.float32(d.a)
    else:
        x = rng.random(n, dtype=np.float32)
        x *= np.float32(d.b - d.a + 1.0)
        x += np.float32(d.a)
        np.floor(x, out=x)
        np.minimum(x, np.float32(d.b), out=x)  # float32 rounding can reach high + 1
    np.rint(x, out=x)
    np.clip(x, 1, max_len, out=x)
    return x
