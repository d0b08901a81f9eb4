"""One ``fully_shard`` call's parameters: DBuffers per dtype, sharded/unsharded swaps, grads."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from hyperrec.dbuffer import DBuffer, ReduceOptions
from hyperrec.parallel5d._api import MixedPrecisionPolicy

__all__ = ["ParamGroup", "TrainingState"]


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


@dataclass(eq=False)
class _Slot:
    """One managed parameter."""

    fqn: str
    registrations: list[tuple[nn.Module, str]]
    buffer: int
    index: int
    requires_grad: bool
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    grad_dtensor: torch.Tensor | None = None
    grad_view: torch.Tensor | None = None  # the grad_full view set as `unsharded.grad`
    written: bool = False  # its gradient landed in grad_full in this accumulation window

    def gathered(self) -> nn.Parameter:
        """The unsharded parameter (made at the first unshard, before any gradient)."""
        if self.unsharded is None:
            raise RuntimeError(f"{self.fqn}: gradients before the first unshard")
        return self.unsharded


@dataclass(eq=False)
class _Comm:
    """Streams and per-iteration bookkeeping shared by all groups under one root."""

    device: torch.device
    ag_stream: torch.cuda.Stream | None = None
    rs_stream: torch.cuda.Stream | None = None
    pending_reduce: list[ParamGroup] = field(default_factory=list)
    forward_order: list[ParamGroup] = field(default_factory=list)
    last_forward_order: list[ParamGroup] = field(default_factory=list)
    post_forward_order: list[ParamGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Prefetching only pays where communication overlaps compute (CUDA streams);
        # gloo collectives are synchronous, so there it would only hold memory longer.
        self.overlap = self.device.type == "cuda"
        if self.device.type == "cuda":
            # High priority so collectives are not starved by queued compute.
            self.ag_stream = torch.cuda.Stream(self.device, priority=-1)
            self.rs_stream = torch.cuda.Stream(self.device, priority=-1)

    def wait_reduces(self) -> None:
        for group in self.pending_reduce:
            for buf in group.buffers:
                buf.wait_reduce()
        self.pending_reduce.clear()


class ParamGroup:
    """The parameters of one ``fully_shard`` call, one :class:`DBuffer` per dtype.

    Between steps the module holds ``sharded`` parameters: ``nn.Parameter`` DTensors with
    RaggedShard placements whose local tensors are views of the buffers' shard storage,
    so an optimizer that updates them updates the buffers in place. During forward and
    backward it holds ``unsharded`` parameters: plain ``nn.Parameter`` views of the
    buffers' full storage, created once and kept (their storage is freed and re-grown).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        fqns: Sequence[str],
        registrations: Sequence[list[tuple[nn.Module, str]]],
        granularities: Sequence[int],
        *,
        mesh: DeviceMesh,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        alignment: int,
        reshard_after_forward: bool,
        post_forward_group: dist.ProcessGroup | None = None,
        offload: bool = False,
        pin_memory: bool = True,
    ) -> None:
        self.device = device
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.alignment = alignment
        self.offload = offload
        self.pin_memory = pin_memory
        self.reshard_after_forward = reshard_after_forward
        # reshard_after_forward=N: after forward keep 1/N of the parameters on each rank
        # of a group of N and gather over that group only in backward.
        self.post_forward_group = post_forward_group
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        # FSDP2's per-group switches (see FSDPModule's setters).
        self.requires_all_reduce = True
        self.unshard_in_backward = True
        self.divide_factor: float | None = None
        self.force_sum = False
        self.all_reduce_hook: tuple[Callable[[torch.Tensor], None], Any] | None = (
            None  # (hook, stream)
        )
        self.custom_all_gather = None
        self.custom_reduce_scatter = None
        self.reduce_scatter_group: dist.ProcessGroup | None = None
        self.training_state = TrainingState.IDLE
        self.post_forward_index: int | None = None
        self.comm: _Comm | None = None
        self._grads_begun = False
        self._reduced = False
        self.defer_grad_landing = False  # set for the root group at lazy init

        # One buffer per (dtype, requires_grad): frozen parameters never share a flat
        # shard with trainable ones, so a fused optimizer over flat_params (which leaves
        # non-trainable buffers out) cannot move them through weight decay or momentum.
        by_kind: dict[tuple[torch.dtype, bool], list[int]] = {}
        for k, p in enumerate(params):
            by_kind.setdefault((p.dtype, p.requires_grad), []).append(k)
        self.buffers: list[DBuffer] = []
        self.slots: list[_Slot] = []
        self._in_place: list[bool] = []
        for b, ((dtype, trainable), members) in enumerate(by_kind.items()):
            floating = dtype.is_floating_point
            param_dtype = (mp_policy.param_dtype if floating else None) or dtype
            reduce_dtype = (mp_policy.reduce_dtype if floating else None) or param_dtype
            buf = DBuffer(
                [params[k].shape for k in members],
                mesh=mesh,
                dtype=dtype,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                device=device,
                granularities=[granularities[k] for k in members],
                alignment=alignment,
                names=[fqns[k] for k in members],
                offload=offload,
                pin_memory=pin_memory,
                trainable=trainable,
            )
            if not any(params[k].is_meta for k in members):
                buf.copy_from_full_([params[k] for k in members])
            self.buffers.append(buf)
            # How gradients land in grad_full: see the "gradients" section below.
            self._in_place.append(reduce_dtype == param_dtype)
            views = buf.as_dtensors()
            for i, k in enumerate(members):
                p = params[k]
                # Its RaggedShard placement (the buffer layout's) is all that optimizers
                # need to find which flat elements of the parameter this rank holds.
                sharded = nn.Parameter(views[i], requires_grad=p.requires_grad)
                self.slots.append(
                    _Slot(
                        fqn=fqns[k],
                        registrations=list(registrations[k]),
                        buffer=b,
                        index=i,
                        requires_grad=p.requires_grad,
                        sharded=sharded,
                    )
                )
        self._register(sharded=True)
        self._sharded = True

    # ------------------------------------------------------------------ helpers
    def _register(self, *, sharded: bool) -> None:
        for s in self.slots:
            param = s.sharded if sharded else s.unsharded
            for module, name in s.registrations:
                module._parameters[name] = param

    def _slots_of(self, b: int) -> list[_Slot]:
        return [s for s in self.slots if s.buffer == b]

    def _make_unsharded(self) -> None:
        # Created on first unshard, while the full storage exists; kept afterwards.
        for s in self.slots:
            if s.unsharded is None:
                view = self.buffers[s.buffer].full_view(s.index)
                s.unsharded = nn.Parameter(view, requires_grad=s.requires_grad)
                if s.requires_grad and not self._in_place[s.buffer]:
                    s.unsharded.register_post_accumulate_grad_hook(
                        functools.partial(self._land_grad, s)
                    )

    def _sync_requires_grad(self) -> None:
        # `p.requires_grad_(False)` on a sharded parameter after fully_shard (freezing
        # layers for fine-tuning) must stop its gradients, as in FSDP2, which copies the
        # flag onto the unsharded parameter at each unshard: else autograd still computes
        # one, it is reduced and exposed, and an optimizer over all parameters moves the
        # frozen weight. The parameter stays in its flat buffer (a fused optimizer over
        # flat_params still sees its zero gradient there; freeze before fully_shard for
        # that).
        for s in self.slots:
            flag = s.sharded.requires_grad
            if flag == s.requires_grad:
                continue
            s.requires_grad = flag
            s.written = False
            if s.unsharded is not None:
                s.unsharded.grad = None
                s.unsharded.requires_grad_(flag)
                # Cast-path slots made trainable have no landing hook: their gradients
                # are cast in by _fold_pending_grads at the group's post-backward.

    @property
    def is_sharded(self) -> bool:
        return self._sharded

    # ------------------------------------------------------------- unshard side
    def unshard(self) -> None:
        """Issue the all-gathers (one per buffer); no-op if already unsharded."""
        if not self.unshard_in_backward and self.training_state == TrainingState.PRE_BACKWARD:
            return  # the user said backward needs none of these values (FSDP2's switch)
        stream = self.comm.ag_stream if self.comm is not None else None
        for buf in self.buffers:
            buf.unshard(stream=stream, all_gather=self.custom_all_gather)

    def wait_for_unshard(self) -> None:
        """Wait for the all-gathers and register the unsharded parameters."""
        for buf in self.buffers:
            buf.wait_unshard()
        if self.training_state in (TrainingState.IDLE, TrainingState.FORWARD):
            self._sync_requires_grad()
        self._make_unsharded()
        if self._sharded:
            self._register(sharded=False)
            self._sharded = False

    def reshard(self, *, post_forward: bool = False) -> None:
        """Register the sharded parameters and free the full storages (after forward with
        ``reshard_after_forward=N``: keep this rank's piece for a gather over N ranks)."""
        if not self._sharded:
            self._register(sharded=True)
            self._sharded = True
        keep = self.post_forward_group if post_forward else None
        for buf in self.buffers:
            buf.reshard(keep=keep if buf.is_unsharded else None)

    # ---------------------------------------------------------------- reduction
    def reduce_options(self) -> ReduceOptions:
        """This group's :class:`hyperrec.dbuffer.ReduceOptions` (FSDP2's setters)."""
        hook, hook_stream = self.all_reduce_hook or (None, None)
        return ReduceOptions(
            divide_factor=self.divide_factor,
            force_sum=self.force_sum,
            all_reduce=self.requires_all_reduce,
            hook=hook,
            hook_stream=hook_stream,
            reduce_scatter=self.custom_reduce_scatter,
            group=self.reduce_scatter_group,
        )

    def has_pending_grads(self) -> bool:
        """Gradients produced since this group's last reduction (e.g. by a module run again
        after its post-backward) that no reduction has taken yet. Never while accumulating
        without synchronisation (those stay where they are until a synced backward)."""
        if not self.requires_gradient_sync:
            return False
        if any(buf.grad_full_live for buf in self.buffers):
            return True
        return any(
            s.unsharded is not None
            and s.unsharded.grad is not None
            and s.unsharded.grad is not s.grad_view
            for s in self.slots
        )

    # ---------------------------------------------------------------- gradients
    #
    # Gradients computed in the reduce dtype accumulate in place: each unsharded
    # parameter's `.grad` is set to its view of grad_full, and autograd adds into it.
    # Otherwise (mixed precision: bf16 gradients, fp32 reduction) when and where a
    # gradient is cast into grad_full decides the memory held through backward:
    # * a synced backward on several ranks keeps autograd's bf16 gradients as they are
    #   and casts them into grad_full at the group's post-backward, so the fp32 grad_full
    #   (twice the group's bf16 bytes) exists only from there until its reduction is
    #   done, never through the group's backward compute; this is also what FSDP2 holds
    #   (its reduce-scatter input), and the cast is the one the policy asks for;
    # * where grad_full is the persistent grad_shard (one rank) or already holds
    #   gradients of unsynced passes (accumulation, in fp32 as FSDP2 does), each
    #   gradient is cast in by a post-accumulate hook as soon as autograd produces it,
    #   which frees the bf16 copy at once and costs no transient buffer.
    # The root group always waits for its post-backward (its reduction can only run
    # when the whole backward is over).

    def _defer_landing(self, s: _Slot) -> bool:
        if self.defer_grad_landing:
            return True
        buf = self.buffers[s.buffer]
        return (
            self.requires_gradient_sync
            and not buf.grad_full_aliases_shard
            and not buf.grad_full_live
        )

    def begin_grads(self) -> None:
        """Prepare every buffer to receive this backward's gradients."""
        if self._grads_begun:
            return
        self._grads_begun = True
        custom = self.reduce_options() != ReduceOptions()
        for b, buf in enumerate(self.buffers):
            slots = [s for s in self._slots_of(b) if s.requires_grad]
            if not slots:
                continue
            if custom:
                # One rank on the shard axis: a divide factor or hook must see this
                # backward's gradients apart from the ones the shard already holds.
                buf.unalias_grad_()
            if not buf.grad_full_live:
                self._sync_with_sharded_grads(b, slots)
            if self._in_place[b]:
                buf.begin_grad(zero=True)
                for s in slots:
                    s.grad_view = buf.grad_full_view(s.index)
                    s.gathered().grad = s.grad_view

    def _ensure_live(self, b: int) -> DBuffer:
        buf = self.buffers[b]
        if not buf.grad_full_live:
            slots = [s for s in self._slots_of(b) if s.requires_grad]
            self._sync_with_sharded_grads(b, slots)
            # With one rank on the shard axis grad_full is grad_shard: a gradient it holds
            # (an earlier backward's, not yet stepped on) must be added to, not
            # overwritten by the first landing nor zeroed for parameters this backward
            # does not reach.
            held = buf.grad_full_aliases_shard and buf.has_grad
            for s in slots:
                s.written = held
            buf.begin_grad(zero=self._in_place[b])
        return buf

    def release_dropped_grads(self) -> None:
        """Before forward: give back the memory of gradients the optimizer set to ``None``."""
        for b, buf in enumerate(self.buffers):
            slots = [s for s in self._slots_of(b) if s.requires_grad]
            if slots and not buf.grad_full_live:
                self._sync_with_sharded_grads(b, slots, release=True)

    def _sync_with_sharded_grads(
        self, b: int, slots: list[_Slot], *, release: bool = False
    ) -> None:
        # The optimizer's zero_grad(set_to_none=True) clears the sharded `.grad`s (or the
        # flat one): then the next reduction overwrites instead of accumulating.
        buf = self.buffers[b]
        if self._reduced:
            # Reduced gradients not yet exposed (set_is_last_backward(False)): nobody
            # could have cleared or replaced them.
            return
        self._adopt_assigned_grads(b, slots)
        if not buf.has_grad:
            return
        if buf.shard.grad is None or all(s.sharded.grad is None for s in slots):
            buf.drop_grad_(release=release)
            return
        for s in slots:
            if s.sharded.grad is None:
                buf.grad_shard_view(s.index).zero_()
                s.sharded.grad = s.grad_dtensor

    def _grad_dtensors(self, b: int) -> None:
        # The gradient DTensors of buffer b (views of its grad_shard), made once.
        slots = self._slots_of(b)
        if slots and slots[0].grad_dtensor is None:
            grads = self.buffers[b].as_dtensors(self.buffers[b].grad_shard)
            for s in slots:
                s.grad_dtensor = grads[s.index]

    @torch.no_grad()
    def _adopt_assigned_grads(self, b: int, slots: list[_Slot]) -> None:
        # A `.grad` the user assigned (`p.grad = p.grad * 0.5`, a tensor of their own) is
        # no view of grad_shard: the next reduction would add to the stale values there
        # while the optimizer kept reading the assigned tensor, dropping every later
        # backward. FSDP2 (and plain autograd) accumulate into whatever `.grad` holds, so
        # its values are copied in and `.grad` is the view again.
        assigned = [
            (s, g) for s in slots if (g := s.sharded.grad) is not None and g is not s.grad_dtensor
        ]
        if not assigned:
            return
        from hyperrec.parallel5d._convert import _local_piece

        buf = self.buffers[b]
        held = buf.has_grad
        flat = buf.grad_shard
        if not held:
            flat.zero_()  # a dropped gradient's stale values
        self._grad_dtensors(b)
        for s, grad in assigned:
            piece = _local_piece(grad, buf, s.index)
            if piece is not None:
                buf.grad_shard_view(s.index).copy_(piece)
            s.sharded.grad = s.grad_dtensor
        if not held:
            buf.set_grad_(flat)  # marks it as holding a gradient (copies nothing new)
        buf.shard.grad = buf.grad_shard

    @torch.no_grad()
    def _land(self, s: _Slot, grad: torch.Tensor) -> None:
        view = self._ensure_live(s.buffer).grad_full_view(s.index)
        if s.written or self._in_place[s.buffer]:
            view.add_(grad)
        else:
            # The cast to the reduce dtype, written in place. As a one-tensor foreach
            # call: a bf16 -> fp32 copy_ runs PyTorch's unrolled elementwise kernel, the
            # foreach kernel 1.13-1.20x faster on 16-45 M elements (one H100,
            # bench/bench_landing.py); the same values either way.
            torch._foreach_copy_([view], [grad])
        s.written = True

    def _land_grad(self, s: _Slot, param: nn.Parameter) -> None:
        # Post-accumulate hook of the cast path, run once per parameter per backward.
        # With gradient sync it always defers (to _fold_pending_grads), so that test comes
        # first, outside any grad-mode switch: a decorator here cost ~5 us per parameter.
        if param.grad is None or self._defer_landing(s):
            return
        with record_function("hyperrec::land_grad"):
            self._land(s, param.grad)  # _land runs under no_grad
        param.grad = None

    @torch.no_grad()
    def _fold_pending_grads(self) -> None:
        # Gradients still outside the buffer: the root's deferred ones, and any autograd
        # produced although pre-backward never ran for this group (outputs that did not
        # require grad), which it then stored as fresh tensors.
        # One foreach call per kind instead of one copy per parameter: a tower of a few
        # hundred small tensors otherwise pays a kernel launch and a Python round trip
        # for each cast. Views of distinct slots never overlap, so the order is free.
        copy_dst: list[torch.Tensor] = []
        copy_src: list[torch.Tensor] = []
        add_dst: list[torch.Tensor] = []
        add_src: list[torch.Tensor] = []
        for s in self.slots:
            u = s.unsharded
            if u is None or u.grad is None or u.grad is s.grad_view:
                continue
            grad = u.grad
            u.grad = None
            # _ensure_live first: it resets the slots' `written` flags of a fresh buffer
            view = self._ensure_live(s.buffer).grad_full_view(s.index)
            if s.written or self._in_place[s.buffer]:
                add_dst.append(view)
                add_src.append(grad)
            else:
                copy_dst.append(view)
                copy_src.append(grad)  # the cast to the reduce dtype, written in place
            s.written = True
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)

    def post_backward(self) -> None:
        """Reduce-scatter this group's gradients (unless accumulating) and reshard.

        Idempotent: after a reduction it reduces again only if new gradients arrived
        (a module of the group that ran forward more than once)."""
        if self.training_state == TrainingState.POST_BACKWARD and not self.has_pending_grads():
            return
        self.training_state = TrainingState.POST_BACKWARD
        comm = self.comm
        if self.requires_gradient_sync and comm is not None:
            # One group's reduction in flight at a time; waiting before the deferred
            # gradients are cast in lets the previous grad_full's block be reused for
            # this one instead of both being held at once.
            comm.wait_reduces()
        self._fold_pending_grads()
        live = [b for b, buf in enumerate(self.buffers) if buf.grad_full_live]
        if self.requires_gradient_sync and live:
            stream = comm.rs_stream if comm is not None else None
            for b in live:
                buf = self.buffers[b]
                slots = [s for s in self._slots_of(b) if s.requires_grad]
                if self._in_place[b]:
                    for s in slots:
                        s.gathered().grad = None
                        s.grad_view = None
                else:
                    buf.zero_grad_padding_()
                    for s in slots:
                        if not s.written:
                            buf.grad_full_view(s.index).zero_()
                        s.written = False
                buf.reduce_grad(stream=stream, options=self.reduce_options())
            if comm is not None:
                comm.pending_reduce.append(self)
            self._grads_begun = False
            self._reduced = True
        if self.reshard_after_backward:
            self.reshard()

    def reset_iter_state(self) -> None:
        """Drop this iteration's unreduced gradients (and an HSDP partial sum), keep the
        reduced ones, register the sharded parameters (FSDP2's ``reset_iter_state``)."""
        for buf in self.buffers:
            buf.wait_unshard()
            buf.discard_grad_full()
        for s in self.slots:
            if s.unsharded is not None:
                s.unsharded.grad = None
            s.grad_view = None
            s.written = False
        self._grads_begun = False
        self.finalize_backward()
        self.reshard()

    def finalize_backward(self) -> None:
        """After all reductions: expose the reduced gradients on the sharded parameters."""
        self.training_state = TrainingState.IDLE
        self.post_forward_index = None
        if not self._reduced:
            return
        self._reduced = False
        for b, buf in enumerate(self.buffers):
            buf.wait_reduce()
            if not buf.has_grad:
                continue
            slots = [s for s in self._slots_of(b) if s.requires_grad]
            if slots:
                self._grad_dtensors(b)
            for s in slots:
                if s.sharded.grad is None:
                    s.sharded.grad = s.grad_dtensor
            buf.shard.grad = buf.grad_shard
