"""Group operations over several DBuffers: one kernel per buffer, one collective in all."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from hyperrec.dbuffer._validate import check_float
from hyperrec.dbuffer.buffer import DBuffer

__all__ = ["clip_grad_norm_", "flat_params", "grad_norm", "zero_grad_"]


def _check(buffers: Iterable[DBuffer]) -> list[DBuffer]:
    # A lone DBuffer (or a str) is a common slip for [buffer]: refuse it by name.
    if isinstance(buffers, DBuffer | str | bytes) or not isinstance(buffers, Iterable):
        raise TypeError(f"buffers must be an iterable of DBuffers, got {type(buffers).__name__}")
    buffers = list(buffers)
    if not all(isinstance(b, DBuffer) for b in buffers):
        raise TypeError("buffers must be DBuffer instances")
    groups = {id(b._shard_group) for b in buffers}
    if len(groups) > 1:
        raise ValueError("buffers must share one mesh (their shard axes differ)")
    return buffers


@torch.no_grad()
def grad_norm(buffers: Iterable[DBuffer]) -> torch.Tensor:
    """Global 2-norm (fp32 scalar) of the reduced gradients of ``buffers``.

    One norm kernel per buffer on its flat ``grad_shard`` and ONE ``all_reduce`` over
    the shard axis (replicas of an HSDP mesh hold equal gradients and are not summed).

    Raises:
        TypeError: ``buffers`` is not an iterable of DBuffers.
        ValueError: the buffers live on different meshes.
    """
    buffers = _check(buffers)
    if not buffers:
        return torch.zeros(())
    for b in buffers:
        b.wait_reduce()
    sq = torch.stack([b.grad_norm_sq() for b in buffers]).sum()
    if buffers[0].world_size > 1:
        # Offloaded (host) gradients: the collective runs on the buffers' device.
        home = sq.device
        sq = sq.to(buffers[0].device)
        dist.all_reduce(sq, group=buffers[0]._shard_group)
        sq = sq.to(home)
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(
    buffers: Iterable[DBuffer], max_norm: float, *, eps: float = 1e-6
) -> torch.Tensor:
    """Scale all gradients so their global 2-norm is at most ``max_norm``; return the norm.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (coefficient
    ``max_norm / (norm + eps)`` clamped to 1), applied as one multiply per buffer.

    Raises:
        TypeError: ``max_norm`` or ``eps`` not a real number; ``buffers`` not an iterable
            of DBuffers.
        ValueError: ``max_norm`` is not positive and finite, ``eps`` negative or not
            finite, or the buffers live on different meshes.
    """
    check_float("max_norm", max_norm, minimum=0, exclusive=True)
    check_float("eps", eps, minimum=0)
    buffers = _check(buffers)
    norm = grad_norm(buffers)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for b in buffers:
        b.scale_grad_(coef.to(b.grad_shard.device))
    return norm


@torch.no_grad()
def zero_grad_(buffers: Iterable[DBuffer]) -> None:
    """Zero every buffer's flat gradient (one memset each).

    Raises:
        TypeError: ``buffers`` is not an iterable of DBuffers.
        ValueError: the buffers live on different meshes.
    """
    for b in _check(buffers):
        b.zero_grad_()


def flat_params(buffers: Iterable[DBuffer]) -> list[torch.Tensor]:
    """The flat shard storages of the trainable buffers, each with ``.grad`` set to its
    flat gradient.

    Hand them to any ``torch.optim`` optimizer (e.g. ``AdamW(..., fused=True)``) to update
    every tensor of a buffer with one kernel per step; the per-tensor views see the update
    because they alias the storage. Padding has zero value and zero gradient, so it stays
    zero under the usual optimizers (weight decay included). Buffers built with
    ``trainable=False`` are left out: frozen tensors given a zero gradient would still
    be moved by weight decay and momentum.

    Raises:
        TypeError: ``buffers`` is not an iterable of DBuffers.
        ValueError: the buffers live on different meshes.
    """
    out = []
    for b in _check(buffers):
        if not b.trainable:
            continue
        b.wait_reduce()
        b.shard.grad = b.grad_shard
        out.append(b.shard)
    return out
