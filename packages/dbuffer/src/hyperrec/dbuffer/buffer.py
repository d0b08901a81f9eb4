"""DBuffer: one flat, rank-major, zero-copy buffer for a group of same-dtype tensors."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from hyperrec.dbuffer._streams import Pending, on_stream
from hyperrec.dbuffer._validate import check_bool, check_float, check_int
from hyperrec.raggedshard import Layout, RaggedShard, from_local, plan_layout, wrap_local
from hyperrec.raggedshard.reference import layout_violations

__all__ = ["DBuffer", "ReduceOptions"]


@dataclass(frozen=True, kw_only=True)
class ReduceOptions:
    """How :meth:`DBuffer.reduce_grad` reduces: PyTorch FSDP2's gradient-reduction knobs.

    The defaults are the plain average over every data-parallel rank.

    Raises:
        TypeError: ``divide_factor`` is not a real number, ``force_sum``/``all_reduce``
            not bools, ``hook``/``reduce_scatter`` not callables.
        ValueError: ``divide_factor`` is not positive and finite.
    """

    divide_factor: float | None = None
    """Divide the gradient summed over all data-parallel ranks by this instead of by their
    number (FSDP2's ``set_gradient_divide_factor``). ``None``: average."""
    force_sum: bool = False
    """Issue only ``SUM`` collectives and divide in a separate kernel (FSDP2's
    ``set_force_sum_reduction_for_comms``; NCCL's zero-copy collectives need ``SUM``)."""
    all_reduce: bool = True
    """HSDP: all-reduce over the replicate axis in this reduction. ``False`` keeps the
    reduce-scattered gradient as a partial sum that the next reduction with ``True``
    adds before its all-reduce (FSDP2's ``set_requires_all_reduce``); the shard gradient
    is not updated meanwhile."""
    hook: Callable[[torch.Tensor], None] | None = None
    """Called with this rank's reduced gradient (``(shard_numel,)``, ``reduce_dtype``)
    after the reduce-scatter (and the HSDP all-reduce), before any post-division and
    before it is added to :attr:`DBuffer.grad_shard` (FSDP2's ``set_all_reduce_hook``)."""
    hook_stream: torch.cuda.Stream | None = None
    """CUDA stream the hook runs on (default: the reduction's stream)."""
    reduce_scatter: Callable[..., Any] | None = None
    """Custom collective called as ``fn(output_tensor=, input_tensor=, group=, op=)`` in
    place of ``reduce_scatter_tensor`` (FSDP2's ``ReduceScatter`` comm; its ``allocate`` is
    not used: the input and output are this buffer's own storages)."""
    group: dist.ProcessGroup | None = None
    """Process group of the reduce-scatter (default: the shard axis' own group)."""

    def __post_init__(self) -> None:
        # A zero factor divided by zero (or gave inf gradients with SUM-only collectives),
        # a negative one flipped every gradient's sign, a string failed deep in the
        # reduction: refuse them here, by name.
        if self.divide_factor is not None:
            check_float("divide_factor", self.divide_factor, minimum=0, exclusive=True)
        check_bool("force_sum", self.force_sum)
        check_bool("all_reduce", self.all_reduce)
        for name in ("hook", "reduce_scatter"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")


def _default_options(options: ReduceOptions | None) -> bool:
    return options is None or options == ReduceOptions()


def _reduce_factors(
    shard_size: int,
    replicas: int,
    reduce_dtype: torch.dtype,
    divide_factor: float | None,
    force_sum: bool,
) -> tuple[float | None, float | None, Any, Any, float | None]:
    """``(pre, post, reduce_scatter_op, all_reduce_op, premul)`` for one reduction.

    The same arithmetic as PyTorch FSDP2 so that results agree bitwise: fp32/bf16 use the
    collectives' own averaging (or a pre-multiplied sum for a custom factor); any other
    reduce dtype (fp16's range, fp64) and ``force_sum`` use ``SUM`` with the division
    split around it (for fp16: by about ``sqrt(factor)`` before and the rest after, so
    neither the inputs nor the sum leave its range).
    """
    sum_op = dist.ReduceOp.SUM
    risky = reduce_dtype not in (torch.float32, torch.bfloat16)
    world = shard_size * replicas
    if not risky and not force_sum:
        if divide_factor is None:
            op = sum_op if world == 1 else dist.ReduceOp.AVG
            return None, None, op, op, None
        if divide_factor == shard_size:
            return None, None, dist.ReduceOp.AVG, sum_op, None
        return None, None, sum_op, sum_op, 1.0 / divide_factor
    factor = float(world if divide_factor is None else divide_factor)
    if not risky:
        return None, factor, sum_op, sum_op, None
    pre = 1.0
    # Grow the pre-division by powers of two while it divides the factor and stays
    # below the remaining post-division.
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre, factor / pre, sum_op, sum_op, None


# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: Elements per host-to-device chunk of an offloaded shard cast on the device (64 MiB fp32).
_OFFLOAD_CHUNK = 1 << 24


def _free(t: torch.Tensor) -> None:
    # Resizing the storage (not dropping the tensor) keeps every view and every tensor
    # autograd saved for backward attached to the same storage object, so a later
    # all-gather into the re-grown storage is seen through all of them.
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def _gather_call(*, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any) -> None:
    _all_gather(output_tensor, input_tensor, group=group)


def _reduce_scatter_call(
    *, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any
) -> None:
    _reduce_scatter(output_tensor, input_tensor, op=op, group=group)


def _alloc(t: torch.Tensor, numel: int) -> bool:
    storage = t.untyped_storage()
    nbytes = numel * t.element_size()
    if storage.size() == nbytes:
        return False
    storage.resize_(nbytes)
    return True


def _check_ints(name: str, values: object, *, minimum: int, per_item: bool) -> list[int]:
    """``values`` as a list of ints ``>= minimum`` (numpy ints accepted; bools and floats,
    even ``2.0``, rejected: a float here is a bug upstream, never something to truncate)."""
    if isinstance(values, torch.Tensor | str) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    for i, v in enumerate(values):
        where = f"{name}[{i}]" if per_item else name
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{where} must hold ints, got {type(v).__name__} {v!r}")
        if v < minimum:
            raise ValueError(f"{where} must be >= {minimum}, got {v} in {list(values)}")
    return [int(v) for v in values]


class DBuffer:
    """A group of tensors laid out in one flat, rank-major buffer planned by raggedshard.

    The geometry is the :class:`hyperrec.raggedshard.Layout` in :attr:`layout` (planned
    here, or passed in): the buffer holds ``world_size * shard_numel`` elements; rank
    ``r`` owns elements ``[r * shard_numel, (r + 1) * shard_numel)`` (its *shard*), and
    tensor ``i`` occupies ``[offsets[i], offsets[i] + numels[i])``. Which elements of a
    tensor a rank holds, where they sit in its shard and the ``RaggedShard`` placement of
    its DTensor view are all read from the layout (``rank_range``, ``shard_range``,
    ``placement``); nothing here re-derives them. Because the planner never lets a shard
    boundary cut a block of ``granularities[i]`` elements, every rank holds whole blocks
    (whole rows, whole 2,048-element quantization blocks, whole matrices...).

    Storage:

    * ``shard`` — ``(shard_numel,)`` in ``dtype``, persistent: the master copy this rank
      owns. Each tensor's local piece is a view of it (:meth:`shard_view`).
    * ``full`` — ``(world_size * shard_numel,)`` in ``param_dtype``, present only while
      unsharded; each full tensor is a view of it (:meth:`full_view`). :meth:`unshard` is
      ONE ``all_gather_into_tensor(full, shard)``: no copy-in, no copy-out. With
      ``param_dtype != dtype`` the shard is cast straight into this rank's slot of
      ``full`` and gathered in place. With one rank and no cast, ``full`` *is* ``shard``.
    * ``grad_full`` — ``(world_size * shard_numel,)`` in ``reduce_dtype``, present while
      gradients are being produced; each full tensor's gradient is a view of it.
      :meth:`reduce_grad` is ONE ``reduce_scatter_tensor`` (averaging) into
      ``grad_shard``, plus one ``all_reduce`` across the replicate axis for HSDP.
    * ``grad_shard`` — ``(shard_numel,)`` in ``dtype``, persistent once created.

    Full storages are allocated as one block per buffer (the storage object is kept and
    re-grown, so views and saved tensors stay valid) and freed with :meth:`reshard` /
    after the reduction; buffers of equal size therefore reuse the same allocator blocks.

    Args:
        shapes: shape of each tensor (any number of dims; zero-size tensors allowed).
        mesh: ``None`` (one process), a 1-D ``DeviceMesh`` (shard across it) or a 2-D
            mesh ``(replicate, shard)`` for HSDP. Default ``None``.
        dtype: dtype of the shard (master) storage. Default ``torch.float32``.
        param_dtype: dtype of the full (unsharded) storage. Default ``dtype``.
        reduce_dtype: dtype gradients are produced and reduced in. Default ``param_dtype``.
        device: device of all storages. Default: the mesh's device (the current CUDA
            device for a CUDA mesh) or the CPU.
        granularities: per tensor, the block size in elements that no shard boundary may
            cut (1 = element-wise, ``shape[1:]`` product = rows, ``numel`` = whole tensor).
            Default all 1. Not with ``layout``.
        alignment: every tensor starts at a multiple of this many elements. Default 1.
            Not with ``layout``.
        names: one name per tensor for :meth:`state_dict`. Default ``"0"``, ``"1"``, ...
        layout: a precomputed layout of these tensors (e.g. planned once for many
            buffers); default: ``plan_layout(numels, granularities, world_size,
            alignment=alignment)``. It must be for the shard axis's world size and
            honour the planner's contract (checked).
        offload: keep ``shard`` and ``grad_shard`` on the host (CPU) and ``full`` /
            ``grad_full`` on ``device``: :meth:`unshard` copies the shard host-to-device
            (on the gather's stream) into its slot of ``full`` before gathering, and
            :meth:`reduce_grad` copies the reduced gradient device-to-host (PyTorch
            FSDP2's ``CPUOffloadPolicy``). Default ``False``.
        pin_memory: with ``offload``, pin the host storages (when CUDA is available) so
            the copies are asynchronous. Default ``True``.
        trainable: whether an optimizer updates these tensors. :func:`flat_params` leaves
            a buffer with ``trainable=False`` out (frozen parameters: a zero gradient
            would still let weight decay or momentum move them). Default ``True``.

    Raises:
        TypeError: ``shapes`` is not a sequence of shapes of ints; a dtype is not a
            floating dtype; ``granularities``/``names`` not sequences of ints/strings;
            ``alignment`` not an int; ``offload``/``pin_memory``/``trainable`` not bools;
            ``mesh`` not a ``DeviceMesh``; ``device`` not a device; ``layout`` is not a
            ``Layout``.
        ValueError: a negative dim, ``granularities``/``names`` of the wrong length,
            non-positive granularity or alignment, duplicate names, an unknown device
            type, a mesh of more than 2 axes; a ``layout`` for other numels or another
            world size, one that breaks the planner's contract, or given together with
            ``granularities``/``alignment``.
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        *,
        mesh: DeviceMesh | None = None,
        dtype: torch.dtype = torch.float32,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        granularities: Sequence[int] | None = None,
        alignment: int = 1,
        names: Sequence[str] | None = None,
        layout: Layout | None = None,
        offload: bool = False,
        pin_memory: bool = True,
        trainable: bool = True,
    ) -> None:
        if isinstance(shapes, torch.Tensor | str) or not isinstance(shapes, Sequence):
            raise TypeError(f"shapes must be a sequence of shapes, got {type(shapes).__name__}")
        for i, s in enumerate(shapes):
            _check_ints(f"shapes[{i}]", s, minimum=0, per_item=False)
        if granularities is not None:
            granularities = _check_ints("granularities", granularities, minimum=1, per_item=True)
        if names is not None and (isinstance(names, str) or not isinstance(names, Sequence)):
            raise TypeError(f"names must be a sequence of strings, got {type(names).__name__}")
        for i, name in enumerate(names or ()):
            if not isinstance(name, str):
                raise TypeError(f"names[{i}] must be a str, got {type(name).__name__} {name!r}")
        check_int("alignment", alignment, minimum=1)
        check_bool("offload", offload)
        check_bool("pin_memory", pin_memory)
        check_bool("trainable", trainable)
        self.trainable = trainable
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
        if device is not None:
            try:
                device = torch.device(device)
            except (TypeError, RuntimeError) as e:
                err = TypeError if not isinstance(device, str | int) else ValueError
                raise err(
                    f"device must be a torch.device or a device string, got {device!r}"
                ) from e
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        n = len(self.shapes)
        self.dtype = dtype
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        for name, dt in (
            ("dtype", self.dtype),
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
        ):
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise TypeError(f"{name} must be a floating torch.dtype, got {dt!r}")
        given_blocks = granularities is not None
        granularities = [1] * n if granularities is None else list(granularities)
        if len(granularities) != n:
            raise ValueError(f"granularities has {len(granularities)} entries for {n} tensors")
        self.names = [str(i) for i in range(n)] if names is None else [str(x) for x in names]
        if len(self.names) != n or len(set(self.names)) != n:
            raise ValueError(f"names must be {n} distinct strings, got {names!r}")
        self.granularities = granularities

        self.mesh = mesh
        if mesh is None:
            self.world_size, self.rank = 1, 0
            self._shard_group = self._replicate_group = None
        else:
            if mesh.ndim not in (1, 2):
                raise ValueError(f"mesh must have 1 axis (FSDP) or 2 (HSDP), got {mesh.ndim}")
            self._shard_group = mesh.get_group(mesh.ndim - 1)
            self._replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
            self.world_size = mesh.size(mesh.ndim - 1)
            self.rank = mesh.get_local_rank(mesh.ndim - 1)
        if device is None:
            if mesh is not None and mesh.device_type == "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device(mesh.device_type if mesh is not None else "cpu")
        self.device = torch.device(device)

        if layout is None:
            # Zero-numel tensors still get a place (all-empty ranges).
            layout = plan_layout(self.numels, granularities, self.world_size, alignment=alignment)
        else:
            _check_layout(layout, self.numels, self.world_size, given_blocks or alignment != 1)
            self.granularities = [int(g) for g in layout.granularities]
        self.layout: Layout = layout
        self.shard_numel = int(layout.shard_numel)
        S, W = self.shard_numel, self.world_size
        # Cached once from the layout: the tensors' offsets in the full buffer and this
        # rank's piece of each inside its shard.
        self._offsets = [int(o) for o in layout.offsets]
        self._local = [layout.shard_range(i, self.rank) for i in range(n)]
        # Built on first use: a RaggedShard holds one count per rank, and gradient
        # DTensors are rebuilt every step (O(world) validation each time otherwise).
        self._placements: list[RaggedShard | None] = [None] * n
        self._gaps = _padding_ranges(self._offsets, self.numels, W * S)

        self.offload = offload
        self.pin_memory = offload and pin_memory and torch.cuda.is_available()
        self.shard_device = torch.device("cpu") if self.offload else self.device
        self.shard = self._host_zeros(S, dtype)
        # With one rank and no cast the full buffer is the shard itself: nothing to
        # gather, nothing to allocate (not when the shard lives on the host).
        self._full_aliases_shard = W == 1 and self.param_dtype == dtype and not self.offload
        if self._full_aliases_shard:
            self.full = self.shard
        else:
            self.full = torch.empty(W * S, dtype=self.param_dtype, device=self.device)
        # With one rank on the shard axis gradients land directly in grad_shard; HSDP
        # replicas then average it in place (a held gradient is equal on all replicas,
        # so averaging old + new gives old + the average of new).
        self._grad_full_aliases_shard = W == 1 and self.reduce_dtype == dtype and not self.offload
        self._grad_shard: torch.Tensor | None = None
        self._partial: torch.Tensor | None = None  # HSDP reduce-scattered, not all-reduced
        self._post_forward: tuple[torch.Tensor, dist.ProcessGroup] | None = None
        self._grad_full: torch.Tensor | None = None
        self._grad_gap_views: list[torch.Tensor] = []  # grad_full's gaps, made with it
        self._grad_full_live = False
        self._has_grad = False
        self._unshard_pending: Pending | None = None
        self._reduce_pending: Pending | None = None
        self._full_views = self._views_of(self.full)
        self._shard_views = [self.shard[lo:hi] for lo, hi in self._local]
        # Views are made while the storage exists; freeing it afterwards keeps them valid.
        if not self._full_aliases_shard:
            _free(self.full)

    def _host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(numel, dtype=dtype, device=self.shard_device)
        return t.pin_memory() if self.pin_memory else t

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], **kwargs: Any) -> DBuffer:
        """A buffer shaped like ``tensors`` (same values on every rank) holding their shards.

        ``dtype`` and ``device`` default to those of the first tensor. Other keyword
        arguments as for :class:`DBuffer`.

        Raises:
            TypeError: ``tensors`` is not a non-empty sequence of tensors; the tensors
                have different dtypes (one DBuffer holds one dtype: build one per
                dtype), or a ``dtype`` argument differs from theirs (no silent cast); an
                unknown keyword; as :class:`DBuffer`.
            ValueError: as :class:`DBuffer`.
        """
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(
                f"tensors must be a non-empty sequence of tensors, got {type(tensors).__name__}"
            )
        tensors = list(tensors)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("tensors must be a non-empty sequence of tensors")
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise TypeError(
                f"tensors must share one dtype (one DBuffer per dtype), got {', '.join(dtypes)}"
            )
        if kwargs.get("dtype", tensors[0].dtype) != tensors[0].dtype:
            raise TypeError(
                f"dtype={kwargs['dtype']} differs from the tensors' dtype {tensors[0].dtype}; "
                "cast the tensors first (a DBuffer never casts its inputs silently)"
            )
        kwargs.setdefault("dtype", tensors[0].dtype)
        kwargs.setdefault("device", tensors[0].device)
        buf = cls([t.shape for t in tensors], **kwargs)
        buf.copy_from_full_(tensors)
        return buf

    @torch.no_grad()
    def copy_from_full_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Fill this rank's shard from full tensors (identical on every rank); init-time only.

        Every tensor is checked before the first one is copied.

        Raises:
            TypeError: ``tensors`` is not a sequence of tensors, or one's dtype is not
                the buffer's ``dtype`` (no silent cast).
            ValueError: wrong number of tensors or a shape mismatch.
        """
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"tensors must be a sequence of tensors, got {type(tensors).__name__}")
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        for i, (t, s) in enumerate(zip(tensors, self.shapes)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] must be a tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise TypeError(f"tensors[{i}] has dtype {t.dtype}, expected {self.dtype}")
            if t.shape != s:
                raise ValueError(f"tensors[{i}] has shape {tuple(t.shape)}, expected {tuple(s)}")
        for i, t in enumerate(tensors):
            lo, hi = self.local_range(i)
            self._shard_views[i].copy_(t.detach().reshape(-1)[lo:hi])

    # ----------------------------------------------------------------------- views
    def __len__(self) -> int:
        return len(self.shapes)

    def local_range(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the flat elements of tensor ``i`` held by ``rank`` (default: self).

        The layout's :meth:`~hyperrec.raggedshard.Layout.rank_range`.
        """
        return self.layout.rank_range(i, self.rank if rank is None else rank)

    def _views_of(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor (full shape) as a view of a ``(world_size * shard_numel,)`` tensor."""
        return [full[o : o + n].view(s) for o, n, s in zip(self._offsets, self.numels, self.shapes)]

    def shard_view(self, i: int) -> torch.Tensor:
        """1-D view of this rank's piece of tensor ``i`` inside :attr:`shard` (may be empty)."""
        return self._shard_views[i]

    def full_view(self, i: int) -> torch.Tensor:
        """Tensor ``i`` (its full shape) as a view of :attr:`full`; valid while unsharded."""
        return self._full_views[i]

    def flat_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i``'s local piece of any ``(shard_numel,)`` tensor (optimizer states...).

        Raises:
            TypeError: ``flat`` is not a tensor.
            ValueError: ``flat`` is not 1-D of ``shard_numel`` elements.
        """
        _check_flat(flat, self.shard_numel)
        if flat.dim() != 1 or flat.numel() != self.shard_numel:
            raise ValueError(f"flat must have shape ({self.shard_numel},), got {tuple(flat.shape)}")
        lo, hi = self._local[i]
        return flat[lo:hi]

    @property
    def is_unsharded(self) -> bool:
        """Whether the full storage currently holds memory."""
        return self.full.untyped_storage().size() != 0

    @property
    def padding(self) -> int:
        """Elements of the flat buffer that belong to no tensor (all ranks together)."""
        return self.world_size * self.shard_numel - sum(self.numels)

    # ------------------------------------------------------------- all-gather side
    @torch.no_grad()
    def unshard(
        self,
        *,
        stream: torch.cuda.Stream | None = None,
        all_gather: Callable[..., Any] | None = None,
    ) -> None:
        """Materialise every full tensor: one ``all_gather_into_tensor``, zero copies.

        On CUDA the gather runs on ``stream`` (default: the current stream) after work
        already queued; call :meth:`wait_unshard` before using the full views. A second
        call while unsharded is a no-op. After :meth:`reshard` with ``keep=`` the gather
        runs over that smaller group from the kept piece.

        Args:
            stream: CUDA stream for the copy-in (offload, casts) and the collective.
            all_gather: custom collective called as ``fn(output_tensor=full,
                input_tensor=slot, group=)`` instead of ``all_gather_into_tensor``.
        """
        if self._full_aliases_shard or self._unshard_pending is not None or self.is_unsharded:
            return
        # Allocate on the current stream: the side stream waits for it below, and the
        # block is later freed on the current stream after the consumer's wait.
        _alloc(self.full, self.world_size * self.shard_numel)
        S, r = self.shard_numel, self.rank
        gather = all_gather or _gather_call
        # Refilling the storage is not a modification autograd must see: tensors saved
        # in forward are views of it and must read the re-gathered values in backward.
        with (
            on_stream(stream, self.device),
            torch.autograd._unsafe_preserve_version_counter(self.full),  # type: ignore[attr-defined]
        ):
            keep = None
            if self._post_forward is not None:
                piece, group = self._post_forward
                self._post_forward = None
                gather(output_tensor=self.full, input_tensor=piece, group=group)
                keep = piece
            else:
                src = self.shard
                if self.param_dtype != self.dtype or self.offload:
                    # The cast the mixed-precision policy asks for (and the host-to-device
                    # copy of an offloaded shard), written straight into this rank's slot
                    # of the output: the gather then runs in place.
                    src = self.full[r * S : (r + 1) * S]
                    if self.offload and self.param_dtype != self.dtype:
                        # Through the device in chunks: a whole fp32 copy of the shard
                        # would live beside the gather buffer (measured: 1.27x FSDP2's
                        # peak allocated memory on one H200). Each chunk is allocated and
                        # freed on this stream, so the next one reuses its block only
                        # after the cast that reads it.
                        for a in range(0, S, _OFFLOAD_CHUNK):
                            b = min(a + _OFFLOAD_CHUNK, S)
                            staged = self.shard[a:b].to(self.device, non_blocking=self.pin_memory)
                            src[a:b].copy_(staged)
                    else:
                        src.copy_(self.shard, non_blocking=self.pin_memory)
                if self.world_size > 1:
                    gather(output_tensor=self.full, input_tensor=src, group=self._shard_group)
            self._unshard_pending = Pending(self.device, keepalive=keep)

    def wait_unshard(self) -> None:
        """Order the current stream after the pending :meth:`unshard` (no-op if none)."""
        if self._unshard_pending is not None:
            self._unshard_pending.wait()
            self._unshard_pending = None

    def reshard(self, *, keep: dist.ProcessGroup | None = None) -> None:
        """Free the full storage (views stay valid objects; no-op when it aliases the shard).

        Args:
            keep: a process group of ``N`` ranks of the shard axis (``N`` divides
                ``world_size``) whose members together hold the full buffer: this rank
                keeps the piece ``[i * L, (i + 1) * L)`` of it, ``L = world_size *
                shard_numel / N`` and ``i`` its rank in ``keep`` (one copy), and the next
                :meth:`unshard` gathers over ``keep`` only (PyTorch FSDP2's
                ``reshard_after_forward=N``). Must be called while unsharded.

        Raises:
            TypeError: ``keep`` is not a process group.
            ValueError: ``keep`` does not divide the buffer, or nothing is unsharded.
        """
        if keep is not None and not isinstance(keep, dist.ProcessGroup):
            raise TypeError(f"keep must be a ProcessGroup or None, got {type(keep).__name__}")
        self.wait_unshard()
        self._post_forward = None
        if self._full_aliases_shard:
            return
        if keep is not None:
            n = keep.size()
            total = self.world_size * self.shard_numel
            if self.world_size % n:
                raise ValueError(f"keep must have a size dividing {self.world_size}, got {n}")
            # A buffer of zero elements (only empty tensors) never holds memory, gathered
            # or not: there is nothing to keep, and nothing to check.
            if total and not self.is_unsharded:
                raise ValueError("reshard(keep=...) needs the full storage (call unshard first)")
            i, length = keep.rank(), total // n
            with torch.no_grad():
                piece = self.full[i * length : (i + 1) * length].clone()
            self._post_forward = (piece, keep)
        _free(self.full)

    # ---------------------------------------------------------- reduce-scatter side
    @property
    def grad_shard(self) -> torch.Tensor:
        """``(shard_numel,)`` gradient of the shard in ``dtype`` (zeros when (re)allocated)."""
        g = self._grad_storage()
        if _alloc(g, self.shard_numel):
            g.zero_()
        return g

    def _grad_storage(self) -> torch.Tensor:
        # The tensor object (and so every view of it) lives as long as the buffer; its
        # memory may be released between steps (see drop_grad_).
        if self._grad_shard is None:
            self._grad_shard = self._host_zeros(self.shard_numel, self.dtype)
        return self._grad_shard

    @property
    def has_grad(self) -> bool:
        """Whether :attr:`grad_shard` holds a reduced gradient (cleared by :meth:`zero_grad_`)."""
        return self._has_grad

    @property
    def grad_full(self) -> torch.Tensor:
        """``(world_size * shard_numel,)`` unreduced gradient in ``reduce_dtype``."""
        if self._grad_full is None:
            if self._grad_full_aliases_shard:
                self._grad_full = self.grad_shard
            else:
                self._grad_full = torch.empty(
                    self.world_size * self.shard_numel,
                    dtype=self.reduce_dtype,
                    device=self.device,
                )
            self._grad_full_views = self._views_of(self._grad_full)
            g = self._grad_full
            self._grad_gap_views = [g[a:b] for a, b in self._gaps]
            if not self._grad_full_aliases_shard:
                _free(self._grad_full)
        return self._grad_full

    def grad_full_view(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s gradient (full shape) as a view of :attr:`grad_full`."""
        self.grad_full  # noqa: B018  (creates the views on first use)
        return self._grad_full_views[i]

    def grad_shard_view(self, i: int) -> torch.Tensor:
        """1-D view of this rank's piece of tensor ``i``'s gradient inside :attr:`grad_shard`."""
        return self.flat_view(self.grad_shard, i)

    @property
    def grad_full_aliases_shard(self) -> bool:
        """Whether :attr:`grad_full` is :attr:`grad_shard` itself (one rank, no cast)."""
        return self._grad_full_aliases_shard

    @property
    def grad_full_live(self) -> bool:
        """Whether :attr:`grad_full` currently holds gradients waiting for :meth:`reduce_grad`."""
        return self._grad_full_live

    @torch.no_grad()
    def begin_grad(self, *, zero: bool = True) -> torch.Tensor:
        """Make :attr:`grad_full` ready to receive gradients and return it.

        Allocates it (one block) if needed. With ``zero=True`` it is zeroed by one kernel
        unless it already holds gradients of this accumulation window (then gradients
        keep accumulating). When ``grad_full`` aliases ``grad_shard`` (one rank) and the
        shard already holds a reduced gradient, it is not zeroed either, so gradients
        accumulate across optimizer-free backward passes exactly as with more ranks.

        Raises:
            TypeError: ``zero`` is not a bool.
        """
        check_bool("zero", zero)
        g = self.grad_full
        if self._grad_full_live:
            return g
        self.wait_reduce()
        if not self._grad_full_aliases_shard:
            _alloc(g, self.world_size * self.shard_numel)
            if zero:
                g.zero_()
        elif _alloc(g, self.shard_numel) or (not self._has_grad and zero):
            g.zero_()
        self._grad_full_live = True
        return g

    @torch.no_grad()
    def zero_grad_padding_(self) -> None:
        """Zero the parts of :attr:`grad_full` that belong to no tensor (before a reduce)."""
        if self._gaps:
            self.grad_full  # noqa: B018  (creates the views on first use)
            # one foreach call (one kernel on CUDA) for every alignment gap
            torch._foreach_zero_(self._grad_gap_views)

    @torch.no_grad()
    def reduce_grad(
        self,
        *,
        stream: torch.cuda.Stream | None = None,
        options: ReduceOptions | None = None,
    ) -> None:
        """Average :attr:`grad_full` over all data-parallel ranks into :attr:`grad_shard`.

        One ``reduce_scatter_tensor`` over the shard axis (in ``reduce_dtype``), then for
        HSDP one ``all_reduce`` across the replicate axis of this rank's slice only. If
        ``grad_shard`` already holds a gradient (accumulation across synced backward
        passes) the new one is added to it, else it is overwritten. On CUDA this runs on
        ``stream``; call :meth:`wait_reduce` before reading ``grad_shard``. ``grad_full``
        is released once the reduction is done.

        Args:
            stream: CUDA stream of the reduction.
            options: :class:`ReduceOptions` (divide factor, SUM-only collectives, HSDP
                partial reduction, a hook, a custom collective). Default: average.

        Raises:
            TypeError: ``options`` is not a :class:`ReduceOptions` (or ``None``).
            RuntimeError: no gradients were begun with :meth:`begin_grad`, or non-default
                ``options`` on a buffer whose ``grad_full`` is ``grad_shard`` while it
                holds a gradient (call :meth:`unalias_grad_` before the backward).
        """
        if options is not None and not isinstance(options, ReduceOptions):
            raise TypeError(
                f"options must be a ReduceOptions or None, got {type(options).__name__}"
            )
        if not self._grad_full_live:
            raise RuntimeError("reduce_grad() without begin_grad(): no gradients to reduce")
        self.wait_reduce()
        S, r, W = self.shard_numel, self.rank, self.world_size
        g, out = self.grad_full, self._grad_storage()
        regrown = _alloc(out, S)  # uninitialised memory until a path below writes it
        if regrown and self._has_grad:
            raise RuntimeError("grad_shard was released while holding a gradient")
        if (
            not _default_options(options)
            or self.offload
            or self._partial is not None
            or self.reduce_dtype not in (torch.float32, torch.bfloat16)
        ):
            self._reduce_general(options or ReduceOptions(), stream, regrown)
            return
        with on_stream(stream, self.device):
            if self._grad_full_aliases_shard:
                # One rank on the shard axis: the gradient already sits in grad_shard.
                if self._replicate_group is not None:
                    dist.all_reduce(out, op=dist.ReduceOp.AVG, group=self._replicate_group)
            elif not self._has_grad and self.reduce_dtype == self.dtype:
                _reduce_scatter(out, g, op=dist.ReduceOp.AVG, group=self._shard_group)
                if self._replicate_group is not None:
                    dist.all_reduce(out, op=dist.ReduceOp.AVG, group=self._replicate_group)
            else:
                # Accumulating (or casting): reduce in place into this rank's slot of
                # grad_full, then one add/cast kernel into grad_shard.
                mine = g[r * S : (r + 1) * S]
                if W > 1:
                    _reduce_scatter(mine, g, op=dist.ReduceOp.AVG, group=self._shard_group)
                if self._replicate_group is not None:
                    dist.all_reduce(mine, op=dist.ReduceOp.AVG, group=self._replicate_group)
                if self._has_grad:
                    out.add_(mine)
                else:
                    out.copy_(mine)
            keep = None if self._grad_full_aliases_shard else g
            self._reduce_pending = Pending(self.device, keepalive=keep)
        self._has_grad = True
        self._grad_full_live = False

    def _reduce_general(
        self, options: ReduceOptions, stream: torch.cuda.Stream | None, regrown: bool
    ) -> None:
        # Every option goes through one path: reduce in place into this rank's slot of
        # grad_full, finish the slot (all-reduce, hook, division), then one add/cast
        # (and, offloaded, one device-to-host copy) into grad_shard.
        S, r, W = self.shard_numel, self.rank, self.world_size
        g, out = self.grad_full, self._grad_storage()
        aliased = self._grad_full_aliases_shard
        if aliased and self._has_grad and not _default_options(options):
            raise RuntimeError(
                "reduce_grad(options=...) on a buffer whose grad_full is grad_shard while it "
                "holds a gradient would rescale that gradient too; call unalias_grad_() "
                "before the backward"
            )
        replicas = 1 if self._replicate_group is None else self._replicate_group.size()
        pre, post, rs_op, ar_op, premul = _reduce_factors(
            W, replicas, self.reduce_dtype, options.divide_factor, options.force_sum
        )
        mine = g[r * S : (r + 1) * S]
        keep: list[torch.Tensor] = [] if aliased else [g]
        done = False
        with on_stream(stream, self.device):
            if pre is not None and pre != 1:
                g.div_(pre)
            if W > 1:
                if premul is not None:
                    if self.device.type == "cuda" and hasattr(dist, "_make_nccl_premul_sum"):
                        rs_op = dist._make_nccl_premul_sum(premul)
                    else:  # gloo has no PREMUL_SUM: the same products, then a sum
                        g.mul_(premul)
                scatter = options.reduce_scatter or _reduce_scatter_call
                group = options.group or self._shard_group
                scatter(output_tensor=mine, input_tensor=g, group=group, op=rs_op)
            elif options.divide_factor is not None and pre is None and post is None:
                # No reduce-scatter to pre-multiply in; with a pre/post split those
                # divisions make the factor already (FSDP2 2.13 divides twice here).
                mine.div_(options.divide_factor)
            if self._replicate_group is not None:
                if not options.all_reduce:
                    if self._partial is None:
                        self._partial = mine.clone()
                    else:
                        self._partial.add_(mine)
                    done = True
                    if regrown:
                        # Nothing lands in grad_shard this time: leave a released one
                        # released (it reads as zeros when re-grown), never uninitialised.
                        _free(out)
                else:
                    if self._partial is not None:
                        mine.add_(self._partial)
                        keep.append(self._partial)
                        self._partial = None
                    dist.all_reduce(mine, op=ar_op, group=self._replicate_group)
            if not done:
                if options.hook is not None:
                    with on_stream(options.hook_stream, self.device):
                        options.hook(mine)
                    if options.hook_stream is not None and self.device.type == "cuda":
                        # What follows (division, landing) runs after the hook's work.
                        torch.cuda.current_stream().wait_stream(options.hook_stream)
                if post is not None and post != 1:
                    mine.div_(post)
                if not aliased:
                    if self.offload:
                        src = mine.to(self.dtype)
                        if self._has_grad:
                            out.add_(src.to(out.device))
                        else:
                            out.copy_(src, non_blocking=self.pin_memory)
                            keep.append(src)
                    elif self._has_grad:
                        out.add_(mine)
                    else:
                        out.copy_(mine)
            self._reduce_pending = Pending(
                self.device, keepalive=keep or None, host=self.offload and self.pin_memory
            )
        if not done:
            self._has_grad = True
        self._grad_full_live = False

    def unalias_grad_(self) -> None:
        """Give :attr:`grad_full` its own storage where it was :attr:`grad_shard` (one rank
        on the shard axis), so that non-default :class:`ReduceOptions` apply to the new
        gradients only. No-op otherwise or while gradients are being produced."""
        if not self._grad_full_aliases_shard or self._grad_full_live:
            return
        self.wait_reduce()
        self._grad_full_aliases_shard = False
        self._grad_full = None

    @torch.no_grad()
    def set_grad_(self, flat: torch.Tensor) -> None:
        """Make :attr:`grad_shard` hold ``flat`` (``(shard_numel,)``, cast to ``dtype``) as a
        reduced gradient, e.g. when moving a buffer's gradient into a rebuilt buffer.

        Raises:
            TypeError: ``flat`` is not a tensor.
            ValueError: ``flat`` is not 1-D of ``shard_numel`` elements.
        """
        _check_flat(flat, self.shard_numel)
        if flat.dim() != 1 or flat.numel() != self.shard_numel:
            raise ValueError(f"flat must have shape ({self.shard_numel},), got {tuple(flat.shape)}")
        self.wait_reduce()
        self.grad_shard.copy_(flat)
        self._has_grad = True

    def wait_reduce(self) -> None:
        """Order the current stream after the pending :meth:`reduce_grad`; free ``grad_full``.

        With ``offload`` (pinned) the host also waits for the device-to-host copy, so the
        host gradient can be read (by a CPU optimizer) right after.
        """
        if self._reduce_pending is not None:
            self._reduce_pending.wait()
            self._reduce_pending = None
            full = self._grad_full
            if full is not None and not self._grad_full_aliases_shard and not self._grad_full_live:
                _free(full)

    def discard_grad_full(self) -> None:
        """Drop unreduced gradients (e.g. after an aborted step) and free their storage,
        including an HSDP partial sum kept by ``ReduceOptions(all_reduce=False)``."""
        self.wait_reduce()
        self._grad_full_live = False
        self._partial = None
        if self._grad_full is not None and not self._grad_full_aliases_shard:
            _free(self._grad_full)

    # ------------------------------------------------------------------- group ops
    @torch.no_grad()
    def zero_grad_(self) -> None:
        """Zero :attr:`grad_shard` (one kernel) and mark it empty for the next reduce.

        A gradient released by ``drop_grad_(release=True)`` stays released (it reads as
        zeros when it is re-grown): writing through its empty storage would be out of
        bounds.
        """
        self.wait_reduce()
        g = self._grad_shard
        if g is not None and g.untyped_storage().size() != 0:
            g.zero_()
        self._has_grad = False

    def drop_grad_(self, *, release: bool = False) -> None:
        """Mark :attr:`grad_shard` empty without writing it: the next reduce overwrites it.

        With ``release=True`` its memory is also returned until the next reduction (the
        tensor object and its views stay valid), as ``zero_grad(set_to_none=True)``
        frees gradients between steps. Pinned host memory (``offload``) cannot be resized
        in place, so an offloaded shard keeps its host memory.

        Raises:
            TypeError: ``release`` is not a bool.
        """
        check_bool("release", release)
        self.wait_reduce()
        self._has_grad = False
        if (
            release
            and self._grad_shard is not None
            and not self._grad_full_live
            and self._grad_shard.untyped_storage().resizable()
        ):
            _free(self._grad_shard)

    @torch.no_grad()
    def scale_grad_(self, factor: float | torch.Tensor) -> None:
        """``grad_shard *= factor`` in one kernel.

        Raises:
            TypeError: ``factor`` is neither a real number nor a tensor.
        """
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real | torch.Tensor):
            raise TypeError(f"factor must be a float or a tensor, got {type(factor).__name__}")
        self.grad_shard.mul_(factor)

    @torch.no_grad()
    def add_(self, other: DBuffer | torch.Tensor, *, alpha: float = 1.0) -> None:
        """``shard += alpha * other`` in one kernel; ``other`` a same-layout buffer or flat tensor.

        Raises:
            TypeError: ``other`` is neither a DBuffer nor a tensor; ``alpha`` not a number.
            ValueError: ``other`` has another layout or shape.
        """
        if not isinstance(other, DBuffer | torch.Tensor):
            raise TypeError(f"other must be a DBuffer or a tensor, got {type(other).__name__}")
        check_float("alpha", alpha, finite=False)
        if isinstance(other, DBuffer):
            if other.shapes != self.shapes or other._offsets != self._offsets:
                raise ValueError("other must be a DBuffer with the same shapes and layout")
            other = other.shard
        if other.shape != self.shard.shape:
            raise ValueError(f"other must have shape ({self.shard_numel},), got {other.shape}")
        self.shard.add_(other, alpha=alpha)

    @torch.no_grad()
    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's :attr:`grad_shard` in fp32 (padding is zero).

        Accumulated in fp32, or in fp64 for an fp64 buffer (a narrowing norm is refused by
        torch), and returned as fp32. The global squared norm is the sum of this over the
        shard axis; see :func:`hyperrec.dbuffer.clip_grad_norm_`.
        """
        g = self.grad_shard
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        return torch.linalg.vector_norm(g, dtype=acc).square().float()

    @torch.no_grad()
    def gather_full(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Full values of every tensor from a ``(shard_numel,)`` tensor (default :attr:`shard`).

        One all-gather into a fresh buffer (the live full storage is not touched), then
        one clone per tensor. Collective over the shard axis. For checkpoints that need a
        single file, tests and debugging; training never calls it.

        Raises:
            TypeError: ``flat`` is not a tensor.
            ValueError: ``flat`` is not 1-D of ``shard_numel`` elements.
        """
        flat = self.shard if flat is None else _check_flat(flat, self.shard_numel)
        if flat.dim() != 1 or flat.numel() != self.shard_numel:
            raise ValueError(f"flat must have shape ({self.shard_numel},), got {tuple(flat.shape)}")
        if self.world_size > 1:
            # Host (offloaded) shards travel through the collective's device.
            src = flat.to(self.device).contiguous()
            full = src.new_empty(self.world_size * self.shard_numel)
            _all_gather(full, src, group=self._shard_group)
            full = full.to(flat.device)
        else:
            full = flat
        return [v.clone() for v in self._views_of(full)]

    # ------------------------------------------------------------------ state dict
    def placement(self, i: int) -> RaggedShard:
        """The ``RaggedShard`` of tensor ``i`` on the shard axis (the layout's
        :meth:`~hyperrec.raggedshard.Layout.placement`)."""
        placement = self._placements[i]
        if placement is None:
            placement = self._placements[i] = self.layout.placement(i, self.shapes[i])
        return placement

    def as_dtensors(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each tensor's piece of ``flat`` (default :attr:`shard`) as a ragged DTensor view.

        The placement is :meth:`placement` (``(Replicate(), RaggedShard)`` on an HSDP
        mesh). Without a mesh the pieces are plain tensors of the full shapes. Any
        ``(shard_numel,)`` tensor works, e.g. a flat optimizer state. No copies.

        Stock ``torch`` ops on these DTensors (an optimizer step, ``clip_grad_norm_``)
        run shard-locally only under :func:`hyperrec.raggedshard.enable_local_ops` /
        :func:`hyperrec.raggedshard.local_ops`; this method does not switch them on.

        The local tensors stay on ``flat``'s device also when that is not the mesh's
        (an ``offload`` buffer's host shard on a CUDA mesh, as FSDP2's offloaded
        parameters). Only views of a ``flat`` that requires grad, on the mesh's device,
        are differentiable (built by ``DTensor.from_local``); the others are built
        directly from the layout's placements, without re-checking them.
        """
        flat = self.shard if flat is None else flat
        out: list[torch.Tensor] = []
        for i, shape in enumerate(self.shapes):
            local = self.flat_view(flat, i)
            if self.mesh is None:
                out.append(local.view(shape))
                continue
            placement = self.placement(i)
            local = local.view(placement.local_shape(shape, self.rank))
            placements = (placement,) if self.mesh.ndim == 1 else (Replicate(), placement)
            if flat.requires_grad and local.device.type == self.mesh.device_type:
                out.append(from_local(local, self.mesh, placements, shape=shape))
            else:
                # The layout's own placements need no re-validation (this runs for every
                # gradient every step), and DTensor.from_local would copy a host shard to
                # the mesh's device: a view no more.
                out.append(wrap_local(local, self.mesh, placements, shape=shape))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` with every tensor a zero-copy view of this rank's shard.

        With a mesh the values are DTensors with ``RaggedShard`` placements, so
        ``torch.distributed.checkpoint`` saves and reloads them onto any world size.
        """
        return dict(zip(self.names, self.as_dtensors()))

    @torch.no_grad()
    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> None:
        """Copy values into the shard: ragged DTensors with the same layout copy locally;
        other DTensors are redistributed; plain tensors are taken as full values.

        Every entry is checked before the first one is copied.

        Raises:
            TypeError: ``state_dict`` is not a mapping, a value is not a tensor, or
                ``strict`` is not a bool.
            KeyError: a name is missing (``strict``) or unknown.
            ValueError: a value has the wrong shape.
        """
        check_bool("strict", strict)
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        unknown = set(state_dict) - set(self.names)
        if unknown:
            raise KeyError(f"unexpected keys {sorted(unknown, key=str)}")
        for i, name in enumerate(self.names):
            if name not in state_dict:
                if strict:
                    raise KeyError(f"missing key {name!r}")
                continue
            src = state_dict[name]
            if not isinstance(src, torch.Tensor):
                raise TypeError(f"state_dict[{name!r}] must be a tensor, got {type(src).__name__}")
            if tuple(src.shape) != tuple(self.shapes[i]):
                raise ValueError(
                    f"state_dict[{name!r}] has shape {tuple(src.shape)}, expected "
                    f"{tuple(self.shapes[i])}"
                )
        views = self.as_dtensors()
        for i, name in enumerate(self.names):
            if name in state_dict:
                _copy_into(views[i], state_dict[name], self.local_range(i), self.shard_view(i))


def _check_flat(flat: object, shard_numel: int) -> torch.Tensor:
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a ({shard_numel},) tensor, got {type(flat).__name__}")
    return flat


def _check_layout(layout: Any, numels: list[int], world_size: int, overridden: bool) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a raggedshard Layout, got {type(layout).__name__}")
    if overridden:
        raise ValueError("pass either layout or granularities/alignment, not both")
    if [int(n) for n in layout.numels] != numels:
        raise ValueError(f"layout is for numels {list(layout.numels)}, these shapes have {numels}")
    if layout.world_size != world_size:
        raise ValueError(
            f"layout is for world_size {layout.world_size}, the shard axis has {world_size} ranks"
        )
    bad = layout_violations(
        [int(o) for o in layout.offsets],
        numels,
        [int(g) for g in layout.granularities],
        int(layout.shard_numel),
        world_size,
        int(layout.alignment),
    )
    if bad:
        raise ValueError(f"layout breaks the planner's contract: {'; '.join(bad[:3])}")


def _padding_ranges(offsets: list[int], numels: list[int], end: int) -> list[tuple[int, int]]:
    """Maximal ranges of ``[0, end)`` that hold no tensor (zeroed before a reduction)."""
    gaps, pos = [], 0
    for a, b in sorted((o, o + n) for o, n in zip(offsets, numels) if n > 0):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        gaps.append((pos, end))
    return gaps


def _copy_into(
    dst: torch.Tensor, src: torch.Tensor, local: tuple[int, int], flat_dst: torch.Tensor
) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(src, DTensor):
        if isinstance(dst, DTensor) and src.placements == dst.placements:
            flat_dst.copy_(src.to_local().reshape(-1))
            return
        if isinstance(dst, DTensor):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                src = src.redistribute(dst.device_mesh, dst.placements).to_local()
            flat_dst.copy_(src.reshape(-1))
            return
        src = src.full_tensor()
    lo, hi = local
    flat_dst.copy_(src.reshape(-1)[lo:hi].to(flat_dst.dtype))
