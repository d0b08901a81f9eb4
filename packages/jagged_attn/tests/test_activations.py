"""Activations: derivatives against autograd, and the ALU-only GELU's documented bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyperrec.jagged_attn.activations import (
    ACTIVATIONS,
    GELU_POLY_COEFFS,
    GELU_POLY_DERIVATIVE_MAX_ERROR,
    GELU_POLY_MAX_ERROR,
    GELU_POLY_RANGE,
    _gelu_poly,
    activation,
    activation_derivative,
    gelu_poly,
)

ELEMENTWISE = [a for a in ACTIVATIONS if a != "softmax"]


def _grid(dtype=torch.float64) -> torch.Tensor:
    dense = torch.linspace(-12.0, 12.0, 240_001, dtype=torch.float64)
    edges = torch.tensor([0.0, GELU_POLY_RANGE, -GELU_POLY_RANGE, 1e3, -1e3, 1e30, -1e30])
    return torch.cat([dense, edges.double()]).to(dtype)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_derivative_matches_autograd(name):
    # Random points away from the kinks (relu at 0, gelu_poly at the range edge).
    x = torch.randn(4096, dtype=torch.float64) * 4
    x = x[(x.abs() > 1e-3) & ((x.abs() - GELU_POLY_RANGE).abs() > 1e-3)].requires_grad_()
    (auto,) = torch.autograd.grad(activation(name, x).sum(), x)
    torch.testing.assert_close(
        activation_derivative(name, x.detach()), auto, rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    ("name", "exact"),
    [
        ("silu", F.silu),
        ("gelu", F.gelu),
        ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
        ("relu", F.relu),
        ("sigmoid", torch.sigmoid),
        ("identity", lambda t: t),
    ],
)
def test_activation_values_match_torch(name, exact):
    x = torch.randn(1000, dtype=torch.float64) * 5
    torch.testing.assert_close(activation(name, x), exact(x), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_poly_max_error_is_as_documented(dtype):
    x = _grid(dtype)
    err = (gelu_poly(x).double() - F.gelu(x.double())).abs().max().item()
    assert err <= GELU_POLY_MAX_ERROR
    # The bound is tight: the fit is not accidentally much better than claimed.
    assert err >= GELU_POLY_MAX_ERROR / 2


def test_gelu_poly_derivative_error_is_as_documented():
    x = _grid().requires_grad_()
    (exact,) = torch.autograd.grad(F.gelu(x).sum(), x)
    err = (activation_derivative("gelu_poly", x.detach()) - exact).abs().max().item()
    assert err <= GELU_POLY_DERIVATIVE_MAX_ERROR


def test_gelu_poly_special_values():
    x = torch.tensor([0.0, float("nan"), float("inf"), 1e38, -1e38, 300.0, -300.0])
    y = gelu_poly(x)
    assert y[0] == 0.0
    assert math.isnan(y[1])
    assert y[2] == float("inf")
    assert y[3] == 1e38 and y[4] == 0.0 and y[5] == 300.0 and y[6] == 0.0
    # The clamp keeps the unselected polynomial branch finite, so gradients are too.
    xs = torch.tensor([1e4, -1e4, 300.0, 3.0], requires_grad=True)
    (g,) = torch.autograd.grad(gelu_poly(xs).sum(), xs)
    assert torch.isfinite(g).all()


def test_gelu_poly_is_alu_only():
    # Only multiply/add/clamp/compare/select: traced ops contain no transcendental.
    gm = torch.fx.symbolic_trace(_gelu_poly)  # the math behind the public argument check
    names = " ".join(str(n.target) for n in gm.graph.nodes)
    for banned in ("exp", "erf", "tanh", "sigmoid", "log", "sqrt", "div"):
        assert banned not in names, names


def _lawson_fit(limit: float, degree: int, iters: int = 2000) -> tuple[np.ndarray, float]:
    """Minimax fit of 0.5 x erf(x / sqrt 2) by sum_k c_k x^(2k) on [0, limit]."""
    x = np.linspace(0.0, limit, 4001)
    target = 0.5 * x * np.array([math.erf(t / math.sqrt(2.0)) for t in x])
    cols = np.stack([(x / limit) ** (2 * k) for k in range(1, degree + 1)], axis=1)
    w = np.full_like(x, 1.0 / x.size)
    for _ in range(iters):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(cols * sw[:, None], target * sw, rcond=None)
        resid = np.abs(cols @ c - target)
        w = w * resid
        w /= w.sum()
    return c / np.array([limit ** (2 * k) for k in range(1, degree + 1)]), resid.max()


def test_gelu_poly_coefficients_are_a_minimax_fit():
    coeffs, err = _lawson_fit(GELU_POLY_RANGE, len(GELU_POLY_COEFFS))
    np.testing.assert_allclose(coeffs, GELU_POLY_COEFFS, rtol=1e-3)
    x = torch.linspace(0.0, GELU_POLY_RANGE - 1e-9, 100_001, dtype=torch.float64)
    shipped = (gelu_poly(x) - F.gelu(x)).abs().max().item()
    assert shipped <= 1.01 * err


@pytest.mark.parametrize("bad", ["softmax", "swish", ""])
def test_unknown_or_rowwise_activation_raises(bad):
    with pytest.raises(ValueError, match="activation"):
        activation(bad, torch.zeros(1))
    with pytest.raises(ValueError, match="activation"):
        activation_derivative(bad, torch.zeros(1))
