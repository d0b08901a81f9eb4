"""``convert(model, policy)``: swap eligible ``nn.Linear`` modules for :class:`MXLinear`."""

from __future__ import annotations

from torch import nn

from hyperrec.mxfp8.linear import MXLinear
from hyperrec.mxfp8.policy import PrecisionPolicy

__all__ = ["convert", "plan_conversion"]


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def plan_conversion(model: nn.Module, policy: PrecisionPolicy | None = None) -> dict[str, str]:
    """What :func:`convert` would do: ``{linear name: "mx" or the reason it is kept}``.

    "First" and "last" follow ``model.named_modules()`` order (registration order).
    Existing :class:`MXLinear` modules are reported as ``"mx"``.

    Raises:
        TypeError: ``model`` not an ``nn.Module`` or ``policy`` not a ``PrecisionPolicy``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    policy = PrecisionPolicy() if policy is None else policy
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"policy must be a PrecisionPolicy, got {type(policy).__name__}")
    linears = _linears(model)
    out: dict[str, str] = {}
    for i, (name, mod) in enumerate(linears):
        if isinstance(mod, MXLinear):
            out[name] = "mx"
            continue
        reason = policy.keep_reason(name, mod, is_first=i == 0, is_last=i == len(linears) - 1)
        out[name] = "mx" if reason is None else reason
    return out


def convert(model: nn.Module, policy: PrecisionPolicy | None = None) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` the policy selects by an :class:`MXLinear`
    that shares its parameters (``state_dict`` keys and values are unchanged).

    Args:
        model: any module; if it is itself an eligible ``nn.Linear`` the converted module
            is returned (a lone linear is both first and last: it is converted only when
            ``keep_first`` and ``keep_last`` are off).
        policy: the :class:`PrecisionPolicy` (default ``PrecisionPolicy()``).

    Returns:
        ``model`` (or the new module when ``model`` was a linear).

    Raises:
        TypeError: as :func:`plan_conversion`.
    """
    policy = PrecisionPolicy() if policy is None else policy
    plan = plan_conversion(model, policy)
    if isinstance(model, nn.Linear) and not isinstance(model, MXLinear):
        return MXLinear.from_linear(model, policy) if plan[""] == "mx" else model
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and plan.get(full) == "mx":
                setattr(parent, child_name, MXLinear.from_linear(child, policy))
    return model
