"""Per-module FSDP state: forward/backward hooks, root detection, prefetching."""

from __future__ import annotations

import functools
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
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        with record_function("hyperrec::post_backward"):
            # A grouped module called on its own (a head per chunk) has no pre-backward
            # hook on its output: the root's end-of-backward work is queued here then.
            ctx.state._queue_final_callback()
            ctx.state.group.post_backward()
        return (None, *grads)


class FSDPState:
    """Hooks of one ``fully_shard`` call (the group may be ``None``: no own params).

    ``modules`` are the modules passed together (``fully_shard([a, b])``): their forward
    passes count as one group forward that starts when the first of them runs and ends
    when all of them have run (or when the root's forward ends, for those that did not).
    """

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup | None,
        *,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool = False,
    ) -> None:
        self.modules = modules
        self.module = modules[0]
        self.group = group
        self.device = device
        self.mp_policy = mp_policy
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self.root: FSDPState | None = None
        self.all_states: list[FSDPState] = []
        self.comm: _Comm | None = None
        self.shared_comm: _Comm | None = None  # share_comm_ctx before lazy init
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # reshard_after_forward=None: True, except for the root (resolved at lazy init).
        self.auto_reshard_after_forward = auto_reshard_after_forward
        # Modules of a grouped call that have not run forward yet in this pass.
        self.modules_to_run: set[nn.Module] = set()
        # Root-only iteration state.
        self._iter_root_active = False
        self._iter_forward_root: FSDPState | None = None
        self._final_callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: Any = None
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
        if group is not None:
            # state_dict() / load_state_dict() always see the sharded parameters (the
            # root keeps its gathered ones after forward by default), as in FSDP2.
            owners = {id(m): m for s in group.slots for m, _ in s.registrations}
            for owner in owners.values():
                owner.register_state_dict_pre_hook(self._to_sharded_hook)
                owner._register_load_state_dict_pre_hook(self._to_sharded_hook)
                # DTensors of another layout (FSDP2's state dict) are loaded into ours.
                owner._register_load_state_dict_pre_hook(self._relayout_hook, with_module=True)
                # load_state_dict(assign=True) replaces parameters: rebuild around them.
                owner.register_load_state_dict_post_hook(self._resync_hook)
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self._post_forward, prepend=False)
        else:
            for module in modules:
                module.register_forward_pre_hook(
                    self._group_pre_forward, prepend=True, with_kwargs=True
                )
                module.register_forward_hook(
                    functools.partial(self._group_post_forward, module),
                    prepend=False,
                    always_call=True,
                )

    # Both hooks are registered only for a state with a group.
    def _to_sharded_hook(self, *args: Any, **kwargs: Any) -> None:
        if self.group is not None:
            self.group.reshard()

    def _relayout_hook(self, module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        from hyperrec.parallel5d._convert import relayout_loaded

        if self.group is not None:
            relayout_loaded(self.group, module, state_dict, prefix)

    def _resync_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        from hyperrec.parallel5d._convert import resync_group

        if self.group is not None:
            resync_group(self.group, partial_ok=False)

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
        if len(self.modules) > 1:
            raise RuntimeError(
                "fully_shard needs a single root module: the first module to run forward was "
                "part of a grouped fully_shard([...]) call; apply fully_shard to the model "
                "that contains them and run forward through it"
            )
        self.is_root = True
        self.root = self
        self.comm = self.shared_comm or _Comm(self.device)
        for module in self.module.modules():
            state = get_state(module)
            if state is None or state in self.all_states:
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
            self.all_states.append(state)
            if state.group is not None:
                state.group.comm = self.comm
                # Picks up parameters replaced since fully_shard (load_state_dict(
                # assign=True), .to() of a submodule...).
                from hyperrec.parallel5d._convert import resync_group

                if state.group.is_sharded:
                    resync_group(state.group, partial_ok=False)
            if state.auto_reshard_after_forward and state.group is not None:
                # FSDP2's reshard_after_forward=None: the root's parameters are needed
                # again as soon as backward starts, so it keeps them.
                state.group.reshard_after_forward = state is not self
                if state is self:
                    state.group.post_forward_group = None
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

    def _to_device(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != self.device:
            return x.to(self.device)
        return x

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        return tree_map(
            lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
            output,
        )

    def _group_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self.modules_to_run:
            self.modules_to_run.update(self.modules)
        return self._pre_forward(module, args, kwargs)

    def _group_post_forward(
        self, module: nn.Module, hook_module: nn.Module, args: Any, output: Any
    ) -> Any:
        if module in self.modules_to_run:
            self.modules_to_run.discard(module)
            if not self.modules_to_run:
                return self._post_forward(hook_module, args, output)
        # Not the group's last module in this pass: only the policy's output cast.
        return self._cast_output(output)

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
            return self._cast_inputs(args, kwargs)
        if self.training_state == TrainingState.FORWARD:
            # Another module of a grouped call already started this group's forward (and
            # registered the group's post-backward on its inputs, which fires after this
            # module's backward too).
            if self.group is not None and self.group.is_sharded:
                self.group.unshard()
                self.group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        self.lazy_init()
        root = self.root_state
        if not root._iter_root_active:
            root._iter_root_active = True
            root._iter_forward_root = self
            self.shared.forward_order = []
            self._wait_post_optim_event()
            for state in root.all_states:
                if state.group is not None:
                    state.group.release_dropped_grads()
            if self.device.type != "cpu":
                # As FSDP2's root: inputs go to the mesh's device (as DDP does).
                args, kwargs = tree_map(self._to_device, (args, kwargs))
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
        return self._register_post_backward(args, kwargs)

    def _register_post_backward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec, idx = _grad_tensors((args, kwargs))
        if idx:
            outs = _RegisterPostBackward.apply(self, *[leaves[i] for i in idx])
            for i, out in zip(idx, outs):
                leaves[i] = out
            args, kwargs = tree_unflatten(leaves, spec)
        return args, kwargs

    def _wait_post_optim_event(self) -> None:
        root = self.root_state
        event = root.post_optim_event
        if event is None:
            return
        root.post_optim_event = None
        if self.shared.ag_stream is not None:
            # FSDP2's set_post_optim_event: the gathers of this iteration start after the
            # user's event (the gathers also wait for the current stream, whose work
            # wrote the shards the optimizer updated).
            self.shared.ag_stream.wait_event(event)

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
            return self._cast_output(output)
        output = self._finish_forward(output)
        root = self.root
        if root is not None and root._iter_root_active and root._iter_forward_root is self:
            # Grouped calls whose modules did not all run (e.g. a head called per chunk
            # after the model's forward): finish them now, as FSDP2 does.
            for state in reversed(root.all_states):
                if state is not self and state.modules_to_run:
                    state.modules_to_run.clear()
                    output = state._finish_forward(output)
            root._iter_root_active = False
            self.shared.last_forward_order = self.shared.forward_order
        return output

    def _finish_forward(self, output: Any) -> Any:
        group = self.group
        if group is not None and self.training_state == TrainingState.FORWARD:
            if group.reshard_after_forward:
                group.reshard(post_forward=True)
            group.post_forward_index = len(self.shared.post_forward_order)
            self.shared.post_forward_order.append(group)
            group.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            leaves, _, idx = _grad_tensors(output)
            for i in idx:
                leaves[i].register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE
        return self._cast_output(output)

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        with record_function("hyperrec::pre_backward"):
            return self._pre_backward_impl(grad)

    def _pre_backward_impl(self, grad: torch.Tensor) -> torch.Tensor:
        group = self.group
        if self.training_state == TrainingState.PRE_BACKWARD and (
            group is None or group.training_state != TrainingState.POST_BACKWARD
        ):
            return grad
        self.training_state = TrainingState.PRE_BACKWARD
        self._queue_final_callback()
        if group is not None and group.training_state != TrainingState.PRE_BACKWARD:
            # Also after this group's post-backward: a module that ran forward more than
            # once needs its parameters again for the earlier call's backward.
            group.training_state = TrainingState.PRE_BACKWARD
            group.unshard()
            for target in self._backward_targets():
                target.unshard()
            group.wait_for_unshard()
            group.begin_grads()
        return grad

    def _queue_final_callback(self) -> None:
        root = self.root_state
        if not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)

    def _backward_targets(self) -> list[ParamGroup]:
        if not self.shared.overlap:
            return []
        if self.backward_prefetch is not None:
            return [s.group for s in self.backward_prefetch if s.group is not None]
        k = self.group.post_forward_index if self.group is not None else None
        order = self.shared.post_forward_order
        # Roots sharing one context (share_comm_ctx) clear the shared order at their own
        # backward's end: an index may point past it.
        if k and k - 1 < len(order) and order[k - 1] is not self.group:
            return [order[k - 1]]
        return []

    def _final_callback(self) -> None:
        with record_function("hyperrec::root_post_backward"):
            self._final_callback_impl()

    def _final_callback_impl(self) -> None:
        # Groups whose post-backward did not fire (inputs without grad, e.g. token ids
        # into the root's embedding), or that received gradients after it did, reduce
        # here, in reverse forward order.
        for state in reversed(self.all_states):
            group = state.group
            if group is not None and (
                group.training_state in (TrainingState.PRE_BACKWARD, TrainingState.FORWARD)
                or group.has_pending_grads()
            ):
                group.post_backward()
        last = self.is_last_backward
        if last:
            self.shared.wait_reduces()
        for state in self.all_states:
            group = state.group
            if group is not None:
                if last:
                    group.finalize_backward()
                else:
                    group.training_state = TrainingState.IDLE
                if group.reshard_after_backward:
                    group.reshard()
            state.training_state = TrainingState.IDLE
            state.modules_to_run.clear()
        if last:
            self.shared.post_forward_order.clear()
        # A forward that ran through a non-root module (or a grouped module called on
        # its own) leaves the iteration open: close it so the next forward starts afresh.
        self._iter_root_active = False
        self._iter_forward_root = None
        self._final_callback_queued = False

    # ------------------------------------------------------------------ reset
    def reset_iter_state(self) -> None:
        """FSDP2's recovery after an exception in forward or backward (see
        :meth:`FSDPModule.reset_iter_state`)."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root fully_shard module")
        states = self.all_states or [self]
        for state in states:
            group = state.group
            if group is not None:
                group.reset_iter_state()
            state.training_state = TrainingState.IDLE
            state.modules_to_run.clear()
        if self.comm is not None:
            self.shared.wait_reduces()
            self.shared.post_forward_order.clear()
            self.shared.forward_order = []
        self._iter_root_active = False
        self._iter_forward_root = None
        self._final_callback_queued = False
