"""``convert(model, policy)``: swap eligible ``nn.Linear`` modules for :class:`MXLinear`."""

from __future__ import annotations

from torch import nn

from hyperrec.mxfp8.linear import MXLinear
from hyperrec.mxfp8.policy import PrecisionPolicy

__all__ = ["convert", "plan_conversion"]


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _not_swappable(mod: nn.Linear) -> str | None:
    """Why ``MXLinear.from_linear(mod)`` would not behave like ``mod``, or ``None``.

    ``from_linear`` takes ``weight`` and ``bias`` only: a subclass's ``forward``, hooks
    (e.g. the legacy ``weight_norm``'s pre-hook) and any other parameter, buffer or
    submodule (``weight_g``/``weight_v``, parametrizations) would be silently dropped.
    """
    if type(mod) is not nn.Linear:
        return f"{type(mod).__name__} is an nn.Linear subclass (its forward is not MXLinear's)"
    if any(getattr(mod, h, None) for h in _HOOK_DICTS):
        return "has hooks (MXLinear does not carry them)"
    extra = set(mod._parameters) - {"weight", "bias"}
    if extra or mod._buffers or mod._modules or not isinstance(mod.weight, nn.Parameter):
        return "has parameters, buffers or submodules besides weight and bias"
    return None


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
        reason = _not_swappable(mod) or policy.keep_reason(
            name, mod, is_first=i == 0, is_last=i == len(linears) - 1
        )
        out[name] = "mx" if reason is None else reason
    return out


def convert(model: nn.Module, policy: PrecisionPolicy | None = None) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` the policy selects by an :class:`MXLinear`
    that shares its parameters (``state_dict`` keys and values are unchanged).

    Only plain ``nn.Linear`` modules without hooks or extra parameters, buffers or
    submodules are swapped (``MXLinear.from_linear`` carries ``weight`` and ``bias``
    only); :func:`plan_conversion` gives the reason for the others. A linear reachable
    under several names is replaced by one ``MXLinear`` under all of them.

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
    # A module reachable under several names (tied/shared layers) is planned under its
    # first name; every name gets the one replacement, so it stays shared.
    selected = {id(m): m for n, m in _linears(model) if type(m) is nn.Linear and plan[n] == "mx"}
    new: dict[int, MXLinear] = {}
    for _, parent in list(model.named_modules()):
        # Not named_children(): it skips a module registered twice in one parent.
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in selected:
                if id(child) not in new:
                    new[id(child)] = MXLinear.from_linear(child, policy)
                setattr(parent, child_name, new[id(child)])
    return model
