"""Reductions of ``RaggedShard`` DTensors: sum, mean, p-norms, amax/amin, max/min, any/all.

Upstream DTensor (torch 2.11-2.14) has no reduction rule for a custom placement: ``x.sum()``
on a ragged DTensor fails in sharding propagation ("Expected Shard/_StridedShard"). These
handlers compute every such reduction with the result of the same op on the full tensor
and without gathering it:

- reducing only dims that no rank boundary crosses (dims ``>= len(RaggedShard.dims)``,
  e.g. per-row norms of a row-sharded matrix) is a local op; the result keeps the
  operand's ``RaggedShard`` placement (same units) and nothing is communicated;
- any other reduction (whole tensor, or over a sharded row dim) reduces the local rows
  into this rank's contribution to the (small) output, combines the contributions over
  the ragged mesh axis with ONE collective (``all_reduce`` of sums; ``all_gather`` of the
  contributions for max/min/any/all, so NaN propagates exactly as in torch) and returns a
  ``Replicate`` DTensor. Memory is O(local shard + output), never the full tensor.

Covered ATen ops: ``sum`` (``.default``, ``.dim_IntList``), ``mean`` (``.default``,
``.dim``), ``linalg_vector_norm`` (any ``ord``, with or without ``dim``; what
``Tensor.norm``/``torch.norm`` dispatch to), ``_foreach_norm`` (one collective per mesh
axis for the whole list: ``clip_grad_norm_``), ``amax``/``amin``, ``max``/``min`` without a
dim, ``any``/``all``. Operands: a ``RaggedShard`` on one mesh axis and ``Replicate`` on the
others (FSDP, HSDP). Gradients do not flow through these handlers (see
:func:`install`). Everything else goes to upstream's normal path unchanged.

They are installed when :mod:`hyperrec.raggedshard` is imported. Unlike the shard-local
pointwise ops of :func:`~hyperrec.raggedshard.enable_local_ops` (which change what upstream
computes for a ragged operand: a local result instead of a gathered one), these only
turn an upstream error into the full-tensor answer, and never apply to a DTensor without
a ``RaggedShard`` placement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from hyperrec.raggedshard._collectives import gather_stacked
from hyperrec.raggedshard.placement import RaggedShard
from hyperrec.raggedshard.redistribute import wrap_local

__all__ = ["install", "installed"]

_aten = torch.ops.aten
_INSTALLED = False


@dataclass(frozen=True)
class _Spec:
    """One reduction: what to combine, over which dims, into which dtype."""

    kind: str  # "sum" | "mean" | "norm" | "amax" | "amin" | "any" | "all"
    dims: tuple[int, ...]  # normalised, sorted; every dim for a whole-tensor reduction
    keepdim: bool
    dtype: torch.dtype | None  # the op's dtype= argument
    ord: float = 2.0


def _bind(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _dims(dim: Any, ndim: int, *, empty_means_all: bool) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    dim = list(dim)
    if not dim and empty_means_all:
        return tuple(range(ndim))
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _parse(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, _Spec] | None:
    """The operand and the reduction of one supported op call (``None``: not ours)."""
    a = _bind(op, args, kwargs)
    x = a.get("self")
    if not isinstance(x, DTensor):
        return None
    nd = x.dim()
    name = op._schema.name.split("::")[-1]
    keepdim = bool(a.get("keepdim") or False)
    dtype = a.get("dtype")
    if name in ("sum", "mean"):
        return x, _Spec(name, _dims(a.get("dim"), nd, empty_means_all=True), keepdim, dtype)
    if name == "linalg_vector_norm":
        dims = _dims(a.get("dim"), nd, empty_means_all=True)
        return x, _Spec("norm", dims, keepdim, dtype, float(a.get("ord", 2)))
    if name in ("amax", "amin"):
        return x, _Spec(name, _dims(a.get("dim"), nd, empty_means_all=True), keepdim, None)
    if name in ("max", "min"):  # .default only: no dim, no indices
        return x, _Spec("a" + name, tuple(range(nd)), False, None)
    if name in ("any", "all"):
        return x, _Spec(name, _dims(a.get("dim"), nd, empty_means_all=False), keepdim, None)
    return None


def _ragged_axis(x: DTensor) -> tuple[int, RaggedShard] | None:
    found = [(i, p) for i, p in enumerate(x.placements) if isinstance(p, RaggedShard)]
    if len(found) != 1:
        return None
    return found[0]


def _check_operand(x: DTensor, what: str) -> tuple[int, RaggedShard]:
    axis, placement = _ragged_axis(x)  # type: ignore[misc]
    others = [p for i, p in enumerate(x.placements) if i != axis]
    if not all(isinstance(p, Replicate) for p in others):
        raise NotImplementedError(
            f"{what} of a RaggedShard DTensor needs Replicate on every other mesh axis, got "
            f"placements {tuple(x.placements)}; redistribute first"
        )
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"{what} of a RaggedShard DTensor that requires grad is not differentiable here "
            "(the handlers run below autograd); use torch.no_grad() for logging/clipping, or "
            "hyperrec.raggedshard.full_tensor(x) to differentiate through the full tensor"
        )
    return axis, placement


def _comm_device(x: DTensor) -> torch.device:
    # Parameters offloaded to the host keep a CUDA mesh: collectives run on its device.
    dev = x.device_mesh.device_type
    if dev == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dev)


def _replicated(value: torch.Tensor, x: DTensor) -> DTensor:
    mesh = x.device_mesh
    return wrap_local(value, mesh, (Replicate(),) * mesh.ndim, shape=value.shape)


def _same_layout(
    value: torch.Tensor, shape: Sequence[int], x: DTensor, placements: Any = None
) -> DTensor:
    return wrap_local(
        value, x.device_mesh, x.placements if placements is None else placements, shape=shape
    )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 norms accumulate in fp32 like torch's kernels.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _local_reduce(
    t: torch.Tensor, spec: _Spec, dims: Sequence[int], keepdim: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """``spec``'s reduction of plain tensor ``t`` over ``dims`` (the op's own semantics)."""
    dims = list(dims)
    if spec.kind == "sum":
        return torch.sum(t, dims, keepdim=keepdim, dtype=spec.dtype)
    if spec.kind == "mean":
        return torch.mean(t, dims, keepdim=keepdim, dtype=spec.dtype)
    if spec.kind == "norm":
        return torch.linalg.vector_norm(t, spec.ord, dims, keepdim, dtype=spec.dtype)
    if spec.kind in ("amax", "amin"):
        return getattr(torch, spec.kind)(t, dims, keepdim=keepdim)
    fn = torch.any if spec.kind == "any" else torch.all
    out = t
    for d in sorted(dims, reverse=True):
        out = fn(out, d, keepdim=keepdim)
    return out


def _partial(t: torch.Tensor, spec: _Spec, dims: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """Partial reduction of ``t`` over ``dims`` (keepdim) in the combinable form: sums (of
    ``|x|^p`` for norms), maxima, minima, or boolean any/all."""
    if spec.kind in ("sum", "mean"):
        # Low-precision sums accumulate in fp32 and round once at the end, as torch does.
        acc = _compute_dtype(out_dtype if spec.kind == "mean" else (spec.dtype or out_dtype))
        return torch.sum(t, dims, keepdim=True, dtype=acc) if dims else t.to(acc)
    if spec.kind == "norm":
        a = t.abs().to(_compute_dtype(out_dtype))
        p = spec.ord
        if math.isinf(p):
            if not dims:
                return a
            return torch.amax(a, dims, keepdim=True) if p > 0 else torch.amin(a, dims, keepdim=True)
        a = (a != 0).to(a.dtype) if p == 0 else a.pow(p)
        return torch.sum(a, dims, keepdim=True) if dims else a
    if spec.kind in ("amax", "amin"):
        return getattr(torch, spec.kind)(t, dims, keepdim=True) if dims else t
    out = t if t.dtype == torch.bool else t != 0
    fn = torch.any if spec.kind == "any" else torch.all
    for d in sorted(dims, reverse=True):
        out = fn(out, d, keepdim=True)
    return out


def _combine(kind: str, ord: float) -> str:
    if kind in ("sum", "mean") or (kind == "norm" and not math.isinf(ord)):
        return "sum"
    if kind == "amax" or (kind == "norm" and ord > 0):
        return "max"
    if kind == "norm" or kind == "amin":
        return "min"
    return kind  # any / all


def _identity(how: str, dtype: torch.dtype) -> Any:
    if how == "sum":
        return 0
    if how == "any":
        return False
    if how == "all":
        return True
    if dtype == torch.bool:
        return how == "min"
    if dtype.is_floating_point:
        return -math.inf if how == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if how == "max" else info.max


def _combine_over_axis(
    parts: list[torch.Tensor], how: str, x: DTensor, axis: int
) -> list[torch.Tensor]:
    """Combine each rank's contributions over mesh axis ``axis``: ONE collective for all."""
    mesh = x.device_mesh
    group = mesh.get_group(axis)
    if mesh.size(axis) == 1:
        return parts
    home = parts[0].device
    dev = _comm_device(x)
    shapes = [p.shape for p in parts]
    dtype = parts[0].dtype
    wire = torch.uint8 if dtype == torch.bool else dtype
    flat = torch.cat([p.reshape(-1).to(wire) for p in parts]).to(dev)
    if how == "sum":
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        combined = flat
    else:
        # Gather rather than all-reduce MAX/MIN (see gather_stacked: NaN propagates).
        everyone = gather_stacked(flat, group, mesh.size(axis))
        if dtype == torch.bool:
            everyone = everyone.bool()
        fns: dict[str, Callable[..., torch.Tensor]] = {
            "max": torch.amax,
            "min": torch.amin,
            "any": torch.any,
            "all": torch.all,
        }
        combined = fns[how](everyone, 0)
    combined = combined.to(home).to(dtype)
    out, start = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(combined[start : start + n].view(s))
        start += n
    return out


def _finish(
    c: torch.Tensor, spec: _Spec, shape: Sequence[int], out_dtype: torch.dtype
) -> torch.Tensor:
    if spec.kind == "mean":
        n = math.prod(shape[d] for d in spec.dims)
        c = c / n
    elif spec.kind == "norm" and not math.isinf(spec.ord) and spec.ord != 0:
        c = c.pow(1.0 / spec.ord)
    kept = [1 if d in spec.dims else s for d, s in enumerate(shape)]
    c = c.reshape(kept)
    if not spec.keepdim:
        c = c.reshape([s for d, s in enumerate(shape) if d not in spec.dims])
    return c.to(out_dtype).contiguous()


def _contribution(
    x: DTensor, placement: RaggedShard, axis: int, spec: _Spec, out_dtype: torch.dtype
) -> torch.Tensor:
    """This rank's contribution to the output, shape ``(prod(kept leading dims),
    *trailing dims with reduced ones kept as 1)``; identity where it holds nothing."""
    shape = tuple(x.shape)
    k = len(placement.dims)
    local = x._local_tensor
    # Local dim j + 1 is global dim k + j; local dim 0 is the (flattened) row dim.
    trailing = [d - k + 1 for d in spec.dims if d >= k]
    part = _partial(local, spec, trailing, out_dtype)  # (rows_i, *trail_keepdim)
    lead_kept = [d for d in range(k) if d not in spec.dims]
    n_out = math.prod(shape[d] for d in lead_kept)
    how = _combine(spec.kind, spec.ord)
    contrib = torch.full(
        (n_out, *part.shape[1:]), _identity(how, part.dtype), dtype=part.dtype, device=part.device
    )
    rank = x.device_mesh.get_local_rank(axis)
    r0, r1 = placement.row_bounds(shape)[rank]
    if r1 > r0:
        rows = torch.arange(r0, r1, device=part.device)
        target = torch.zeros_like(rows)
        stride = 1
        for d in range(k - 1, -1, -1):
            coord = rows % shape[d]
            rows = rows // shape[d]
            if d in lead_kept:
                target += coord * stride
                stride *= shape[d]
        reduce = {"sum": "sum", "max": "amax", "min": "amin", "any": "amax", "all": "amin"}[how]
        values = part if part.dtype != torch.bool else part.to(torch.uint8)
        base = contrib if contrib.dtype != torch.bool else contrib.to(torch.uint8)
        index = target.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
        base = base.scatter_reduce(0, index, values, reduce=reduce, include_self=True)
        contrib = base.bool() if contrib.dtype == torch.bool else base
    return contrib


def _reduce(x: DTensor, spec: _Spec, what: str, meta_out: torch.Tensor) -> DTensor:
    axis, placement = _check_operand(x, what)
    shape = tuple(x.shape)
    k = len(placement.dims)
    out_dtype = meta_out.dtype
    if math.prod(shape) == 0:
        empty = torch.empty(shape, dtype=x.dtype, device=x._local_tensor.device)
        return _replicated(_local_reduce(empty, spec, spec.dims, spec.keepdim, out_dtype), x)
    if spec.dims and all(d >= k for d in spec.dims) and len(spec.dims) < len(shape):
        local = _local_reduce(
            x._local_tensor, spec, [d - k + 1 for d in spec.dims], spec.keepdim, out_dtype
        )
        out_shape = tuple(meta_out.shape)
        if x.device_mesh.size(axis) == 1 and k == 0:
            # A one-rank axis must hold the global shape locally (upstream skips the
            # placement there): (1, *out) -> out with dims=(0,).
            placements = list(x.placements)
            placements[axis] = RaggedShard.from_numels(out_shape, [math.prod(out_shape)])
            return _same_layout(local.reshape(out_shape), out_shape, x, placements)
        return _same_layout(local, out_shape, x)
    contrib = _contribution(x, placement, axis, spec, out_dtype)
    (combined,) = _combine_over_axis([contrib], _combine(spec.kind, spec.ord), x, axis)
    return _replicated(_finish(combined, spec, shape, out_dtype), x)


def _meta(x: DTensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def _upstream(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


def _reduction_handler(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> object:
    parsed = _parse(op, args, kwargs)
    if parsed is None or _ragged_axis(parsed[0]) is None:
        return _upstream(op, args, kwargs)
    x, spec = parsed
    what = op._schema.name.split("::")[-1]
    _check_operand(x, what)

    def call_on(t: torch.Tensor) -> torch.Tensor:
        return op(
            *(t if a is x else a for a in args),
            **{k: t if v is x else v for k, v in kwargs.items()},
        )

    if x.numel() == 0:
        # Nothing to combine: torch's own answer (or error) on an empty tensor.
        return _replicated(
            call_on(torch.empty(x.shape, dtype=x.dtype, device=x._local_tensor.device)), x
        )
    # The op on a meta tensor of the global shape validates the arguments with torch's
    # own errors and gives the output's shape and dtype.
    return _reduce(x, spec, what, call_on(_meta(x)))


def _foreach_norm_handler(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> object:
    a = _bind(op, args, kwargs)
    tensors = list(a["self"])
    if not tensors or not all(isinstance(t, DTensor) and _ragged_axis(t) for t in tensors):
        return _upstream(op, args, kwargs)
    ord = float(a.get("ord", 2))
    dtype = a.get("dtype")
    outs: list[DTensor | None] = [None] * len(tensors)
    groups: dict[tuple[int, int, torch.dtype], list[int]] = {}
    contribs: list[torch.Tensor] = []
    specs: list[_Spec] = []
    for i, t in enumerate(tensors):
        axis, placement = _check_operand(t, "_foreach_norm")
        spec = _Spec("norm", tuple(range(t.dim())), False, dtype, ord)
        out_dtype = torch.linalg.vector_norm(_meta(t), ord, dtype=dtype).dtype
        specs.append(spec)
        if t.numel() == 0:
            contribs.append(torch.zeros((), dtype=out_dtype))
            outs[i] = _reduce(t, spec, "_foreach_norm", torch.empty((), dtype=out_dtype))
            continue
        c = _contribution(t, placement, axis, spec, out_dtype).reshape(())
        contribs.append(c)
        groups.setdefault((id(t.device_mesh), axis, c.dtype), []).append(i)
    how = _combine("norm", ord)
    for (_, axis, _), idx in groups.items():
        combined = _combine_over_axis([contribs[i] for i in idx], how, tensors[idx[0]], axis)
        for i, c in zip(idx, combined):
            t = tensors[i]
            out_dtype = torch.linalg.vector_norm(_meta(t), ord, dtype=dtype).dtype
            outs[i] = _replicated(_finish(c, specs[i], tuple(t.shape), out_dtype), t)
    return outs


def _ops() -> dict[torch._ops.OpOverload, Callable[..., object]]:
    names = [
        ("sum", "default"),
        ("sum", "dim_IntList"),
        ("mean", "default"),
        ("mean", "dim"),
        ("linalg_vector_norm", "default"),
        ("amax", "default"),
        ("amin", "default"),
        ("max", "default"),
        ("min", "default"),
        ("any", "default"),
        ("any", "dim"),
        ("any", "dims"),
        ("all", "default"),
        ("all", "dim"),
        ("all", "dims"),
    ]
    out: dict[torch._ops.OpOverload, Callable[..., object]] = {}
    for packet, overload in names:
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None:  # e.g. any.dims is newer than some releases
            out[op] = _reduction_handler
    out[_aten._foreach_norm.Scalar] = _foreach_norm_handler
    return out


def install() -> None:
    """Register the reduction handlers in DTensor's op table (idempotent).

    Called when :mod:`hyperrec.raggedshard` is imported. A handler another library put
    there first for the same op is kept. Reductions of ragged DTensors that require grad
    with grad mode on raise ``RuntimeError`` (use ``torch.no_grad()``, as gradient clipping
    and logging do).
    """
    global _INSTALLED
    if _INSTALLED:
        return
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _ops().items():
        handlers.setdefault(op, handler)
    _INSTALLED = True


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _INSTALLED
