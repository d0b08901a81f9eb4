"""The host cost of a step's shape-dependent launches, timed at the model's own shapes.

``validate_cost.py`` takes a host-bound step's time from a copy of the model with small
dims (``host_copy``): same ops, same hooks, same collectives. ``host_gap.py`` found what
such a copy misses on the H200 (GEM tower, 64 fake ranks, 2026-12-05): the same calls
cost the host more at the tower's shapes (``cudaMemcpyAsync`` 9-11 us a call against
5-6 us; cuBLAS launches workspace clears and cluster kernels for the large GEMMs, about
1 ms a step the copy never issues). This module measures that difference without timing
the step it predicts:

1. :func:`record_ops`: one training step of a model under a dispatch mode that counts
   the calls of the ops whose host cost depends on their shapes (GEMMs and copies,
   :data:`SHAPED_OPS`), keyed by op, argument shapes, strides and dtypes;
2. :func:`time_op`: each distinct call replayed alone on fresh tensors of those shapes,
   ``reps`` launches back to back without a sync, host seconds per launch (median of
   ``rounds`` batches; a device sync between batches keeps the queue short, so the host
   never waits for the device);
3. :func:`host_op_delta`: ``sum(count x seconds)`` over the model's calls minus the
   same over its copy's: the host time the copy's measurement lacks.

Every other op is taken to cost the host the same at any shape (what the copy assumes);
on the H200 profile above the two kinds here carried most of the gap, the FSDP hooks'
own Python time (also larger at the tower's shapes) is not covered.

With ``collectives=True`` the step's collectives (ops of the ``c10d`` namespace) are
recorded too and replayed on the same process group. That is for the fake backend, whose
all-gather is not free on the host: it copies the input into each of the world size's
chunks of the output (PyTorch's ``FakeProcessGroup``, so that ``DeviceMesh``'s checks see
equal data), i.e. 64 device copies of the shard per all-gather at 64 fake ranks, issued
inside the collective, below the dispatcher's ``copy_`` (a real backend launches one
kernel). Those copies cost the host more at the model's shard sizes than at its copy's.
Replaying a collective on a real backend would need every rank to replay the same calls
in the same order: keep ``collectives=False`` there.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Ops whose host (launch) cost depends on their operands' shapes: cuBLAS picks its
#: kernels (and their auxiliary launches) per shape, copies split by size and layout.
SHAPED_OPS = (
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.copy_.default,
    aten._to_copy.default,
    aten._foreach_copy_.default,
    aten.cat.default,
    aten.split_with_sizes_copy.default,
)

Key = tuple  # (op name, args spec, kwargs spec)


#: Opaque arguments of recorded collectives (process groups, reduce ops), by token: the
#: replay hands the same objects back (a recording is replayed in the process that made it).
_OBJECTS: dict[str, Any] = {}


def _spec(x: Any) -> Any:
    if isinstance(x, torch.ScriptObject):
        token = f"obj{id(x)}"
        _OBJECTS[token] = x
        return ("S", token)
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_spec(v) for v in x)
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("O", str(x))
    return ("?", repr(x))


class _Recorder(TorchDispatchMode):
    def __init__(self, collectives: bool) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.collectives = collectives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SHAPED_OPS or (self.collectives and func.namespace == "c10d"):
            self.calls[(str(func), _spec(args), _spec(sorted(kwargs.items())))] += 1
        return func(*args, **kwargs)


def record_ops(step: Callable[[], Any], *, collectives: bool = False) -> Counter:
    """Calls of :data:`SHAPED_OPS` made by ``step()`` (forward, backward and optimizer;
    the autograd engine's threads inherit the mode), counted per distinct key; with
    ``collectives``, the ``c10d`` collectives too (fake backend only: see the module's
    docstring)."""
    rec = _Recorder(collectives)
    with rec:
        step()
    return rec.calls


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                               torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}  # fmt: skip


def _build(spec: Any, device: torch.device) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        _, shape, stride, dtype, dev = spec
        # a host-side operand stays on the host (an H2D copy is not a D2D one)
        where = device if dev == device.type else torch.device(dev)
        # zeros under the recorded strides (a broadcast view's zero strides included)
        n = 1 + sum((d - 1) * st for d, st in zip(shape, stride)) if all(shape) else 0
        base = torch.zeros(n, dtype=_DTYPES[dtype], device=where)
        return base.as_strided(shape, stride)
    if isinstance(spec, tuple) and spec and spec[0] == "O":
        text = spec[1]
        if text in _DTYPES:
            return _DTYPES[text]
        if text.startswith("torch.") and hasattr(torch, text.split(".", 1)[1]):
            return getattr(torch, text.split(".", 1)[1])
        return torch.device(text)
    if isinstance(spec, tuple) and spec and spec[0] == "S":
        return _OBJECTS[spec[1]]
    if isinstance(spec, tuple) and spec and spec[0] == "?":
        raise ValueError(f"cannot rebuild argument {spec[1]!r}")
    if isinstance(spec, tuple):
        return tuple(_build(v, device) for v in spec)
    return spec


def _resolve(name: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default`` (any namespace: ``c10d`` too)."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def time_op(key: Key, device: torch.device, *, reps: int = 20, rounds: int = 5) -> float:
    """Host seconds per launch of the call ``key`` (median over ``rounds`` batches of
    ``reps`` back-to-back launches, after one untimed call)."""
    if reps < 1 or rounds < 1:
        raise ValueError(f"reps and rounds must be >= 1, got {reps} and {rounds}")
    name, args_spec, kwargs_spec = key
    op = _resolve(name)
    args = _build(args_spec, device)
    kwargs = dict((k, _build(v, device)) for k, v in kwargs_spec)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    op(*args, **kwargs)
    sync()
    per = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            op(*args, **kwargs)
        per.append((time.perf_counter() - t0) / reps)
    sync()
    return statistics.median(per)


def host_op_delta(
    model_calls: Counter,
    copy_calls: Counter,
    device: torch.device,
    *,
    timer: Callable[[Key, torch.device], float] | None = None,
) -> dict:
    """Host seconds the model's shaped calls take beyond its copy's: ``delta_s`` and the
    per-op totals (``model_s``, ``copy_s`` per op name), from one timing per distinct key
    (``timer``, default :func:`time_op`)."""
    timer = timer or time_op
    seconds: dict[Key, float] = {}
    # one fixed order (set order varies with the process's hash seed)
    for key in sorted(set(model_calls) | set(copy_calls), key=repr):
        seconds[key] = timer(key, device)
    per_op: dict[str, dict[str, float]] = {}
    for label, calls in (("model_s", model_calls), ("copy_s", copy_calls)):
        for key, n in calls.items():
            entry = per_op.setdefault(key[0], {"model_s": 0.0, "copy_s": 0.0, "calls": 0})
            entry[label] += n * seconds[key]
            if label == "model_s":
                entry["calls"] += n
    model_s = sum(v["model_s"] for v in per_op.values())
    copy_s = sum(v["copy_s"] for v in per_op.values())
    return {
        "delta_s": model_s - copy_s,
        "model_s": model_s,
        "copy_s": copy_s,
        "distinct_calls": {"model": len(model_calls), "copy": len(copy_calls)},
        "per_op": per_op,
    }
