"""Step-time model: compute per layer, alpha-beta collectives per tier, FSDP overlap.

:func:`predict` prices one training step of a :class:`ModelConfig` on a mesh
(:class:`~hyperrec.parallel5d.mesh.MeshSpec`) of a
:class:`~hyperrec.parallel5d.topology.Topology`; :func:`plan_mesh` enumerates the valid
meshes and returns the fastest that fits in memory.

What a step is made of, per rank (local batch ``b = global_batch / world``):

* **compute** per layer: measured seconds per sample when the layer carries them, else a
  roofline: matmul FLOPs at the device's (measured) matmul rate + other memory traffic
  at its copy bandwidth + kernel launches. Backward = 2 x forward, plus one forward when
  the layer's activations are checkpointed (recompute; not counted as useful FLOPs):
  ``ModelConfig.activation_checkpointing``, or ``LayerSpec.recompute`` per layer.
* **FSDP collectives** on a communication stream, FSDP2's prefetch schedule: the
  all-gather of layer ``i + 1`` is issued when layer ``i``'s forward starts; in backward
  the all-gather of layer ``i - 1`` is issued when layer ``i``'s backward starts and
  layer ``i``'s reduce-scatter (+ the all-reduce across ``replicate``, HSDP) when it
  ends. One network resource: collectives run one at a time, in issue order. Compute
  waits for its layer's all-gather.
* **blocking collectives** on the compute stream: the expert all-to-alls (dispatch and
  combine, forward, backward and recompute); the sparse embedding all-to-all too unless
  ``CostOptions.sparse_pipelined`` (then the next batch's input all-to-all and row
  gather run on their own stream during this forward, and backward waits for them).
* **SM contention**: an SM-based collective (NCCL kernels) slows the compute it overlaps
  by ``DeviceSpec.sm_slowdown`` (calibrated on one GPU); SM-free collectives (copy
  engines / RDMA offload, ``CostOptions.sm_free``) take nothing from compute.
* **mixed-precision casts**: each unshard casts this rank's fp32 shard to bf16, each
  backward casts the layer's bf16 gradients into the fp32 reduction buffer
  (:attr:`ModelConfig.master_bytes`): HBM traffic at the copy bandwidth, counted as
  compute on every rank.
* **optimizer**: AdamW over this rank's shard at the copy bandwidth.
* **host**: where the model carries a measured host issue time per step
  (:attr:`ModelConfig.host_s`), the step lasts at least that long plus the optimizer's
  update, which is issued last and so runs after the host is done: a step of many small
  kernels (hundreds of small parameters) can be bound by the CPU that launches them.
  With :attr:`ModelConfig.host_forward_s` the host's issue is walked layer by layer
  beside the GPU's schedule, so a host-bound forward and a GPU-bound backward add up
  instead of hiding each other.

Outputs: step time, compute time, exposed communication (GPU schedule - compute), MFU (model
FLOPs / step time / peak), local MFU (same over compute time) and scaling ratio (compute
/ step), so ``mfu = local_mfu * scaling_ratio`` as in Meta's GEM accounting.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from hyperrec.parallel5d._validate import check_bool, check_choice, check_float, check_int
from hyperrec.parallel5d.cost.collectives import GroupShape, collective_time
from hyperrec.parallel5d.mesh import _VIEWS, AXES, MeshSpec, _resolve_tiers
from hyperrec.parallel5d.topology import TIERS, Topology

__all__ = [
    "CostOptions",
    "DeviceSpec",
    "LayerSpec",
    "ModelConfig",
    "Plan",
    "Prediction",
    "SparseSpec",
    "plan_mesh",
    "predict",
]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One GPU's figures. Defaults: H200 (cited); :meth:`from_calibration` loads measured ones."""

    name: str = "H200"
    """Device name, for reports."""
    peak_tflops: float = 989.0
    """Dense bf16 peak, the MFU denominator (H100/H200 SXM datasheet)."""
    matmul_tflops: float = 780.0
    """Achievable bf16 GEMM rate for shapes without a measured entry."""
    hbm_gbps: float = 4200.0
    """Achievable copy bandwidth (GB/s) for memory-bound work."""
    launch_us: float = 4.0
    """Host cost per kernel launch (a floor for tiny kernels)."""
    memory_gb: float = 141.0
    """HBM capacity (GB = 1e9 bytes)."""
    sm_slowdown: float = 0.1
    """Fractional slowdown of compute while an SM-based collective overlaps it."""
    matmul_table: tuple[tuple[str, float], ...] = ()
    """Measured GEMM TFLOP/s per layer name (from ``bench/calibrate_cost.py``)."""
    sources: tuple[tuple[str, str], ...] = (
        ("peak_tflops", "cited: NVIDIA H100/H200 SXM dense bf16 989 TFLOP/s"),
        ("matmul_tflops", "cited: ~780 TFLOP/s bf16 GEMM on H200 (project brief ceiling)"),
        ("hbm_gbps", "cited: ~4.2 TB/s copy on H200 (project brief ceiling)"),
        ("launch_us", "assumed: 4 us per kernel"),
        ("sm_slowdown", "assumed: 10% until calibrated"),
    )
    """Where each figure comes from (``"cited: ..."``, ``"measured: ..."``, ``"assumed: ..."``)."""

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "matmul_tflops", "hbm_gbps", "memory_gb"):
            check_float(name, getattr(self, name), minimum=1e-9)
        check_float("launch_us", self.launch_us, minimum=0.0)
        check_float("sm_slowdown", self.sm_slowdown, minimum=0.0)
        # A measured rate of 0 raised ZeroDivisionError in predict, a negative one gave
        # negative compute times and NaN propagated silently: check them as the defaults.
        if not isinstance(self.matmul_table, tuple):
            raise TypeError(
                "matmul_table must be a tuple of (layer name, TFLOP/s) pairs, got "
                f"{type(self.matmul_table).__name__}"
            )
        for entry in self.matmul_table:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
                raise TypeError(
                    f"matmul_table entries must be (layer name, TFLOP/s) pairs, got {entry!r}"
                )
            check_float(f"matmul_table[{entry[0]!r}]", entry[1], minimum=1e-9)

    def matmul_rate(self, layer: str) -> float:
        """FLOP/s for ``layer``'s GEMMs: its measured entry, else ``matmul_tflops``."""
        for name, tflops in self.matmul_table:
            if name == layer:
                return tflops * 1e12
        return self.matmul_tflops * 1e12

    @classmethod
    def from_calibration(cls, path_or_dict: str | os.PathLike[str] | dict[str, Any]) -> DeviceSpec:
        """Load the JSON ``bench/calibrate_cost.py`` writes; missing figures keep defaults.

        Raises:
            ValueError: the JSON has no ``"device"`` section.
        """
        data = path_or_dict
        if not isinstance(data, dict):
            with open(data) as f:
                data = json.load(f)
        if "device" not in data:
            raise ValueError("calibration JSON must have a 'device' section")
        dev = data["device"]
        base = cls()
        sources = dict(base.sources)
        kw: dict[str, Any] = {}
        for key in (
            "name",
            "peak_tflops",
            "matmul_tflops",
            "hbm_gbps",
            "launch_us",
            "memory_gb",
            "sm_slowdown",
        ):
            if dev.get(key) is not None:
                kw[key] = dev[key]
                sources[key] = dev.get("sources", {}).get(key, "measured: calibrate_cost.py")
        table = tuple((m["layer"], float(m["tflops"])) for m in data.get("matmul", []))
        return replace(base, **kw, matmul_table=table, sources=tuple(sources.items()))


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One FSDP unit of the dense (or expert) part, per sample."""

    name: str
    """Layer name (also the key of measured GEMM rates)."""
    params: int
    """Parameters (elements). For an expert layer: of all its experts together."""
    flops_per_sample: float
    """Forward matmul FLOPs per sample (for an expert layer: of the routed tokens)."""
    hbm_bytes_per_sample: float = 0.0
    """Forward memory traffic of the non-matmul work per sample (bytes)."""
    kernels: int = 10
    """Forward kernel launches."""
    input_bytes_per_sample: float = 0.0
    """Bytes of the layer's input (what activation checkpointing keeps)."""
    saved_bytes_per_sample: float = 0.0
    """Bytes saved for backward without checkpointing."""
    kind: Literal["dense", "experts"] = "dense"
    """``"experts"``: parameters sharded over ``ep`` x ``efsdp``, tokens all-to-all'd."""
    a2a_bytes_per_sample: float = 0.0
    """Bytes one all-to-all (dispatch; combine is the same) sends per sample."""
    measured_fwd_s: float | None = None
    """Measured forward seconds per sample (overrides the roofline)."""
    measured_bwd_s: float | None = None
    """Measured backward seconds per sample (without recompute)."""
    recompute: bool | None = None
    """Whether backward recomputes this layer's forward. ``None`` (default): as
    :attr:`ModelConfig.activation_checkpointing` says. ``False`` for a part the runtime
    does not checkpoint under a model-wide policy (typically the root's embeddings and
    heads, around checkpointed blocks); ``True`` for a checkpointed layer in a model
    that checkpoints nothing else."""

    def __post_init__(self) -> None:
        check_int("params", self.params, minimum=0)
        for name in (
            "flops_per_sample",
            "hbm_bytes_per_sample",
            "input_bytes_per_sample",
            "saved_bytes_per_sample",
            "a2a_bytes_per_sample",
        ):
            check_float(name, getattr(self, name), minimum=0.0)
        check_int("kernels", self.kernels, minimum=0)
        check_choice("kind", self.kind, ("dense", "experts"))
        for name in ("measured_fwd_s", "measured_bwd_s"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), minimum=0.0)
        if self.recompute is not None:
            check_bool("recompute", self.recompute)


@dataclass(frozen=True, kw_only=True)
class SparseSpec:
    """Embedding tables of one kind, sharded over the sparse axes."""

    name: str
    """Name, for reports."""
    rows: int
    """Rows over all tables of this kind."""
    dim: int
    """Embedding width."""
    lookups_per_sample: float
    """Ids looked up per sample."""
    param_bytes: int = 4
    """Bytes per element of the stored rows (fp32)."""
    state_bytes_per_row: int = 4
    """Optimizer bytes per row (row-wise Adagrad: one fp32)."""
    comm_bytes: int = 2
    """Bytes per element of looked-up embeddings sent in the all-to-all (bf16)."""

    def __post_init__(self) -> None:
        check_int("rows", self.rows, minimum=0)
        check_int("dim", self.dim, minimum=1)
        check_float("lookups_per_sample", self.lookups_per_sample, minimum=0.0)
        for name in ("param_bytes", "state_bytes_per_row", "comm_bytes"):
            check_int(name, getattr(self, name), minimum=0)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model as the cost model sees it: FSDP units in forward order, plus tables."""

    name: str
    """Name, for reports."""
    layers: tuple[LayerSpec, ...]
    """Dense and expert layers, forward order."""
    sparse: tuple[SparseSpec, ...] = ()
    """Embedding tables."""
    param_bytes: int = 2
    """Bytes per gathered parameter (bf16 compute)."""
    reduce_bytes: int = 4
    """Bytes per reduced gradient (fp32 reduction)."""
    master_bytes: int = 4
    """Bytes per sharded master parameter (fp32). Where it differs from ``param_bytes``
    each unshard casts this rank's shard (reads ``master_bytes``, writes ``param_bytes``
    per local parameter), and where ``param_bytes`` differs from ``reduce_bytes`` each
    backward casts the layer's gradients into the reduction buffer (reads
    ``param_bytes``, writes ``reduce_bytes`` per unsharded parameter): HBM traffic on
    every rank, one GPU included, priced at the copy bandwidth as compute."""
    state_bytes_per_param: int = 16
    """Sharded bytes per parameter: fp32 master + fp32 gradient shard + AdamW moments."""
    optimizer_traffic_per_param: int = 28
    """HBM bytes AdamW moves per parameter (reads p, g, m, v; writes p, m, v; fp32)."""
    activation_checkpointing: bool = True
    """Recompute each layer's forward in backward (keeps only layer inputs), except where
    a layer's :attr:`LayerSpec.recompute` says otherwise."""
    host_s: float | None = None
    """Measured seconds the host (CPU) takes to issue one step on one rank of the target
    runtime: Python, dispatch, kernel launches, the sharding runtime's hooks and its
    collective calls. The GPU cannot finish a step before the host has issued it, so a
    step lasts at least this long. ``None``: not modelled (fine where the GPU work is
    much longer). Measure it with the runtime and mesh layout being predicted (the number
    of collectives per step matters, their size does not), e.g. on a copy of the model
    with the same tensors but small dims, whose GPU work is negligible
    (``bench/validate_cost.py``)."""
    host_forward_s: float | None = None
    """The part of :attr:`host_s` spent issuing the forward (loss included); the rest
    issues the backward and the optimizer. Given, the host's issue is walked layer by
    layer beside the GPU's schedule (each phase's host time split evenly over the
    layers): a layer's kernels cannot start before the host has issued the layer
    before it, nor end before their own issue ends. A forward bound by the host and a
    backward bound by the GPU then add up, where ``max(host, GPU)`` over the whole step
    (``None``, the default) lets the one hide the other. Requires ``host_s``."""
    host_backward_s: float | None = None
    """With :attr:`host_forward_s`: the part of :attr:`host_s` spent issuing the backward;
    the rest issues the optimizer after the last layer, while the GPU may still run the
    backward. ``None``: everything after the forward is walked with the backward."""

    def __post_init__(self) -> None:
        if not self.layers or not all(isinstance(x, LayerSpec) for x in self.layers):
            raise ValueError("layers must be a non-empty tuple of LayerSpec")
        # ``sparse=None`` failed with "'NoneType' object is not iterable".
        if not isinstance(self.sparse, tuple | list) or not all(
            isinstance(x, SparseSpec) for x in self.sparse
        ):
            raise TypeError(f"sparse must be a tuple of SparseSpec, got {self.sparse!r:.80}")
        for name in (
            "param_bytes",
            "reduce_bytes",
            "master_bytes",
            "state_bytes_per_param",
            "optimizer_traffic_per_param",
        ):
            check_int(name, getattr(self, name), minimum=0)
        check_bool("activation_checkpointing", self.activation_checkpointing)
        if self.host_s is not None:
            check_float("host_s", self.host_s, minimum=0.0)
        if self.host_forward_s is not None:
            check_float("host_forward_s", self.host_forward_s, minimum=0.0)
            if self.host_s is None:
                raise ValueError("host_forward_s needs host_s (the whole step's host time)")
            if self.host_forward_s > self.host_s:
                raise ValueError(
                    f"host_forward_s must be <= host_s ({self.host_s}), got {self.host_forward_s}"
                )
        if self.host_backward_s is not None:
            check_float("host_backward_s", self.host_backward_s, minimum=0.0)
            if self.host_forward_s is None:
                raise ValueError("host_backward_s needs host_forward_s")
            rest = self.host_s - self.host_forward_s  # type: ignore[operator]
            if self.host_backward_s > rest * (1 + 1e-12):
                raise ValueError(
                    f"host_backward_s must be <= host_s - host_forward_s ({rest}), "
                    f"got {self.host_backward_s}"
                )

    @property
    def model_flops_per_sample(self) -> float:
        """Useful FLOPs per sample: forward + backward (3 x forward), no recompute."""
        return 3.0 * sum(x.flops_per_sample for x in self.layers)

    @property
    def dense_params(self) -> int:
        return sum(x.params for x in self.layers if x.kind == "dense")

    @property
    def expert_params(self) -> int:
        return sum(x.params for x in self.layers if x.kind == "experts")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dense_params": self.dense_params,
            "expert_params": self.expert_params,
            "embedding_rows": sum(s.rows for s in self.sparse),
            "embedding_bytes": sum(s.rows * s.dim * s.param_bytes for s in self.sparse),
            "model_flops_per_sample": self.model_flops_per_sample,
            "layers": len(self.layers),
            "host_s": self.host_s,
            "host_forward_s": self.host_forward_s,
            "host_backward_s": self.host_backward_s,
        }


@dataclass(frozen=True, kw_only=True)
class CostOptions:
    """What the modelled system can do."""

    overlap: bool = True
    """Prefetch all-gathers and overlap reductions (FSDP2 schedule); False: serial."""
    sm_free: bool = False
    """Collectives on copy engines / RDMA offload, taking no SMs from compute."""
    nvls: bool = True
    """NVLink SHARP all-reduce inside a host where the topology has it."""
    reshard_after_forward: bool = True
    """Gather parameters again in backward (FSDP's default)."""
    memory_fraction: float = 0.9
    """Share of HBM a plan may use."""
    casts: bool = True
    """Price the mixed-precision casts (:attr:`ModelConfig.master_bytes`); False: a
    runtime that needs none (fused into kernels that read the data anyway), so the
    projection says what they cost."""
    communication: bool = True
    """False: collectives take no time, as on one GPU or on a fake process group where
    they move no data (what compute, casts and the host give alone)."""
    sparse_pipelined: bool = True
    """The embedding input all-to-all and row gather for the next batch run during this
    step (TorchRec's ``TrainPipelineSparseDist``): on their own stream from the start of
    the step, overlapping this forward; backward waits for them. False: they block the
    start of forward."""

    def __post_init__(self) -> None:
        for name in (
            "overlap",
            "sm_free",
            "nvls",
            "reshard_after_forward",
            "casts",
            "communication",
            "sparse_pipelined",
        ):
            check_bool(name, getattr(self, name))
        check_float("memory_fraction", self.memory_fraction, minimum=1e-9)
        if self.memory_fraction > 1.0:  # a share of HBM: above 1 passed plans that cannot fit
            raise ValueError(f"memory_fraction must be <= 1, got {self.memory_fraction}")


@dataclass(frozen=True)
class Prediction:
    """Predicted figures of one step (seconds unless named otherwise)."""

    spec: MeshSpec
    world_size: int
    local_batch: float
    step_s: float
    compute_s: float
    exposed_comm_s: float
    blocking_comm_s: float
    comm_s: float
    mfu: float
    local_mfu: float
    scaling_ratio: float
    memory_gb: float
    feasible: bool
    reason: str
    breakdown: dict[str, float] = field(default_factory=dict)
    """Total seconds per collective kind and axis (``"all_gather/fsdp"``, ...)."""
    algorithms: dict[str, str] = field(default_factory=dict)
    """Algorithm priced per collective kind and axis."""
    host_s: float = 0.0
    """The model's :attr:`ModelConfig.host_s` (0 when not given)."""
    host_bound: bool = False
    """The host's issue time (plus the optimizer's update after it), not the GPU
    schedule, set ``step_s``."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer's update at the end of the step (AdamW over this rank's
    shard, sparse row updates), part of ``compute_s``."""
    cast_s: float = 0.0
    """Seconds of FSDP's mixed-precision casts (parameters at each unshard, gradients
    into the reduction buffer), part of ``compute_s`` (:attr:`ModelConfig.master_bytes`)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = {a: self.spec.size(a) for a in AXES}
        return d


@dataclass(frozen=True)
class Plan:
    """:func:`plan_mesh`'s answer: the best feasible mesh and every candidate priced."""

    best: Prediction | None
    candidates: tuple[Prediction, ...]


# ----------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=4096)
def _axis_shape(topology: Topology, view_shape: tuple[int, ...], pos: int) -> GroupShape:
    world = _world_order(topology)
    arr = world.reshape(view_shape)
    groups = np.moveaxis(arr, pos, -1).reshape(-1, view_shape[pos])
    span = topology.span(groups)
    return GroupShape(
        size=view_shape[pos],
        ranks_per_host=int(span.ranks_per_host.min()),
        ranks_per_zone=int(span.ranks_per_zone.min()),
        hosts=int(span.hosts.max()),
        zones=int(span.zones.max()),
    )


@functools.lru_cache(maxsize=64)
def _world_order(topology: Topology) -> np.ndarray:
    return topology.ranks_in_slot_order()


def _shapes(spec: MeshSpec, topology: Topology) -> dict[str, GroupShape]:
    out = {}
    for view, axes in _VIEWS.items():
        vs = spec.view_shape(view)
        for pos, axis in enumerate(axes):
            out[axis] = _axis_shape(topology, vs, pos)
    return out


@dataclass
class _LayerCost:
    fwd: float
    bwd: float
    blocking_fwd: float
    blocking_bwd: float
    ag: float
    reduce: float


def _one_pass(
    layers: list[_LayerCost],
    fwd_scale: list[float],
    bwd_scale: list[float],
    *,
    pre: float,
    post_comm: float,
    reshard: bool,
    early_comm: float = 0.0,
    host_fwd: float = 0.0,
    host_bwd: float = 0.0,
) -> tuple[float, list[tuple[float, float]], list[tuple[float, float]], list[tuple[float, float]]]:
    """One walk of the schedule: (end of communication and compute, compute intervals of
    forward and backward, communication intervals). ``early_comm`` (the next batch's
    pipelined sparse input distribution) runs from the start of the step on its own
    stream, as TorchRec's ``TrainPipelineSparseDist`` does, and backward waits for it
    (the pipeline waits on it after this forward). ``host_fwd``/``host_bwd``: the
    host's seconds to issue one layer's forward / backward (:attr:`ModelConfig.host_forward_s`):
    a layer's compute starts no earlier than the host's issue of it and ends no earlier
    than the end of that issue (its last kernel)."""
    n = len(layers)
    issued = 0.0  # the host's clock: when it has issued everything walked so far
    comm_free = 0.0
    comm_iv: list[tuple[float, float]] = []

    def comm(issue: float, dur: float) -> float:
        nonlocal comm_free
        if dur <= 0:
            # No collective is issued (a group of one rank): nothing to wait for. Queuing
            # it would make the layer wait for every reduction issued before it, e.g. a
            # replicate-only mesh's backward stalled on the all-reduces of later layers.
            return issue
        start = max(issue, comm_free)
        comm_free = start + dur
        if dur > 0:
            comm_iv.append((start, comm_free))
        return comm_free

    fwd_iv: list[tuple[float, float]] = []
    bwd_iv: list[tuple[float, float]] = [(0.0, 0.0)] * n
    t = pre
    ready = [0.0] * n
    ready[0] = comm(0.0, layers[0].ag)
    if early_comm > 0:
        comm_iv.append((0.0, early_comm))  # SM contention with the forward it overlaps
    for i, x in enumerate(layers):
        start = max(t, ready[i], issued)
        issued += host_fwd
        if i + 1 < n:  # prefetch: the next all-gather is issued as this forward starts
            ready[i + 1] = comm(start, layers[i + 1].ag)
        end = max(start + x.fwd * fwd_scale[i], issued)
        fwd_iv.append((start, start + x.fwd * fwd_scale[i]))  # compute, for the stretch
        t = end + x.blocking_fwd
    t = max(t, early_comm)
    ready = [0.0] * n
    ready[n - 1] = comm(t, layers[n - 1].ag) if reshard else t
    for i in reversed(range(n)):
        x = layers[i]
        start = max(t, ready[i], issued)
        issued += host_bwd
        if i > 0:
            ready[i - 1] = comm(start, layers[i - 1].ag) if reshard else start
        end = max(start + x.bwd * bwd_scale[i], issued)
        bwd_iv[i] = (start, start + x.bwd * bwd_scale[i])
        t = end + x.blocking_bwd
        comm(t, x.reduce)  # reduce-scatter (+ replicate all-reduce) when backward ends
    comm(t, post_comm)
    return max(t, comm_free), fwd_iv, bwd_iv, comm_iv


def _simulate(
    layers: list[_LayerCost],
    *,
    pre: float,
    post_comm: float,
    tail: float,
    overlap: bool,
    reshard: bool,
    slowdown: float,
    early_comm: float = 0.0,
    host_fwd: float = 0.0,
    host_bwd: float = 0.0,
) -> float:
    """Step seconds of the schedule (module docstring)."""
    if not overlap:
        # Serial collectives: the same walk with each layer's collectives folded into
        # its compute (blocking, nothing overlaps), so the host walks beside it too.
        serial = [
            _LayerCost(
                x.fwd + x.ag, x.bwd + (x.ag if reshard else 0.0) + x.reduce,
                x.blocking_fwd, x.blocking_bwd, 0.0, 0.0,
            )
            for x in layers
        ]  # fmt: skip
        end, *_ = _one_pass(serial, [1.0] * len(layers), [1.0] * len(layers),
                            pre=pre + early_comm, post_comm=post_comm, reshard=False,
                            host_fwd=host_fwd, host_bwd=host_bwd)  # fmt: skip
        return end + tail

    def walk(fwd_scale: list[float], bwd_scale: list[float]) -> Any:
        return _one_pass(layers, fwd_scale, bwd_scale, pre=pre, post_comm=post_comm,
                         reshard=reshard, early_comm=early_comm,
                         host_fwd=host_fwd, host_bwd=host_bwd)  # fmt: skip

    n = len(layers)
    end, fwd_iv, bwd_iv, comm_iv = walk([1.0] * n, [1.0] * n)
    if slowdown > 0:
        # Second walk with each compute interval stretched by the SM slowdown over the
        # share of it the first walk overlapped with communication.
        def stretch(iv: tuple[float, float]) -> float:
            s, e = iv
            covered = sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in comm_iv)
            return 1.0 + slowdown * covered / max(e - s, 1e-30)

        end, *_ = walk([stretch(iv) for iv in fwd_iv], [stretch(iv) for iv in bwd_iv])
    return end + tail


# ----------------------------------------------------------------------------- predict


def predict(
    model: ModelConfig,
    topology: Topology,
    spec: MeshSpec,
    global_batch: int,
    *,
    device: DeviceSpec | None = None,
    options: CostOptions | None = None,
) -> Prediction:
    """Predict one training step of ``model`` on ``spec`` over ``topology``.

    Args:
        global_batch: samples per step over all ranks; a multiple of the world size.

    Raises:
        TypeError: an argument of the wrong type (named).
        ValueError: mismatched world sizes or a batch that does not split evenly.
    """
    _check_types(model, topology, device, options)
    if not isinstance(spec, MeshSpec):
        raise TypeError(f"spec must be a MeshSpec, got {type(spec).__name__}")
    device = device or DeviceSpec()
    options = options or CostOptions()
    w = spec.world_size
    if w != topology.world_size:
        raise ValueError(f"the mesh has {w} ranks but the topology has {topology.world_size}")
    global_batch = check_int("global_batch", global_batch, minimum=1)
    if global_batch % w:
        raise ValueError(
            f"global_batch must be a multiple of the world size {w}, got {global_batch}"
        )
    b = global_batch / w
    shapes = _shapes(spec, topology)
    breakdown: dict[str, float] = {}
    algos: dict[str, str] = {}

    def coll(kind: str, axis: str, nbytes: float) -> float:
        t, algo = collective_time(topology, shapes[axis], kind, nbytes, nvls=options.nvls)  # type: ignore[arg-type]
        if not options.communication:
            t = 0.0
        key = f"{kind}/{axis}"
        breakdown[key] = breakdown.get(key, 0.0) + t
        algos[key] = algo
        return t

    hbm = device.hbm_gbps * 1e9
    casts = 0.0
    costs = []
    for layer in model.layers:
        if layer.measured_fwd_s is not None:
            fwd = layer.measured_fwd_s * b
        else:
            fwd = (
                layer.flops_per_sample * b / device.matmul_rate(layer.name)
                + layer.hbm_bytes_per_sample * b / hbm
                + layer.kernels * device.launch_us * 1e-6
            )
        bwd = layer.measured_bwd_s * b if layer.measured_bwd_s is not None else 2.0 * fwd
        ac = _recomputes(model, layer)
        if ac:
            bwd += fwd
        experts = layer.kind == "experts"
        shard_axis = "efsdp" if experts else "fsdp"
        local_params = layer.params / spec.ep if experts else float(layer.params)
        # The casts of mixed precision, on every rank (one GPU included): a measured
        # per-layer time (bf16 parameters and gradients alone) or a roofline never sees
        # them. The parameter cast runs on the all-gather stream at high priority, a
        # memory-bound kernel over the whole GPU; it is priced as compute, i.e. as not
        # hiding under the GEMMs. On one H100 this predicts the Llama-like step 3-4%
        # high; with the parameter casts fully hidden it would read 2-3% low: part of
        # them hides, how much is not modelled (12.8 ms of 125.5 lay outside the
        # per-layer times before these terms).
        cast = (
            local_params / spec.size(shard_axis) * (model.master_bytes + model.param_bytes) / hbm
            if options.casts and model.master_bytes != model.param_bytes
            else 0.0
        )
        land = (
            local_params * (model.param_bytes + model.reduce_bytes) / hbm
            if options.casts and model.param_bytes != model.reduce_bytes
            else 0.0
        )
        regather = cast if options.reshard_after_forward else 0.0
        fwd += cast
        bwd += regather + land
        casts += cast + regather + land
        if experts:
            a2a = coll("all_to_all", "ep", layer.a2a_bytes_per_sample * b)
            blocking_fwd, blocking_bwd = 2 * a2a, (4 if ac else 2) * a2a
            # coll() counted one; a step runs 2 forward, 2 backward (+ 2 recomputed).
            breakdown["all_to_all/ep"] += a2a * (1 + 2 + (2 if ac else 0))
        else:
            blocking_fwd = blocking_bwd = 0.0
        ag = coll("all_gather", shard_axis, local_params * model.param_bytes)
        if options.reshard_after_forward:
            coll("all_gather", shard_axis, local_params * model.param_bytes)
        reduce = coll("reduce_scatter", shard_axis, local_params * model.reduce_bytes)
        reduce += coll(
            "all_reduce",
            "replicate",
            local_params / spec.size(shard_axis) * model.reduce_bytes,
        )
        costs.append(_LayerCost(fwd, bwd, blocking_fwd, blocking_bwd, ag, reduce))

    # Sparse tables: id/embedding all-to-all over the shard group (blocking, forward and
    # backward), the fully-sharded gather/scatter of the touched rows over the replica
    # axis, and the gradient all-reduce across table copies (sparse_dp).
    pre = post_comm = 0.0
    sparse_opt = 0.0
    for s in model.sparse:
        a2a = coll("all_to_all", "sparse_shard", s.lookups_per_sample * b * s.dim * s.comm_bytes)
        rows_bytes = s.lookups_per_sample * b * s.dim * s.param_bytes
        gather = coll("all_gather", "sparse_replicate", rows_bytes * spec.sparse_replicate)
        pre += a2a + gather
        post_comm += a2a  # backward all-to-all of the embedding gradients
        breakdown["all_to_all/sparse_shard"] += a2a
        post_comm += coll("reduce_scatter", "sparse_replicate", rows_bytes * spec.sparse_replicate)
        post_comm += coll("all_reduce", "sparse_dp", rows_bytes)
        sparse_opt += 3 * rows_bytes / hbm

    local_params = model.dense_params / spec.fsdp + model.expert_params / spec.fsdp
    tail = local_params * model.optimizer_traffic_per_param / hbm
    tail += sparse_opt
    slowdown = 0.0 if options.sm_free else device.sm_slowdown
    early = 0.0
    if options.sparse_pipelined:
        # The next batch's input all-to-all and row gather run during this step's
        # forward (TorchRec starts them before this forward, on their own stream, and
        # waits for them before backward). Queuing them after this step's backward (as
        # before) left them fully exposed: the pipelined step came out no faster, often
        # slower, than the blocking one.
        early, pre = pre, 0.0
    simulate = functools.partial(
        _simulate,
        costs,
        pre=pre,
        post_comm=post_comm,
        tail=tail,
        overlap=options.overlap,
        reshard=options.reshard_after_forward,
        slowdown=slowdown,
        early_comm=early,
    )
    step = simulate()
    if model.host_forward_s is not None:
        n = len(costs)
        after_forward = model.host_s - model.host_forward_s  # type: ignore[operator]
        host_walk = simulate(
            host_fwd=model.host_forward_s / n,
            host_bwd=(after_forward if model.host_backward_s is None else model.host_backward_s)
            / n,
        )
    else:
        host_walk = 0.0
    # The sparse backward all-to-all blocks the end of backward (its gradients feed the
    # table update), so it is on the critical path whatever the overlap.
    compute = sum(x.fwd + x.bwd for x in costs) + tail
    gpu_step = step
    host = model.host_s or 0.0
    # A host slower than the GPU work issues kernels one by one as the GPU drains them,
    # so the step is the host's time plus what runs after its last launch: the
    # optimizer's update, issued last, cannot start before it and is one long kernel,
    # not many short ones that keep pace with the host. (Measured on one H100, GEM
    # tower, host-bound: step - host = 2.5 ms in each of 5 rounds, AdamW over the
    # unsharded 0.28 B parameters; without the tail the host bound read 5-12% low.)
    # With host_forward_s the walk above already waited for the host layer by layer.
    host_step = max(host + tail, host_walk)  # without host_s: tail <= gpu_step
    step = max(gpu_step, host_step)
    blocking = sum(x.blocking_fwd + x.blocking_bwd for x in costs) + pre
    comm_total = sum(breakdown.values())

    # Memory per rank.
    unsharded = [x.params / (spec.ep if x.kind == "experts" else 1) for x in model.layers]
    # Two layers' gathered parameters and unsharded gradients (current + prefetched).
    gathered = 2 * max(unsharded) * (model.param_bytes + model.reduce_bytes)
    if not options.reshard_after_forward:
        # Without resharding every layer keeps its gathered parameters from its forward
        # to its backward: the peak holds all of them. Counting two layers' (as with
        # resharding) under-estimated memory, so plans could be infeasible in practice.
        gathered += max(0.0, sum(unsharded) - 2 * max(unsharded)) * model.param_bytes
    # A recomputed layer keeps its input; its saved tensors live only while its backward
    # runs, one such layer at a time. A layer that is not recomputed keeps them all. The
    # sum of both is an upper bound (a later layer's saves are freed before an earlier
    # layer's recompute).
    acts = sum(x.input_bytes_per_sample for x in model.layers) * b
    acts += sum(x.saved_bytes_per_sample for x in model.layers if not _recomputes(model, x)) * b
    acts += (
        max((x.saved_bytes_per_sample for x in model.layers if _recomputes(model, x)), default=0.0)
        * b
    )
    tables = (
        sum((s.rows * s.dim * s.param_bytes + s.rows * s.state_bytes_per_row) for s in model.sparse)
        * spec.sparse_dp
        / w
    )
    touched = 2 * sum(s.lookups_per_sample * b * s.dim * s.param_bytes for s in model.sparse)
    memory = (local_params * model.state_bytes_per_param + gathered + acts + tables + touched) / 1e9
    budget = device.memory_gb * options.memory_fraction
    feasible = memory <= budget
    reason = "" if feasible else f"needs {memory:.1f} GB per GPU, budget {budget:.1f} GB"

    useful = model.model_flops_per_sample * b
    peak = device.peak_tflops * 1e12
    return Prediction(
        spec=spec,
        world_size=w,
        local_batch=b,
        step_s=step,
        compute_s=compute,
        exposed_comm_s=gpu_step - compute,
        blocking_comm_s=blocking,
        comm_s=comm_total,
        mfu=_ratio(useful, step * peak),
        local_mfu=_ratio(useful, compute * peak),
        scaling_ratio=_ratio(compute, step, empty=1.0),
        memory_gb=memory,
        feasible=feasible,
        reason=reason,
        breakdown=breakdown,
        algorithms=algos,
        host_s=host,
        host_bound=host_step > gpu_step,
        optimizer_s=tail,
        cast_s=casts,
    )


def _recomputes(model: ModelConfig, layer: LayerSpec) -> bool:
    return model.activation_checkpointing if layer.recompute is None else layer.recompute


def _check_types(model: Any, topology: Any, device: Any, options: Any) -> None:
    """A wrong type raised AttributeError deep inside predict (or, for ``options``,
    was silently replaced by the defaults when falsy, e.g. ``{}``)."""
    checks: tuple[tuple[str, Any, type, bool], ...] = (
        ("model", model, ModelConfig, False),
        ("topology", topology, Topology, False),
        ("device", device, DeviceSpec, True),
        ("options", options, CostOptions, True),
    )
    for name, value, cls, optional in checks:
        if not isinstance(value, cls) and not (optional and value is None):
            want = f"a {cls.__name__}" + (" or None" if optional else "")
            raise TypeError(f"{name} must be {want}, got {type(value).__name__}")


def _ratio(num: float, den: float, *, empty: float = 0.0) -> float:
    """``num / den``; a step with no work at all (zero compute, zero step: measured layer
    times of 0, no parameters) raised ZeroDivisionError. ``0 / 0`` is ``empty``; a
    positive amount over no time is ``inf``."""
    if den > 0:
        return num / den
    return empty if num == 0 else math.inf


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def plan_mesh(
    model: ModelConfig,
    topology: Topology,
    global_batch: int,
    *,
    device: DeviceSpec | None = None,
    options: CostOptions | None = None,
    axis_tiers: dict[str, str] | None = None,
    num_experts: int | None = None,
) -> Plan:
    """Enumerate the valid meshes of ``topology`` and return the fastest that fits.

    Candidates: every ``fsdp`` dividing the world size (``replicate`` the rest), ``ep``
    dividing both ``fsdp`` and the GPUs per host (and ``num_experts`` if given; 1 if the
    model has no expert layer), ``sparse_replicate`` dividing the GPUs per host, and
    ``sparse_dp`` dividing the number of zones (copies aligned with zones). A candidate
    whose axes cross slower tiers than allowed (:data:`DEFAULT_AXIS_TIERS`, overridable
    with ``axis_tiers``) is not valid; one that does not fit in memory is priced but not
    chosen. Ties go to the smaller ``ep`` / fewer copies.

    Returns:
        :class:`Plan` with ``best`` (``None`` if nothing fits) and the valid candidates,
        fastest first.

    Raises:
        TypeError: an argument of the wrong type (named).
        ValueError: a bad ``global_batch`` or ``num_experts``, or an ``axis_tiers`` key
            that is not an axis or value that is not a tier.
    """
    _check_types(model, topology, device, options)
    global_batch = check_int("global_batch", global_batch, minimum=1)
    if num_experts is not None:
        num_experts = check_int("num_experts", num_experts, minimum=1)
    options = options or CostOptions()
    w = topology.world_size
    # Validated as ParallelMesh / check_axis_tiers do: a misspelt axis (e.g.
    # "sparse-shard") was silently ignored, so the plan broke the intended constraint,
    # and an unknown tier failed with "tuple.index(x): x not in tuple".
    tiers: dict[str, str] = dict(_resolve_tiers(axis_tiers))
    has_experts = any(x.kind == "experts" for x in model.layers)
    gph = topology.gpus_per_host
    out = []
    for fsdp in _divisors(w):
        eps = [e for e in _divisors(math.gcd(fsdp, gph)) if has_experts or e == 1]
        if num_experts is not None:
            eps = [e for e in eps if num_experts % e == 0]
        for ep in eps:
            for sr in _divisors(math.gcd(gph, w)) if model.sparse else [1]:
                sdps = (
                    [d for d in _divisors(topology.zones) if (w // sr) % d == 0]
                    if model.sparse
                    else [1]
                )
                for sdp in sdps:
                    spec = MeshSpec(
                        replicate=w // fsdp, fsdp=fsdp, ep=ep, sparse_replicate=sr, sparse_dp=sdp
                    )
                    shapes = _shapes(spec, topology)
                    if any(TIERS.index(shapes[a].tier) > TIERS.index(tiers[a]) for a in AXES):
                        continue
                    out.append(
                        predict(model, topology, spec, global_batch, device=device, options=options)
                    )
    out.sort(key=lambda p: (p.step_s, p.spec.ep, p.spec.sparse_dp))
    best = next((p for p in out if p.feasible), None)
    return Plan(best=best, candidates=tuple(out))
