"""Regions: the units autoac checkpoints, and how their forwards are intercepted.

A region is a module (usually one block of a tower) or a span of code the user wraps
in :class:`Span`. autoac replaces the region's ``forward`` *on the instance* (the class,
the parameters and the ``state_dict`` keys stay the same) with a dispatcher that runs
the original forward the way the current plan says: plainly, under a
selective-checkpoint policy, or with packed saved tensors. :func:`remove` restores it.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Span", "region_names", "resolve_regions"]


class Span(nn.Module):
    """Mark a span of code as a region: ``y = self.span(x)`` instead of ``y = f(x)``.

    Args:
        fn: the callable to run; tensors it closes over are not inputs of the region
            (pass them as arguments if they are activations).

    The span has no parameters of its own; parameters ``fn`` uses (e.g. a bound method
    of another module) still receive gradients.

    Raises:
        TypeError: ``fn`` not callable.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _RegionState:
    """What autoac keeps on a region module (``module._autoac``)."""

    def __init__(self, module: nn.Module, name: str, index: int) -> None:
        self.name = name
        self.index = index
        # A forward set on the instance before autoac (a wrapper), else None: the class's
        # forward is bound afresh at each call, so a copy of the module runs its own.
        self.instance_forward: Callable[..., Any] | None = module.__dict__.get("forward")
        # ``runner(state, fn, args, kwargs)`` runs one call of the region.
        self.runner: Callable[..., Any] | None = None
        self.calls = 0


def _state(module: nn.Module) -> _RegionState | None:
    """The autoac state of ``module``, or None.

    Kept in the instance ``__dict__`` (where ``module._autoac = ...`` would put it too):
    ``nn.Module`` types its dynamic attributes as parameters, buffers and submodules only.
    """
    st = module.__dict__.get("_autoac")
    return st if isinstance(st, _RegionState) else None


def _instance_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = _state(module)
    assert state is not None and state.instance_forward is not None
    return state.instance_forward(*args, **kwargs)


def region_forward(module: nn.Module, state: _RegionState) -> Callable[..., Any]:
    """The region's original forward as a method bound to ``module`` (``__self__`` is the
    module even when the original was an instance-level wrapper: autoac finds the
    module's buffers through it)."""
    if state.instance_forward is not None:
        return types.MethodType(_instance_forward, module)
    return types.MethodType(type(module).forward, module)


def _dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = _state(module)
    if state is None:
        raise RuntimeError(
            f"autoac's dispatcher ran on a {type(module).__name__} that has no autoac state"
        )
    state.calls += 1
    fn = region_forward(module, state)
    if state.runner is None:
        return fn(*args, **kwargs)
    return state.runner(state, fn, args, kwargs)


class _Forward:
    """The dispatcher installed as ``module.forward``: an object holding its module, so
    ``copy.deepcopy`` and pickling of the model give the copy a dispatcher of its own
    (a closure over the module ran the original's weights in a deep copy)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _dispatch(self.module, *args, **kwargs)


def install(modules: list[nn.Module], names: list[str]) -> list[_RegionState]:
    """Put the dispatcher on each region (idempotent per module)."""
    states = []
    for i, (m, n) in enumerate(zip(modules, names)):
        st = _state(m)
        if st is None:
            st = _RegionState(m, n, i)
            m.__dict__["_autoac"] = st
            m.forward = _Forward(m)
        st.name, st.index = n, i
        states.append(st)
    return states


def uninstall(modules: Iterable[nn.Module]) -> None:
    """Restore the original ``forward`` of each region."""
    for m in modules:
        st = _state(m)
        if st is None:
            continue
        if st.instance_forward is not None:
            m.forward = st.instance_forward
        else:
            del m.forward
        del m.__dict__["_autoac"]


def installed_regions(model: nn.Module) -> list[nn.Module]:
    """Modules of ``model`` that carry an autoac dispatcher."""
    return [m for m in model.modules() if "_autoac" in m.__dict__]


def _largest_module_list(model: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    best: nn.ModuleList | nn.Sequential | None = None
    best_n = 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) >= 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
    return best


def resolve_regions(
    model: nn.Module,
    regions: None | str | type | nn.Module | Iterable[str | nn.Module],
) -> tuple[list[nn.Module], list[str]]:
    """The region modules of ``model`` and their names.

    Args:
        model: the model.
        regions: ``None`` (the children of the ``ModuleList``/``Sequential`` with the
            most parameters: the blocks of the tower), a module class (every module of
            that class, outermost matches only), a name or ``fnmatch`` pattern of
            ``model.named_modules()`` (``"layers.*"``), a module, or a list of names /
            patterns / modules.

    Returns:
        ``(modules, names)`` in ``model.named_modules()`` order.

    Raises:
        TypeError: ``model`` not a module, ``regions`` of another type.
        ValueError: nothing matched, a module that is not part of ``model``, or one
            region nested inside another.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = list(model.named_modules())
    name_of = {id(m): n for n, m in named}
    picked: dict[int, nn.Module] = {}
    explicit: set[int] = set()
    if regions is None:
        ml = _largest_module_list(model)
        if ml is None:
            raise ValueError(
                "regions must be given: model has no ModuleList/Sequential of blocks to "
                "pick by default"
            )
        for m in ml.children():
            picked[id(m)] = m
    elif isinstance(regions, type):
        if not issubclass(regions, nn.Module):
            raise TypeError(f"regions must be a Module class, got {regions.__name__}")
        for _, m in named:
            if isinstance(m, regions):
                picked[id(m)] = m
    else:
        items = [regions] if isinstance(regions, str | nn.Module) else regions
        try:
            items = list(items)
        except TypeError:
            raise TypeError(
                f"regions must be None, a Module class, a name/pattern, a Module or a list of "
                f"them, got {type(regions).__name__}"
            ) from None
        for it in items:
            if isinstance(it, nn.Module):
                if id(it) not in name_of:
                    raise ValueError("regions must be submodules of model; got a foreign module")
                picked[id(it)] = it
                explicit.add(id(it))
            elif isinstance(it, str):
                hits = [m for n, m in named if fnmatch.fnmatchcase(n or "<root>", it)]
                if not hits:
                    raise ValueError(f"regions entry {it!r} matches no module of model")
                for m in hits:
                    picked[id(m)] = m
            else:
                raise TypeError(
                    f"regions entries must be names or Modules, got {type(it).__name__}"
                )
    if not picked:
        raise ValueError("regions must select at least one module, got none")
    # Outermost matches only for classes and patterns; explicit nesting is an error.
    mods = [m for _, m in named if id(m) in picked]
    keep: list[nn.Module] = []
    for m in mods:
        inside = [k for k in keep if any(c is m for c in k.modules())]
        if inside:
            if id(m) not in explicit or id(inside[0]) not in explicit:
                continue
            raise ValueError(
                f"regions must not be nested: {name_of[id(m)] or '<root>'} is inside "
                f"{name_of[id(inside[0])] or '<root>'}"
            )
        keep.append(m)
    names = [name_of[id(m)] or "<root>" for m in keep]
    return keep, names


def region_names(model: nn.Module) -> list[str]:
    """Names of the regions autoac currently manages in ``model``."""
    return [st.name for m in installed_regions(model) if (st := _state(m)) is not None]


def flat_tensors(tree: Any) -> list[torch.Tensor]:
    """Tensor leaves of a pytree."""
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
