"""What a compiled region holds from its forward to its backward, read off the autograd
graph its call built.

The planner prices a plan from the profiled eager step; a compiled region saves what
AOTAutograd's partitioner chose (other tensors than eager autograd: a decomposed op saves
its own intermediates, cheap ops are recomputed in the backward) and its packing hooks
pack whole op classes, not the plan's occurrences. The tensors a compiled forward saves
are held by the backward node its call created (for AOTAutograd,
``CompiledFunctionBackward``: ``ctx.saved_tensors`` and, on some versions, tensors saved
without a version check on the context), so after one call they can be listed whatever
the backend (Inductor buffers included) and whatever the torch version's internals. Only
nodes created by the call are read (autograd sequence numbers are per thread and
increase), so the graph of the region's inputs is not walked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["graph_saves", "nodes_since", "sequence_now", "storage_keys"]


def sequence_now() -> int | None:
    """The autograd sequence number the next node made on this thread gets at least
    (``None`` where grad mode is off or the number cannot be read)."""
    if not torch.is_grad_enabled():
        return None
    probe = torch.empty(0, requires_grad=True).view(0)
    fn = probe.grad_fn
    seq = getattr(fn, "_sequence_nr", None)
    return int(seq()) + 1 if callable(seq) else None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _node_saves(node: Any) -> list[torch.Tensor]:
    """Tensors a backward node holds for its backward."""
    out: list[torch.Tensor] = []
    if hasattr(node, "saved_tensors"):
        # A Python autograd function's context (AOTAutograd's compiled function): what
        # it saved, and tensors it keeps as attributes (saved without a version check).
        with contextlib.suppress(RuntimeError):  # already released by a backward
            out += _tensors(tuple(node.saved_tensors))
        out += [t for v in vars(node).values() for t in _tensors(v)]
        return out
    for name in dir(node):
        # Built-in nodes expose their saved values as ``_saved_<argument>``.
        if name.startswith("_saved_"):
            try:
                out += _tensors(getattr(node, name))
            except RuntimeError:
                continue
    return out


def storage_keys(tensors: Iterable[Any]) -> set[tuple[str, int]]:
    """``(device, data pointer)`` of each tensor's storage."""
    keys = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            keys.add((str(t.device), st.data_ptr()))
    return keys


def nodes_since(roots: Iterable[Any], since: int) -> Iterator[tuple[Any, int]]:
    """``(node, sequence number)`` of each autograd node reachable from ``roots`` that
    was made at sequence number ``since`` or later (by a region's call: its inputs'
    graph, and leaves' ``AccumulateGrad``, are not walked), each once."""
    seen: set[int] = set()
    stack: list[Any] = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        seq = getattr(node, "_sequence_nr", None)
        # AccumulateGrad (a parameter's or input's) and nodes made before the call
        if hasattr(node, "variable") or not callable(seq) or int(seq()) < since:
            continue
        yield node, int(seq())
        stack.extend(f for f, _ in node.next_functions if f is not None)


def graph_saves(
    outputs: Iterable[torch.Tensor], since: int, exclude: set[tuple[str, int]]
) -> dict[tuple[str, int], int]:
    """Storages held for the backward by the autograd nodes created since sequence
    number ``since`` that ``outputs`` reach, as ``storage key -> bytes`` (each storage
    once; those in ``exclude``, the region's inputs and parameters, left out: they are
    held whatever the region saves)."""
    saves: dict[tuple[str, int], int] = {}
    for node, _ in nodes_since((t.grad_fn for t in outputs if t.grad_fn is not None), since):
        for t in _node_saves(node):
            if t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = (str(t.device), st.data_ptr())
            if key not in exclude and st.nbytes() > 0:
                saves[key] = st.nbytes()
    return saves
