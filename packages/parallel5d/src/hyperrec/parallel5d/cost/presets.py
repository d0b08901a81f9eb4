"""Model presets for the cost model.

:func:`gem_scale` describes a GEM-style ranking model at production shape per GPU (the
GEM-scale preset of the end-to-end work): model dim 1024, 8 heads x 128, 12 sequence
layers over power-law user histories capped at 8k events, an interaction MLP 4096 wide,
routed experts in the interaction tower, and large embedding tables. Every figure is
computed from the shapes below (FLOPs = 2 x multiply-adds), so the assumptions are
visible and adjustable.
"""

from __future__ import annotations

import numpy as np

from hyperrec.parallel5d.cost.model import LayerSpec, ModelConfig, SparseSpec

__all__ = ["gem_scale", "history_moments"]


def history_moments(
    *, min_len: int, scale: float, alpha: float, max_len: int, samples: int = 200_000
) -> tuple[float, float]:
    """``(E[L], E[L^2])`` of the capped Lomax history-length law the synthetic data uses:
    ``L = min(max_len, min_len + floor(scale * (u^(-1/alpha) - 1)))``, ``u ~ U(0, 1)``
    (estimated on a fixed-seed sample)."""
    u = np.random.default_rng(0).random(samples)
    lengths = np.minimum(max_len, min_len + np.floor(scale * (u ** (-1.0 / alpha) - 1.0)))
    return float(lengths.mean()), float((lengths**2).mean())


def gem_scale(
    *,
    dim: int = 1024,
    heads: int = 8,
    seq_layers: int = 12,
    max_history: int = 8192,
    history_scale: float = 512.0,
    history_alpha: float = 1.5,
    candidates: int = 16,
    mlp_dims: tuple[int, ...] = (8192, 4096, 4096, 2048, 1024),
    moe_layers: int = 2,
    num_experts: int = 16,
    top_k: int = 2,
    expert_hidden: int = 4096,
    embedding_rows: int = 1_000_000_000,
    embedding_dim: int = 128,
    pooled_ids: int = 200,
) -> ModelConfig:
    """A GEM-scale ranker for the cost model (per sample = one request).

    * Sequence tower: ``seq_layers`` causal transformer layers (QKV/O projections + a
      4x SwiGLU-free MLP: 24 dim^2 FLOPs per token, attention 2 L^2 dim per sequence)
      over the history (capped Lomax lengths, :func:`history_moments`).
    * Interaction: ``candidates`` candidates per request through an MLP of widths
      ``mlp_dims``, and ``moe_layers`` routed-expert layers (``num_experts`` SwiGLU
      experts of ``expert_hidden``, top-``top_k``) on the candidate tokens.
    * Sparse: ``embedding_rows`` rows of ``embedding_dim`` fp32 (row-wise Adagrad), looked
      up once per history event and ``pooled_ids`` times for pooled features.
    """
    mean_l, mean_l2 = history_moments(
        min_len=16, scale=history_scale, alpha=history_alpha, max_len=max_history
    )
    d = dim
    act = 2  # bf16 activations
    layers = []
    for i in range(seq_layers):
        layers.append(
            LayerSpec(
                name="seq",
                params=12 * d * d + 4 * d,
                flops_per_sample=24 * d * d * mean_l + 2 * d * mean_l2,
                # norms, residuals, activation, rotary/bias and the attention kernel's
                # Q/K/V/O traffic: ~24 reads+writes of a dim-wide bf16 row per token
                hbm_bytes_per_sample=24 * d * act * mean_l,
                kernels=18,
                input_bytes_per_sample=d * act * mean_l,
                saved_bytes_per_sample=16 * d * act * mean_l,
            )
        )
        del i
    widths = list(mlp_dims)
    mlp_params = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    layers.append(
        LayerSpec(
            name="interaction_mlp",
            params=mlp_params,
            flops_per_sample=2 * mlp_params * candidates,
            hbm_bytes_per_sample=4 * sum(widths) * act * candidates,
            kernels=4 * len(widths),
            input_bytes_per_sample=widths[0] * act * candidates,
            saved_bytes_per_sample=2 * sum(widths) * act * candidates,
        )
    )
    for _ in range(moe_layers):
        layers.append(
            LayerSpec(
                name="moe",
                kind="experts",
                params=num_experts * 3 * d * expert_hidden + num_experts * d,
                flops_per_sample=top_k * candidates * 6 * d * expert_hidden,
                hbm_bytes_per_sample=top_k * candidates * (4 * d + 3 * expert_hidden) * act,
                kernels=3 * num_experts + 10,
                input_bytes_per_sample=d * act * candidates,
                saved_bytes_per_sample=top_k * candidates * (2 * d + 3 * expert_hidden) * act,
                a2a_bytes_per_sample=top_k * candidates * d * act,
            )
        )
    layers.append(
        LayerSpec(
            name="heads",
            params=3 * (d * 256 + 256),
            flops_per_sample=2 * 3 * d * 256 * candidates,
            kernels=12,
            input_bytes_per_sample=d * act * candidates,
            saved_bytes_per_sample=3 * 256 * act * candidates,
        )
    )
    sparse = (
        SparseSpec(
            name="embeddings",
            rows=embedding_rows,
            dim=embedding_dim,
            lookups_per_sample=mean_l + pooled_ids,
        ),
    )
    return ModelConfig(name="gem_scale", layers=tuple(layers), sparse=sparse)
