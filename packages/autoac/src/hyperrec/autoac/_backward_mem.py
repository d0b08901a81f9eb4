"""What each region's backward allocates beyond what was allocated when it started.

Measured in a real (compiled) step: a hook before the autograd node of a region's
outputs marks the start of its backward, a hook after the earliest node its call made
(for a compiled region its backward graph's node, under any view nodes on its outputs;
for an eager region its first op's) marks the end. On CUDA the allocator's counters are
read there (``memory_allocated`` at the start, the peak reset, ``max_memory_allocated``
at the end). On the CPU there is no allocator counter: the step runs under
``torch.profiler`` with ``profile_memory=True`` and the hooks make marker allocations
whose sizes name the region and the edge; the bytes come from the allocation events
between them. (autoac's memory tracker cannot measure a compiled step: Dynamo does not
compile under a dispatch mode.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import kineto_available

from hyperrec.autoac._compiled_saves import nodes_since, sequence_now
from hyperrec.autoac.regions import flat_tensors

#: Marker allocation sizes (bytes, odd, above any scalar's): region ``i`` allocates
#: ``_MARK + 4 i`` when its backward starts and ``_MARK + 4 i + 2`` when it ends.
_MARK = 1_000_001


def _marker(i: int, end: bool) -> int:
    return _MARK + 4 * i + (2 if end else 0)


class BackwardProbe:
    """Per region, the most bytes its backward allocated beyond its start (one step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.index: dict[str, int] = {}
        self.result: dict[str, int] = {}
        self.skip: set[str] = set()
        self._base: dict[str, int] = {}
        self._handles: list[Any] = []

    def watch(self, name: str, outputs: Iterable[torch.Tensor], since: int | None) -> None:
        """Hook a region call's backward: it starts at its outputs' node and ends after
        the earliest node the call created (autograd sequence number ``since`` or
        later; for a compiled region its backward graph's node, under any view nodes on
        its outputs). A region without such a node, with outputs from several nodes,
        or called twice in the step, is not measured."""
        nodes = {id(t.grad_fn): t.grad_fn for t in outputs if t.grad_fn is not None}
        first = _earliest_since(list(nodes.values()), since)
        if len(nodes) != 1 or first is None or name in self.index:
            # a second call of the region in one step: its edges would be ambiguous
            self.skip.add(name)
            return
        (node,) = nodes.values()
        i = self.index[name] = len(self.index)
        self._handles.append(node.register_prehook(lambda g: self._start(name, i)))
        self._handles.append(first.register_hook(lambda gi, go: self._end(name, i)))

    def _start(self, name: str, i: int) -> None:
        if self.cuda:
            self._base[name] = int(torch.cuda.memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            torch.empty(_marker(i, False), dtype=torch.uint8, device="cpu")

    def _end(self, name: str, i: int) -> None:
        if self.cuda:
            if name in self._base:
                peak = int(torch.cuda.max_memory_allocated(self.device))
                self.result[name] = max(peak - self._base[name], 0)
        else:
            torch.empty(_marker(i, True), dtype=torch.uint8, device="cpu")

    def run(self, step: Callable[[], Any]) -> dict[str, int]:
        """Run ``step`` and return region name -> bytes. ``step`` must run the forward
        (the region calls :meth:`watch` sees) as well as the backward: on the CPU the
        allocator's events are read while it runs, and a backward alone would miss the
        frees of the forward's tensors it releases (too many bytes)."""
        try:
            if self.cuda:
                step()
            elif torch.autograd.profiler._is_profiler_enabled or not kineto_available():
                # a profiler of the caller's is running (a second one cannot start, and
                # that one's events are not ours to read), or this build has none:
                # nothing is measured
                self.skip.update(self.index)
                step()
            else:
                self._from_events(_allocation_events(step))
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
        return {n: b for n, b in self.result.items() if n not in self.skip}

    def _from_events(self, events: list[int]) -> None:
        marks = {_marker(i, end): (n, end) for n, i in self.index.items() for end in (False, True)}
        rest: list[int] = []
        at: dict[tuple[str, bool], list[int]] = {}
        for nbytes in events:
            m = marks.get(abs(nbytes))
            if m is None:
                rest.append(nbytes)
            elif nbytes > 0:
                # where the marker was made, among the step's own events
                at.setdefault(m, []).append(len(rest))
        live = np.concatenate(([0], np.cumsum(np.asarray(rest, dtype=np.int64))))
        for name in self.index:
            s, e = at.get((name, False), []), at.get((name, True), [])
            if len(s) != 1 or len(e) != 1 or e[0] < s[0]:
                continue  # not reached, or a size the step allocated itself
            self.result[name] = max(int(live[s[0] : e[0] + 1].max()) - int(live[s[0]]), 0)


def _earliest_since(outputs: list[Any], since: int | None) -> Any:
    """Of the autograd nodes reachable from ``outputs`` with a sequence number of at
    least ``since`` (made by the call), the earliest made: the last its backward runs.
    ``None`` where there is none or ``since`` is unknown."""
    if since is None:
        return None
    made = list(nodes_since(outputs, since))
    return min(made, key=lambda ns: ns[1])[0] if made else None


def _allocation_events(step: Callable[[], Any]) -> list[int]:
    """CPU allocations (+bytes) while ``step`` runs and frees (-bytes) of those
    allocations, in time order.

    Frees of blocks allocated before ``step`` are left out. The profiler reports such a
    free only if the block was allocated under an earlier memory-profiling window (it
    knows no size otherwise), e.g. a tensor of an earlier measurement that a reference
    cycle kept alive until the garbage collector happened to run inside this one; counted,
    it would lower this step's peak by an amount that depends on when the collector ran."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events: list[tuple[int, bool, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            n = e.extra_fields.alloc_size
            # at equal times an allocation before a free (a marker's pair stays in order)
            events.append((e.start_time_ns, n < 0, n, e.extra_fields.ptr))
        stack.extend(e.children)
    events.sort()
    out: list[int] = []
    live: dict[int, int] = {}  # address -> bytes, of the blocks allocated in the window
    for _, _, n, ptr in events:
        if n > 0:
            live[ptr] = n
            out.append(n)
        elif live.pop(ptr, None) is not None:
            out.append(n)
    return out


def allocation_peak(step: Callable[[], Any]) -> tuple[int, int]:
    """``(peak, end)``: the largest and the final sum of CPU bytes allocated minus freed
    while ``step`` runs (what it allocated beyond what it started with; compiled code
    included)."""
    live = np.cumsum([0, *_allocation_events(step)])
    return int(live.max()), int(live[-1])


def module_backward_bytes(
    model: nn.Module, step: Callable[[], Any], names: Sequence[str]
) -> dict[str, int]:
    """What the backward of each named submodule's call allocates beyond its start, in
    one run of ``step`` (forward and backward; forward hooks watch each call, see
    :class:`BackwardProbe`). For benchmarks and tests of models autoac does not run."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    probe = BackwardProbe(device)
    since: dict[str, int | None] = {}
    hooks = []
    for n in names:
        mod = model.get_submodule(n)

        def pre(_m: nn.Module, _a: Any, n: str = n) -> None:
            since[n] = sequence_now()

        def post(_m: nn.Module, _a: Any, out: Any, n: str = n) -> None:
            probe.watch(n, flat_tensors(out), since[n])

        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        return probe.run(step)
    finally:
        for h in hooks:
            h.remove()
