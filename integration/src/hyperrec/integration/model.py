r"""The GEM-style ranking model: embeddings, sequence tower, PMA, cross attention, DCN, heads.

::

    history events [T]                          request [B]                  candidates [C]
    item, category, action, age bucket          user id, tags (multi-hot),   item, category
        |  sum of 4 embeddings + LayerNorm      dense features                  |
        v                                           |                           |
    SequenceBlock x seq_layers (HSTU-style:         |                           |
      lower layers block attention, O(L);           |                           |
      upper layers causal GDPA-silu, 1/N)           |                           |
        |--------------------------.                |                           |
        v                          v                v                           v
    PMA pooling: P learned     candidate -> history cross attention (softmax; each
    queries attend to each     candidate is a length-1 query sequence mapped to its
    history -> [B, d]          request's history) -> [C, d]
        \________________________  |  ______________/___________________________/
                                  v v v   (request features gathered per candidate)
                      [C, F * d] -> LayerNorm -> DCN-v2 cross layers -> MLP
                                  |                         |
                              CTR head                  CVR head
                          logit P(click)      logit P(conversion | click)

Multi-task training follows ESMM (Ma et al., 2018): the CVR tower is never trained on
clicked impressions alone (a biased population); instead ``P(click & conversion) =
P(click) * P(conversion | click)`` is fitted against conversions over *all*
impressions, next to the CTR loss. See :func:`esmm_loss`.

The attention ops are :mod:`hyperrec.jagged_attn`'s: no padding in the model itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperrec.integration.config import DataConfig, DataSchema, ModelConfig, Preset
from hyperrec.integration.data import Batch
from hyperrec.jagged_attn import block_attention, gdpa, jagged_attention

__all__ = [
    "CandidateAttention",
    "CrossNetwork",
    "GEMModel",
    "MemoryEstimate",
    "PMAPooling",
    "SequenceBlock",
    "TaskHead",
    "esmm_loss",
    "estimate_memory",
]


def _jagged(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, dim] -> [N, heads, dim // heads] (the jagged_attn layout)."""
    return x.view(x.shape[0], heads, x.shape[1] // heads)


class SequenceBlock(nn.Module):
    """One HSTU-style layer over jagged tokens ``[T, dim]``.

    ``u, v, q, k = split(silu(W x))``; ``a = attention(q, k, v)``;
    ``x + W_o(dropout(LayerNorm(a) * u))``. Full layers use causal GDPA with SiLU and
    HSTU's ``1/N`` normalisation, where ``N`` is the configured history cap (a constant,
    so a request's output never depends on the rest of its batch). Block layers
    (``block_size > 0``) use causal softmax attention inside fixed blocks: O(L) cost.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        max_seqlen: int,
        block_size: int = 0,
        activation: str = "silu",
        dropout: float = 0.0,
        validate: bool = True,
    ):
        super().__init__()
        self.dim, self.heads, self.max_seqlen, self.validate = dim, heads, max_seqlen, validate
        self.block_size, self.activation = block_size, activation
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.attn_norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """x: [T, dim]; offsets: int64 [B + 1]; max_seqlen: longest sequence. Returns [T, dim]."""
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(self.dim, dim=-1)
        q, k, v = _jagged(q, self.heads), _jagged(k, self.heads), _jagged(v, self.heads)
        scale = 1.0 / math.sqrt(self.dim // self.heads)
        if self.block_size:
            a = block_attention(
                q,
                k,
                v,
                offsets,
                max_seqlen,
                block_size=self.block_size,
                causal=True,
                scale=scale,
                validate=self.validate,
            )
        elif self.activation == "softmax":
            a = jagged_attention(
                q, k, v, offsets, max_seqlen, causal=True, scale=scale, validate=self.validate
            )
        else:
            a = gdpa(
                q,
                k,
                v,
                offsets,
                offsets,
                max_seqlen,
                max_seqlen,
                activation=self.activation,
                scale=scale,
                causal=True,
                output_scale=1.0 / self.max_seqlen,
                validate=self.validate,
            )
        a = a.reshape(x.shape[0], self.dim)
        return x + self.out(self.dropout(self.attn_norm(a) * u))


class PMAPooling(nn.Module):
    """Pooling by multi-head attention: ``queries`` learned vectors attend to each history.

    Returns ``[B, dim]``: the ``queries`` outputs of each request concatenated and
    projected. An empty history pools to the projection's bias (attention over no keys
    is zero).
    """

    def __init__(self, dim: int, heads: int, queries: int, *, validate: bool = True):
        super().__init__()
        self.dim, self.heads, self.num_queries, self.validate = dim, heads, queries, validate
        self.queries = nn.Parameter(torch.randn(queries, dim) * dim**-0.5)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(queries * dim, dim)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """x: [T, dim]; offsets: int64 [B + 1]. Returns [B, dim]."""
        b = offsets.shape[0] - 1
        p = self.num_queries
        k, v = self.kv(x).split(self.dim, dim=-1)
        # Under autocast the projection yields bf16 keys while the learned queries stay in
        # the parameter dtype: attention needs one dtype.
        q = self.queries.to(k.dtype).unsqueeze(0).expand(b, p, self.dim).reshape(b * p, self.dim)
        q_offsets = torch.arange(b + 1, device=x.device, dtype=offsets.dtype) * p
        o = jagged_attention(
            _jagged(q, self.heads),
            _jagged(k, self.heads),
            _jagged(v, self.heads),
            q_offsets,
            p,
            kv_offsets=offsets,
            max_seqlen_kv=max_seqlen,
            validate=self.validate,
        )
        return self.out(o.reshape(b, p * self.dim))


class CandidateAttention(nn.Module):
    """Target attention: each candidate attends to its request's history (softmax).

    Each candidate is a query sequence of length 1 and ``owner[c]`` maps it to its
    request's kv sequence, so no history is copied per candidate.
    """

    def __init__(self, dim: int, heads: int, *, validate: bool = True):
        super().__init__()
        self.dim, self.heads, self.validate = dim, heads, validate
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(
        self,
        candidates: torch.Tensor,
        owner: torch.Tensor,
        history: torch.Tensor,
        offsets: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """candidates: [C, dim]; owner: int64 [C] request of each candidate; history: [T, dim];
        offsets: int64 [B + 1]. Returns [C, dim]."""
        c = candidates.shape[0]
        k, v = self.kv(history).split(self.dim, dim=-1)
        q_offsets = torch.arange(c + 1, device=candidates.device, dtype=offsets.dtype)
        o = gdpa(
            _jagged(self.q(candidates), self.heads),
            _jagged(k, self.heads),
            _jagged(v, self.heads),
            q_offsets,
            offsets,
            1,
            max_seqlen,
            activation="softmax",
            scale=1.0 / math.sqrt(self.dim // self.heads),
            kv_index=owner,
            validate=self.validate,
        )
        return self.out(o.reshape(c, self.dim))


class CrossNetwork(nn.Module):
    """DCN-v2 cross layers: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` on ``[N, width]``.

    With ``rank > 0`` each ``W_l`` is the low-rank product ``U_l V_l`` (DCN-Mix without
    experts), which keeps wide inputs affordable.
    """

    def __init__(self, width: int, layers: int, rank: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(width, width)
            if rank == 0 or rank >= width
            else nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
            for _ in range(layers)
        )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """x0: [N, width]. Returns [N, width]."""
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


def _mlp(widths: list[int], dropout: float) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i in range(len(widths) - 1):
        mods += [nn.Linear(widths[i], widths[i + 1]), nn.SiLU(), nn.Dropout(dropout)]
    return nn.Sequential(*mods)


class TaskHead(nn.Module):
    """One task's tower: an MLP then a logit, ``[N, width] -> float32 [N]``."""

    def __init__(self, width: int, hidden: tuple[int, ...]):
        super().__init__()
        self.mlp = _mlp([width, *hidden], 0.0)
        self.weight = nn.Parameter(torch.randn(hidden[-1]) * hidden[-1] ** -0.5)
        self.bias = nn.Parameter(torch.zeros(1))  # 1-D: FSDP2 cannot shard 0-d tensors

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, width]. Returns float32 [N] logits (a fresh tensor, not a view)."""
        return (self.mlp(h) @ self.weight.to(h.dtype)).float() + self.bias


class GEMModel(nn.Module):
    """A GEM-style CTR/CVR ranking model over a :class:`~hyperrec.integration.data.Batch`.

    Args:
        model: the network's sizes.
        data: the input schema (vocabularies, dense width, history cap, tasks), or a
            synthetic :class:`~hyperrec.integration.config.DataConfig` (its ``schema``).
        validate: let the attention ops check offsets and maxima (host syncs on GPU).

    ``forward(batch)`` returns ``(ctr_logit, cvr_logit)``, float32 ``[C]`` each (one per
    candidate, in ``batch.candidate_items`` order); ``cvr_logit`` is ``None`` when the
    schema has the CTR task only (there is no CVR head then).
    """

    def __init__(self, model: ModelConfig, data: DataSchema | DataConfig, *, validate: bool = True):
        super().__init__()
        if not isinstance(model, ModelConfig) or not isinstance(data, (DataSchema, DataConfig)):
            raise TypeError(
                "GEMModel expects (model: ModelConfig, data: DataSchema | DataConfig), got "
                f"({type(model).__name__}, {type(data).__name__})"
            )
        schema = data.schema if isinstance(data, DataConfig) else data
        self.config, self.schema = model, schema
        self.data_config = data  # as given (kept for callers that read it)
        d = model.dim
        # Item ids are the biggest table; history and candidates share it (and its rows'
        # gradients), as production rankers do.
        self.item_embedding = nn.Embedding(schema.num_items, d)
        self.category_embedding = nn.Embedding(schema.num_categories, d)
        self.action_embedding = nn.Embedding(schema.num_actions, d)
        self.time_embedding = nn.Embedding(model.time_buckets, d)
        self.user_embedding = nn.Embedding(model.user_hash_size, d)
        self.tag_embedding = nn.EmbeddingBag(schema.num_tags, d, mode="mean")
        self.dense_proj = nn.Linear(schema.num_dense, d)
        self.token_norm = nn.LayerNorm(d)
        self.seq_layers = nn.ModuleList(
            SequenceBlock(
                d,
                model.heads,
                max_seqlen=schema.max_seqlen,
                block_size=model.attn_block_size if i < model.block_attention_layers else 0,
                activation=model.activation,
                dropout=model.dropout,
                validate=validate,
            )
            for i in range(model.seq_layers)
        )
        self.seq_norm = nn.LayerNorm(d)
        self.pma = (
            PMAPooling(d, model.heads, model.pma_queries, validate=validate)
            if model.pma_queries
            else None
        )
        self.cross_attention = CandidateAttention(d, model.heads, validate=validate)
        num_features = 7 if self.pma is not None else 6
        width = num_features * d
        self.feature_norm = nn.LayerNorm(width)
        self.interaction = CrossNetwork(width, model.cross_layers, model.cross_rank)
        self.mlp = _mlp([width, *model.mlp_dims], model.dropout)
        top = model.mlp_dims[-1]
        self.ctr_head = TaskHead(top, model.head_dims)
        self.cvr_head = TaskHead(top, model.head_dims) if schema.has_conversion else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small-normal embeddings (std 1/sqrt(dim)); PyTorch defaults elsewhere."""
        std = self.config.dim**-0.5
        for m in self.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                nn.init.normal_(m.weight, std=std)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The embedding tables' weights (for a separate optimizer group)."""
        return [m.weight for m in self.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]

    def check_batch(self, batch: Batch) -> None:
        """:meth:`Batch.validate` against this model's schema, plus the history cap.

        Raises:
            ValueError / TypeError: see :meth:`Batch.validate`; or a history longer than
                the schema's ``max_seqlen``.
        """
        if not isinstance(batch, Batch):
            raise TypeError(f"expected a Batch, got {type(batch).__name__}")
        batch.validate(self.schema)
        if batch.max_history_len > self.schema.max_seqlen:
            raise ValueError(
                f"Batch.max_history_len = {batch.max_history_len} exceeds the model's "
                f"DataSchema.max_seqlen = {self.schema.max_seqlen}"
            )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of P(click) and P(conversion | click), float32 ``[C]`` each (the second
        ``None`` for a CTR-only schema)."""
        b, c, t = batch.num_requests, batch.num_candidates, batch.num_history_events
        if b == 0:
            raise ValueError("batch is empty: it must hold at least one request")
        dev = batch.history_items.device
        h_off, max_len = batch.history_offsets, batch.max_history_len
        rows = torch.arange(b, device=dev)
        h_owner = torch.repeat_interleave(rows, h_off.diff(), output_size=t)
        c_owner = torch.repeat_interleave(rows, batch.candidate_offsets.diff(), output_size=c)

        # History tokens: what, which category, how the user reacted, how long ago.
        age_minutes = (batch.request_time[h_owner] - batch.history_time).float() / 60.0
        bucket = torch.log2(1.0 + age_minutes.clamp_min(0.0)).floor().long()
        bucket = bucket.clamp(0, self.config.time_buckets - 1)
        x = (
            self.item_embedding(batch.history_items)
            + self.category_embedding(batch.history_categories)
            + self.action_embedding(batch.history_actions)
            + self.time_embedding(bucket)
        )
        x = self.token_norm(x)
        for layer in self.seq_layers:
            x = layer(x, h_off, max_len)
        x = self.seq_norm(x)

        cand = self.item_embedding(batch.candidate_items)
        cand_cat = self.category_embedding(batch.candidate_categories)
        user = self.user_embedding(batch.user_ids % self.config.user_hash_size)
        tags = self.tag_embedding(batch.tags, batch.tag_offsets[:-1])
        dense = self.dense_proj(batch.dense)
        target = self.cross_attention(cand + cand_cat, c_owner, x, h_off, max_len)
        request = [user, tags, dense]
        if self.pma is not None:
            request.append(self.pma(x, h_off, max_len))
        features = torch.cat([cand, cand_cat, target, *(f[c_owner] for f in request)], dim=-1)

        h = self.interaction(self.feature_norm(features))
        h = self.mlp(h)
        return self.ctr_head(h), (self.cvr_head(h) if self.cvr_head is not None else None)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler, 2012)."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def esmm_loss(
    ctr_logit: torch.Tensor,
    cvr_logit: torch.Tensor,
    click: torch.Tensor,
    conversion: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (not averaged) ESMM losses over ``C`` impressions.

    ``ctr = BCE(sigmoid(ctr_logit), click)`` and
    ``ctcvr = BCE(sigmoid(ctr_logit) * sigmoid(cvr_logit), conversion)``, both over every
    impression, computed in log space. Returning sums lets the caller divide by a
    *global* impression count, so the gradient is the same on any number of ranks.

    Args:
        ctr_logit, cvr_logit: float [C].
        click, conversion: float [C] in {0, 1}.

    Returns:
        ``(ctr_loss_sum, ctcvr_loss_sum)``, float32 scalars.
    """
    ctr = F.binary_cross_entropy_with_logits(ctr_logit, click, reduction="sum")
    log_p = F.logsigmoid(ctr_logit) + F.logsigmoid(cvr_logit)
    ctcvr = -(conversion * log_p + (1.0 - conversion) * _log1mexp(log_p)).sum()
    return ctr, ctcvr


@dataclass(frozen=True)
class MemoryEstimate:
    """Training memory of one preset on one device (bytes unless stated)."""

    parameters: int
    """Number of parameters (all)."""
    embedding_parameters: int
    """Of which in embedding tables."""
    mean_history_len: float
    """Expected history length of the data law (tokens per request)."""
    tokens_per_step: float
    """Expected history tokens per step and rank."""
    weights_grads_optimizer: int
    """fp32 parameters + gradients + AdamW's two moments: 16 bytes per parameter."""
    activations: int
    """Estimated saved activations of one step (see :func:`estimate_memory`)."""

    @property
    def total(self) -> int:
        """Sum of the two terms (bytes)."""
        return self.weights_grads_optimizer + self.activations


def estimate_memory(
    preset: Preset, *, world_size: int = 1, activation_bytes: int = 2
) -> MemoryEstimate:
    """Estimate the training memory of ``preset`` per rank, without allocating it.

    The parameter count is exact (the model is built on the meta device). Activations
    are estimated per history token as ``(6 + 14 * seq_layers) * dim`` saved values of
    ``activation_bytes`` each (bf16 autocast by default): the summed token embedding,
    per layer the norm, the ``4 * dim`` projection and its SiLU, the attention output,
    its norm, the gate and the residual, plus the K/V projections of PMA and cross
    attention. Attention itself is assumed fused (no ``L^2`` buffers), as the
    jagged_attn kernels are; the candidate-side tower is small and ignored.
    The state is not sharded (single device); divide by ``world_size`` for FSDP.
    """
    from hyperrec.integration.data import TRAIN, SyntheticRecsysData

    with torch.device("meta"):
        model = GEMModel(preset.model, preset.data)
    params = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for p in model.embedding_parameters())
    lengths = SyntheticRecsysData(preset.data).history_lengths(TRAIN, torch.arange(65536).numpy())
    mean_len = float(lengths.mean())
    tokens = mean_len * preset.train.global_batch_size / world_size
    per_token = (6 + 14 * preset.model.seq_layers) * preset.model.dim * activation_bytes
    return MemoryEstimate(
        parameters=params,
        embedding_parameters=emb,
        mean_history_len=mean_len,
        tokens_per_step=tokens,
        weights_grads_optimizer=16 * params // world_size,
        activations=int(tokens * per_token),
    )
