"""Local-shard operations on ragged DTensors: elementwise maps, foreach ops, norms.

Upstream DTensor propagates sharding for ATen ops only over the placements it knows.
For a ``RaggedShard`` operand, torch 2.13 picks a strategy that first all-gathers the
operand (correct, but it communicates and returns a ``Replicate`` result) and rejects
in-place ops; torch 2.11's propagation raises. Registering ragged rules would mean
replacing upstream's private strategy tables, so this package instead provides explicit
local-shard ops that never communicate (except the one all-reduce of :func:`total_norm`)
and keep the layout:

- :func:`ragged_map`: an elementwise function over DTensors that share one layout.
- :func:`ragged_foreach`: a ``torch._foreach_*`` op over lists of DTensors (an optimizer
  step on ragged parameters, in place).
- :func:`to_local` / :func:`full_tensor`: differentiable for every placement (upstream's
  ``DTensor.to_local`` backward cannot rebuild a ragged gradient's metadata on 2.13).
- :func:`total_norm`: the norm of many DTensors with one all-reduce per mesh axis and no
  gathered tensor (gradient clipping).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from hyperrec.raggedshard._collectives import gather_stacked
from hyperrec.raggedshard._geometry import contiguous_stride
from hyperrec.raggedshard.redistribute import dtensor_from_local, redistribute

__all__ = ["full_tensor", "ragged_foreach", "ragged_map", "to_local", "total_norm"]


def _grad_placements(placements: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor) -> torch.Tensor:
        ctx.meta = (dt.device_mesh, tuple(dt.placements), dt.shape, dt.stride())
        ctx.set_materialize_grads(False)
        local = dt.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> DTensor | None:
        if grad is None:
            return None
        mesh, placements, shape, stride = ctx.meta
        return dtensor_from_local(grad, mesh, _grad_placements(placements), shape, stride)


def to_local(dtensor: DTensor) -> torch.Tensor:
    """This rank's local tensor, differentiable for every placement (incl. ``RaggedShard``).

    The gradient of the local tensor becomes a DTensor gradient with the same placements
    (``Partial`` -> ``Replicate``, as upstream). Without grad it is
    ``dtensor.to_local()``.

    Raises:
        TypeError: ``dtensor`` is not a DTensor.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"dtensor must be a DTensor, got {type(dtensor).__name__}")
    if torch.is_grad_enabled() and dtensor.requires_grad:
        return _ToLocal.apply(dtensor)
    return dtensor.to_local()


def full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The full tensor on every rank (one collective per sharded axis); differentiable.

    Same as ``dtensor.full_tensor()`` but through :func:`redistribute`, so it also works
    where upstream's own path cannot (e.g. gradients flowing through ``to_local``).

    Raises:
        TypeError: ``dtensor`` is not a DTensor.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"dtensor must be a DTensor, got {type(dtensor).__name__}")
    return to_local(redistribute(dtensor, [Replicate()] * dtensor.device_mesh.ndim))


def _layout(dt: DTensor) -> tuple[Any, ...]:
    return (dt.device_mesh, tuple(dt.placements), tuple(dt.shape))


def _tree_map(fn: Callable[[Any, str], Any], obj: Any, path: str) -> Any:
    if isinstance(obj, DTensor | torch.Tensor):
        return fn(obj, path)
    if isinstance(obj, list | tuple):
        out = [_tree_map(fn, v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _tree_map(fn, v, f"{path}[{k!r}]") for k, v in obj.items()}
    return fn(obj, path)


def _wrap(out: torch.Tensor, ref: DTensor) -> DTensor:
    return dtensor_from_local(
        out, ref.device_mesh, ref.placements, ref.shape, contiguous_stride(ref.shape)
    )


def ragged_map(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Apply an elementwise ``fn`` to the local shards of DTensors that share one layout.

    Every DTensor found in ``args``/``kwargs`` (also inside lists, tuples and dicts)
    must have the same mesh, placements and global shape; ``fn`` receives their local
    tensors (differentiable) and every other argument unchanged. Each plain tensor
    output with the local shard's shape comes back as a DTensor with that layout;
    other outputs are returned as they are (local values). No communication.

    Example::

        y = ragged_map(lambda a, b: torch.addcmul(a, a, b, value=0.5), x, w)

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: no DTensor argument, or two DTensors with different layouts.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    refs: list[DTensor] = []

    def unwrap(obj: Any, path: str) -> Any:
        if not isinstance(obj, DTensor):
            return obj
        if refs and _layout(obj) != _layout(refs[0]):
            raise ValueError(
                f"argument {path} has layout {obj.placements} {tuple(obj.shape)} but the first "
                f"DTensor has {refs[0].placements} {tuple(refs[0].shape)}; ragged_map needs one "
                "layout (redistribute first)"
            )
        refs.append(obj)
        return to_local(obj)

    local_args = _tree_map(unwrap, list(args), "args")
    local_kwargs = _tree_map(unwrap, dict(kwargs), "kwargs")
    if not refs:
        raise ValueError("ragged_map needs at least one DTensor argument")
    ref = refs[0]
    if any(p.is_partial() for p in ref.placements):
        raise ValueError(
            f"ragged_map on a DTensor with a Partial axis ({ref.placements}): its local "
            "pieces are pending sums; redistribute that axis to Replicate() first"
        )
    local_shape = ref.to_local().shape
    out = fn(*local_args, **local_kwargs)

    def wrap(obj: Any, _: str) -> Any:
        plain = isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor)
        return _wrap(obj, ref) if plain and obj.shape == local_shape else obj

    return _tree_map(wrap, out, "out")


def ragged_foreach(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a ``torch._foreach_*`` op on the local shards of lists of DTensors.

    Each list argument of DTensors is replaced by the list of their local tensors;
    element ``j`` of every such list must share the layout (mesh, placements, shape) of
    element ``j`` of the first list, so the op is elementwise per position. Other
    arguments (scalars, scalar lists) pass through. In-place ops (``_foreach_mul_``)
    update the DTensors' storage and return ``None``; out-of-place ops return a list whose
    ``j``-th tensor is a DTensor with the layout of position ``j``. No communication.

    Example::

        with torch.no_grad():
            ragged_foreach(torch._foreach_add_, params, grads, alpha=-lr)

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: no list of DTensors, lists of different lengths, or a position
            whose layouts differ.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    ref: list[DTensor] | None = None

    def convert(obj: Any, name: str) -> Any:
        nonlocal ref
        if not isinstance(obj, list | tuple) or not any(isinstance(v, DTensor) for v in obj):
            return obj
        if not all(isinstance(v, DTensor) for v in obj):
            raise ValueError(f"{name} mixes DTensors and other values")
        if ref is None:
            ref = list(obj)
        elif len(obj) != len(ref):
            raise ValueError(f"{name} has {len(obj)} tensors but the first list has {len(ref)}")
        for j, (v, r) in enumerate(zip(obj, ref)):
            if _layout(v) != _layout(r):
                raise ValueError(
                    f"{name}[{j}] has layout {v.placements} {tuple(v.shape)} but position {j} "
                    f"of the first list has {r.placements} {tuple(r.shape)}"
                )
        return [to_local(v) for v in obj]

    local_args = [convert(a, f"args[{i}]") for i, a in enumerate(args)]
    local_kwargs = {k: convert(v, f"kwargs[{k!r}]") for k, v in kwargs.items()}
    if ref is None:
        raise ValueError("ragged_foreach needs at least one list of DTensors")
    out = fn(*local_args, **local_kwargs)
    if isinstance(out, list | tuple) and len(out) == len(ref):
        return [
            _wrap(o, r) if isinstance(o, torch.Tensor) and o.shape == r.to_local().shape else o
            for o, r in zip(out, ref)
        ]
    return out


def total_norm(tensors: DTensor | Sequence[DTensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all elements of ``tensors``, without gathering any tensor.

    Each rank reduces its local shards; one all-reduce per mesh axis combines the
    per-rank partial sums (replicated copies are counted once). Use it to clip ragged
    gradients: ``clip = max_norm / (total_norm(grads) + 1e-6)``.

    Args:
        tensors: a DTensor or a sequence of DTensors on one mesh (any placements but
            ``Partial``).
        norm_type: ``p > 0`` or ``math.inf``. Default 2.

    Returns:
        A 0-dim float32 tensor (float64 if any input is float64), the same on every rank.

    Raises:
        TypeError: ``tensors`` not DTensors, ``norm_type`` not a number.
        ValueError: empty input, mixed meshes, a ``Partial`` placement, or ``norm_type``
            not ``> 0`` (NaN included).
    """
    if isinstance(tensors, DTensor):
        items = [tensors]
    elif isinstance(tensors, Sequence) and not isinstance(tensors, torch.Tensor | str):
        items = list(tensors)
    else:
        raise TypeError(f"tensors must be a DTensor or a sequence of them, got {type(tensors)}")
    if not items:
        raise ValueError("tensors must hold at least one DTensor")
    if not all(isinstance(t, DTensor) for t in items):
        raise TypeError("tensors must be DTensors")
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float):
        raise TypeError(f"norm_type must be a float, got {type(norm_type).__name__}")
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    mesh = items[0].device_mesh
    acc = torch.float64 if any(t.dtype == torch.float64 for t in items) else torch.float32
    parts = []
    for i, t in enumerate(items):
        if t.device_mesh != mesh:
            raise ValueError(f"tensors[{i}] lives on another mesh")
        if any(pl.is_partial() for pl in t.placements):
            raise ValueError(f"tensors[{i}] has a Partial placement; reduce it first")
        local = t.to_local().detach().to(acc)
        if math.isinf(p):
            parts.append(local.abs().max() if local.numel() else local.new_zeros(()))
        else:
            copies = math.prod(
                mesh.size(a) for a, pl in enumerate(t.placements) if isinstance(pl, Replicate)
            )
            parts.append(local.abs().pow(p).sum() / copies)
    stacked = torch.stack(parts)
    for axis in range(mesh.ndim):
        group = mesh.get_group(axis)
        if math.isinf(p):
            # Not an all-reduce MAX, which drops a NaN gradient (see gather_stacked).
            stacked = torch.amax(gather_stacked(stacked, group, mesh.size(axis)), 0)
        else:
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    if math.isinf(p):
        return stacked.max()
    return stacked.sum().pow(1.0 / p)
