"""Opt-in: stock ATen pointwise, foreach and fused-optimizer ops on ragged DTensors.

Upstream DTensor (torch 2.11-2.14) has no sharding rule for a custom placement: torch 2.13
all-gathers a ``RaggedShard`` operand of a pointwise op (and returns a ``Replicate``
result) and rejects in-place ops, torch 2.11 raises. Elementwise math needs no
communication when every operand shares one layout, so :func:`enable_local_ops` routes
those ops to the local shards and keeps the operands' placement. That is what lets a stock
``torch.optim`` optimizer (foreach or fused) step parameters exposed as ragged DTensors.
A 0-dim DTensor operand of any layout (e.g. ``clip_grad_norm_``'s clip coefficient)
takes part as a scalar. Norms and other reductions of ragged DTensors are not part of this
switch: :mod:`hyperrec.raggedshard.reductions` handles them from import on.

Scope. The handlers go into DTensor's custom-op-handler table, a private upstream hook
shared by the whole process, so the switch is explicit and never implied by importing a
hyperrec package:

- :func:`enable_local_ops` installs them for the rest of the process (what
  ``hyperrec.parallel5d.fully_shard`` calls, and documents, because the parameters it
  returns must step under any ``torch.optim`` optimizer);
- :func:`local_ops` installs them for a ``with`` block only and restores the previous state
  on exit (for code that steps ragged DTensors it built itself);
- :func:`local_ops_enabled` reports the state.

Ops with no ragged operand, or whose operands do not share one layout, fall through to
upstream's normal path unchanged, so the handlers do not change what non-ragged DTensor
code computes. The explicit :func:`~hyperrec.raggedshard.ragged_map` /
:func:`~hyperrec.raggedshard.ragged_foreach` need no hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyperrec.raggedshard.placement import RaggedShard

__all__ = ["enable_local_ops", "local_ops", "local_ops_enabled"]

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


def _local_op_set() -> set[torch._ops.OpOverload]:
    from torch.distributed.tensor._ops import _pointwise_ops

    ops: set[torch._ops.OpOverload] = set()
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


def _check_no_partial(op: object, ref: DTensor) -> None:
    """A local op on pending-sum pieces computes f(piece) where the value is
    f(sum of pieces): only right for linear ops, so refuse them all."""
    if any(p.is_partial() for p in ref.placements):
        raise NotImplementedError(
            f"{op} on a ragged DTensor with a Partial axis ({ref.placements}): the local "
            "pieces are pending sums; redistribute that axis to Replicate() first"
        )


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


def _same_layout(x: DTensor, ref: DTensor) -> bool:
    # The mesh matters too: equal placements on two meshes (e.g. two axes of a 2-D mesh)
    # put different elements on a rank.
    return (
        x.device_mesh == ref.device_mesh and x.placements == ref.placements and x.shape == ref.shape
    )


def _foreach_positions_match(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether, at every position ``j``, the (non-scalar) DTensors of all tensor lists of a
    foreach/fused op share one layout, so the op is elementwise on the local shards."""
    lists = [
        v
        for v in (*args, *kwargs.values())
        if isinstance(v, list | tuple) and any(isinstance(t, DTensor) for t in v)
    ]
    if not lists:
        return True
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        return False
    for j in range(n):
        ref = None
        for lst in lists:
            t = lst[j]
            if not isinstance(t, DTensor) or _is_scalar_operand(t):
                continue
            if ref is None:
                ref = t
            elif not _same_layout(t, ref):
                return False
    return True


def _upstream(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
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


def _flat(values: Iterable[object]) -> bool:
    return not any(isinstance(v, list | tuple | dict) for v in values)


def _local_handler(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> object:
    # Pointwise ops of a single-tensor optimizer step arrive here by the dozen per
    # parameter: flat argument lists skip pytree (most of the per-op host cost).
    if _flat(args) and _flat(kwargs.values()):
        return _local_flat(op, args, kwargs)
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

    leaves, _ = tree_flatten((args, kwargs))
    dts = [x for x in leaves if isinstance(x, DTensor) and not _is_scalar_operand(x)]
    plain = [x for x in leaves if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)]
    foreach = op.name().startswith(("aten::_foreach_", "aten::_fused_"))
    if foreach:
        layouts_ok = _foreach_positions_match(args, kwargs)
    else:
        layouts_ok = all(_same_layout(d, dts[0]) for d in dts)
    local_ok = any(_is_ragged(d) for d in dts) and layouts_ok
    if not local_ok:
        return _upstream(op, args, kwargs)
    _check_no_partial(op, dts[0])
    call = (args, kwargs)
    if not foreach and any(p.dim() != 0 for p in plain):
        # Plain operands count as replicated only under implicit_replication().
        from hyperrec.raggedshard._implicit import localize

        flat, spec = tree_flatten(call)
        localized = localize(flat, dts[0])
        if localized is None:
            return _upstream(op, args, kwargs)
        call = tree_unflatten(localized, spec)
    local_args, local_kwargs = tree_map(_to_local, call)
    return _rewrap(op, args, op(*local_args, **local_kwargs), dts[0])


def _rewrap(op: torch._ops.OpOverload, args: tuple[Any, ...], out: object, ref: DTensor) -> object:
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


def _local_flat(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """:func:`_local_handler` for argument lists without nested containers."""
    ref = None
    plain = False
    for x in (*args, *kwargs.values()):
        if isinstance(x, DTensor):
            if _is_scalar_operand(x):
                continue
            if ref is None:
                ref = x
            elif not _same_layout(x, ref):
                return _upstream(op, args, kwargs)
        elif isinstance(x, torch.Tensor) and x.dim() != 0:
            plain = True
    if ref is None or not _is_ragged(ref):
        return _upstream(op, args, kwargs)
    _check_no_partial(op, ref)
    call_args, call_kwargs = list(args), dict(kwargs)
    if plain:
        # Plain operands count as replicated only under implicit_replication().
        from hyperrec.raggedshard._implicit import localize

        local_args = localize(call_args, ref)
        values = localize(list(call_kwargs.values()), ref)
        if local_args is None or values is None:
            return _upstream(op, args, kwargs)
        call_args, call_kwargs = local_args, dict(zip(call_kwargs, values))
    out = op(
        *[_to_local(a) for a in call_args], **{k: _to_local(v) for k, v in call_kwargs.items()}
    )
    return _rewrap(op, args, out, ref)


def _handlers() -> dict[torch._ops.OpOverload, Any]:
    return DTensor._op_dispatcher._custom_op_handlers


def _install() -> None:
    global _INSTALLED
    handlers = _handlers()
    for op in _local_op_set():
        handlers.setdefault(op, _local_handler)
    _INSTALLED = True


def _uninstall() -> None:
    global _INSTALLED
    handlers = _handlers()
    # Only our own entries: a handler someone else registered for the same op stays, and
    # so do the reductions' handlers (installed on import, not part of this switch).
    for op in [op for op, h in handlers.items() if h is _local_handler]:
        del handlers[op]
    _INSTALLED = False


def enable_local_ops() -> None:
    """Run pointwise, foreach and fused-optimizer ops on ragged DTensors shard-locally.

    Idempotent and process-global: the handlers stay installed until the process ends
    (see the module docstring for their scope; :func:`local_ops` limits them to a block).
    Call it once before a stock optimizer steps ragged-DTensor parameters or
    ``torch.nn.utils.clip_grad_norm_`` runs on them.
    """
    if not _INSTALLED:
        _install()


def local_ops_enabled() -> bool:
    """Whether the shard-local handlers of :func:`enable_local_ops` are installed."""
    return _INSTALLED


@contextlib.contextmanager
def local_ops() -> Iterator[None]:
    """:func:`enable_local_ops` for a ``with`` block only.

    On exit the handlers are removed again if they were not installed on entry (an
    :func:`enable_local_ops` call inside the block is undone too); nested blocks and an
    earlier :func:`enable_local_ops` keep them installed.
    """
    was_installed = _INSTALLED
    if not was_installed:
        _install()
    try:
        yield
    finally:
        if not was_installed:
            _uninstall()
