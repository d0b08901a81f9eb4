"""Muon on sharded parameters: each matrix is orthogonalised where it lives, whole."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hyperrec.parallel5d._validate import check_bool, check_float, check_int
from hyperrec.parallel5d.optim._checkpoint import ShardedStateOptimizer
from hyperrec.parallel5d.optim._local import (
    check_fraction,
    element_ranges,
    local_flat,
    local_range,
    state_tensor,
)

__all__ = ["Muon", "newton_schulz"]

# Quintic iteration coefficients of Muon (Jordan et al., 2024): they push all singular
# values into roughly [0.7, 1.2] in five steps, which is all the update needs.
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, *, eps: float = 1e-7) -> torch.Tensor:
    """Approximate ``U V^T`` of ``g = U S V^T`` (2-D) by the quintic Newton-Schulz iteration.

    Computed in ``g``'s dtype; the input is not modified. Returns a new tensor of
    ``g``'s shape.

    Raises:
        ValueError: ``g`` is not 2-D.
    """
    if g.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = _NS_COEFFS
    x = g / (torch.linalg.matrix_norm(g) + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    for _ in range(steps):
        m = x @ x.mT
        x = a * x + (b * m + c * m @ m) @ x
    return x.mT if tall else x


class Muon(ShardedStateOptimizer):
    """Muon (momentum + orthogonalised update) for matrix parameters, shard-aware.

    Works on plain tensors and on ``fully_shard`` parameters sharded with
    ``granularity="matrix"``: each matrix then lies whole on exactly one rank, which
    runs Newton-Schulz on it locally — no gather, no communication, and the same
    arithmetic as single-process Muon, so states and results do not depend on the mesh.
    Ranks holding no piece of a matrix skip it. Use another optimizer (e.g. AdamW) for
    1-D parameters (biases, norms) and embeddings, as usual with Muon.

    Update per matrix ``W`` (rows x cols) with gradient ``G``::

        B <- momentum * B + G
        U <- G + momentum * B  (nesterov) or B
        W <- W * (1 - lr * weight_decay) - lr * max(1, rows / cols) ** 0.5 * NS(U)

    State of a parameter ``p``: ``"momentum_buffer"``, ``p``'s global shape and dtype,
    sharded like ``p`` (for a ``fully_shard`` parameter a DTensor with ``p``'s
    placements: whole on the rank that owns the matrix, empty elsewhere). It is created
    (zero) with the optimizer; :meth:`state_dict` / :meth:`load_state_dict` round-trip
    through ``torch.distributed.checkpoint`` onto any world size, where another rank may
    own the matrix (see the package README).

    Args:
        params: parameters or param groups; every parameter must have >= 2 dims
            (the dims after the first are flattened into columns: a ``(out, in, kh,
            kw)`` weight is orthogonalised as ``(out, in * kh * kw)``).
        lr: learning rate. Default 0.02.
        momentum: momentum coefficient in [0, 1). Default 0.95.
        nesterov: Nesterov momentum. Default ``True``.
        ns_steps: Newton-Schulz iterations. Default 5.
        weight_decay: decoupled weight decay. Default 0.
        ns_dtype: dtype Newton-Schulz runs in (``torch.bfloat16`` is faster on GPUs).
            Default ``torch.float32``.

    Raises:
        ValueError: bad hyper-parameter values (``lr <= 0``, ``momentum`` outside
            [0, 1), negative ``weight_decay``, NaN/inf, ``ns_steps < 1``), a parameter
            with fewer than 2 dims, or a matrix split across ranks (shard with
            ``granularity="matrix"``).
        TypeError: hyper-parameters of the wrong type (``ns_dtype`` must be a floating
            dtype, ``nesterov`` a bool); a DTensor parameter sharded other than by
            ``RaggedShard``/``Replicate``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_float("lr", lr, minimum=0, exclusive=True)
        check_fraction("momentum", momentum)
        check_float("weight_decay", weight_decay, minimum=0)
        check_bool("nesterov", nesterov)
        check_int("ns_steps", ns_steps, minimum=1)
        if not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise TypeError(f"ns_dtype must be a floating torch.dtype, got {ns_dtype!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)

    def _check_param(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.dim() < 2:
            raise ValueError(
                f"Muon updates matrices; got a parameter of shape {tuple(p.shape)} "
                "(give 1-D parameters to AdamW)"
            )
        # Every rank checks every rank's piece, so all of them raise together.
        for rank, (start, stop) in enumerate(element_ranges(p)):
            if stop - start not in (0, p.numel()):
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is split across ranks "
                    f"(rank {rank} holds elements [{start}, {stop})); shard it with "
                    "fully_shard(..., granularity='matrix')"
                )

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": state_tensor(p, p.dtype)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                start, stop = local_range(p)
                if stop == start:
                    continue  # another rank owns this matrix
                rows = p.shape[0]
                w = local_flat(p).view(rows, -1)
                g = local_flat(p.grad).view(rows, -1)
                buf = local_flat(self._state_of(p, group)["momentum_buffer"]).view(rows, -1)
                buf.mul_(group["momentum"]).add_(g)
                u = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                o = newton_schulz(u.to(group["ns_dtype"]), group["ns_steps"]).to(w.dtype)
                scale = max(1.0, w.shape[0] / w.shape[1]) ** 0.5
                if group["weight_decay"]:
                    w.mul_(1 - group["lr"] * group["weight_decay"])
                w.add_(o, alpha=-group["lr"] * scale)
        return loss
