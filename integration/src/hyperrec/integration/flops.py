"""Model FLOPs of a training step, from the step's actual jagged lengths, and MFU.

MFU (model FLOPs utilisation) = useful model FLOPs per second / the hardware's peak.
"Useful" follows the usual convention (PaLM, Megatron, NVIDIA's recsys benchmarks):

- only matrix multiplications count, ``2 * M * N * K`` each: every linear layer on the
  tokens it actually sees (jagged, unpadded), and attention as its two GEMMs per allowed
  (query, key) pair (``S = Q K^T`` and ``O = P V``: ``4 * head_dim`` FLOPs per pair and
  head). Elementwise work (norms, activations, softmax, gating, the DCN's products and
  sums, embedding lookups, the optimizer) is not counted;
- attention counts allowed pairs only: a causal sequence of length ``L`` has
  ``L (L + 1) / 2``, a block-causal one the same per block, PMA ``P * L`` per request,
  candidate cross attention ``L`` per candidate;
- training = forward + backward = 3x forward: each GEMM has a data-gradient and a
  weight-gradient GEMM of the same size (attention: dQ, dK, dV and dP, four GEMMs against
  two). A layer whose input needs no gradient (the dense-feature projection reads the
  batch) has no data-gradient GEMM and counts 2x. Recomputation (attention kernels
  recompute ``S`` in backward; activation checkpointing) is work, not useful FLOPs, and is
  not counted;
- padding is not useful: the naive baseline is credited with the same FLOPs as the
  jagged path for the same batch.

The counts are checked against ``torch.utils.flop_counter.FlopCounterMode`` in the tests.

Peak: :data:`PEAK_BF16_TFLOPS`, a table of dense (no sparsity) BF16 tensor-core peaks
from vendor datasheets, looked up by device name; and, beside it,
:func:`measure_matmul_tflops`, the BF16 GEMM rate measured on the machine (what a large
``torch.mm`` reaches; on an H200 about 700-780 of the 989 TFLOP/s).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hyperrec.integration.config import DataConfig, DataSchema, ModelConfig
from hyperrec.integration.data import Batch

__all__ = [
    "PEAK_BF16_TFLOPS",
    "FlopCount",
    "StepShape",
    "attention_pairs",
    "batch_flops",
    "measure_matmul_tflops",
    "model_flops",
    "peak_tflops",
]

PEAK_BF16_TFLOPS: dict[str, float] = {
    # Dense BF16 tensor-core peak per GPU (datasheet "with sparsity" figures halved).
    # Matched against torch.cuda.get_device_name as whole words, in this order (first hit
    # wins): "L4" is not "L40", "H20" not "H200", "A100" not "RTX A1000".
    "GB200": 2500.0,
    "B200": 2250.0,
    "GH200": 989.4,
    "H200 NVL": 835.5,
    "H200": 989.4,
    "H100 NVL": 835.5,
    "H100 PCIe": 756.0,
    "H100": 989.4,  # SXM
    "H800": 989.4,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.05,
    "L40": 181.05,
    "L4": 121.0,
    "MI300X": 1307.4,
}
"""Dense BF16 peak TFLOP/s by device-name fragment (vendor datasheets)."""


def peak_tflops(device: torch.device | str) -> tuple[float | None, str | None]:
    """``(peak TFLOP/s, table key)`` for ``device``, or ``(None, None)`` on a CPU or an
    unlisted GPU (MFU is then reported against the measured matmul rate only).

    A key matches the device name as whole words (not inside a longer model number)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if re.search(rf"(?<![0-9A-Za-z]){re.escape(key)}(?![0-9A-Za-z])", name):
            return value, key
    return None, None


def measure_matmul_tflops(
    device: torch.device | str, *, n: int = 8192, iters: int = 10
) -> float | None:
    """BF16 ``torch.mm`` of ``n x n x n`` timed on ``device`` (TFLOP/s), or None on a CPU.

    Two warm-up multiplications, then ``iters`` timed back to back between CUDA events:
    the sustained GEMM rate of this machine, the practical ceiling next to the datasheet
    peak. Takes well under a second on a datacenter GPU.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        torch.mm(a, b)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.mm(a, b)
    stop.record()
    stop.synchronize()
    seconds = start.elapsed_time(stop) / 1e3
    del a, b
    return 2.0 * n**3 * iters / seconds / 1e12


@dataclass(frozen=True)
class StepShape:
    """The host-side sizes of one step on one rank (all a FLOP count needs)."""

    history_lengths: np.ndarray
    """int64 [B]: history length of each request."""
    candidate_counts: np.ndarray
    """int64 [B]: candidates of each request."""

    @staticmethod
    def from_batch(batch: Batch) -> StepShape:
        """The shape of a CPU ``batch`` (reads its offsets; never call it on device
        tensors in the step: that would be a host sync)."""
        if batch.history_offsets.device.type != "cpu":
            raise ValueError("StepShape.from_batch needs the CPU copy of the batch")
        return StepShape(
            np.diff(batch.history_offsets.numpy()), np.diff(batch.candidate_offsets.numpy())
        )


def attention_pairs(
    lengths: np.ndarray | Sequence[int], *, causal: bool, block_size: int = 0
) -> int:
    """Allowed (query, key) pairs of self-attention over sequences of ``lengths``.

    ``causal``: ``L (L + 1) / 2`` per sequence, else ``L^2``. ``block_size > 0``: the
    same within each block of ``block_size`` tokens (the last block may be shorter).

    Raises:
        ValueError: a negative or fractional length (a count of pairs is not linear in
            the length: a mean length does not give the mean count), or a negative
            ``block_size``.
    """
    lens = _lengths("lengths", lengths)
    if block_size < 0:
        raise ValueError(f"block_size must be >= 0, got {block_size}")
    if block_size > 0:
        full, rest = lens // block_size, lens % block_size
        per_block = block_size * (block_size + 1) // 2 if causal else block_size * block_size
        tail = rest * (rest + 1) // 2 if causal else rest * rest
        return int((full * per_block + tail).sum())
    return int((lens * (lens + 1) // 2).sum() if causal else (lens * lens).sum())


@dataclass(frozen=True)
class FlopCount:
    """Model FLOPs of one step, by component (see the module doc for the rules)."""

    forward: dict[str, float] = field(default_factory=dict)
    """Forward FLOPs per component."""
    training: dict[str, float] = field(default_factory=dict)
    """Forward + backward FLOPs per component (recomputation excluded)."""

    @property
    def total_forward(self) -> float:
        """Sum of :attr:`forward`."""
        return float(sum(self.forward.values()))

    @property
    def total_training(self) -> float:
        """Sum of :attr:`training`: the numerator of MFU."""
        return float(sum(self.training.values()))


def _lengths(name: str, values: np.ndarray | Sequence[int]) -> np.ndarray:
    """``values`` as int64 ``[B]``; negative or fractional values raise (no truncation)."""
    raw = np.asarray(values).reshape(-1)
    if raw.size and not (np.issubdtype(raw.dtype, np.number) or raw.dtype == np.bool_):
        raise ValueError(f"{name} must be numbers, got dtype {raw.dtype}")
    real = raw.astype(np.float64)
    if (real < 0).any() or not np.isfinite(real).all():
        raise ValueError(f"{name} must be non-negative")
    if (real != np.floor(real)).any():
        raise ValueError(f"{name} must be whole numbers, got {raw[real != np.floor(real)][:3]}")
    return raw.astype(np.int64)


class _Counter:
    def __init__(self) -> None:
        self.forward: dict[str, float] = {}
        self.training: dict[str, float] = {}

    def gemm(self, name: str, m: float, k: int, n: int, *, input_grad: bool = True) -> None:
        fwd = 2.0 * m * k * n
        self.forward[name] = self.forward.get(name, 0.0) + fwd
        self.training[name] = self.training.get(name, 0.0) + fwd * (3.0 if input_grad else 2.0)

    def attention(self, name: str, pairs: float, dim: int) -> None:
        fwd = 4.0 * pairs * dim  # two GEMMs of 2 * head_dim per pair and head
        self.forward[name] = self.forward.get(name, 0.0) + fwd
        self.training[name] = self.training.get(name, 0.0) + 3.0 * fwd


def model_flops(
    model: ModelConfig,
    data: DataSchema | DataConfig,
    history_lengths: np.ndarray | Sequence[int],
    candidate_counts: np.ndarray | Sequence[int],
) -> FlopCount:
    """Model FLOPs of a step whose requests have these history lengths and candidates.

    Components: ``embedding_projection`` (narrow tables -> ``dim``),
    ``sequence_linear`` (each layer's ``4d`` projection and output projection),
    ``attention_block`` / ``attention_full`` (the sequence layers' attention),
    ``pma``, ``cross_attention`` (projections and attention), ``dense_features``,
    ``dcn``, ``mlp``, ``heads`` (one head per task of ``data``'s schema: CTR, and CVR
    where the data has conversions).

    ``candidate_counts`` may be expected (fractional) counts: every candidate-side term
    is linear in a request's candidate count, so a mean count gives the exact expected
    FLOPs. ``history_lengths`` must be whole numbers (attention is quadratic in them).

    Raises:
        ValueError: lengths and counts of different sizes, negative or non-finite values,
            or a fractional history length.
    """
    cands = np.asarray(candidate_counts, dtype=np.float64).reshape(-1)
    lens_in = np.asarray(history_lengths).reshape(-1)
    if lens_in.shape != cands.shape:
        raise ValueError(
            f"history_lengths and candidate_counts must have one entry per request, got "
            f"{lens_in.shape[0]} and {cands.shape[0]}"
        )
    if (cands < 0).any() or not np.isfinite(cands).all():
        raise ValueError("history_lengths and candidate_counts must be non-negative")
    lens = _lengths("history_lengths", lens_in)
    schema = data.schema if isinstance(data, DataConfig) else data
    d, e = model.dim, model.table_dim
    b, t, c = lens.shape[0], float(lens.sum()), float(cands.sum())
    f = _Counter()
    if e != d:
        f.gemm("embedding_projection", t, e, d)
        f.gemm("embedding_projection", c, e, d)
    for i in range(model.seq_layers):
        f.gemm("sequence_linear", t, d, 4 * d)
        f.gemm("sequence_linear", t, d, d)
        if i < model.block_attention_layers:
            pairs = attention_pairs(lens, causal=True, block_size=model.attn_block_size)
            f.attention("attention_block", pairs, d)
        else:
            f.attention("attention_full", attention_pairs(lens, causal=True), d)
    if model.pma_queries:
        p = model.pma_queries
        f.gemm("pma", t, d, 2 * d)
        f.attention("pma", int(p * lens.sum()), d)
        f.gemm("pma", b, p * d, d)
    f.gemm("cross_attention", c, d, d)
    f.gemm("cross_attention", t, d, 2 * d)
    f.attention("cross_attention", float((cands * lens).sum()), d)
    f.gemm("cross_attention", c, d, d)
    f.gemm("dense_features", b, schema.num_dense, d, input_grad=False)
    width = 4 * e + (3 if model.pma_queries else 2) * d
    for _ in range(model.cross_layers):
        r = model.cross_rank
        if r == 0 or r >= width:
            f.gemm("dcn", c, width, width)
        else:
            f.gemm("dcn", c, width, r)
            f.gemm("dcn", c, r, width)
    widths = [width, *model.mlp_dims]
    for k_in, n_out in zip(widths[:-1], widths[1:]):
        f.gemm("mlp", c, k_in, n_out)
    head = [model.mlp_dims[-1], *model.head_dims]
    for _ in schema.tasks:  # CTR, and CVR when the data has conversions
        for k_in, n_out in zip(head[:-1], head[1:]):
            f.gemm("heads", c, k_in, n_out)
        f.gemm("heads", c, head[-1], 1)
    return FlopCount(forward=f.forward, training=f.training)


def batch_flops(model: ModelConfig, data: DataSchema | DataConfig, batch: Batch) -> FlopCount:
    """:func:`model_flops` of a CPU ``batch``."""
    shape = StepShape.from_batch(batch)
    return model_flops(model, data, shape.history_lengths, shape.candidate_counts)
