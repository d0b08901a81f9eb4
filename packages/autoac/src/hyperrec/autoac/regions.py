"""Regions: the units autoac checkpoints, and how their forwards are intercepted.

A region is a module (usually one block of a tower) or a span of code the user wraps
in :class:`Span`. autoac replaces the region's ``forward`` *on the instance* (the class,
the parameters and the ``state_dict`` keys stay the same) with a dispatcher that runs
the original forward the way the current plan says: plainly, under a
selective-checkpoint policy, or with packed saved tensors. :func:`remove` restores it.
"""

from __future__ import annotations

import fnmatch
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
        self.orig_forward = module.forward
        self.had_instance_forward = "forward" in module.__dict__
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


def _dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = _state(module)
    if state is None:
        raise RuntimeError(
            f"autoac's dispatcher ran on a {type(module).__name__} that has no autoac state"
        )
    state.calls += 1
    if state.runner is None:
        return state.orig_forward(*args, **kwargs)
    return state.runner(state, state.orig_forward, args, kwargs)


def install(modules: list[nn.Module], names: list[str]) -> list[_RegionState]:
    """Put the dispatcher on each region (idempotent per module)."""
    states = []
    for i, (m, n) in enumerate(zip(modules, names)):
        st = _state(m)
        if st is None:
            st = _RegionState(m, n, i)
            m.__dict__["_autoac"] = st

            def fwd(*args: Any, _m: nn.Module = m, **kwargs: Any) -> Any:
                return _dispatch(_m, *args, **kwargs)

            m.forward = fwd
        st.name, st.index = n, i
        states.append(st)
    return states


def uninstall(modules: Iterable[nn.Module]) -> None:
    """Restore the original ``forward`` of each region."""
    for m in modules:
        st = _state(m)
        if st is None:
            continue
        if st.had_instance_forward:
            m.forward = st.orig_forward
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
