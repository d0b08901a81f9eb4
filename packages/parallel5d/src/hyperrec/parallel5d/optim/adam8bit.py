"""AdamW with block-quantized 8-bit states whose blocks never straddle ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hyperrec.parallel5d._validate import check_float, check_int
from hyperrec.parallel5d.optim._checkpoint import ShardedStateOptimizer
from hyperrec.parallel5d.optim._local import (
    block_placements,
    check_fraction,
    element_ranges,
    local_flat,
    state_tensor,
)

__all__ = ["AdamW8bit", "dequantize_blocks", "quantize_blocks"]


def quantize_blocks(
    x: torch.Tensor, block_size: int, *, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear 8-bit block quantization of a flat fp32 tensor.

    Each block of ``block_size`` consecutive elements (the last may be shorter) gets one
    fp32 scale ``max|x| / 127`` (signed, int8 codes) or ``max(x) / 255`` (unsigned,
    uint8 codes, ``x >= 0``). Codes are round-to-nearest. Returns ``(codes, scales)``
    with ``codes.shape == x.shape`` and ``scales.shape == (ceil(n / block_size),)``.
    """
    n = x.numel()
    nb = -(-n // block_size)
    padded = torch.nn.functional.pad(x, (0, nb * block_size - n)).view(nb, block_size)
    qmax = 127.0 if signed else 255.0
    scales = padded.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-qmax if signed else 0.0, qmax)
    codes = codes.to(torch.int8 if signed else torch.uint8).view(-1)[:n]
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` (fp32, same shape as ``codes``)."""
    n = codes.numel()
    nb = scales.numel()
    padded = torch.nn.functional.pad(codes.to(torch.float32), (0, nb * block_size - n))
    return (padded.view(nb, block_size) * scales[:, None]).view(-1)[:n]


class AdamW8bit(ShardedStateOptimizer):
    """AdamW whose moments are stored in 8 bits per element, quantized per block.

    The first moment is stored as int8 with one fp32 scale per block; the second as the
    uint8-quantized square root of the moment (better relative precision for small
    values) with one scale per block. Blocks are ``block_size`` consecutive elements
    counted from each parameter's first element. Shard with
    ``fully_shard(..., granularity=block_size)`` and every rank holds whole blocks, so the
    quantization — and therefore every state and every update — is bit-identical
    whatever the mesh, for the same gradients. Parameters and gradients stay in their
    dtype; the math runs in fp32.

    State of a parameter ``p`` of ``n`` elements (``nb = ceil(n / block_size)``), each
    sharded like ``p`` (a DTensor with ``p``'s placements for a ``fully_shard``
    parameter, the rank holding a block also holding its scales; plain tensors for a
    plain ``p``):

    ============================  ===============  ==========================
    name                          global shape     dtype
    ============================  ===============  ==========================
    ``"step"``                    ``()``           int64 (CPU; same on all ranks)
    ``"exp_avg"``                 ``p.shape``      int8 codes
    ``"exp_avg_scale"``           ``(nb,)``        float32
    ``"exp_avg_sq"``              ``p.shape``      uint8 codes (of the square root)
    ``"exp_avg_sq_scale"``        ``(nb,)``        float32
    ============================  ===============  ==========================

    States are created (zero) with the optimizer; :meth:`state_dict` /
    :meth:`load_state_dict` round-trip through ``torch.distributed.checkpoint`` onto any
    world size and shard layout (see the package README).

    Args:
        params: parameters or param groups (plain or ``fully_shard`` DTensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (defaults 1e-3,
            (0.9, 0.999), 1e-8, 1e-2).
        block_size: elements per quantization block (also settable per param group;
            saved with the state and checked on load). Default 2048.

    Raises:
        ValueError: bad hyper-parameter values (``lr``/``eps`` not positive, ``betas``
            not a pair in [0, 1), negative ``weight_decay``, NaN/inf, ``block_size < 1``),
            or a parameter whose piece on some rank starts inside a block (shard with
            ``fully_shard(..., granularity=block_size)``).
        TypeError: hyper-parameters of the wrong type; a DTensor parameter sharded other
            than by ``RaggedShard``/``Replicate``.
    """

    _FIXED_GROUP_KEYS = ("block_size",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 2048,
    ) -> None:
        check_float("lr", lr, minimum=0, exclusive=True)
        if isinstance(betas, str) or not isinstance(betas, tuple | list):
            raise TypeError(f"betas must be a pair of floats, got {betas!r}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            check_fraction(f"betas[{i}]", b)
        check_float("eps", eps, minimum=0, exclusive=True)
        check_float("weight_decay", weight_decay, minimum=0)
        _check_block_size(block_size)
        self.block_size = block_size
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size
        )
        super().__init__(params, defaults)

    def _check_param(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        bs = _check_block_size(group["block_size"])
        # Every rank checks every rank's piece, so all of them raise together.
        for rank, (start, stop) in enumerate(element_ranges(p)):
            if stop > start and start % bs:
                raise ValueError(
                    f"rank {rank}'s shard of a parameter of shape {tuple(p.shape)} starts at "
                    f"element {start}, inside a {bs}-element block; shard it with "
                    f"fully_shard(..., granularity={bs})"
                )

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        bs = group["block_size"]
        blocks = (-(-p.numel() // bs),)
        on_blocks = block_placements(p, bs)
        return {
            "step": torch.zeros((), dtype=torch.int64),
            "exp_avg": state_tensor(p, torch.int8),
            "exp_avg_scale": state_tensor(p, torch.float32, shape=blocks, placements=on_blocks),
            "exp_avg_sq": state_tensor(p, torch.uint8),
            "exp_avg_sq_scale": state_tensor(p, torch.float32, shape=blocks, placements=on_blocks),
        }

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            bs = group["block_size"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p, group)
                # Counted on every rank, also those holding none of p: the counter is
                # one replicated value in a checkpoint.
                state["step"].add_(1)
                x = local_flat(p)
                if x.numel() == 0:
                    continue
                g = local_flat(p.grad).float()
                t = int(state["step"])
                m_codes, m_scales = local_flat(state["exp_avg"]), local_flat(state["exp_avg_scale"])
                r_codes = local_flat(state["exp_avg_sq"])
                r_scales = local_flat(state["exp_avg_sq_scale"])
                m = dequantize_blocks(m_codes, m_scales, bs)
                r = dequantize_blocks(r_codes, r_scales, bs)
                m.lerp_(g, 1 - beta1)
                v = r.square_().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - beta1**t
                bc2 = 1 - beta2**t
                denom = (v / bc2).sqrt_().add_(group["eps"])
                xf = x.float()
                xf.mul_(1 - group["lr"] * group["weight_decay"])
                xf.addcdiv_(m, denom, value=-group["lr"] / bc1)
                x.copy_(xf)
                # Written into the existing state tensors: they are (views of) the
                # DTensors a checkpoint holds.
                codes, scales = quantize_blocks(m, bs, signed=True)
                m_codes.copy_(codes)
                m_scales.copy_(scales)
                codes, scales = quantize_blocks(v.sqrt_(), bs, signed=False)
                r_codes.copy_(codes)
                r_scales.copy_(scales)
        return loss


def _check_block_size(block_size: Any) -> int:
    return check_int("block_size", block_size, minimum=1)
