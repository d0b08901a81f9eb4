"""An MXFP8 MLP: ``fc2(act(fc1(x)))`` with the activation fused into fc2's input cast."""

from __future__ import annotations

import torch
from torch import nn

from hyperrec.mxfp8.linear import MXLinear
from hyperrec.mxfp8.policy import PrecisionPolicy
from hyperrec.mxfp8.reference import ACTIVATIONS, Activation

__all__ = ["MXMLP"]


class MXMLP(nn.Module):
    """Two :class:`MXLinear` layers, ``dim -> hidden_dim -> dim``.

    The hidden activation is never written in high precision: fc1 writes its BF16 output
    (the pre-activation, also what the activation's backward needs), and fc2's fused
    cast reads it once and writes ``act(h)``'s row-wise copy (for its forward GEMM) and
    column-wise copy (kept for its wgrad) in FP8.

    Args:
        dim: input and output features.
        hidden_dim: hidden features.
        activation: ``"gelu_tanh"`` (default), ``"relu"``, ``"relu2"``, ``"silu"``.
        bias: whether both layers have a bias.
        policy: :class:`PrecisionPolicy` for both layers (default ``PrecisionPolicy()``).
        device, dtype: parameter placement and dtype.

    Raises:
        TypeError: ``dim``/``hidden_dim`` not ints; ``policy`` not a
            :class:`PrecisionPolicy`; in ``forward``, an input that is not a tensor.
        ValueError: non-positive sizes or an unknown activation; in ``forward``, an input
            whose last dim is not ``dim`` (reported as fc1's ``in_features``).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        activation: Activation = "gelu_tanh",
        bias: bool = True,
        policy: PrecisionPolicy | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("dim", dim), ("hidden_dim", hidden_dim)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if activation not in ACTIVATIONS or activation == "none":
            raise ValueError(f"activation must be one of {ACTIVATIONS[1:]}, got {activation!r}")
        self.fc1 = MXLinear(dim, hidden_dim, bias=bias, policy=policy, device=device, dtype=dtype)
        self.fc2 = MXLinear(
            hidden_dim,
            dim,
            bias=bias,
            input_activation=activation,
            policy=policy,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim) -> (..., dim)``."""
        return self.fc2(self.fc1(x))
