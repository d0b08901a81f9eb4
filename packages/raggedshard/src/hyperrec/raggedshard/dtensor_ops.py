"""Opt-in: stock ATen pointwise, foreach and fused-optimizer ops on ragged DTensors.

Upstream DTensor (torch 2.11-2.14) has no sharding rule for a custom placement: torch 2.13
all-gathers a ``RaggedShard`` operand of a pointwise op (and returns a ``Replicate``
result) and rejects in-place ops, torch 2.11 raises. Elementwise math needs no
communication when every operand shares one layout, so :func:`enable_local_ops` routes
those ops to the local shards and keeps the operands' placement. That is what lets a stock
``torch.optim`` optimizer (foreach or fused) step parameters exposed as ragged DTensors.
Whole-tensor p-norms (``torch.linalg.vector_norm`` without ``dim``, ``_foreach_norm``;
not under autograd) are shard-local norms combined by one all-reduce per mesh axis and
returned replicated, which is what ``torch.nn.utils.clip_grad_norm_`` needs; a 0-dim
DTensor operand of any layout (e.g. its clip coefficient) takes part as a scalar.

It installs handlers in DTensor's custom-op-handler table, a private upstream hook, so it
is opt-in and global to the process; ops with no ragged operand, or whose operands do not
share one layout, fall through to upstream's normal path unchanged. The explicit
:func:`~hyperrec.raggedshard.ragged_map` / :func:`~hyperrec.raggedshard.ragged_foreach`
need no hook.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hyperrec.raggedshard.placement import RaggedShard

__all__ = ["enable_local_ops"]

_INSTALLED = False
_EXTRA_OPS = (
    "zeros_like.default",
    "ones_like.default",
    "empty_like.default",
    "full_like.default",
    "clone.default",
    "_to_copy.default",  # .to(dtype/device): elementwise, keeps the layout (no gather)
    "copy_.default",
    "detach.default",
    "_fused_adam_.default",
    "_fused_adam_.tensor_lr",
    "_fused_adamw_.default",
    "_fused_adamw_.tensor_lr",
    "_fused_sgd_.default",
    "_fused_sgd_.tensor_lr",
)


def _local_op_set() -> set:
    from torch.distributed.tensor._ops import _pointwise_ops

    ops = set()
    # Upstream keeps these ops in lists, sets and dicts, and moves them between releases:
    # torch 2.11 holds mul_/add_/copy_ only in the dict `linear_pointwise_ops` (op ->
    # linearity), torch 2.13 in lists. Collect from every container kind.
    for value in vars(_pointwise_ops).values():
        if isinstance(value, list | tuple | set | frozenset | dict):
            ops.update(v for v in value if isinstance(v, torch._ops.OpOverload))
    for name in _EXTRA_OPS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            ops.add(op)
    return ops


def _is_ragged(t: DTensor) -> bool:
    return any(isinstance(p, RaggedShard) for p in t.placements)


def _wrap(local: torch.Tensor, ref: DTensor) -> DTensor:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(
        ref.device_mesh,
        ref.placements,
        tensor_meta=TensorMeta(ref.shape, ref.stride(), local.dtype),
    )
    return DTensor(local, spec, requires_grad=local.requires_grad)


def _is_scalar_operand(x: DTensor) -> bool:
    # A 0-dim DTensor that is not itself ragged (a clip coefficient, a learning rate...):
    # it takes part as a plain scalar, reduced/broadcast first.
    return x.dim() == 0 and not _is_ragged(x)


def _upstream(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


def _to_local(x: object) -> object:
    if not isinstance(x, DTensor):
        return x
    return x.full_tensor() if _is_scalar_operand(x) else x._local_tensor


def _flat(values: object) -> bool:
    return not any(isinstance(v, list | tuple | dict) for v in values)


def _local_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    # Pointwise ops of a single-tensor optimizer step arrive here by the dozen per
    # parameter: flat argument lists skip pytree (most of the per-op host cost).
    if _flat(args) and _flat(kwargs.values()):
        return _local_flat(op, args, kwargs)
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

    leaves, _ = tree_flatten((args, kwargs))
    dts = [x for x in leaves if isinstance(x, DTensor) and not _is_scalar_operand(x)]
    plain = [x for x in leaves if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)]
    foreach = op.name().startswith(("aten::_foreach_", "aten::_fused_"))
    same_layout = all(d.placements == dts[0].placements and d.shape == dts[0].shape for d in dts)
    local_ok = any(_is_ragged(d) for d in dts) and (foreach or same_layout)
    if not local_ok:
        return _upstream(op, args, kwargs)
    call = (args, kwargs)
    if not foreach and any(p.dim() != 0 for p in plain):
        # Plain operands count as replicated only under implicit_replication().
        from hyperrec.raggedshard._implicit import localize

        flat, spec = tree_flatten(call)
        flat = localize(flat, dts[0])
        if flat is None:
            return _upstream(op, args, kwargs)
        call = tree_unflatten(flat, spec)
    local_args, local_kwargs = tree_map(_to_local, call)
    return _rewrap(op, args, op(*local_args, **local_kwargs), dts[0])


def _rewrap(op: torch._ops.OpOverload, args: tuple, out: object, ref: DTensor) -> object:
    """The local result of ``op`` as DTensors laid out like its operands."""
    if op._schema.is_mutable:
        # In-place: the DTensor operands already see the new local values.
        return args[0] if isinstance(args[0], DTensor) else out
    if isinstance(out, torch.Tensor):
        return _wrap(out, ref)
    if isinstance(out, list | tuple):
        # Out-of-place foreach: element j takes the layout of the first list's element j.
        refs = next(a for a in args if isinstance(a, list | tuple))
        return type(out)(_wrap(o, r) if isinstance(r, DTensor) else o for o, r in zip(out, refs))
    return out


def _local_flat(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """:func:`_local_handler` for argument lists without nested containers."""
    ref = None
    plain = False
    for x in (*args, *kwargs.values()):
        if isinstance(x, DTensor):
            if _is_scalar_operand(x):
                continue
            if ref is None:
                ref = x
            elif x.placements != ref.placements or x.shape != ref.shape:
                return _upstream(op, args, kwargs)
        elif isinstance(x, torch.Tensor) and x.dim() != 0:
            plain = True
    if ref is None or not _is_ragged(ref):
        return _upstream(op, args, kwargs)
    call_args, call_kwargs = list(args), dict(kwargs)
    if plain:
        # Plain operands count as replicated only under implicit_replication().
        from hyperrec.raggedshard._implicit import localize

        call_args = localize(call_args, ref)
        values = localize(list(call_kwargs.values()), ref)
        if call_args is None or values is None:
            return _upstream(op, args, kwargs)
        call_kwargs = dict(zip(call_kwargs, values))
    out = op(
        *[_to_local(a) for a in call_args], **{k: _to_local(v) for k, v in call_kwargs.items()}
    )
    return _rewrap(op, args, out, ref)


def _reduced_norms(tensors: list[DTensor], ord: float, dtype: object) -> list[DTensor]:
    """Whole-tensor p-norms of ragged DTensors, replicated: local norms, then ONE
    all-reduce of their p-th powers (of their maxima for inf) per mesh axis."""
    import math

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    local = [torch.linalg.vector_norm(t._local_tensor, ord, dtype=dtype) for t in tensors]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(tensors):
        axis = next(a for a, p in enumerate(t.placements) if isinstance(p, RaggedShard))
        groups.setdefault((id(t.device_mesh), axis), []).append(i)
    out: list[DTensor | None] = [None] * len(tensors)
    for (_, axis), idx in groups.items():
        mesh = tensors[idx[0]].device_mesh
        vals = torch.stack([local[i].to(torch.float64) for i in idx])
        if math.isinf(ord):
            dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
        else:
            vals = vals.pow(ord)
            dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=mesh.get_group(axis))
            vals = vals.pow(1.0 / ord)
        for j, i in enumerate(idx):
            value = vals[j].to(local[i].dtype)
            spec = DTensorSpec(
                mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta((), (), value.dtype)
            )
            out[i] = DTensor(value, spec, requires_grad=False)
    return out


def _norm_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    # Whole-tensor p-norms (p > 0) of ragged DTensors; anything else goes upstream.
    kw = dict(kwargs)
    if op is torch.ops.aten._foreach_norm.Scalar:
        tensors = list(args[0])
        ord = args[1] if len(args) > 1 else kw.pop("ord", 2)
        ragged = bool(tensors) and all(isinstance(t, DTensor) and _is_ragged(t) for t in tensors)
    else:
        tensors = [args[0]]
        ord = args[1] if len(args) > 1 else kw.pop("ord", 2)
        dim = args[2] if len(args) > 2 else kw.pop("dim", None)
        keepdim = args[3] if len(args) > 3 else kw.pop("keepdim", False)
        ragged = isinstance(args[0], DTensor) and _is_ragged(args[0]) and dim is None
        ragged = ragged and not keepdim
    ord = float(ord)
    if not ragged or not ord > 0 or any(t.requires_grad for t in tensors):
        return _upstream(op, args, kwargs)
    outs = _reduced_norms(tensors, ord, kw.get("dtype"))
    return outs if op is torch.ops.aten._foreach_norm.Scalar else outs[0]


def enable_local_ops() -> None:
    """Run pointwise, foreach and fused-optimizer ops on ragged DTensors shard-locally.

    Idempotent and process-global (see the module docstring). Call it once before an
    optimizer steps ragged-DTensor parameters.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _local_op_set():
        handlers.setdefault(op, _local_handler)
    for op in (torch.ops.aten._foreach_norm.Scalar, torch.ops.aten.linalg_vector_norm.default):
        handlers.setdefault(op, _norm_handler)
    _INSTALLED = True
