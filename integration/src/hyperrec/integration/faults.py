"""Faults in training: injection for tests and drills, and the non-finite step report.

**Injection** (:class:`FaultInjector`): the environment variable ``HYPERREC_FAULT``
lists faults as ``kind@step=N,rank=R[,module=NAME][,attempt=A]``, separated by ``;``:

- ``kill``: the rank kills itself (SIGKILL) in the middle of step ``N``, after the
  backward pass and before the optimizer step;
- ``kill_in_checkpoint``: the rank kills itself while the step-``N`` checkpoint is being
  written (files written, manifest and rename not yet done);
- ``nan_loss``: the rank's loss of step ``N`` is multiplied by NaN before backward;
- ``nan_grad``: after backward of step ``N``, the rank writes NaN into the gradient of
  the first parameter of module ``NAME`` (default: the first parameter of the model).

A fault fires only in attempt ``A`` of the job (default 0, the first): under
``torchrun --max-restarts`` the restarted workers see ``TORCHELASTIC_RESTART_COUNT``
> 0 and run clean unless a fault names their attempt, which is how a test checks that
a restart resumes and finishes.

**Non-finite steps** (:func:`nonfinite_report`): when a step's global loss or gradient
norm is NaN or Inf, every rank reports whether its own loss was finite and the first
module, in backward order (the reverse of the order in which modules finished their
forward, recorded once by :class:`ForwardOrder`, so the module nearest the loss comes
first), whose own parameters have a non-finite local gradient; the report names the
step, the ranks and that module. With sharded parameters a rank sees only its
shards *after* the reduce-scatter, so for a non-finite gradient behind a finite loss
the ranks named are the shard holders, not necessarily the rank whose batch caused it;
a non-finite loss is always attributed to the ranks that computed it.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "FAULT_ENV",
    "FAULT_KINDS",
    "Fault",
    "FaultInjector",
    "ForwardOrder",
    "NonFiniteError",
    "NonFiniteReport",
    "check_fault_modules",
    "nonfinite_report",
    "parse_faults",
]

FAULT_ENV = "HYPERREC_FAULT"
"""The environment variable read by :meth:`FaultInjector.from_env`."""
FAULT_KINDS = ("kill", "kill_in_checkpoint", "nan_loss", "nan_grad")
"""Fault kinds :func:`parse_faults` accepts."""


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    kind: str
    """One of :data:`FAULT_KINDS`."""
    step: int
    """1-based step at which it fires."""
    rank: int
    """The rank it fires on."""
    module: str = ""
    """For ``nan_grad``: the module (dotted name) whose first parameter gets a NaN."""
    attempt: int = 0
    """The job attempt (``TORCHELASTIC_RESTART_COUNT``) in which it fires."""


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse ``"kill@step=6,rank=1; nan_grad@step=3,rank=0,module=mlp.0"``.

    Raises:
        ValueError: a malformed entry, an unknown kind or key, or a missing step/rank
            (the message quotes :data:`FAULT_ENV` and the entry).
    """
    out = []
    for entry in (e.strip() for e in spec.split(";")):
        if not entry:
            continue
        kind, sep, rest = entry.partition("@")
        kind = kind.strip()
        if not sep or kind not in FAULT_KINDS:
            raise ValueError(
                f"{FAULT_ENV} entry {entry!r} must look like 'kind@step=N,rank=R' with kind "
                f"one of {FAULT_KINDS}"
            )
        kw: dict[str, Any] = {}
        for item in rest.split(","):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or key not in ("step", "rank", "module", "attempt"):
                raise ValueError(f"{FAULT_ENV} entry {entry!r}: bad field {item.strip()!r}")
            if key == "module":
                kw[key] = value
                continue
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"{FAULT_ENV} entry {entry!r}: {key} must be an int") from None
        if "step" not in kw or "rank" not in kw or min(kw["step"] - 1, kw["rank"]) < 0:
            raise ValueError(f"{FAULT_ENV} entry {entry!r} needs step >= 1 and rank >= 0")
        if kw.get("attempt", 0) < 0:
            raise ValueError(f"{FAULT_ENV} entry {entry!r} needs attempt >= 0")
        out.append(Fault(kind=kind, **kw))
    return tuple(out)


def check_fault_modules(faults: tuple[Fault, ...], model: nn.Module) -> None:
    """Check, before any step, that every ``nan_grad`` fault names a module with parameters.

    Give it the job's faults (every rank, every attempt): a name that matches nothing
    otherwise surfaces only at the fault's step, on its rank, as an error that ends that
    attempt, and under ``torchrun --max-restarts`` the next attempt runs without the
    fault: a drill that passes having injected nothing.

    Raises:
        ValueError: a ``nan_grad`` fault whose module owns no parameter of ``model``
            (the message quotes :data:`FAULT_ENV` and the module).
    """
    names = [name for name, _ in model.named_parameters()]
    for fault in faults:
        if fault.kind != "nan_grad":
            continue
        prefix = f"{fault.module}." if fault.module else ""
        if not any(name.startswith(prefix) for name in names):
            modules = sorted({name.partition(".")[0] for name in names})
            raise ValueError(
                f"{FAULT_ENV}: nan_grad@step={fault.step},rank={fault.rank} names module "
                f"{fault.module!r}, which has no parameters (top-level modules: {modules})"
            )


class FaultInjector:
    """The faults that fire on this rank (see the module docstring).

    Args:
        faults: the faults of the job (all ranks).
        rank: this process's rank.
        restart: the job's attempt (``TORCHELASTIC_RESTART_COUNT``); a fault fires only
            in its own attempt.
    """

    def __init__(self, faults: tuple[Fault, ...], *, rank: int, restart: int = 0):
        self.faults = tuple(f for f in faults if f.rank == rank and f.attempt == restart)
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        """The injector described by :data:`FAULT_ENV` (none when it is unset).

        Raises:
            ValueError: a malformed :data:`FAULT_ENV`.
        """
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        return cls(parse_faults(os.environ.get(FAULT_ENV, "")), rank=rank, restart=restart)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _at(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.step == step:
                return f
        return None

    def kill(self, kind: str, step: int) -> None:
        """SIGKILL this process if a ``kind`` fault is due at ``step``."""
        if self._at(kind, step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss * NaN`` if a ``nan_loss`` fault is due at ``step``, else ``loss``."""
        return loss * math.nan if self._at("nan_loss", step) is not None else loss

    def poison_grad(self, step: int, model: nn.Module) -> None:
        """Write NaN into the gradient of ``module``'s first parameter if due at ``step``.

        Raises:
            ValueError: the fault names a module without parameters with gradients.
        """
        fault = self._at("nan_grad", step)
        if fault is None:
            return
        prefix = f"{fault.module}." if fault.module else ""
        for name, p in model.named_parameters():
            if name.startswith(prefix) and p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if g.numel():
                    g.view(-1)[0] = math.nan
                    return
        raise ValueError(
            f"{FAULT_ENV}: module {fault.module!r} has no parameter with a gradient on rank "
            f"{self.rank}"
        )


@dataclass(frozen=True)
class NonFiniteReport:
    """What went non-finite in one step (identical on every rank)."""

    step: int
    """The 1-based step."""
    loss: float
    """The step's global mean loss (NaN/Inf when that is what failed)."""
    grad_norm: float
    """The global gradient norm before clipping."""
    loss_ranks: tuple[int, ...]
    """Ranks whose own loss was non-finite (the origin of a non-finite loss)."""
    grad_ranks: tuple[int, ...]
    """Ranks holding a non-finite gradient (shard)."""
    rank: int | None
    """The rank reported: the first of ``loss_ranks``, else the rank of ``module``."""
    module: str | None
    """The first module, in backward order, with a non-finite gradient (None if none)."""
    parameter: str | None
    """That module's parameter."""

    def message(self) -> str:
        """One line for logs and errors."""
        what = "loss" if not math.isfinite(self.loss) else "gradient"
        parts = [f"non-finite {what} at step {self.step} (loss {self.loss}, "
                 f"gradient norm {self.grad_norm})"]  # fmt: skip
        if self.loss_ranks:
            parts.append(f"loss non-finite on rank(s) {list(self.loss_ranks)}")
        if self.module is not None:
            parts.append(
                f"first module with a non-finite gradient (backward order): {self.module!r} "
                f"(parameter {self.parameter!r}) on rank {self.rank}"
            )
        elif self.rank is not None:
            parts.append(f"rank {self.rank}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus ``"message"``."""
        out = asdict(self)
        out["loss_ranks"], out["grad_ranks"] = list(self.loss_ranks), list(self.grad_ranks)
        for key in ("loss", "grad_norm"):
            if not math.isfinite(out[key]):
                out[key] = str(out[key])
        out["message"] = self.message()
        return out


class NonFiniteError(RuntimeError):
    """A step's loss or gradient was NaN or Inf under ``TrainConfig.nonfinite="stop"``."""

    def __init__(self, report: NonFiniteReport):
        super().__init__(report.message() + ' (TrainConfig.nonfinite="stop")')
        self.report = report


class ForwardOrder:
    """The order in which ``model``'s modules *finish* their forward on the first pass.

    Completion order puts a module after its children, which is where a module's own
    parameters are usually used (a head's output weight after its MLP), so its reverse
    is the order gradients arrive in backward. Recorded with hooks that remove
    themselves when the second pass starts, so later steps pay nothing.
    """

    def __init__(self, model: nn.Module):
        self.names: list[str] = []
        self._passes = 0
        self._handles = [model.register_forward_pre_hook(self._new_pass)]
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_hook(self._hook(name)))

    def _new_pass(self, module: nn.Module, args: Any) -> None:
        self._passes += 1
        if self._passes > 1:
            self.close()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._passes == 1 and name not in self.names:
                self.names.append(name)

        return hook

    def close(self) -> None:
        """Remove the hooks (the order recorded so far is kept)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _backward_order(model: nn.Module, forward: list[str]) -> list[tuple[str, nn.Parameter]]:
    """Parameters grouped by owning module, modules in reverse forward order (modules that
    never ran, in reverse registration order, last)."""
    modules = dict(model.named_modules())
    ran = [n for n in forward if n in modules]
    rest = [n for n in reversed(list(modules)) if n not in set(ran)]
    out = []
    for name in [*reversed(ran), *rest]:
        for pname, p in modules[name].named_parameters(recurse=False):
            out.append((f"{name}.{pname}" if name else pname, p))
    return out


def _first_nonfinite(
    model: nn.Module, forward: list[str], flagged: Collection[str] | None = None
) -> tuple[int, str] | None:
    """(position in backward order, parameter name) of the first non-finite local grad;
    with ``flagged``, of the first parameter (``named_parameters`` names) listed there."""
    if flagged is not None:
        names = {id(p): n for n, p in model.named_parameters()}
    for i, (name, p) in enumerate(_backward_order(model, forward)):
        if flagged is not None:
            if names.get(id(p)) in flagged:
                return i, name
            continue
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if g.numel() and not bool(torch.isfinite(g).all()):
            return i, name
    return None


def nonfinite_report(
    step: int,
    model: nn.Module,
    *,
    local_loss: float,
    loss: float,
    grad_norm: float,
    forward_order: list[str] | None = None,
    nonfinite_grads: Collection[str] | None = None,
) -> NonFiniteReport:
    """Build the report of a non-finite step (collective under torch.distributed).

    Args:
        step: the 1-based step.
        model: the (possibly sharded) model, gradients still in place unless
            ``nonfinite_grads`` is given.
        local_loss: this rank's own summed loss of the step.
        loss, grad_norm: the global values (identical on every rank).
        forward_order: module names in forward order (:class:`ForwardOrder`); without
            it, the reverse of registration order stands in for backward order.
        nonfinite_grads: names (as ``model.named_parameters()`` gives them) of the
            parameters whose local gradient was non-finite, recorded during the step;
            for a report made after the gradients were released (the trainer's
            pipelined step checks one step later, without synchronising).
    """
    first = _first_nonfinite(model, forward_order or [], nonfinite_grads)
    mine = (not math.isfinite(local_loss), first)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    loss_ranks = tuple(r for r, (bad, _) in enumerate(gathered) if bad)
    grad_ranks = tuple(r for r, (_, first) in enumerate(gathered) if first is not None)
    best = min(
        ((first[0], r, first[1]) for r, (_, first) in enumerate(gathered) if first is not None),
        default=None,
    )
    module = parameter = None
    rank = loss_ranks[0] if loss_ranks else None
    if best is not None:
        parameter = best[2]
        module = parameter.rpartition(".")[0] or parameter
        if rank is None:
            rank = best[1]
    return NonFiniteReport(
        step=step,
        loss=float(loss),
        grad_norm=float(grad_norm),
        loss_ranks=loss_ranks,
        grad_ranks=grad_ranks,
        rank=rank,
        module=module,
        parameter=parameter,
    )
