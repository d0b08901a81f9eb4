"""Numeric comparators shared by every package's tests."""

from __future__ import annotations

import math

import torch

__all__ = [
    "assert_close_to_reference",
    "max_abs_error",
    "poison_like",
    "rel_error",
    "snr_db",
]


def _pair(
    actual: torch.Tensor, expected: torch.Tensor, names: tuple[str, str] = ("actual", "expected")
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError(f"{names[0]} and {names[1]} must be tensors")
    for name, t in zip(names, (actual, expected)):
        if t.is_complex():
            # .double() would drop the imaginary part with only a warning.
            raise TypeError(f"{name} must be real, got {t.dtype}; compare .real/.imag")
    if actual.shape != expected.shape:
        raise ValueError(
            f"shape mismatch: {names[0]} {tuple(actual.shape)} vs {names[1]} "
            f"{tuple(expected.shape)}"
        )
    return actual.detach().double().cpu(), expected.detach().double().cpu()


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float64 (0 for empty tensors; NaN if either has NaN).

    Raises:
        TypeError: non-tensor or complex inputs.
        ValueError: shapes differ.
    """
    a, e = _pair(actual, expected)
    if a.numel() == 0:
        return 0.0
    return float((a - e).abs().max())


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_2 / ||expected||_2 in float64; the absolute norm if expected is 0.

    Raises:
        TypeError: non-tensor or complex inputs.
        ValueError: shapes differ.
    """
    a, e = _pair(actual, expected)
    num = float(torch.linalg.vector_norm(a - e))
    den = float(torch.linalg.vector_norm(e))
    return num / den if den > 0 else num


def snr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-noise ratio 10*log10(||expected||^2 / ||actual - expected||^2) in dB.

    ``inf`` when the tensors are equal; ``-inf`` when ``expected`` is all zeros but
    ``actual`` is not.

    Raises:
        TypeError: non-tensor or complex inputs.
        ValueError: shapes differ.
    """
    a, e = _pair(actual, expected)
    noise = float(((a - e) ** 2).sum())
    signal = float((e**2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def assert_close_to_reference(
    actual: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor,
    *,
    factor: float = 2.0,
    atol: float = 1e-5,
    name: str = "output",
) -> None:
    """The kernel accuracy rule: err(actual) <= factor * err(reference) + atol.

    ``exact`` is the high-precision (fp64) answer, ``reference`` the same-dtype PyTorch
    answer and ``actual`` the kernel's; errors are max-abs against ``exact``. NaN/Inf
    must appear at the same positions with the same values in ``actual`` and ``exact``.

    Raises:
        AssertionError: with both errors in the message.
        TypeError: non-tensor or complex inputs; ``factor``/``atol`` not numbers,
            ``name`` not a str.
        ValueError: shapes differ; ``factor``/``atol`` negative or not finite (a
            negative factor or atol would make the rule fail or pass meaninglessly).
    """
    for arg, v in (("factor", factor), ("atol", atol)):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"{arg} must be a float, got {type(v).__name__} {v!r}")
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{arg} must be finite and >= 0, got {v!r}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    a, e = _pair(actual, exact, ("actual", "exact"))
    r, _ = _pair(reference, exact, ("reference", "exact"))
    bad_a, bad_e = ~torch.isfinite(a), ~torch.isfinite(e)
    if not torch.equal(bad_a, bad_e) or not torch.equal(
        a[bad_a].nan_to_num(0.0, 1.0, -1.0), e[bad_e].nan_to_num(0.0, 1.0, -1.0)
    ):
        raise AssertionError(f"{name}: NaN/Inf pattern differs from the exact answer")
    fin = ~bad_e
    err_a = float((a[fin] - e[fin]).abs().max()) if fin.any() else 0.0
    err_r = float((r[fin] - e[fin]).abs().max()) if fin.any() else 0.0
    if not err_a <= factor * err_r + atol:
        raise AssertionError(
            f"{name}: max error {err_a:.3e} exceeds {factor} x the same-dtype reference's "
            f"{err_r:.3e} + atol {atol:.1e}"
        )


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` filled with a value no correct kernel writes.

    NaN for floating dtypes, the dtype's max for integers, True for bool. Use it as a
    pre-filled output to check that every element is written.

    Raises:
        TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full_like(t, float("nan"))
    if t.dtype == torch.bool:
        return torch.ones_like(t)
    return torch.full_like(t, torch.iinfo(t.dtype).max)
