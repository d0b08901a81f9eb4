"""Element-wise activations that GDPA applies to attention scores, with their derivatives.

Each activation is a pair of pure-PyTorch functions: the value and its derivative. The
reference backward uses the explicit derivative (not autograd) so that it states exactly
what a kernel has to compute.

``gelu_poly`` is the ALU-only GELU: it uses only multiply, add, compare, clamp and
select (no ``exp``/``erf``/``tanh``), so a kernel can evaluate it on the FMA pipes
instead of the special-function unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "ACTIVATIONS",
    "GELU_POLY_COEFFS",
    "GELU_POLY_DERIVATIVE_MAX_ERROR",
    "GELU_POLY_MAX_ERROR",
    "GELU_POLY_RANGE",
    "activation",
    "activation_derivative",
    "gelu_poly",
]

#: Names accepted by ``gdpa(activation=...)``. ``"softmax"`` is row-wise over the allowed
#: keys; every other name is element-wise on the scaled scores.
ACTIVATIONS: tuple[str, ...] = (
    "softmax",
    "silu",
    "gelu",
    "gelu_tanh",
    "gelu_poly",
    "relu",
    "sigmoid",
    "identity",
)

#: ``gelu_poly`` evaluates its polynomial on ``|x| < GELU_POLY_RANGE`` and is exactly
#: ``relu(x)`` outside, where GELU differs from ReLU by at most ``x * Phi(-x) < 4.6e-5``.
GELU_POLY_RANGE = 4.25

#: ``c_1 .. c_8`` of ``Q(u) = sum_k c_k u^k`` with ``u = x^2``:
#: ``gelu_poly(x) = 0.5 x + Q(x^2)`` inside the range. ``GELU(x) - 0.5 x = 0.5 x erf(x/sqrt 2)``
#: is even, so a polynomial in ``x^2`` fits it with half the terms; ``c_0 = 0`` keeps
#: ``gelu_poly(0) = 0`` exact. The coefficients are a minimax fit on ``[0, GELU_POLY_RANGE]``
#: (Lawson's iteratively reweighted least squares); ``tests/test_activations.py`` refits
#: them and checks the error bound below.
GELU_POLY_COEFFS: tuple[float, ...] = (
    3.9845708019e-01,
    -6.5513760949e-02,
    9.2903585042e-03,
    -9.4865343396e-04,
    6.6620982231e-05,
    -3.0181736698e-06,
    7.8669248919e-08,
    -8.9047786563e-10,
)

#: Max ``|gelu_poly(x) - GELU(x)|`` over all finite ``x``, evaluated in float32 (7.7e-5
#: in float64; the float32 figure includes rounding in Horner's scheme).
GELU_POLY_MAX_ERROR = 1.0e-4

#: Max ``|gelu_poly'(x) - GELU'(x)|`` over all finite ``x`` (float64).
GELU_POLY_DERIVATIVE_MAX_ERROR = 6.0e-3

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def _horner(u: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """``sum_{k>=1} coeffs[k-1] * u**k`` with one multiply-add per coefficient."""
    acc = torch.zeros_like(u)
    for c in reversed(coeffs):
        acc = (acc + c) * u
    return acc


def gelu_poly(x: torch.Tensor) -> torch.Tensor:
    """ALU-only GELU: a degree-16 even polynomial plus ``0.5 x``, ReLU for ``|x| >= 4.25``.

    Args:
        x: floating tensor of any shape.

    Returns:
        A tensor like ``x``. ``|gelu_poly(x) - gelu(x)| <= GELU_POLY_MAX_ERROR`` (1e-4) for
        every finite ``x``; NaN stays NaN. The function jumps by at most 7.7e-5 at
        ``|x| = 4.25`` (the polynomial's error there), which is harmless in practice but
        makes it non-continuous in the strict sense.

    Evaluate it in float32 or wider: ``c_7`` and ``c_8`` underflow in float16, and the
    reference upcasts half-precision scores before any activation.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating-point tensor, got {what}")
    return _gelu_poly(x)


def _gelu_poly(x: torch.Tensor) -> torch.Tensor:
    # Clamp before the polynomial so the unselected branch stays finite: x**16 overflows
    # float32 for |x| > 250 and would turn the where() gradient into NaN.
    xc = x.clamp(-GELU_POLY_RANGE, GELU_POLY_RANGE)
    inside = 0.5 * x + _horner(xc * xc, GELU_POLY_COEFFS)
    return torch.where(x.abs() < GELU_POLY_RANGE, inside, torch.relu(x))


def _gelu_poly_derivative(x: torch.Tensor) -> torch.Tensor:
    xc = x.clamp(-GELU_POLY_RANGE, GELU_POLY_RANGE)
    # d/dx Q(x^2) = 2 x Q'(x^2), Q'(u) = sum_k k c_k u^(k-1).
    u = xc * xc
    dq = torch.zeros_like(u)
    for k in range(len(GELU_POLY_COEFFS), 0, -1):
        dq = dq * u + k * GELU_POLY_COEFFS[k - 1]
    inside = 0.5 + 2.0 * xc * dq
    return torch.where(x.abs() < GELU_POLY_RANGE, inside, (x > 0).to(x.dtype))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / _SQRT_2))


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1.0 + torch.erf(x / _SQRT_2))
    pdf = torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return cdf + x * pdf


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x)))


def _gelu_tanh_derivative(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x))
    dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner


def _silu_derivative(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _sigmoid_derivative(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 - s)


_Fn = Callable[[torch.Tensor], torch.Tensor]

_ELEMENTWISE: dict[str, tuple[_Fn, _Fn]] = {
    "silu": (torch.nn.functional.silu, _silu_derivative),
    "gelu": (_gelu, _gelu_derivative),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_derivative),
    "gelu_poly": (_gelu_poly, _gelu_poly_derivative),
    "relu": (torch.relu, lambda x: (x > 0).to(x.dtype)),
    "sigmoid": (torch.sigmoid, _sigmoid_derivative),
    "identity": (lambda x: x, torch.ones_like),
}


def _lookup(name: str) -> tuple[_Fn, _Fn]:
    if name == "softmax":
        raise ValueError("activation 'softmax' is row-wise, not element-wise")
    try:
        return _ELEMENTWISE[name]
    except KeyError:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}") from None


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """Apply the element-wise activation ``name`` to ``x``.

    Args:
        name: one of :data:`ACTIVATIONS` except ``"softmax"``.
        x: floating tensor of any shape.

    Raises:
        ValueError: ``name`` is unknown or ``"softmax"``.
    """
    return _lookup(name)[0](x)


def activation_derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    """The derivative of the element-wise activation ``name`` at ``x`` (same shape/dtype).

    ``relu`` uses 0 at ``x = 0`` (PyTorch's convention).

    Raises:
        ValueError: ``name`` is unknown or ``"softmax"``.
    """
    return _lookup(name)[1](x)
