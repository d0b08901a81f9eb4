"""Per-module FSDP state: forward/backward hooks, root detection, prefetching."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hyperrec.parallel5d._api import MixedPrecisionPolicy
from hyperrec.parallel5d._group import ParamGroup, TrainingState, _Comm

__all__ = ["FSDPState", "get_state"]

_STATE_ATTR = "_hyperrec_fsdp_state"


def get_state(module: nn.Module) -> FSDPState | None:
    """The state ``fully_shard`` attached to ``module``, or ``None``."""
    return module.__dict__.get(_STATE_ATTR)


def _grad_tensors(tree: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = tree_flatten(tree)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    return leaves, spec, idx


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward fires once their gradients (and so
    every gradient of the module's parameters) have been computed."""

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        with record_function("hyperrec::post_backward"):
            ctx.group.post_backward()
        return (None, *grads)


class FSDPState:
    """Hooks of one ``fully_shard``-ed module (the group may be ``None``: no own params)."""

    def __init__(
        self,
        module: nn.Module,
        group: ParamGroup | None,
        *,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.module = module
        self.group = group
        self.device = device
        self.mp_policy = mp_policy
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self.root: FSDPState | None = None
        self.all_states: list[FSDPState] = []
        self.comm: _Comm | None = None
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # Root-only iteration state.
        self._iter_root_active = False
        self._iter_forward_root: FSDPState | None = None
        self._final_callback_queued = False
        self.is_last_backward = True
        module.__dict__[_STATE_ATTR] = self
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    @property
    def root_state(self) -> FSDPState:
        """The root's state; set by :meth:`lazy_init`, which the forward hooks run first."""
        if self.root is None:
            raise RuntimeError("fully_shard: this module has not run forward yet")
        return self.root

    @property
    def shared(self) -> _Comm:
        """Streams and bookkeeping shared under the root (set by :meth:`lazy_init`)."""
        if self.comm is None:
            raise RuntimeError("fully_shard: this module has not run forward yet")
        return self.comm

    # --------------------------------------------------------------- lazy init
    def lazy_init(self) -> None:
        """The first state to run forward becomes the root of every state below it."""
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        self.comm = _Comm(self.device)
        for module in self.module.modules():
            state = get_state(module)
            if state is None:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(
                        "fully_shard: a nested module ran forward before its root; run "
                        "forward through the outermost fully_shard module first"
                    )
                state.is_root = False
                state.root = self
                state.comm = self.comm
            if state not in self.all_states:
                self.all_states.append(state)
            if state.group is not None:
                state.group.comm = self.comm
        if self.group is not None:
            self.group.defer_grad_landing = True

    # ----------------------------------------------------------------- forward
    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        with record_function("hyperrec::pre_forward"):
            return self._pre_forward_impl(args, kwargs)

    def _pre_forward_impl(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.training_state == TrainingState.PRE_BACKWARD:
            # Recomputation under activation checkpointing: parameters must be there.
            if self.group is not None and self.group.is_sharded:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        self.lazy_init()
        root = self.root_state
        if not root._iter_root_active:
            root._iter_root_active = True
            root._iter_forward_root = self
            self.shared.forward_order = []
            for state in root.all_states:
                if state.group is not None:
                    state.group.release_dropped_grads()
        self.training_state = TrainingState.FORWARD
        args, kwargs = self._cast_inputs(args, kwargs)
        group = self.group
        if group is None:
            return args, kwargs
        group.training_state = TrainingState.FORWARD
        group.unshard()
        for target in self._forward_targets():
            target.unshard()
        group.wait_for_unshard()
        self.shared.forward_order.append(group)
        if torch.is_grad_enabled():
            leaves, spec, idx = _grad_tensors((args, kwargs))
            if idx:
                outs = _RegisterPostBackward.apply(group, *[leaves[i] for i in idx])
                for i, out in zip(idx, outs):
                    leaves[i] = out
                args, kwargs = tree_unflatten(leaves, spec)
        return args, kwargs

    def _forward_targets(self) -> list[ParamGroup]:
        if not self.shared.overlap:
            return []
        if self.forward_prefetch is not None:
            return [s.group for s in self.forward_prefetch if s.group is not None]
        # Default: the group that ran next in the previous iteration.
        order = self.shared.last_forward_order
        if self.group in order:
            k = order.index(self.group)
            if k + 1 < len(order):
                return [order[k + 1]]
        return []

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        with record_function("hyperrec::post_forward"):
            return self._post_forward_impl(output)

    def _post_forward_impl(self, output: Any) -> Any:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return output
        group = self.group
        if group is not None:
            if group.reshard_after_forward:
                group.reshard()
            group.post_forward_index = len(self.shared.post_forward_order)
            self.shared.post_forward_order.append(group)
            group.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            leaves, _, idx = _grad_tensors(output)
            for i in idx:
                leaves[i].register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE
        root = self.root_state
        if root._iter_root_active and root._iter_forward_root is self:
            root._iter_root_active = False
            self.shared.last_forward_order = self.shared.forward_order
        if self.mp_policy.output_dtype is not None:
            dtype = self.mp_policy.output_dtype
            output = tree_map(
                lambda x: (
                    x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                ),
                output,
            )
        return output

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        with record_function("hyperrec::pre_backward"):
            return self._pre_backward_impl(grad)

    def _pre_backward_impl(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return grad
        self.training_state = TrainingState.PRE_BACKWARD
        root = self.root_state
        if not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)
        group = self.group
        if group is not None and group.training_state != TrainingState.PRE_BACKWARD:
            group.training_state = TrainingState.PRE_BACKWARD
            group.unshard()
            for target in self._backward_targets():
                target.unshard()
            group.wait_for_unshard()
            group.begin_grads()
        return grad

    def _backward_targets(self) -> list[ParamGroup]:
        if not self.shared.overlap:
            return []
        if self.backward_prefetch is not None:
            return [s.group for s in self.backward_prefetch if s.group is not None]
        k = self.group.post_forward_index if self.group is not None else None
        if k:
            return [self.shared.post_forward_order[k - 1]]
        return []

    def _final_callback(self) -> None:
        with record_function("hyperrec::root_post_backward"):
            self._final_callback_impl()

    def _final_callback_impl(self) -> None:
        # Groups whose post-backward did not fire (inputs without grad, e.g. token ids
        # into the root's embedding) reduce here, in reverse forward order.
        for state in reversed(self.all_states):
            group = state.group
            if group is not None and group.training_state in (
                TrainingState.PRE_BACKWARD,
                TrainingState.FORWARD,
            ):
                group.post_backward()
        self.shared.wait_reduces()
        for state in self.all_states:
            group = state.group
            if group is not None:
                group.finalize_backward()
                if group.reshard_after_backward:
                    group.reshard()
            state.training_state = TrainingState.IDLE
        self.shared.post_forward_order.clear()
        self._final_callback_queued = False
