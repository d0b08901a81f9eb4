"""AdamW with block-quantized 8-bit states whose blocks never straddle ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hyperrec.parallel5d.optim._local import local_flat, local_range

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


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are stored in 8 bits per element, quantized per block.

    The first moment is stored as int8 with one fp32 scale per block; the second as the
    uint8-quantized square root of the moment (better relative precision for small
    values) with one scale per block. Blocks are ``block_size`` consecutive elements
    counted from each parameter's first element. Shard with
    ``fully_shard(..., granularity=block_size)`` and every rank holds whole blocks, so the
    quantization — and therefore every state and every update — is bit-identical
    whatever the mesh, for the same gradients. Parameters and gradients stay in their
    dtype; the math runs in fp32.

    Args:
        params: parameters or param groups (plain or ``fully_shard`` DTensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (defaults 1e-3,
            (0.9, 0.999), 1e-8, 1e-2).
        block_size: elements per quantization block. Default 2048.

    Raises:
        ValueError: bad hyper-parameters, or a shard that starts inside a block.
    """

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
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.block_size = block_size
        for group in self.param_groups:
            for p in group["params"]:
                start, stop = local_range(p)
                if start % block_size and stop > start:
                    raise ValueError(
                        f"a shard of a parameter of shape {tuple(p.shape)} starts at element "
                        f"{start}, inside a {block_size}-element block; shard it with "
                        f"fully_shard(..., granularity={block_size})"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bs = self.block_size
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                x = local_flat(p)
                if x.numel() == 0:
                    continue
                g = local_flat(p.grad).float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    nb = -(-x.numel() // bs)
                    state["exp_avg"] = torch.zeros(x.numel(), dtype=torch.int8, device=x.device)
                    state["exp_avg_scale"] = torch.zeros(nb, device=x.device)
                    state["exp_avg_sq"] = torch.zeros(x.numel(), dtype=torch.uint8, device=x.device)
                    state["exp_avg_sq_scale"] = torch.zeros(nb, device=x.device)
                state["step"] += 1
                t = state["step"]
                m = dequantize_blocks(state["exp_avg"], state["exp_avg_scale"], bs)
                r = dequantize_blocks(state["exp_avg_sq"], state["exp_avg_sq_scale"], bs)
                m.lerp_(g, 1 - beta1)
                v = r.square_().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - beta1**t
                bc2 = 1 - beta2**t
                denom = (v / bc2).sqrt_().add_(group["eps"])
                xf = x.float()
                xf.mul_(1 - group["lr"] * group["weight_decay"])
                xf.addcdiv_(m, denom, value=-group["lr"] / bc1)
                x.copy_(xf)
                state["exp_avg"], state["exp_avg_scale"] = quantize_blocks(m, bs, signed=True)
                state["exp_avg_sq"], state["exp_avg_sq_scale"] = quantize_blocks(
                    v.sqrt_(), bs, signed=False
                )
        return loss
