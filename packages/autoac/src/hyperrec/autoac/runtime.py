"""Put a plan in force on a model (eager or compiled), measure a step, take it off.

Eager: each region's ``forward`` runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False, context_fn=...)`` with torch's selective-checkpoint contexts and
autoac's policy, or (regions with packed saves) with autoac's packing contexts; an
un-checkpointed region with packed saves runs under ``saved_tensors_hooks``.

Compiled: :func:`compile_mechanism` says how the installed torch takes per-region
plans under ``torch.compile``:

* ``"sac"``: Dynamo traces ``checkpoint`` with a selective policy and the partitioner
  obeys its ``MUST_SAVE`` / ``MUST_RECOMPUTE`` marks: the plan applies op by op in each
  compiled region (every supported torch, 2.11 to 2.14).
* ``"memory_budget"``: the fallback when it does not: each region is compiled with
  the functorch ``activation_memory_budget`` set to the fraction of its saved bytes
  the plan keeps (``torch.autograd.graph.region_activation_memory_budget`` where it
  exists).

Packed saves under compilation: where this torch inlines ``GraphModule`` saved-tensor
hooks into AOTAutograd's graphs (:func:`compiled_packing_supported`), a region whose
packed saves are all ``"mxint8"`` is compiled like the others and called inside
``saved_tensors_hooks`` that trace the quantization into its forward graph and the
dequantization into its backward graph (``_compiled_pack``: per op class, so Inductor
can fuse both into the neighbouring kernels). Other packed regions run eagerly
(``torch.compiler.disable``), which breaks the graph around them.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from torch.utils.checkpoint import checkpoint

from hyperrec.autoac import _exec
from hyperrec.autoac import regions as _regions
from hyperrec.autoac._backward_mem import BackwardProbe, allocation_peak
from hyperrec.autoac._compiled_pack import (
    COMPILED_FORMATS,
    compiled_packing_supported,
    pack_hooks,
)
from hyperrec.autoac._compiled_saves import graph_saves, sequence_now, storage_keys
from hyperrec.autoac._exec import INPUT, RegionDecisions, no_compile, run_region
from hyperrec.autoac._validate import check_bool, check_choice, check_fraction, check_int
from hyperrec.autoac.formats import SAVE_FORMATS
from hyperrec.autoac.planner import (
    Plan,
    PlanConfig,
    check_saves_args,
    partitioner_plan,
    plan,
    price_compiled_saves,
    restrict,
)
from hyperrec.autoac.profiler import (
    Profile,
    ProfileConfig,
    _check_loss,
    _check_step_fn,
    _device_of,
    _seed_all,
    backward_sparing_inputs,
    grad_error,
    grads_of,
    profile,
    set_grads,
)
from hyperrec.autoac.tracker import MemoryTracker

__all__ = [
    "AutoAC",
    "StepMeasurement",
    "apply",
    "apply_plan",
    "calibrate_none",
    "compile_mechanism",
    "compiled_packing_supported",
    "for_compiled_packing",
    "measure_step",
    "price_compiled",
    "remove",
]

CompileMechanism = Literal["sac", "memory_budget"]


def compile_mechanism() -> CompileMechanism:
    """How this torch applies per-region plans under ``torch.compile`` (feature test)."""
    try:
        from torch._higher_order_ops.wrap import tag_activation_checkpoint  # noqa: F401
        from torch.utils.checkpoint import CheckpointPolicy  # noqa: F401
    except ImportError:  # pragma: no cover - present in every supported torch
        return "memory_budget"
    return "sac"


_F = TypeVar("_F", bound=Callable[..., Any])

#: Region compile calls made so far in this process (see ``_compile``).
_BUILDS = 0


def _compile(fn: Callable[..., Any], compile_kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``torch.compile`` of one region, with room for the recompiles regions bring.

    The regions of a model (its identical layers) share one code object, and Dynamo
    counts compiled entries per code object against ``recompile_limit`` (8 by default):
    every region whose plan differs is another entry (its checkpoint policy, its packing
    hooks), and every new plan (a replan in ``apply``'s verification) adds its own. Past
    the limit Dynamo runs the frame *eagerly* from then on, so the plan silently stops
    being in force: seen on the GPU as a no-AC peak under a packed Llama plan, which the
    verification then answered by replanning to half the budget. Each region compile
    may add two entries (its plan, and the first region's input without
    ``requires_grad``), so ``torch._dynamo.config.recompile_limit`` (and the
    accumulated limit) is raised to ``8 + 2 * region compiles so far`` where it is lower.
    Regions keep sharing entries: ``isolate_recompiles`` would compile every identical
    layer again, and a per-call limit would leave earlier regions at a lower limit than
    the shared entries reach.
    """
    global _BUILDS
    _BUILDS += 1
    need = 8 + 2 * _BUILDS
    import torch._dynamo.config as dconfig

    if dconfig.recompile_limit < need:
        dconfig.recompile_limit = need
    if getattr(dconfig, "accumulated_recompile_limit", need) < need:
        dconfig.accumulated_recompile_limit = need
    return torch.compile(fn, **compile_kwargs)


def _not_compiled(fn: _F) -> _F:
    """``torch.compiler.disable(fn)`` (torch leaves it unannotated; it returns a function
    of the same signature)."""
    disabled: _F = torch.compiler.disable(fn)
    return disabled


def _ckpt(
    fn: Callable[..., Any], ctx: Callable[[], tuple[Any, Any]], *args: Any, **kwargs: Any
) -> Any:
    return checkpoint(
        _exec.bind_kwargs(fn, kwargs),
        *args,
        use_reentrant=False,
        context_fn=ctx,
        preserve_rng_state=_exec._RNG_GUARD,
    )


class _Runner:
    """Runs each region of an applied plan (a picklable-free plain object)."""

    def __init__(
        self,
        decisions: dict[str, RegionDecisions],
        compiled: bool,
        mechanism: CompileMechanism,
        fractions: dict[str, float],
        compile_kwargs: dict[str, Any],
    ) -> None:
        self.decisions = decisions
        self.compiled = compiled
        self.mechanism = mechanism
        self.fractions = fractions
        self.compile_kwargs = compile_kwargs
        # Context functions are made once, outside any trace: Dynamo accepts them as
        # constants.
        self.ctx = {n: _exec.sac_context_fn(d) for n, d in decisions.items() if d.mode == "sac"}
        self._compiled: dict[str, Callable[..., Any]] = {}
        # region -> inlineable (pack, unpack) hooks; regions with equal packed classes
        # share one pair (Dynamo guards on the hooks: one pair, one compiled graph)
        self.hooks: dict[str, tuple[Any, Any]] = {}
        self.pack_counts: dict[str, dict[str, int]] = {}
        # region -> storage key -> bytes its compiled graph saved for the backward, while
        # a step is probed (see ``price_compiled``); ``None``: not probing
        self.probe: dict[str, dict[tuple[str, int], int]] | None = None
        # hooks the backward of each compiled region call while a step is probed for
        # what the backwards allocate (see ``_backward_bytes``); ``None``: not probing
        self.backward_probe: BackwardProbe | None = None
        if compiled and compiled_packing_supported():
            shared: dict[Any, tuple[Any, Any, dict[str, int]]] = {}
            for n, d in decisions.items():
                classes = _packed_classes(d)
                if classes is None:
                    continue
                key = (tuple(sorted(classes.items())), d.min_pack_bytes)
                if key not in shared:
                    shared[key] = pack_hooks(classes, d.min_pack_bytes)
                pack, unpack, counts = shared[key]
                self.hooks[n] = (pack, unpack)
                self.pack_counts[n] = counts

    def __getstate__(self) -> dict[str, Any]:
        # A copy of the model (deepcopy, pickle) compiles its regions afresh: the compiled
        # functions are bound to this model's modules.
        return {**self.__dict__, "_compiled": {}}

    def eager(
        self, state: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        d = self.decisions.get(state.name)
        if d is None:
            return fn(*args, **kwargs)
        if d.mode == "sac" and not d.quantized and torch.is_grad_enabled():
            return _ckpt(_exec.keep_module_state(fn), self.ctx[state.name], *args, **kwargs)
        return _eager_region(d, fn, args, kwargs)

    def __call__(
        self, state: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not self.compiled:
            return self.eager(state, fn, args, kwargs)
        if not torch.compiler.is_compiling() and is_in_torch_dispatch_mode(
            include_infra_modes=False
        ):
            # Under a dispatch mode (the CPU memory tracker of measure_step and the
            # profiler) Dynamo does not compile a frame, and it then skips that frame for
            # good: the regions would never compile afterwards (seen with torch 2.13).
            # Such a step runs the plan eagerly instead, its packed saves included, and
            # the model's own compiled functions inside the region eagerly too
            # (force_eager does not mark frames skipped).
            with no_compile():
                return self.eager(state, fn, args, kwargs)
        d = self.decisions.get(state.name)
        hooks = self.hooks.get(state.name)
        if d is not None and d.quantized and hooks is None:
            return _eager_region(d, fn, args, kwargs)
        c = self._compiled.get(state.name)
        if c is None:
            c = self._build(state.name, fn)
            self._compiled[state.name] = c
        probing = self.probe is not None or self.backward_probe is not None
        since = sequence_now() if probing else None
        if hooks is not None:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                out = c(*args, **kwargs)
        else:
            out = c(*args, **kwargs)
        if self.probe is not None and since is not None:
            self._record_saves(state.name, fn, args, kwargs, out, since)
        if self.backward_probe is not None:
            self.backward_probe.watch(state.name, _regions.flat_tensors(out), since)
        return out

    def _record_saves(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        since: int,
    ) -> None:
        assert self.probe is not None
        outs = _regions.flat_tensors(out)
        # Inputs and parameters are held whatever the region saves. Its outputs are not
        # excluded: where its own backward keeps one (a block ending in tanh), the graph
        # holds it until that backward, as the profile prices it (before 0.1.21 such a
        # region was priced low by the output's bytes).
        held = list(_regions.flat_tensors((args, kwargs)))
        owner = getattr(fn, "__self__", None)
        # a Span's function may be another module's bound method: its parameters too
        inner = getattr(getattr(owner, "fn", None), "__self__", None)
        for m in (owner, inner):
            if isinstance(m, nn.Module):
                held += [*m.parameters(), *m.buffers()]
        saves = graph_saves(outs, since, storage_keys(held))
        self.probe.setdefault(name, {}).update(saves)

    def _build(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        d = self.decisions.get(name)
        if d is None or d.mode == "none":
            return _compile(fn, self.compile_kwargs)
        if d.mode == "partitioner":
            assert d.fraction is not None  # Plan.from_dict and partitioner_plan see to it
            return _compile_with_budget(fn, d.fraction, self.compile_kwargs)
        if self.mechanism == "sac":
            ctx = self.ctx[name]

            def body(*args: Any, **kwargs: Any) -> Any:
                # keep_module_state per call: traced, it is the forward itself; where the
                # checkpoint graph-breaks and runs eagerly, it keeps the recomputation
                # from writing the module's buffers a second time
                return _ckpt(_exec.keep_module_state(fn), ctx, *args, **kwargs)

            return _compile(body, self.compile_kwargs)
        return _compile_with_budget(fn, self.fractions.get(name, 0.0), self.compile_kwargs)


def _compile_with_budget(
    fn: Callable[..., Any], frac: float, compile_kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """``torch.compile`` of a region whose partitioner runs at
    ``activation_memory_budget = frac``, as one graph (``fullgraph=True``: a region that
    graph-breaks raises at its first call). Behind a graph break the annotation would
    run eagerly (and raise), and on older torch the frames after the break would not be
    guarded on the fraction, so a later plan at another fraction would reuse them."""
    compile_kwargs = {**compile_kwargs, "fullgraph": True}
    region_budget = getattr(torch.autograd.graph, "region_activation_memory_budget", None)
    if region_budget is not None:
        # torch >= 2.13: a per-region annotation read by the partitioner.
        return _compile(_with_region_budget(region_budget, frac, fn), compile_kwargs)
    # Older torch: the global knob, read when the region's graph is compiled. Identical
    # layers share one code object, and Dynamo would hand a region with another fraction
    # the graph compiled for the first: the body reads the fraction as a constant, which
    # Dynamo guards on, so each fraction compiles its own graph.
    import torch._functorch.config as fconfig

    text = repr(float(frac))

    def body(*args: Any, **kwargs: Any) -> Any:
        if not text:  # never: the read makes the fraction part of the guards
            raise AssertionError("empty fraction")
        return fn(*args, **kwargs)

    compiled = _compile(body, compile_kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        # set and restored by hand: fconfig.patch costs about 20 us a call on the host
        old = fconfig.activation_memory_budget
        fconfig.activation_memory_budget = frac
        try:
            return compiled(*args, **kwargs)
        finally:
            fconfig.activation_memory_budget = old

    return run


def _packed_classes(d: RegionDecisions) -> dict[str, str] | None:
    """Op class -> format of a region's packed saves, if a compiled region can pack them
    all (one format per class, each in :data:`COMPILED_FORMATS`); else ``None``."""
    if not d.quantized:
        return None
    classes: dict[str, str] = {}
    for (op, _), f in d.saves.items():
        if f not in SAVE_FORMATS:
            continue
        if op == INPUT:
            # a compiled graph's packing hooks see its saved nodes, not the call's inputs
            return None
        if f not in COMPILED_FORMATS or classes.setdefault(op, f) != f:
            return None
    return classes


def _with_region_budget(
    ctx: Callable[[float], AbstractContextManager[Any]], frac: float, fn: Callable[..., Any]
) -> Callable[..., Any]:
    # Dynamo traces float values it reads as symbols; the annotation needs a constant,
    # which ``float`` of a constant string is.
    text = repr(float(frac))

    def run(*args: Any, **kwargs: Any) -> Any:
        with ctx(float(text)):
            return fn(*args, **kwargs)

    return run


@_not_compiled
def _eager_region(
    d: RegionDecisions, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return run_region(d, fn, args, kwargs)


@dataclass(frozen=True)
class StepMeasurement:
    """One measured training step.

    Attributes:
        peak_bytes: the step's peak: ``torch.cuda.max_memory_allocated`` on CUDA,
            the tracker's live-storage peak on the CPU.
        tracked_peak: live tensor storages' peak (``None`` when not tracked).
        allocator_peak: CUDA allocator peak (``None`` on the CPU).
        time_s: wall time of the step (with the tracker's overhead when tracked).
        grads: the parameter gradients of the step (``keep_grads=True``) or ``None``.
        base_bytes: what was held when the step started, counted as ``peak_bytes`` is
            (CUDA: ``torch.cuda.memory_allocated``, everything allocated; CPU: the
            tracker's resident bytes: the storages the step touched that no op of the
            step allocated, i.e. parameters, inputs and buffers it read, but also
            tensors the step builds from host data without an op, such as
            ``torch.from_numpy`` or ``torch.tensor(list)``, and not parameter gradients
            it never touches); ``None`` when not known (an untracked CPU step).
            ``peak_bytes - base_bytes`` is what the step itself allocated at its peak:
            activations, gradients, workspaces.
    """

    peak_bytes: int
    tracked_peak: int | None
    allocator_peak: int | None
    time_s: float
    grads: list[torch.Tensor | None] | None = None
    base_bytes: int | None = None

    @property
    def step_bytes(self) -> int | None:
        """``peak_bytes - base_bytes`` (``None`` when ``base_bytes`` is)."""
        return None if self.base_bytes is None else self.peak_bytes - self.base_bytes


def measure_step(
    model: nn.Module,
    step_fn: Callable[[nn.Module], torch.Tensor],
    *,
    track: bool | None = None,
    seed: int | None = 0,
    keep_grads: bool = False,
) -> StepMeasurement:
    """Run one forward + backward of ``model`` as it is now and measure its peak.

    Args:
        model, step_fn: as for :func:`hyperrec.autoac.profiler`.
        track: count live tensor storages with a tracker (default: on the CPU only;
            it adds Python work per op, so leave it off when timing on a GPU). A
            tracked step runs ``torch.compile``'d code eagerly (Dynamo cannot compile
            under the tracker's dispatch mode).
        seed: seed torch's generators first (restored afterwards); ``None``: do not.
        keep_grads: return the gradients. Parameter gradients are restored either way;
            other leaves the step differentiates (inputs) are left as they were.

    Returns:
        :class:`StepMeasurement`.

    Raises:
        TypeError: bad argument types; ``step_fn`` not taking the model as its one
            argument or not returning a one-element loss that requires grad.
        ValueError: a negative ``seed``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_step_fn(step_fn)
    if seed is not None:
        check_int("seed", seed, minimum=0)
    device = _device_of(model)
    track = device.type != "cuda" if track is None else check_bool("track", track)
    check_bool("keep_grads", keep_grads)
    saved = grads_of(model)
    set_grads(model, None)
    fork = [device] if device.type == "cuda" else []
    tracker = MemoryTracker(device=device) if track else None
    try:
        with torch.random.fork_rng(devices=fork):
            if seed is not None:
                _seed_all(seed, device)
            base = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = int(torch.cuda.memory_allocated(device))
            t0 = time.perf_counter()
            if tracker is not None:
                # Eagerly: Dynamo does not compile under the tracker's dispatch mode and
                # would skip the model's compiled functions for good afterwards.
                with no_compile(), tracker:
                    loss = step_fn(model)
                    _check_loss(loss)
                    backward_sparing_inputs(model, loss)
                tracker.finish()
            else:
                loss = step_fn(model)
                _check_loss(loss)
                backward_sparing_inputs(model, loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
        alloc = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        tracked = tracker.peak_bytes() if tracker is not None else None
        if base is None and tracker is not None:
            base = tracker.resident_bytes
        grads = grads_of(model) if keep_grads else None
    finally:
        set_grads(model, saved)
    peak = alloc if alloc is not None else tracked
    return StepMeasurement(
        peak_bytes=int(peak if peak is not None else 0),
        tracked_peak=tracked,
        allocator_peak=alloc,
        time_s=dt,
        grads=grads,
        base_bytes=base,
    )


class AutoAC:
    """A plan in force on a model (returned by :func:`apply` / :func:`apply_plan`).

    Attributes:
        model: the model.
        plan: the :class:`~hyperrec.autoac.planner.Plan` in force.
        profile: the :class:`~hyperrec.autoac.profiler.Profile` it came from (``None``
            for a loaded plan).
        verification: after ``apply(verify=True)``: predicted vs measured peak, where the
            prediction came from (``"pricing"``: ``"profile"`` or ``"compiled"``) and the
            measured gradient error of the plan on the profiled step. On the CPU the
            measured step runs eagerly (see :func:`measure_step`), compiled plans too.
        compiled: regions run compiled.
        mechanism: how compiled regions take the plan (see :func:`compile_mechanism`).
        search: after ``apply(partitioner_fractions=...)``: one entry per plan tried
            (``"plan"``: ``"autoac"`` or ``"partitioner"``, ``"fraction"``,
            ``"peak_bytes"``, ``"peak_source"`` (``"cuda"``, ``"cpu_events"`` or
            ``"predicted"``), ``"time_s"`` (median of the timed steps), ``"times_s"``,
            ``"fits"``, ``"chosen"``, ``"error"`` for a candidate that did not compile);
            else ``None``.
        packed_in_graph: regions whose packed saves are traced into their compiled
            graphs (see the module docstring), each with the saved nodes its hooks chose
            to pack while the graphs were built (empty until the first compiled step).
            Packed regions not listed run eagerly.

    Raises:
        TypeError: ``model`` not a module, ``plan_`` not a :class:`Plan`,
            ``compile_kwargs`` not a mapping.
        ValueError: a region of the plan is not a module of ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        plan_: Plan,
        *,
        profile_: Profile | None = None,
        compiled: bool = False,
        compile_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(plan_, Plan):
            raise TypeError(f"plan must be a Plan, got {type(plan_).__name__}")
        _check_compile_kwargs(compile_kwargs)
        _check_plan_regions(model, plan_)
        _check_no_plan_in_force(model)
        self.model = model
        self.profile = profile_
        self.compiled = compiled
        self.mechanism: CompileMechanism = compile_mechanism()
        self.compile_kwargs = dict(compile_kwargs or {})
        self.verification: dict[str, Any] | None = None
        self.search: list[dict[str, Any]] | None = None
        self._modules: list[nn.Module] = []
        self.plan = plan_
        self._install(plan_)

    def _check_runnable(self, plan_: Plan) -> None:
        if not self.compiled and any(r.mode == "partitioner" for r in plan_.regions):
            raise ValueError(
                "plan has 'partitioner' regions, which only a compiled region can run "
                "(eagerly they would run un-checkpointed): put it in force with "
                "compile=True"
            )

    def _install(self, plan_: Plan) -> None:
        self._check_runnable(plan_)
        names = [r.name for r in plan_.regions]
        mods, names = _regions.resolve_regions(self.model, names)
        if len(mods) != len(plan_.regions):
            raise ValueError(
                f"plan regions {[r.name for r in plan_.regions]} do not each name one module "
                "of model"
            )
        states = _regions.install(mods, names)
        fractions = {r.name: r.saved_fraction for r in plan_.regions}
        runner = _Runner(
            plan_.decisions(), self.compiled, self.mechanism, fractions, self.compile_kwargs
        )
        for s in states:
            s.runner = runner
        self._runner = runner
        self._modules = mods
        self.plan = plan_

    @property
    def packed_in_graph(self) -> dict[str, list[str]]:
        """Compiled regions with packed saves -> names of the saved graph nodes their
        pack hook packed while graphs were built (empty until a region has run
        compiled; an empty list after that means nothing was packed in the graph).
        Regions that pack the same op classes share one hook pair, and so one list."""
        return {n: sorted(c) for n, c in self._runner.pack_counts.items()}

    def set_plan(self, plan_: Plan) -> None:
        """Replace the plan in force (same regions or others of the same model).

        Raises:
            TypeError: ``plan_`` not a :class:`Plan`.
            ValueError: a region of the plan is not a module of the model (the plan in
                force stays).
        """
        if not isinstance(plan_, Plan):
            raise TypeError(f"plan must be a Plan, got {type(plan_).__name__}")
        _check_plan_regions(self.model, plan_)
        self._check_runnable(plan_)  # before the plan in force is taken off
        _regions.uninstall(self._modules)
        self._install(plan_)

    def remove(self) -> None:
        """Restore every region's original ``forward``."""
        _regions.uninstall(self._modules)
        self._modules = []

    def state_dict(self) -> dict[str, Any]:
        """``{"plan": plan.to_dict()}`` (plain Python values; DCP-friendly)."""
        return {"plan": self.plan.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the saved plan in force.

        Raises:
            TypeError: ``state`` (or its plan) not a mapping.
            ValueError: not a state from :meth:`state_dict`, or regions the model lacks.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be a mapping from AutoAC.state_dict(), got {type(state).__name__}"
            )
        if "plan" not in state:
            raise ValueError("state must be a mapping with a 'plan' entry from AutoAC.state_dict()")
        try:
            plan_ = Plan.from_dict(state["plan"])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"state['plan'] is not a saved plan: {exc}") from None
        self.set_plan(plan_)


def _check_compile_kwargs(compile_kwargs: Any) -> None:
    if compile_kwargs is not None and not isinstance(compile_kwargs, Mapping):
        raise TypeError(
            f"compile_kwargs must be a mapping or None, got {type(compile_kwargs).__name__}"
        )


def _check_no_plan_in_force(model: nn.Module) -> None:
    # Two handles on one model would share its region wrappers: removing the older one
    # would take the newer plan off (and a failed apply would take off both).
    installed = _regions.installed_regions(model)
    if installed:
        names = {id(m): n for n, m in model.named_modules()}
        raise ValueError(
            "model already has an autoac plan in force on "
            f"{sorted(names.get(id(m), '?') or '<root>' for m in installed)}: remove() its "
            "handle (or call autoac.remove(model)) before putting another plan in force, "
            "or replace it with handle.set_plan(plan)"
        )


def _check_plan_regions(model: nn.Module, plan_: Plan) -> None:
    # Before any region is touched: a plan for another model leaves the one in force.
    names = {n or "<root>" for n, _ in model.named_modules()}
    missing = [r.name for r in plan_.regions if r.name not in names]
    if missing:
        raise ValueError(f"plan has regions {missing} that are not modules of model")


def apply_plan(
    model: nn.Module,
    plan_: Plan,
    *,
    compile: bool = False,
    compile_kwargs: Mapping[str, Any] | None = None,
) -> AutoAC:
    """Put ``plan_`` in force on ``model`` (wraps its regions; no other change).

    Args:
        model: the model the plan was made for (same region names).
        plan_: a :class:`~hyperrec.autoac.planner.Plan` (from :func:`plan` or
            :meth:`Plan.from_dict`).
        compile: compile each region with ``torch.compile`` (``compile_kwargs`` passed
            on); see :func:`compile_mechanism`.

    Raises:
        TypeError: bad argument types (``compile_kwargs`` not a mapping).
        ValueError: a region of the plan is not a module of ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan_, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan_).__name__}")
    check_bool("compile", compile)
    return AutoAC(model, plan_, compiled=compile, compile_kwargs=compile_kwargs)


def remove(model: nn.Module) -> None:
    """Take every autoac region of ``model`` back to its original ``forward``.

    Raises:
        TypeError: ``model`` not a module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _regions.uninstall(_regions.installed_regions(model))


def _default_loss(out: Any) -> torch.Tensor:
    ts = [t for t in _regions.flat_tensors(out) if t.is_floating_point() and t.requires_grad]
    if not ts:
        raise TypeError("the model output has no floating tensor that requires grad; pass loss_fn")
    loss = ts[0].float().square().mean()
    for t in ts[1:]:
        loss = loss + t.float().square().mean()
    return loss


def apply(
    model: nn.Module,
    *,
    budget: float | None = None,
    region_budgets: Mapping[str, float] | None = None,
    regions: Any = None,
    step_fn: Callable[[nn.Module], torch.Tensor] | None = None,
    sample_inputs: tuple[Any, ...] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    formats: tuple[str, ...] = (),
    profile_config: ProfileConfig | None = None,
    plan_config: PlanConfig | None = None,
    verify: bool = True,
    replan_peak: bool | None = None,
    compile: bool = False,
    compile_kwargs: Mapping[str, Any] | None = None,
    profile_: Profile | None = None,
    fused_recompute: bool | None = None,
    calibrate_none: bool = False,
    partitioner_fractions: tuple[float, ...] = (),
) -> AutoAC:
    """Profile a step, plan within the budget, and put the plan in force: one call.

    Args:
        model: the model, in train mode.
        budget: peak memory of a training step, bytes (see :func:`plan`); optional
            with ``plan_config=PlanConfig(strategy="pack_all")``.
        region_budgets: ``region name -> bytes`` held between forward and backward.
        regions: which modules are regions (see :func:`resolve_regions`; default:
            the blocks of the largest ``ModuleList``).
        step_fn: ``step_fn(model) -> loss`` for one step at the largest batch you
            train with. Or give ``sample_inputs`` (positional inputs of ``model``) and
            optionally ``loss_fn(output) -> loss`` (default: mean of squares of the
            floating outputs).
        formats: packed formats to consider (``"mxfp8"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``, ``"mx4"``, ``"mxint8"``); overrides ``profile_config.formats``.
            With ``compile=True`` only ``"mxint8"``, where
            :func:`compiled_packing_supported`; the plan then packs only in such
            formats, also where the profile's formats come from ``profile_config`` or
            ``profile_`` (unless ``plan_config.formats`` names others).
        profile_config, plan_config: see :class:`ProfileConfig`, :class:`PlanConfig`.
        verify: run the planned step once: record predicted vs measured peak and the
            gradient error against the exact step in :attr:`AutoAC.verification`. If
            packing made the error exceed ``profile_config.max_grad_error``, the worst
            tensor class is excluded and the step replanned until it does not. If the
            measured peak exceeds ``budget`` by more than :data:`PEAK_TOLERANCE`, the
            step is replanned with the budget lowered by the overshoot (at most
            :data:`MAX_PEAK_REPLANS` times, never below the floor; see
            ``replan_peak``); the verification records ``planned_budget``,
            ``peak_replans`` and ``within_budget``.
        replan_peak: whether ``verify`` replans on a measured peak over the budget.
            Default (``None``): yes, except with ``torch.distributed`` initialised on
            more than one rank, where ranks measure different peaks and would replan a
            different number of times (their steps' collectives would not pair); pass
            ``True`` there only if every rank's step measures the same.
        compile: compile each region (see :func:`apply_plan`). The plan is then priced
            from what the compiled graphs save (:func:`price_compiled`, one compiled
            step), and planned again with the budget lowered by the predicted overshoot
            while that prediction exceeds ``budget`` (at most :data:`MAX_PEAK_REPLANS`
            times, never below the floor; with ``replan_peak``); while it is under
            ``budget`` by more than :data:`PEAK_TOLERANCE` of it (the graphs save less
            than the eager profile: the partitioner recomputes element-wise ops), planned
            again with the budget raised by that headroom, kept if it still fits and adds
            less time (within the same :data:`MAX_PEAK_REPLANS`; step budgets only).
        fused_recompute: with ``compile=True``, price recomputing the ops Inductor
            fuses into their neighbours as free (:func:`for_compiled_packing`).
            Default (``None``): yes where the regions compile with Inductor (no
            ``backend`` in ``compile_kwargs``, or ``"inductor"``), no otherwise. On an
            H100 (2026-12-07) compiled plans priced so ran 0.98-1.07x the speed of
            plans priced with eager op times at the same budgets (README). Give ``profile_``
            as :func:`~hyperrec.autoac.profiler.profile` made it (not already through
            :func:`for_compiled_packing`).
        calibrate_none: with ``compile=True``, compile the plan for the budgets
            (without packing) once and fit the held bytes of the regions it leaves
            un-checkpointed, and of regions with the same ops, to what their graphs save
            before planning (:func:`calibrate_none`; one more compiled step), and
            (0.1.22) their backwards to what the compiled backwards allocate (a second
            step). Nothing is calibrated where that plan checkpoints every region.
            Experimental and off by default (measured at two budgets per benchmark
            model on one GPU: exact predictions, level or no faster; README).
        partitioner_fractions: with ``compile=True`` and a step ``budget``: also try
            torch's own choice, every region compiled with AOTAutograd's partitioner at
            ``activation_memory_budget`` = each of these fractions
            (:func:`~hyperrec.autoac.planner.partitioner_plan`), and keep, of autoac's
            plan and these, the one whose step ran fastest with a measured peak within
            ``budget`` (autoac's plan where none fits). Each candidate compiles the
            regions once more and runs :data:`SEARCH_STEPS` timed steps (peaks: the CUDA
            allocator; on the CPU the allocator's events, else the graph-priced
            prediction). What was measured is in :attr:`AutoAC.search`, and each plan
            is logged as it is measured (logger ``"hyperrec.autoac"``, INFO).
            Experimental, off by default (``()``); see the README for where it helps.
        profile_: a :class:`~hyperrec.autoac.profiler.Profile` of this model and step
            (from :func:`~hyperrec.autoac.profiler.profile`), used instead of profiling
            the step again: put the plans for several budgets in force one after
            another (``.remove()`` the previous one first) at the cost of one profile.
            ``regions`` and ``profile_config`` must then be left out (the profile's
            apply); ``formats``, if given, must be among the profile's formats and
            limit the plan to them (as ``PlanConfig(formats=...)``), else the plan may
            use every format the profile measured. ``step_fn`` (or ``sample_inputs``)
            is still needed: compiled pricing and the verification run it. Nothing
            checks that the profile was made with this step's shapes: a profile of
            smaller inputs predicts too low a peak, which only the verification's
            measured peak shows (and replans on); keep ``verify=True`` with it.

    Returns:
        :class:`AutoAC` (``.plan``, ``.profile``, ``.verification``, ``.remove()``). On
        an error after the plan was put in force (pricing, verification), the model's
        regions are taken off again before it propagates.

    Raises:
        TypeError: bad argument types (each checked before the step is profiled).
        ValueError: no step given, no budget given (except with ``"pack_all"``, which
            needs ``formats`` instead; a budget given with it can also fail after the
            verification drops a class over the gradient bound: the plan then packs
            less), ``loss_fn`` with ``step_fn``, bad budgets
            (naming the smallest feasible), bad regions, ``formats`` other than
            ``("mxint8",)`` with ``compile=True`` (or any where packing in compiled
            graphs is not supported); with ``profile_``: ``regions`` or
            ``profile_config`` given, ``formats`` the profile did not measure, or
            ``formats`` together with ``plan_config.formats``; ``fused_recompute=True``,
            ``calibrate_none=True`` or ``partitioner_fractions`` without
            ``compile=True``; ``partitioner_fractions`` without a step ``budget``, with
            ``region_budgets``, with a fraction outside [0, 1] or with
            ``torch.distributed`` initialised on more than one rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_bool("verify", verify)
    _check_no_plan_in_force(model)  # before the (expensive) profiled step
    if replan_peak is None:
        dist = torch.distributed
        replan_peak = not (dist.is_available() and dist.is_initialized()
                           and dist.get_world_size() > 1)  # fmt: skip
    check_bool("replan_peak", replan_peak)
    check_bool("compile", compile)
    check_bool("calibrate_none", calibrate_none)
    if calibrate_none and not compile:
        raise ValueError(
            "calibrate_none=True needs compile=True: it fits the regions to what their "
            "compiled graphs save"
        )
    fractions = _check_partitioner_fractions(partitioner_fractions, compile, budget, region_budgets)
    if fused_recompute is not None:
        check_bool("fused_recompute", fused_recompute)
        if fused_recompute and not compile:
            raise ValueError(
                "fused_recompute=True needs compile=True: eager regions run every "
                "recomputed op as a kernel of its own"
            )
    # Everything that can be checked before the (expensive) profiled step.
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)):
        raise TypeError(f"budget must be a number of bytes, got {type(budget).__name__} {budget!r}")
    if region_budgets is not None and not isinstance(region_budgets, Mapping):
        raise TypeError(
            f"region_budgets must be a mapping of region name to bytes, got "
            f"{type(region_budgets).__name__}"
        )
    if plan_config is not None and not isinstance(plan_config, PlanConfig):
        raise TypeError(f"plan_config must be a PlanConfig, got {type(plan_config).__name__}")
    pack_all = plan_config is not None and plan_config.strategy == "pack_all"
    if budget is None and not region_budgets and not pack_all:
        raise ValueError("budget or region_budgets must be given, got neither")
    if profile_config is not None and not isinstance(profile_config, ProfileConfig):
        raise TypeError(
            f"profile_config must be a ProfileConfig, got {type(profile_config).__name__}"
        )
    _check_compile_kwargs(compile_kwargs)
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if step_fn is not None:
            raise ValueError("loss_fn goes with sample_inputs; step_fn returns the loss itself")
    if step_fn is None:
        if sample_inputs is None:
            raise ValueError("step_fn or sample_inputs must be given, got neither")
        if not isinstance(sample_inputs, tuple):
            raise TypeError(f"sample_inputs must be a tuple, got {type(sample_inputs).__name__}")
        lf = _default_loss if loss_fn is None else loss_fn

        def step_fn(m: nn.Module) -> torch.Tensor:
            return lf(m(*sample_inputs))

    elif sample_inputs is not None:
        raise ValueError("give step_fn or sample_inputs, not both")
    if not isinstance(formats, tuple):
        raise TypeError(f"formats must be a tuple, got {type(formats).__name__}")
    for f in formats:
        check_choice("formats entry", f, SAVE_FORMATS)
    if compile and formats:
        if not compiled_packing_supported():
            raise ValueError(
                "formats must be () with compile=True on this torch: it does not inline "
                "saved-tensor hooks into compiled graphs, so packed saves would run eagerly"
            )
        eager_only = [f for f in formats if f not in COMPILED_FORMATS]
        if eager_only:
            raise ValueError(
                f"formats with compile=True must be from {COMPILED_FORMATS} (packed inside "
                f"the compiled graphs), got {eager_only}, which pack eagerly only"
            )
    if profile_ is not None:
        plan_config = _with_profile(profile_, regions, profile_config, formats, plan_config)
        prof = profile_
    else:
        pc = ProfileConfig() if profile_config is None else profile_config
        if formats:
            pc = replace(pc, formats=formats)
        prof = profile(model, step_fn, regions=regions, config=pc)
    if compile and (plan_config is None or plan_config.formats is None):
        # a packed save in a format the graphs cannot pack would run its region eagerly
        # (the profile's formats may come from profile_config or profile_, unchecked)
        compiled = COMPILED_FORMATS if compiled_packing_supported() else ()
        plan_config = replace(
            plan_config or PlanConfig(),
            formats=tuple(f for f in prof.config.formats if f in compiled),
        )
    if compile:
        fused = _inductor(compile_kwargs) if fused_recompute is None else fused_recompute
        prof = for_compiled_packing(prof, fused_recompute=fused)
        if calibrate_none:
            prof = _calibrated(
                model, prof, step_fn, budget, region_budgets, plan_config, compile_kwargs
            )
    p = plan(prof, budget=budget, region_budgets=region_budgets, config=plan_config)
    handle = AutoAC(model, p, profile_=prof, compiled=compile, compile_kwargs=compile_kwargs)
    try:
        planned = budget
        planned_regions = dict(region_budgets) if region_budgets else None
        if compile:
            planned, planned_regions = _price_within_budget(
                handle, step_fn, budget, region_budgets, plan_config, replan_peak
            )
        if fractions:
            assert budget is not None  # _check_partitioner_fractions
            _search_partitioner(handle, step_fn, budget, fractions)
        if verify:
            _verify(
                handle,
                step_fn,
                budget,
                region_budgets,
                plan_config,
                replan_peak,
                planned,
                planned_regions,
            )
    except BaseException:
        # no handle reaches the caller: leave the model as it was given
        handle.remove()
        raise
    return handle


#: Timed steps per plan in ``apply(partitioner_fractions=...)``'s search (after one
#: untimed step that compiles it); the median decides.
SEARCH_STEPS = 5

#: Progress of long work (the search logs each plan it measured at INFO).
_log = logging.getLogger("hyperrec.autoac")


def _log_row(row: dict[str, Any]) -> None:
    what = row["plan"] + ("" if row.get("fraction") is None else f" {row['fraction']:g}")
    if row["plan"] == "mixed":
        what += f" {row['low']:g}/{row['high']:g} ({len(row['high_regions'])} at {row['high']:g})"
    if "error" in row:
        _log.info("autoac search: %s failed: %s", what, row["error"])
    else:
        _log.info("autoac search: %s: peak %.3f GiB%s, %.3f ms", what,
                  row["peak_bytes"] / 2**30, "" if row["fits"] else " (over the budget)",
                  row["time_s"] * 1e3)  # fmt: skip


def _check_partitioner_fractions(
    fractions: Any, compile: bool, budget: float | None, region_budgets: Any
) -> tuple[float, ...]:
    if not isinstance(fractions, tuple):
        raise TypeError(
            f"partitioner_fractions must be a tuple of floats, got {type(fractions).__name__}"
        )
    out = tuple(check_fraction("partitioner_fractions entry", f) for f in fractions)
    if not out:
        return out
    if not compile:
        raise ValueError(
            "partitioner_fractions needs compile=True: the partitioner is torch.compile's"
        )
    if budget is None or region_budgets:
        raise ValueError(
            "partitioner_fractions needs a step budget and no region_budgets: the "
            "partitioner's plans are checked against the step's measured peak only"
        )
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "partitioner_fractions is not supported with torch.distributed on more than "
            "one rank: the search chooses by measured step times and peaks, which differ "
            "between ranks, so ranks could put different plans in force"
        )
    return tuple(dict.fromkeys(out))  # each fraction once, in the order given


def _measure_compiled(
    handle: AutoAC, step_fn: Callable[[nn.Module], torch.Tensor]
) -> tuple[int, str, list[float]]:
    """Peak (and where it came from) and step times of the compiled plan in force: one
    step to compile, one measured for the peak, :data:`SEARCH_STEPS` timed."""
    model, prof = handle.model, handle.profile
    assert prof is not None
    seed = prof.config.seed
    measure_step(model, step_fn, track=False, seed=seed)
    if _device_of(model).type == "cuda":
        peak = measure_step(model, step_fn, track=False, seed=seed).peak_bytes
        source = "cuda"
    else:
        peak, source = _cpu_compiled_peak(handle, step_fn)
    times = [
        measure_step(model, step_fn, track=False, seed=seed).time_s for _ in range(SEARCH_STEPS)
    ]
    return int(peak), source, times


def _cpu_compiled_peak(
    handle: AutoAC, step_fn: Callable[[nn.Module], torch.Tensor]
) -> tuple[int, str]:
    """Peak of one compiled step on the CPU, counted as the profile counts it, and where
    it came from: the allocator's events (autoac's tracker would run the compiled
    regions eagerly), else (no kineto) the plan's graph-priced prediction."""
    model, prof = handle.model, handle.profile
    assert prof is not None
    if not torch.profiler.kineto_available():  # pragma: no cover - CPU builds without it
        return handle.plan.predicted_peak, "predicted"
    saved = grads_of(model)
    set_grads(model, None)
    try:
        # the step only: measure_step's saved RNG state is not the step's
        with torch.random.fork_rng(devices=[]):
            if prof.config.seed is not None:
                _seed_all(prof.config.seed, _device_of(model))
            got, _ = allocation_peak(lambda: backward_sparing_inputs(model, step_fn(model)))
    finally:
        set_grads(model, saved)
    return prof.resident_bytes + got, "cpu_events"


def _search_partitioner(
    handle: AutoAC,
    step_fn: Callable[[nn.Module], torch.Tensor],
    budget: float,
    fractions: tuple[float, ...],
) -> None:
    """Measure autoac's plan in force and :func:`partitioner_plan` at each fraction,
    then mixes of two neighbouring fractions (see :func:`_mix_order`); leave in force
    the fastest whose measured peak is within ``budget`` (autoac's plan where none is),
    the measurements in ``handle.search``."""
    prof = handle.profile
    assert prof is not None
    rows: list[dict[str, Any]] = []
    # row index -> the plan measured there, as compiled (see _restore_plan)
    tried: dict[int, tuple[Plan, dict[str, float]]] = {}

    def measure(row: dict[str, Any]) -> int:
        """Measure the plan in force into a new row; its index."""
        peak, source, times = _measure_compiled(handle, step_fn)
        tried[len(rows)] = (handle.plan, handle._runner.fractions)
        rows.append({**row, "peak_bytes": peak, "peak_source": source,
                     "time_s": statistics.median(times), "times_s": times,
                     "fits": peak <= budget, "chosen": False})  # fmt: skip
        _log_row(rows[-1])
        return len(rows) - 1

    def attempt(p: Plan, row: dict[str, Any]) -> int | None:
        """Put a candidate in force and measure it: its row, or ``None`` if it failed."""
        try:
            _set_plan(handle, p, step_fn)
            return measure(row)
        except Exception as err:  # a candidate, not the user's plan
            # Any failure of a candidate's steps (a backend error; a region that graph-
            # breaks, which a partitioner region compiles without: see
            # _compile_with_budget) leaves it out; the plans measured before stay.
            rows.append({**row, "fits": False, "chosen": False,
                         "error": f"{type(err).__name__}: {_last_line(err)}"})  # fmt: skip
            _log_row(rows[-1])
            return None

    measure({"plan": "autoac", "fraction": None})  # autoac's own: its errors propagate
    uniform: dict[float, int] = {}
    for f in fractions:
        k = attempt(
            partitioner_plan(prof, f, budget=budget), {"plan": "partitioner", "fraction": f}
        )
        if k is not None:
            uniform[f] = k
    order = sorted(uniform)
    for lo, hi in zip(order, order[1:]):
        i, j = uniform[lo], uniform[hi]
        if not rows[i]["fits"] or rows[j]["fits"]:
            continue
        switched = _mix_order(prof, budget, tried[i][0], tried[j][0], rows[i]["peak_bytes"])
        # a mix measured over the budget gives back its last switches (twice at most)
        for _ in range(3):
            if not switched:
                break
            mix = {r.name: lo for r in tried[i][0].regions if r.mode == "partitioner"}
            mix.update(dict.fromkeys(switched, hi))
            row = {"plan": "mixed", "fraction": None, "low": lo, "high": hi,
                   "high_regions": list(switched)}  # fmt: skip
            k = attempt(partitioner_plan(prof, mix, budget=budget), row)
            if k is None or rows[k]["fits"]:
                break
            switched = switched[:-1]
    fitting = [i for i in tried if rows[i]["fits"]]
    pick = min(fitting, key=lambda i: rows[i]["time_s"]) if fitting else 0
    rows[pick]["chosen"] = True
    plan_, fractions_ = tried[pick]
    if handle.plan is not plan_ or handle._runner.fractions is not fractions_:
        _restore_plan(handle, plan_, fractions_)
    handle.search = rows


def _mix_order(profile_: Profile, budget: float, low: Plan, high: Plan, low_peak: int) -> list[str]:
    """Regions of the uniform partitioner plan ``low`` (priced from its graphs, measured
    at ``low_peak``) to give ``high``'s fraction, in order, while the predicted peak
    stays within ``budget``: each step takes the region whose switch predicts the least
    peak. Predictions are the graph-priced ones (:func:`price_compiled_saves` with each
    region's bytes from the uniform plan of its fraction), shifted by what ``low``'s
    measured peak differs from its prediction (the backward's working set is priced
    from the eager trace)."""
    held: dict[tuple[float, str], int] = {}
    for p in (low, high):
        for r in p.regions:
            if r.fraction is not None:
                held[(r.fraction, r.name)] = r.held_bytes - r.input_bytes
    lo, hi = (next(r.fraction for r in p.regions if r.fraction is not None) for p in (low, high))
    mix = {r.name: lo for r in low.regions if r.fraction is not None}
    shift = low_peak - low.predicted_peak

    # regions left with the default partition are priced as ``low``'s graphs held them
    # (as ``shift`` was measured), not at the eager profile's bytes
    fixed = {r.name: r.held_bytes - r.input_bytes for r in low.regions if r.fraction is None}

    # the un-checkpointed trace every mix is priced against (its fractions do not enter
    # the pricing, only the bytes handed to it)
    base = partitioner_plan(profile_, mix)

    def peak(m: dict[str, float]) -> int:
        saved = {**fixed, **{n: held[(f, n)] for n, f in m.items()}}
        return price_compiled_saves(base, profile_, saved).predicted_peak

    out: list[str] = []
    while True:
        options = [(peak({**mix, n: hi}), n) for n, f in mix.items() if f == lo]
        if not options:
            return out
        best, name = min(options)
        if best + shift > budget:
            return out
        mix[name] = hi
        out.append(name)


def _inductor(compile_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether ``torch.compile(**compile_kwargs)`` compiles with Inductor."""
    return bool((compile_kwargs or {}).get("backend", "inductor") == "inductor")


def _with_profile(
    profile_: Any,
    regions: Any,
    profile_config: ProfileConfig | None,
    formats: tuple[str, ...],
    plan_config: PlanConfig | None,
) -> PlanConfig | None:
    """``apply``'s checks of a given profile; the plan config limited to ``formats``."""
    if not isinstance(profile_, Profile):
        raise TypeError(f"profile_ must be a Profile, got {type(profile_).__name__}")
    if regions is not None:
        raise ValueError("regions must be left out with profile_: the profile's regions apply")
    if profile_config is not None:
        raise ValueError(
            "profile_config must be left out with profile_: the step is not profiled again"
        )
    if not formats:
        return plan_config
    missing = [f for f in formats if f not in profile_.config.formats]
    if missing:
        raise ValueError(
            f"formats {missing} were not measured by profile_ (its formats: "
            f"{profile_.config.formats}); profile with them"
        )
    if plan_config is not None and plan_config.formats is not None:
        raise ValueError(
            "give formats or plan_config.formats with profile_, not both "
            f"(got {formats} and {plan_config.formats})"
        )
    return replace(plan_config or PlanConfig(), formats=formats)


def _set_plan(handle: AutoAC, plan_: Plan, step_fn: Callable[[nn.Module], torch.Tensor]) -> None:
    """Put ``plan_`` in force; a compiled handle's plan priced from its graphs."""
    handle.set_plan(plan_)
    if handle.compiled:
        assert handle.profile is not None
        handle.plan = price_compiled(handle, step_fn, seed=handle.profile.config.seed)


#: What a region that does not compile raises from its first call.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.BackendCompilerFailed,)


def _last_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    # torch's compile errors end with a hint on verbose logging; the cause is before it
    lines = [ln for ln in lines if not ln.startswith(("Set TORCH", "For even more"))]
    return lines[-1][:200] if lines else ""


def _region_overshoots(plan_: Plan, region_budgets: Mapping[str, float] | None) -> dict[str, int]:
    """Bytes by which each budgeted region of ``plan_`` holds more than its budget."""
    if not region_budgets:
        return {}
    return {
        r.name: int(r.held_bytes - region_budgets[r.name])
        for r in plan_.regions
        if r.name in region_budgets and r.held_bytes > region_budgets[r.name]
    }


def _price_within_budget(
    handle: AutoAC,
    step_fn: Callable[[nn.Module], torch.Tensor],
    budget: float | None,
    region_budgets: Mapping[str, float] | None,
    plan_config: PlanConfig | None,
    replan: bool,
) -> tuple[float | None, dict[str, float] | None]:
    """Price a compiled handle's plan from its graphs and, while that prediction is over
    ``budget`` or a region holds more than its budget, plan again with the planner's
    budgets lowered by the overshoot (as the verification does with a measured one);
    while it is under a step ``budget`` by more than :data:`PEAK_TOLERANCE` of it, plan
    again with the planner's budget raised by the headroom, kept only if the new plan,
    priced from its graphs, still fits and adds less time. Returns the planner's last
    budgets (step, per region)."""
    prof = handle.profile
    assert prof is not None
    handle.plan = price_compiled(handle, step_fn, seed=prof.config.seed)
    planned = budget
    planned_regions = dict(region_budgets) if region_budgets else None
    # the least planner budget whose plan was priced over ``budget``, and those plans:
    # a raise after a lowering goes no higher, nor back to one of them
    ceiling: float | None = None
    over_plans: list[Any] = []
    for _ in range(MAX_PEAK_REPLANS):
        over = handle.plan.predicted_peak - budget if budget is not None else 0
        region_over = _region_overshoots(handle.plan, region_budgets)
        if not replan:
            break
        if over <= 0 and not region_over:
            # The graphs save less than the eager profile predicted (the partitioner
            # recomputes element-wise ops of regions kept whole): plans on the eager
            # prices leave memory unused that would spare recomputation.
            raised = _raise_into_headroom(handle, step_fn, budget, planned, region_budgets,
                                          plan_config, ceiling, over_plans)  # fmt: skip
            if raised is None:
                break
            planned = raised
            continue
        lowered = planned
        if planned is not None and over > 0:
            if planned <= handle.plan.floor:
                break
            ceiling = planned if ceiling is None else min(ceiling, planned)
            over_plans.append(_decisions(handle.plan))
            # no lower than the floor: the planner rejects budgets below it
            lowered = max(planned - over, handle.plan.floor)
        lowered_regions = planned_regions
        if region_over and planned_regions is not None:
            lowered_regions = {n: b - region_over.get(n, 0) for n, b in planned_regions.items()}
        try:
            p = plan(prof, budget=lowered, region_budgets=lowered_regions, config=plan_config)
        except ValueError:
            # a region's budget lowered below its floor: no plan holds it in the graphs
            break
        previous, fractions = handle.plan, handle._runner.fractions
        try:
            _set_plan(handle, p, step_fn)
        except _COMPILE_ERRORS as err:
            # Some plans do not compile (torch 2.13's Inductor, a selective checkpoint
            # with a packed save: "could not find saved tensor ... in bw_g_inputs"):
            # keep the plan that did, and say what it misses below.
            _restore_plan(handle, previous, fractions)
            warnings.warn(
                f"autoac: the plan replanned for the budgets did not compile "
                f"({type(err).__name__}: {_last_line(err)}); "
                "keeping the previous plan",
                stacklevel=3,
            )
            break
        planned, planned_regions = lowered, lowered_regions
    region_over = _region_overshoots(handle.plan, region_budgets)
    if region_over:
        warnings.warn(
            "autoac: priced from the compiled graphs, these regions hold more than their "
            f"budgets (bytes over): {region_over}",
            stacklevel=3,
        )
    return planned, planned_regions


def _raise_into_headroom(
    handle: AutoAC,
    step_fn: Callable[[nn.Module], torch.Tensor],
    budget: float | None,
    planned: float | None,
    region_budgets: Mapping[str, float] | None,
    plan_config: PlanConfig | None,
    ceiling: float | None = None,
    over_plans: Sequence[Any] = (),
) -> float | None:
    """One upward replan of :func:`_price_within_budget`: the planner's budget raised by
    the priced plan's headroom under ``budget`` (to ``ceiling`` at most, and not to a
    plan of ``over_plans``, the decisions already priced over ``budget``). Returns the
    raised budget if its plan is now in force (priced, within ``budget``, less added
    time), else ``None`` with the plan in force unchanged."""
    current, fractions = handle.plan, handle._runner.fractions
    if budget is None or planned is None or region_budgets:
        return None
    headroom = budget - current.predicted_peak
    if headroom <= PEAK_TOLERANCE * budget or current.added_s <= 0:
        return None
    raised = planned + headroom if ceiling is None else min(planned + headroom, ceiling)
    if raised <= planned:
        return None
    prof = handle.profile
    assert prof is not None
    try:
        p = plan(prof, budget=raised, config=plan_config)
    except ValueError:
        return None
    if _decisions(p) in (_decisions(current), *over_plans) or p.added_s >= current.added_s:
        return None
    try:
        _set_plan(handle, p, step_fn)
    except _COMPILE_ERRORS:
        _restore_plan(handle, current, fractions)
        return None
    if handle.plan.predicted_peak > budget:
        _restore_plan(handle, current, fractions)  # priced over: the lower plan stays
        return None
    return raised


def _restore_plan(handle: AutoAC, priced: Plan, fractions: dict[str, float]) -> None:
    """Put back a plan priced from its graphs, compiled as it was priced: its regions'
    ``held_bytes`` are now the graphs', and the ``"memory_budget"`` mechanism would
    otherwise compile it with the fractions of those (another partition)."""
    handle.set_plan(priced)
    handle._runner.fractions = fractions


def _decisions(p: Plan) -> list[tuple[str, str, dict[tuple[str, int], str]]]:
    return [(r.name, r.mode, r.saves) for r in p.regions]


def price_compiled(
    handle: AutoAC, step_fn: Callable[[nn.Module], torch.Tensor], *, seed: int | None = 0
) -> Plan:
    """The plan in force priced from what its compiled regions' graphs save.

    Runs one step of ``handle.model`` with its regions compiled (not under a dispatch
    mode: this works on any device and backend, Inductor included) and reads, for each
    compiled region, the tensors the autograd node its call created holds for the
    backward (see ``_compiled_saves``): the bytes the region holds from its forward to
    its backward, packed or not, beyond its inputs and parameters. The plan's
    prediction is then corrected region by region with
    :func:`~hyperrec.autoac.planner.price_compiled_saves`. Regions that run eagerly
    (packed in formats compiled graphs cannot pack) keep the profile's prices. The
    step's gradients are discarded (parameter ``.grad`` restored); the compiled graphs
    stay compiled for the training steps after.

    Args:
        handle: from :func:`apply_plan` / :func:`apply` with ``compile=True`` and a
            profile (``handle.profile``; :func:`apply` sets it).
        step_fn: the profiled step (``step_fn(model) -> loss``).
        seed: as for :func:`measure_step`.

    Returns:
        The priced :class:`~hyperrec.autoac.planner.Plan` (``pricing="compiled"``); the
        handle's plan is not changed (assign ``handle.plan`` to keep it).

    Raises:
        TypeError: ``handle`` not an :class:`AutoAC`; bad ``step_fn``/``seed``.
        ValueError: ``handle`` does not compile its regions, has no profile, or its plan
            carries no live bytes (a loaded plan).
    """
    if not isinstance(handle, AutoAC):
        raise TypeError(f"handle must be an AutoAC, got {type(handle).__name__}")
    if not handle.compiled:
        raise ValueError("handle must run its regions compiled (apply_plan(..., compile=True))")
    if handle.profile is None:
        raise ValueError("handle must carry the profile its plan was made from (handle.profile)")
    return price_compiled_saves(handle.plan, handle.profile, _graph_saves(handle, step_fn, seed))


def _graph_saves(
    handle: AutoAC, step_fn: Callable[[nn.Module], torch.Tensor], seed: int | None
) -> dict[str, int]:
    """Region name -> bytes its compiled graph saves for the backward (one step)."""
    runner = handle._runner
    runner.probe = {}
    try:
        measure_step(handle.model, step_fn, track=False, seed=seed)
        return {n: sum(s.values()) for n, s in runner.probe.items()}
    finally:
        runner.probe = None


def _backward_bytes(
    handle: AutoAC, step_fn: Callable[[nn.Module], torch.Tensor], seed: int | None
) -> dict[str, int]:
    """Region name -> the most bytes its compiled backward allocated beyond what was
    allocated when it started (one step, after one that compiled the regions: a
    backward graph compiles on its first call)."""
    runner = handle._runner
    probe = BackwardProbe(_device_of(handle.model))
    runner.backward_probe = probe
    try:
        return probe.run(lambda: measure_step(handle.model, step_fn, track=False, seed=seed))
    finally:
        runner.backward_probe = None


def calibrate_none(
    profile_: Profile,
    plan_: Plan,
    saved: Mapping[str, int],
    backward: Mapping[str, int] | None = None,
) -> Profile:
    """``profile_`` with each un-checkpointed region's held bytes fitted to what its
    compiled graph saves (experimental, 0.1.21; the backward fit 0.1.22).

    The profile prices an un-checkpointed region at every tensor the eager step saved;
    AOTAutograd's partitioner saves less: it recomputes element-wise ops in the backward
    (on the CPU a Llama block's compiled graph held 78% of the eager bytes). The planner
    then checkpoints regions it could leave whole. For each region that ``plan_`` leaves
    un-checkpointed (and packs nothing in) and ``saved`` names, the ops Inductor fuses
    (:func:`fuses`) get :attr:`~hyperrec.autoac.profiler.SavedOp.none_held` set so that
    the region's un-checkpointed bytes match ``saved`` (in ``[0, 1]``: a graph that saves
    more than the eager step, or less than the other ops alone, is matched as far as the
    fraction allows). Every other region whose fused ops are those of a calibrated region
    (same ops, same bytes: the identical layers of a stack) gets that region's fraction
    (the largest, where several differ). :func:`price_compiled` still prices every plan
    from its graphs.

    ``backward`` (0.1.22) does the same for what such a region's backward allocates: the
    eager step's backward allocates every element-wise gradient, which a compiled
    backward fuses away (on the CPU the last layer of a small HSTU tower allocated 0.035
    GiB compiled against 0.074 in the trace; the step's peak lies in that backward). Each
    measured un-checkpointed region, and every region with the same ops, gets
    :attr:`~hyperrec.autoac.profiler.RegionProfile.none_backward_bytes`: the planner then
    caps the region's un-checkpointed backward at those bytes above the live bytes where
    it starts (or raises it to them).

    Args:
        profile_: the profile ``plan_`` was made from (already calibrated or not: the
            fractions are fitted from the bytes ``profile_`` prices).
        plan_: a plan priced from ``profile_`` (not :func:`price_compiled`'s) whose
            un-checkpointed regions were compiled and measured; ``apply`` uses the plan
            for the budget asked for, without packing, so that the measured step fits
            the budget.
        saved: region name -> bytes its compiled graph saved beyond its inputs and
            parameters (as :func:`price_compiled` reads them).
        backward: region name -> the most bytes its compiled backward allocated beyond
            what was allocated when it started (``None``: not measured). Only regions
            ``plan_`` leaves un-checkpointed are used.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``plan_``'s regions are not ``profile_``'s, ``plan_`` priced from
            compiled graphs, ``saved`` or ``backward`` naming other regions or negative
            bytes.
    """
    check_saves_args(plan_, profile_, saved, "profile_")
    if backward is not None and not isinstance(backward, Mapping):
        raise TypeError(
            f"backward must be a mapping of region name to bytes or None, got {backward!r}"
        )
    if [r.name for r in plan_.regions] != [r.name for r in profile_.regions]:
        raise ValueError("plan_ must be a plan of profile_'s regions")
    if plan_.pricing != "profile":
        # its held bytes are already the graphs': nothing would be calibrated
        raise ValueError(
            f"plan_ must be priced from profile_ (pricing 'profile'), got {plan_.pricing!r}"
        )
    names = {r.name for r in plan_.regions}
    for what, given in (("saved", saved), ("backward", backward or {})):
        unknown = sorted(map(str, set(given) - names))
        if unknown:
            raise ValueError(f"{what} names regions {unknown} that plan_ does not have")
    checked = {n: check_int(f"saved[{n!r}]", v, minimum=0) for n, v in saved.items()}
    bwd = {n: check_int(f"backward[{n!r}]", v, minimum=0) for n, v in (backward or {}).items()}

    fused_of = {
        r.name: [o for o in r.ops if o.needed and not o.is_input and fuses(o.op)]
        for r in profile_.regions
    }
    # same fused ops, same bytes: the identical layers of a stack
    signature = {n: tuple((o.key, o.op, o.nbytes) for o in ops) for n, ops in fused_of.items()}
    # every op, for the backward: a region's backward allocates for all of them
    layer = {r.name: tuple((o.key, o.op, o.nbytes) for o in r.ops) for r in profile_.regions}
    fitted: dict[str, float] = {}
    by_signature: dict[tuple[Any, ...], float] = {}
    bwd_of: dict[str, int] = {}
    bwd_by_layer: dict[tuple[Any, ...], int] = {}
    for r, rp in zip(profile_.regions, plan_.regions):
        if rp.mode != "none" or any(d in SAVE_FORMATS for d in rp.saves.values()):
            continue  # only what an unpacked un-checkpointed region measured
        if r.name in bwd:
            bwd_of[r.name] = bwd[r.name]
            bwd_by_layer[layer[r.name]] = max(bwd_by_layer.get(layer[r.name], 0), bwd[r.name])
        fused = fused_of[r.name]
        fused_bytes = sum(lv.nbytes for o in fused for lv in o.storages if lv.needed)
        if r.name not in saved or fused_bytes == 0:
            continue
        # the fused ops' bytes as profile_ prices them now (a calibrated profile: less)
        priced = sum(o.none_held_bytes(lv) for o in fused for lv in o.storages if lv.needed)
        excess = (rp.held_bytes - rp.input_bytes) - checked[r.name]
        fitted[r.name] = min(max((priced - excess) / fused_bytes, 0.0), 1.0)
        sig = signature[r.name]
        by_signature[sig] = max(by_signature.get(sig, 0.0), fitted[r.name])
    regions = []
    for r in profile_.regions:
        frac = fitted.get(r.name, by_signature.get(signature[r.name]))
        fused = fused_of[r.name]
        nb = bwd_of.get(r.name, bwd_by_layer.get(layer[r.name]) if r.ops else None)
        if nb is not None and "sac" in r.modes:
            # (a region profiled un-checkpointed only is never fitted: nothing set)
            r = replace(r, none_backward_bytes=nb)
        if frac is None or not fused:
            regions.append(r)
            continue
        ids = {id(o) for o in fused}
        ops = tuple(replace(o, none_held=frac) if id(o) in ids else o for o in r.ops)
        regions.append(replace(r, ops=ops))
    return replace(profile_, regions=tuple(regions))


def _calibrated(
    model: nn.Module,
    prof: Profile,
    step_fn: Callable[[nn.Module], torch.Tensor],
    budget: float | None,
    region_budgets: Mapping[str, float] | None,
    plan_config: PlanConfig | None,
    compile_kwargs: Mapping[str, Any] | None,
) -> Profile:
    """:func:`calibrate_none` from one compiled step of the plan for the budgets asked
    for (unbounded where none is given), unpacked: the step fits the budget (the eager
    prices of un-checkpointed regions are the high ones being corrected)."""
    # kept, not packed, whatever the plan will be (calibrate_none fits the keep prices;
    # "pack_all" would pack every save); allow_none as asked
    config = replace(plan_config or PlanConfig(), strategy="fastest", formats=())
    if budget is None and not region_budgets:
        budget = 1e18
    try:
        probe = plan(prof, budget=budget, region_budgets=region_budgets, config=config)
    except ValueError:
        # no unpacked plan within the budgets ("pack_all" may be asked for less than
        # the floor): nothing to measure; the plan itself says what is wrong, if anything
        return prof
    if all(r.mode != "none" for r in probe.regions):
        return prof  # nothing to calibrate: no compiled step
    h = AutoAC(model, probe, profile_=prof, compiled=True, compile_kwargs=compile_kwargs)
    try:
        saved = _graph_saves(h, step_fn, prof.config.seed)
        backward = _backward_bytes(h, step_fn, prof.config.seed)
    finally:
        h.remove()
    return calibrate_none(prof, probe, saved, backward)


#: Op packets Inductor fuses into the kernels around them besides those torch tags
#: ``pointwise`` (the decomposed norms, softmax and reductions, casts, copies).
_FUSED_PACKETS = frozenset(
    {
        "aten._to_copy",
        "aten.clone",
        "aten.sum",
        "aten.mean",
        "aten.amax",
        "aten.var_mean",
        "aten._softmax",
        "aten._safe_softmax",
        "aten._log_softmax",
        "aten.native_layer_norm",
        "aten._fused_rms_norm",
    }
)


def fuses(op: str) -> bool:
    """Whether Inductor fuses ``op`` (a profiled op name, ``"aten.silu.default"``) into
    the kernels around it, so that recomputing it in a compiled backward adds no pass of
    its own: the ops torch tags ``pointwise`` and :data:`_FUSED_PACKETS`. Matmuls,
    attention kernels, custom ops and anything not resolvable return ``False``; so do
    random ops (``native_dropout``): torch's partitioner does not recompute them unless
    the RNG ops are functionalised, so their recomputation is not free there."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return False
    try:
        overload = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return False
    if f"aten.{parts[1]}" in _FUSED_PACKETS:
        return True
    return torch.Tag.pointwise in getattr(overload, "tags", ())


def for_compiled_packing(profile_: Profile, *, fused_recompute: bool = False) -> Profile:
    """``profile_`` with the pack costs a compiled region pays, for :func:`plan`.

    The profile times a pack and an unpack as eager calls back to back: a per-call term
    (the host's Python path, 56-144 us on the H200) plus a per-element one (the device
    pass). Traced into a compiled graph (:data:`COMPILED_FORMATS`) there is no call: the
    per-call terms are dropped and the per-element ones kept, the time of a standalone
    pass, which is an upper bound on what the pack costs fused into its neighbours.
    Other formats keep their eager costs (those regions run eagerly). The regions'
    inputs are not offered for packing (0.1.18): a graph's packing hooks see the nodes
    it saves, not the call's inputs, so a region packing one would run eagerly.

    With ``fused_recompute`` (for Inductor), recomputing an op Inductor fuses into its
    neighbours (:func:`fuses`: element-wise ops, casts, decomposed norms and softmax) is
    priced as free, as torch's partitioner prices it (by FLOPs) for
    ``activation_memory_budget``: the eager profile times each such op as a kernel of its
    own, which a compiled backward does not launch. Matmuls and attention keep their
    measured times.

    Raises:
        TypeError: ``profile_`` not a :class:`~hyperrec.autoac.profiler.Profile`,
            ``fused_recompute`` not a bool.
    """
    if not isinstance(profile_, Profile):
        raise TypeError(f"profile_ must be a Profile, got {type(profile_).__name__}")
    check_bool("fused_recompute", fused_recompute)
    if fused_recompute:
        regions = tuple(
            replace(
                r,
                ops=tuple(
                    replace(o, time_s=0.0) if not o.is_input and fuses(o.op) else o for o in r.ops
                ),
            )
            for r in profile_.regions
        )
        profile_ = replace(profile_, regions=regions)
    costs = {
        f: ({**c, "pack_call_s": 0.0, "unpack_call_s": 0.0} if f in COMPILED_FORMATS else c)
        for f, c in profile_.pack_costs.items()
    }
    return restrict(replace(profile_, pack_costs=costs), {(INPUT, f) for f in SAVE_FORMATS})


#: ``apply(..., verify=True)`` plans again with a lower budget while the measured peak
#: exceeds the budget asked for by more than this fraction of it: a plan's peak is
#: predicted from the profiled step, and a compiled graph saves other tensors (the
#: partitioner chooses, packing hooks take whole op classes): on an H200 compiled plans
#: with MXINT8 saves peaked 3-8% above their budgets (README).
PEAK_TOLERANCE = 0.05

#: At most this many such replans (each one a measured step, and a recompilation of the
#: regions of a compiled plan).
MAX_PEAK_REPLANS = 3


def _verify(
    handle: AutoAC,
    step_fn: Callable[[nn.Module], torch.Tensor],
    budget: float | None,
    region_budgets: Mapping[str, float] | None,
    plan_config: PlanConfig | None,
    replan_peak: bool = True,
    planned: float | None = None,
    planned_regions: Mapping[str, float] | None = None,
) -> None:
    prof = handle.profile
    assert prof is not None
    ref = None
    excluded: set[tuple[str, str]] = set()
    replans = 0
    # the budget handed to the planner; lowered on an overshoot (predicted from the
    # compiled graphs before, measured here)
    planned = budget if planned is None else planned
    # the region budgets handed to the planner (lowered where compiled graphs held more)
    if planned_regions is None:
        planned_regions = region_budgets
    peak_replans = 0
    while True:
        # autoac's own compiled regions are what it verifies; the model's compiled
        # functions run eagerly, as they did when profiled (see ``no_compile``)
        with contextlib.nullcontext() if handle.compiled else no_compile():
            m = measure_step(handle.model, step_fn, seed=prof.config.seed, keep_grads=True)
        searched = handle.search is not None
        if (
            m.allocator_peak is None
            and handle.compiled
            and (searched or any(r.mode == "partitioner" for r in handle.plan.regions))
        ):
            # the CPU's tracked step runs the regions eagerly, where the partitioner
            # does nothing: the compiled step's own peak, as the search measured it
            m = replace(m, peak_bytes=_cpu_compiled_peak(handle, step_fn)[0])
        err = None
        if handle.plan.packed:
            if ref is None:
                ref = _reference_grads(handle, step_fn, prof)
            err = grad_error(ref, m.grads or [])
        if err is not None and err > prof.config.max_grad_error:
            # Exclude the packed class with the largest measured error and replan.
            used = {
                (o.op_class, d)
                for r, rp in zip(prof.regions, handle.plan.regions)
                for o in r.ops
                if (d := rp.saves.get(o.key)) not in (None, "keep")
            }
            pack_errors = prof.pack_errors
            worst = max(used, key=lambda k: pack_errors.get(k, 0.0))
            excluded.add(worst)
            replans += 1
            prof = restrict(prof, excluded)
            handle.profile = prof
            _set_plan(
                handle,
                plan(prof, budget=planned, region_budgets=planned_regions, config=plan_config),
                step_fn,
            )
            continue
        if (
            budget is not None
            and planned is not None
            and m.peak_bytes > budget * (1.0 + PEAK_TOLERANCE)
        ):
            # Lower the planner's budget by the overshoot, while a plan can meet it.
            lowered = planned - (m.peak_bytes - budget)
            # a "pack_all" plan is not searched: a lower budget cannot change it
            searched = plan_config is None or plan_config.strategy != "pack_all"
            if (
                replan_peak
                and searched
                and peak_replans < MAX_PEAK_REPLANS
                and lowered >= handle.plan.floor
            ):
                planned = lowered
                peak_replans += 1
                p = plan(prof, budget=planned, region_budgets=planned_regions, config=plan_config)
                if _decisions(p) == _decisions(handle.plan) and p.predicted_peak > p.floor:
                    # A planner budget raised into compiled headroom can lie above the
                    # plan's own peak by more than the overshoot: below that peak, so
                    # that the replan changes the plan.
                    planned = min(planned, p.predicted_peak - 1)
                    p = plan(prof, budget=planned, region_budgets=planned_regions,
                             config=plan_config)  # fmt: skip
                _set_plan(handle, p, step_fn)
                continue
        break
    handle.profile = prof
    region_over = _region_overshoots(handle.plan, region_budgets)
    handle.verification = {
        "predicted_peak": handle.plan.predicted_peak,
        "measured_peak": m.peak_bytes,
        "peak_ratio": m.peak_bytes / max(handle.plan.predicted_peak, 1),
        "pricing": handle.plan.pricing,
        "grad_error": err,
        "max_grad_error": prof.config.max_grad_error,
        "excluded_classes": sorted(excluded),
        "replans": replans,
        "measured_s": m.time_s,
        "budget": budget,
        "planned_budget": planned,
        "peak_replans": peak_replans,
        "within_budget": None
        if budget is None
        else m.peak_bytes <= budget * (1.0 + PEAK_TOLERANCE),
        # per region, predicted (from the compiled graphs where compiled): bytes held
        # beyond the region's budget; the step's measured peak does not show these
        "region_overshoots": region_over,
        "within_region_budgets": None if not region_budgets else not region_over,
    }
    if handle.verification["within_budget"] is False:
        # Not silently: a caller that does not read the verification would train over
        # the budget it asked for.
        assert budget is not None
        warnings.warn(
            f"autoac: the verified step peaked at {m.peak_bytes / 1e9:.3f} GB, "
            f"{m.peak_bytes / budget - 1:+.1%} over the budget of {budget / 1e9:.3f} GB "
            f"(predicted {handle.plan.predicted_peak / 1e9:.3f} GB; "
            f"{peak_replans} replans, floor {handle.plan.floor / 1e9:.3f} GB); "
            "see AutoAC.verification",
            stacklevel=3,
        )


def _reference_grads(
    handle: AutoAC, step_fn: Callable[[nn.Module], torch.Tensor], prof: Profile
) -> list[torch.Tensor | None]:
    """Gradients of the exact step (every region fully recomputed: bit-identical to no
    checkpointing for deterministic ops)."""
    current = handle.plan
    exact = Plan(
        regions=tuple(
            replace(r, mode="sac", saves={}, added_s=r.recompute_s, held_bytes=r.input_bytes)
            for r in current.regions
        ),
        budget=None,
        region_budgets={},
        predicted_peak=current.floor,
        added_s=current.full_recompute_s,
        lower_bound_s=current.full_recompute_s,
        proven_optimal=False,
        solver="reference",
        floor=current.floor,
        no_ac_peak=current.no_ac_peak,
        full_recompute_s=current.full_recompute_s,
        min_pack_bytes=current.min_pack_bytes,
        device=current.device,
    )
    handle.set_plan(exact)
    try:
        m = measure_step(handle.model, step_fn, track=False, seed=prof.config.seed, keep_grads=True)
    finally:
        handle.set_plan(current)
    return [None if g is None else g.detach().clone() for g in (m.grads or [])]
