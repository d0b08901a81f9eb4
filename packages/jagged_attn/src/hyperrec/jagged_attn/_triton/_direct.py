"""Direct relaunch of compiled kernels (default; ``JAGGED_ATTN_DIRECT_LAUNCH=0`` turns it off).

Every ``kernel[grid](*args, **kwargs)`` goes through Triton's launch path: it binds ~75
arguments and constexprs, computes each one's specialisation, builds and hashes the
cache key, checks the kernel's globals, then calls the compiled kernel's launcher. For a
call whose kernels are short, that is a large part of the host time. Once a launch key of
``_launch.py`` has compiled (its constexprs are fixed by the key), a :class:`Relauncher`
calls the compiled kernel's launcher directly with the argument list Triton itself bound
at that first launch, as long as the specialisation-relevant facts are unchanged (16-byte
alignment of every tensor, the values of the specialised integers, 32-bit range of the
others); otherwise the call takes Triton's path.

It replays an internal calling convention (the one Triton's ``JITFunction.run`` uses, read
from this Triton's source at first use, and the binder's argument order, compared with
ours at the first launch of each key); any mismatch disables it for that key. Every
kernel of a bf16 call goes through :func:`launch` (the attention kernels through
``_launch._launch_persistent``): the tile schedule, the value check, the backward's delta
pass. On by default since its GPU validation (``tests/test_triton_layout.py``, ``gpu``:
bit-identical outputs and gradients to Triton's own launches; ``bench/diagnose_variance.py``
measures the host time with and without it).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

__all__ = ["DIRECT_ENV", "RELAUNCH", "Relauncher", "direct_requested", "launch"]

#: Environment variable that switches direct relaunches off (``"0"``); on otherwise.
DIRECT_ENV = "JAGGED_ATTN_DIRECT_LAUNCH"

#: One :class:`Relauncher` per launch key (a key fixes the kernel, its constexprs, its
#: launch options and the device).
RELAUNCH: dict[tuple[object, ...], Relauncher] = {}

# What JITFunction.run must contain for the replay below to be the same call.
_RUN_SOURCE = (
    "launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())",
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
    "launch_metadata,",
)
_CONVENTION: list[bool] = []
_INT32 = (-(2**31), 2**31)


def direct_requested() -> bool:
    """Whether direct relaunches are on: unless :data:`DIRECT_ENV` is ``"0"``, and never
    under Triton's interpreter (it has no compiled launcher)."""
    if os.environ.get(DIRECT_ENV, "1") == "0":
        return False
    from hyperrec.jagged_attn._triton import interpreting

    return not interpreting()


def _current_device() -> int:
    from triton.runtime import driver

    return driver.active.get_current_device()


def _current_stream(device: int) -> Any:
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


def _hooks() -> tuple[Any, Any]:
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _convention_ok() -> bool:
    if not _CONVENTION:
        try:
            from triton import knobs  # noqa: F401
            from triton.runtime.jit import JITFunction

            src = " ".join(inspect.getsource(JITFunction.run).split())
            _CONVENTION.append(all(" ".join(s.split()) in src for s in _RUN_SOURCE))
        except Exception:  # another Triton layout: never replay
            _CONVENTION.append(False)
    return _CONVENTION[0]


class Relauncher:
    """Replays one compiled launch key (see the module doc). ``ok`` is False when this
    Triton or this kernel does not allow it."""

    def __init__(self, kernel: Any, compiled: Any, args: tuple[Any, ...], kw: dict[str, Any],
                 options: dict[str, Any]) -> None:  # fmt: skip
        self.ok = False
        if not _convention_ok():
            return
        try:
            device = _current_device()
            binder = kernel.device_caches[device][-1]
            params, _, _ = binder(*args, **kw, **options)
            values = list(params.values())
        except Exception:  # an unexpected binder: never replay
            return
        n = len(args)
        if len(values) < n or any(a is not b for a, b in zip(values[:n], args)):
            return
        names = list(params)
        for name, value in zip(names[n:], values[n:]):
            if name in kw and kw[name] != value:
                return
        not_specialised = {p.name for p in kernel.params if p.do_not_specialize}
        self.tail = values[n:]
        self.tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.ints = [i for i, a in enumerate(args) if type(a) is int]
        self.fixed = [i for i in self.ints if names[i] not in not_specialised]
        self.fixed_values = [args[i] for i in self.fixed]
        if any(args[i].data_ptr() % 16 for i in self.tensors) or not self._ints_ok(args):
            return  # only fully aligned first launches are replayed
        self.compiled, self.device = compiled, device
        self.ok = True

    def _ints_ok(self, args: tuple[Any, ...]) -> bool:
        lo, hi = _INT32
        return all(lo <= args[i] < hi for i in self.ints)

    def __call__(self, grid: tuple[int, ...], args: tuple[Any, ...]) -> bool:
        """Launch on ``grid`` (1 to 3 dims) and return True, or return False (nothing
        launched) if ``args`` would specialise differently from the first launch, or the
        current device is another one."""
        ptr = 0
        for i in self.tensors:
            ptr |= args[i].data_ptr()
        if ptr % 16 or [args[i] for i in self.fixed] != self.fixed_values:
            return False
        if not self._ints_ok(args) or _current_device() != self.device:
            return False
        g0, g1, g2 = (*grid, 1, 1)[:3]
        values = (*args, *self.tail)
        c = self.compiled
        stream = _current_stream(self.device)
        meta = c.launch_metadata((g0, g1, g2), stream, *values)
        c.run(g0, g1, g2, stream, c.function, c.packed_metadata, meta, *_hooks(), *values)
        return True


def launch(kernel: Any, grid: tuple[int, ...], key: tuple[object, ...], args: tuple[Any, ...],
           kw: dict[str, Any], options: dict[str, Any]) -> Any:  # fmt: skip
    """``kernel[grid](*args, **kw, **options)``: replayed through the :class:`Relauncher`
    of ``key`` when direct relaunches are on and it applies. Returns the compiled kernel
    when Triton's path ran, None after a replay. ``key`` must fix everything but ``args``
    (the kernel, ``kw``, ``options``, the device)."""
    if not direct_requested():
        return kernel[grid](*args, **kw, **options)
    relaunch = RELAUNCH.get(key)
    if relaunch is not None and relaunch.ok and relaunch(grid, args):
        return None
    compiled = kernel[grid](*args, **kw, **options)
    if relaunch is None:
        RELAUNCH[key] = Relauncher(kernel, compiled, args, kw, options)
    return compiled
