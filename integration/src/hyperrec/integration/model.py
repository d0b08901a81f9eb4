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
          [C, F * d], a LayerNorm per feature group -> DCN-v2 cross layers -> MLP
                                  |                         |
                              CTR head                  CVR head
                          logit P(click)      logit P(conversion | click)

Multi-task training follows ESMM (Ma et al., 2018): the CVR tower is never trained on
clicked impressions alone (a biased population); instead ``P(click & conversion) =
P(click) * P(conversion | click)`` is fitted against conversions over *all*
impressions, next to the CTR loss. See :func:`esmm_loss`.

The attention ops are :mod:`hyperrec.jagged_attn`'s: no padding in the model itself
(``impl="hyperrec"``). ``impl="naive"`` computes the same function with padded PyTorch
attention (:mod:`hyperrec.integration.naive`): the baseline of every speed claim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyperrec.integration import naive
from hyperrec.integration.config import (
    ACTIVATIONS,
    ATTENTION_PRECISIONS,
    COMPILE_MODES,
    COMPILE_SCOPES,
    IMPLS,
    MLP_PRECISIONS,
    RESIDUAL_DTYPES,
    SEQ_LINEAR_PRECISIONS,
    DataConfig,
    DataSchema,
    EventLogConfig,
    ModelConfig,
    Preset,
)
from hyperrec.integration.data import Batch
from hyperrec.integration.naive import JaggedLayout
from hyperrec.jagged_attn import block_attention, gdpa, jagged_attention, linear_quantize_qkv
from hyperrec.jagged_attn.fp8 import FP8Config, Precision, QuantizedQKV
from hyperrec.mxfp8 import rowwise_linear

__all__ = [
    "TABLES",
    "CandidateAttention",
    "CrossNetwork",
    "EmbeddingTables",
    "GEMModel",
    "MemoryEstimate",
    "PMAPooling",
    "SequenceBlock",
    "TaskHead",
    "activation_bytes_per_token",
    "bucket_rows",
    "esmm_loss",
    "estimate_memory",
    "fuse_tables_state_dict",
    "mlp_policy",
    "sharded_tables",
    "split_tables_state_dict",
]

TABLES = (
    "item_embedding",
    "category_embedding",
    "action_embedding",
    "time_embedding",
    "user_embedding",
    "tag_embedding",
)
"""The model's embedding tables, in the row order of the fused :class:`EmbeddingTables`."""

SHARDED_TABLES = {
    "item_embedding": "item",
    "category_embedding": "category",
    "user_embedding": "user",
    "tag_embedding": "tag",
}
"""The tables a :func:`sharded_tables` collection holds (dense name -> its table name);
the action and time-bucket tables (a few rows) stay dense."""


def sharded_tables(
    model: ModelConfig,
    data: DataSchema | DataConfig,
    *,
    mesh: Any = None,
    shard_axis: str | int = -1,
    device: torch.device | str | None = None,
    seed: int = 0,
    validate: bool = False,
) -> Any:
    """The item, category, user and tag tables as a ``hyperrec.parallel5d``
    ``ShardedEmbeddingCollection``: every row and its optimizer state on one rank of the
    job (row-wise blocks; the tables are small enough to go whole on one rank when they
    fit in 1 MiB), looked up through one deduplicated all-to-all per step and table width.

    Every table uses ``row_order="hashed"``: the synthetic ids (items are ``rank *
    num_topics + topic``, Zipf users) make the popular rows the low ids, which would
    otherwise all sit on the first owner. Rows start ``N(0, 1 / table_dim)`` like the
    dense tables, drawn by the collection's mesh-independent generator (``seed``), so
    not the dense tables' values; :meth:`GEMModel.load_dense_state_dict` copies a dense
    model's tables in.

    Features: ``history_items`` and ``candidate_items`` (item), ``history_categories``
    and ``candidate_categories`` (category), ``users`` (user, one id per request),
    ``tags`` (tag, mean over each request's bag).

    Args:
        mesh: ``None`` (the default process group, or one process), a 1-D or 2-D
            ``DeviceMesh`` (e.g. ``ParallelMesh.sparse_mesh``).
        shard_axis: the 2-D mesh's first-hop axis (``"sparse_replicate"`` on the 5-D mesh).
        validate: let the collection check ids and offsets (host syncs; the trainer
            validates batches on the CPU instead).
    """
    from hyperrec.parallel5d import FeatureConfig, ShardedEmbeddingCollection, TableConfig

    rows = _table_rows(model, data)
    e = model.table_dim
    tables = [
        TableConfig(name=short, num_rows=rows[name], dim=e, row_order="hashed")
        for name, short in SHARDED_TABLES.items()
    ]
    features = [
        FeatureConfig(name="history_items", table="item"),
        FeatureConfig(name="candidate_items", table="item"),
        FeatureConfig(name="history_categories", table="category"),
        FeatureConfig(name="candidate_categories", table="category"),
        FeatureConfig(name="users", table="user"),
        FeatureConfig(name="tags", table="tag", pooling="mean"),
    ]
    return ShardedEmbeddingCollection(
        tables,
        features,
        mesh=mesh,
        shard_axis=shard_axis,
        device=device,
        seed=seed,
        validate=validate,
    )


# -- compiled small-op regions ------------------------------------------------------------
# Each region is a pure function of tensors (parameters passed in), so the compiled graph
# does not depend on module identity and composes with FSDP's parameter swapping: a region
# is always called inside the forward of the module that owns its parameters.
_COMPILED: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}


def compile_kwargs(mode: str) -> dict[str, Any]:
    """``torch.compile`` arguments of a compile mode other than "off" (dynamic shapes:
    the token and candidate counts change every step; one graph serves them all)."""
    if mode == "inductor_autotune":
        options = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
        return {"backend": "inductor", "dynamic": True, "options": options}
    return {"backend": mode, "dynamic": True}


def _region(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """``fn`` itself (mode "off") or its ``torch.compile``d form (:func:`compile_kwargs`)."""
    if mode == "off":
        return fn
    key = (fn, mode)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **compile_kwargs(mode))
    return _COMPILED[key]


def _tokens_region(
    e: torch.Tensor,
    proj_w: torch.Tensor | None,
    proj_b: torch.Tensor | None,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    eps: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if proj_w is not None:
        e = F.linear(e, proj_w, proj_b)
    x = F.layer_norm(e, (e.shape[-1],), norm_w, norm_b, eps)
    return x if dtype is None else x.to(dtype)


def _project_region(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor,
    fp8: bool = False,
    fp8_dgrad: bool = False,
) -> tuple[torch.Tensor, ...]:
    n = F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps)
    # The model asks for an FP8 forward only: an FP8 dgrad needs dY's row scale, a second
    # pass over the SiLU backward below (measured slower, bench/seq_fp8.py's "fp8_dgrad").
    h = F.silu(rowwise_linear(n, w, b, fp8_dgrad=fp8_dgrad) if fp8 else F.linear(n, w, b))
    # Split inside the region: its backward then receives the four gradients and the
    # compiler writes their concatenation inside the SiLU-backward kernel (split outside,
    # autograd concatenated them first: one more pass over [T, 4 * dim] per layer).
    return h.chunk(4, dim=-1)


def _norm_region(
    x: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, eps: float
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps)


def _fused_projection(
    n: torch.Tensor, w: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, QuantizedQKV]:
    """``u, v, q, k`` of ``silu(W n + b)`` as ``_project_region`` returns them, plus Q/K/V
    quantized for the FP8 attention in the projection's epilogue. Under autocast the
    operands are cast to its dtype first, as autocast casts ``F.linear``'s."""
    if torch.is_autocast_enabled(n.device.type):
        dtype = torch.get_autocast_dtype(n.device.type)
        n, w, b = n.to(dtype), w.to(dtype), b.to(dtype)
    y, qkv = linear_quantize_qkv(n, w, b, offsets, heads=heads, chunks="uvqk",
                                 activation="silu", precision="fp8")  # fmt: skip
    u, v, q, k = y.chunk(4, dim=-1)
    return u, v, q, k, qkv


def _gate_region(
    x: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor,
    p: float,
    training: bool,
    fp8: bool = False,
) -> torch.Tensor:
    gated = F.dropout(F.layer_norm(a, (a.shape[-1],), norm_w, norm_b, eps) * u, p, training)
    return x + (rowwise_linear(gated, w, b) if fp8 else F.linear(gated, w, b))


def _cross_region(x0: torch.Tensor, layers: list[list[torch.Tensor]]) -> torch.Tensor:
    x = x0
    for params in layers:
        if len(params) == 2:
            y = F.linear(x, params[0], params[1])
        else:
            y = F.linear(F.linear(x, params[0]), params[1], params[2])
        x = x0 * y + x
    return x


def _jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seqlen: int,
    block_size: int,
    activation: str,
    history_cap: int,
    validate: bool,
    precision: str,
    quantized: QuantizedQKV | None = None,
) -> torch.Tensor:
    """A sequence layer's attention through :mod:`hyperrec.jagged_attn` (configuration as
    plain values, so a compiled caller guards on values, not on a module). ``quantized``:
    Q/K/V quantized by the fused projection (GDPA layers only)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    jp = _jagged_precision(precision)
    if block_size:
        return block_attention(q, k, v, offsets, max_seqlen, block_size=block_size, causal=True,
                               scale=scale, validate=validate, precision=jp)  # fmt: skip
    if activation == "softmax":
        return jagged_attention(q, k, v, offsets, max_seqlen, causal=True, scale=scale,
                                validate=validate, precision=jp)  # fmt: skip
    return gdpa(q, k, v, offsets, offsets, max_seqlen, max_seqlen, activation=activation,
                scale=scale, causal=True, output_scale=1.0 / history_cap, validate=validate,
                precision=jp, quantized=quantized)  # fmt: skip


def _layer_region(
    x: torch.Tensor,
    offsets: torch.Tensor,
    max_seqlen: int,
    params: list[torch.Tensor],
    eps: float,
    attn_eps: float,
    p: float,
    training: bool,
    fp8: bool,
    heads: int,
    block_size: int,
    activation: str,
    history_cap: int,
    validate: bool,
    precision: str,
) -> torch.Tensor:
    """A whole sequence layer (``compile_scope="layers"``): one graph around the attention
    op, so the compiler also fuses across it (the residual gradient's sum with the layer
    norm's backward, which otherwise runs as a separate float32 add)."""
    norm_w, norm_b, w, b, anorm_w, anorm_b, ow, ob = params
    u, v, q, k = _project_region(x, norm_w, norm_b, eps, w, b, fp8)
    q, k, v = _jagged(q, heads), _jagged(k, heads), _jagged(v, heads)
    a = _jagged_attention(q, k, v, offsets, max_seqlen, block_size, activation, history_cap,
                          validate, precision)  # fmt: skip
    a = a.reshape(x.shape[0], x.shape[1])
    return _gate_region(x, a, u, anorm_w, anorm_b, attn_eps, ow, ob, p, training, fp8)


def _jagged(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, dim] -> [N, heads, dim // heads] (the jagged_attn layout)."""
    return x.view(x.shape[0], heads, x.shape[1] // heads)


def bucket_rows(n: int, per_octave: int) -> int:
    """``n`` rounded up to one of ``per_octave`` evenly spaced sizes per power of two
    (``per_octave`` a power of two; 0 or ``n <= per_octave``: ``n`` itself).

    At most ``1 / per_octave`` of ``n`` is added (64 per octave: under 1.6%). Why: a
    cuBLAS call on a matrix shape it has not seen pays a heuristic query on the host
    (about 115 us measured on an H200, against ~25 us for a cached shape), and jagged
    token counts give every step new shapes; bucketed counts repeat.

    Raises:
        ValueError: ``n`` negative or ``per_octave`` not 0 or a power of two.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"bucket_rows: n must be an int >= 0, got {n!r}")
    if (
        isinstance(per_octave, bool)
        or not isinstance(per_octave, int)
        or per_octave < 0
        or per_octave & (per_octave - 1)
    ):
        raise ValueError(f"bucket_rows: per_octave must be 0 or a power of two, got {per_octave!r}")
    if per_octave == 0 or n <= per_octave:
        return n
    step = 1 << (n.bit_length() - per_octave.bit_length())
    return -(-n // step) * step


def _pad_sequences(
    offsets: torch.Tensor, tokens: int, rows: int, longest: int, cap: int
) -> tuple[torch.Tensor, int]:
    """``offsets`` ``[B + 1]`` over ``tokens`` tokens, extended to ``rows`` tokens by
    padding sequences of at most ``max(longest, min(rows - tokens, cap))`` tokens each
    (appended after the ``B`` real ones), and the longest sequence of the result. Built
    on the device from host ints: no host sync."""
    pad = rows - tokens
    if pad <= 0:
        return offsets, longest
    chunk = max(longest, min(pad, cap), 1)
    n = -(-pad // chunk)
    ends = torch.arange(1, n + 1, device=offsets.device, dtype=offsets.dtype) * chunk
    ends = (ends + tokens).clamp_(max=rows)
    return torch.cat([offsets, ends]), max(longest, min(chunk, pad))


def _indexed_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q: int,
    max_kv: int,
    kv_index: torch.Tensor,
    scale: float,
    validate: bool,
) -> torch.Tensor:
    """Softmax attention of query sequence ``b`` over key sequence ``kv_index[b]``."""
    return gdpa(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation="softmax",
                scale=scale, kv_index=kv_index, validate=validate)  # fmt: skip


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_heads(dim: object, heads: object) -> None:
    """The attention modules split ``dim`` into ``heads`` heads: without this check a
    bad pair failed at the first forward, in a ``view``, naming neither."""
    if _check_int("dim", dim, 1) % _check_int("heads", heads, 1):
        raise ValueError(f"heads ({heads}) must divide dim ({dim})")


def _is_attention_precision(value: str) -> bool:
    return value in ATTENTION_PRECISIONS


def _jagged_precision(name: str) -> Precision | FP8Config:
    """The ``precision=`` argument of :mod:`hyperrec.jagged_attn` for a config name."""
    if name == "fp8_bwd":
        return FP8Config(backward="fp8")
    if name == "fp8_fused":  # where it does not fuse, the same forward as "fp8"
        return "fp8"
    assert name in ("bf16", "fp8", "mxfp8"), name
    return name  # type: ignore[return-value]


class SequenceBlock(nn.Module):
    """One HSTU-style layer over jagged tokens ``[T, dim]``.

    ``u, v, q, k = split(silu(W x))``; ``a = attention(q, k, v)``;
    ``x + W_o(dropout(LayerNorm(a) * u))``. Full layers use causal GDPA with SiLU and
    HSTU's ``1/N`` normalisation, where ``N`` is the configured history cap (a constant,
    so a request's output never depends on the rest of its batch). Block layers
    (``block_size > 0``) use causal softmax attention inside fixed blocks: O(L) cost.

    ``impl="hyperrec"`` runs the attention with :mod:`hyperrec.jagged_attn` on the jagged
    tokens; ``impl="naive"`` pads around the attention (:mod:`hyperrec.integration.naive`).
    ``compile`` compiles the two small-op regions around the attention (norm + projection
    + SiLU; norm + gate + output projection + residual).
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
        impl: str = "hyperrec",
        compile: str = "off",
        precision: str = "bf16",
        linear_precision: str = "bf16",
        compile_scope: str = "regions",
    ):
        super().__init__()
        _check_heads(dim, heads)
        # 1/max_seqlen scales the HSTU output (0 divided by zero at the first forward);
        # a negative block size failed there too (naive: a reshape error).
        _check_int("max_seqlen", max_seqlen, 1)
        _check_int("block_size", block_size, 0)
        # The model's activations (ModelConfig's): the naive path computes only these, so
        # another one worked on the hyperrec path and failed after set_impl("naive").
        _check_choice("activation", activation, ACTIVATIONS)
        _check_choice("impl", impl, IMPLS)
        _check_choice("compile", compile, COMPILE_MODES)
        if not _is_attention_precision(precision):
            raise ValueError(f"precision must be one of {ATTENTION_PRECISIONS}, got {precision!r}")
        if impl == "naive" and precision != "bf16":
            raise ValueError(
                f"precision={precision!r} needs impl='hyperrec': the naive padded attention "
                "has no low-precision path"
            )
        _check_choice("linear_precision", linear_precision, SEQ_LINEAR_PRECISIONS)
        _check_choice("compile_scope", compile_scope, COMPILE_SCOPES)
        if precision == "fp8_fused" and (compile_scope != "regions" or linear_precision != "bf16"):
            raise ValueError(
                "precision='fp8_fused' needs compile_scope='regions' and linear_precision="
                f"'bf16', got {compile_scope!r} and {linear_precision!r}"
            )
        self.compile_scope = compile_scope
        if linear_precision != "bf16" and impl == "naive":
            raise ValueError(
                f"linear_precision={linear_precision!r} needs impl='hyperrec': the naive "
                "baseline runs its linears in bf16"
            )
        if linear_precision == "fp8" and dim % 16:
            raise ValueError(f"linear_precision='fp8' needs dim divisible by 16, got dim={dim}")
        self.precision, self.linear_precision = precision, linear_precision
        # The GDPA layers' Q/K/V are quantized by their projection; softmax (block) layers
        # smooth their keys by each sequence's mean, which needs every key first.
        self.fuses_projection = (
            precision == "fp8_fused" and not block_size and activation != "softmax"
        )
        self.dim, self.heads, self.max_seqlen, self.validate = dim, heads, max_seqlen, validate
        self.block_size, self.activation = block_size, activation
        self.impl, self.compile_mode = impl, compile
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.attn_norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: torch.Tensor,
        max_seqlen: int,
        layout: JaggedLayout | None,
    ) -> torch.Tensor:
        scale = 1.0 / math.sqrt(self.dim // self.heads)
        if self.impl == "naive":
            if layout is None:
                layout = JaggedLayout.from_offsets(offsets, max_seqlen, q.shape[0])
            if self.block_size:
                return naive.block_attention(
                    q, k, v, layout, block_size=self.block_size, scale=scale
                )
            if self.activation == "softmax":
                return naive.softmax_self_attention(q, k, v, layout, scale=scale)
            return naive.hstu_attention(
                q,
                k,
                v,
                layout,
                activation=self.activation,
                scale=scale,
                output_scale=1.0 / self.max_seqlen,
            )
        return _jagged_attention(q, k, v, offsets, max_seqlen, self.block_size, self.activation,
                                 self.max_seqlen, self.validate, self.precision)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_seqlen: int,
        layout: JaggedLayout | None = None,
    ) -> torch.Tensor:
        """x: [T, dim]; offsets: int64 [B + 1]; max_seqlen: longest sequence (host int);
        layout: the padded layout of ``offsets`` (naive path; built when None).
        Returns [T, dim]."""
        fp8 = self.linear_precision == "fp8"
        if self.compile_scope == "layers" and self.compile_mode != "off" and self.impl != "naive":
            params = [
                *(self.norm.weight, self.norm.bias, self.uvqk.weight, self.uvqk.bias),
                *(self.attn_norm.weight, self.attn_norm.bias, self.out.weight, self.out.bias),
            ]
            eps = (self.norm.eps, self.attn_norm.eps)
            config = (self.heads, self.block_size, self.activation, self.max_seqlen)
            return _region(_layer_region, self.compile_mode)(
                x, offsets, max_seqlen, params, *eps, self.dropout.p, self.training, fp8,
                *config, self.validate, self.precision)  # fmt: skip
        if self.fuses_projection:
            n = _region(_norm_region, self.compile_mode)(x, self.norm.weight, self.norm.bias,
                                                         self.norm.eps)  # fmt: skip
            u, v, q, k, qkv = _fused_projection(n, self.uvqk.weight, self.uvqk.bias, offsets,
                                                self.heads)  # fmt: skip
            q, k, v = _jagged(q, self.heads), _jagged(k, self.heads), _jagged(v, self.heads)
            a = _jagged_attention(q, k, v, offsets, max_seqlen, self.block_size,
                                  self.activation, self.max_seqlen, self.validate,
                                  self.precision, qkv).reshape(x.shape[0], self.dim)  # fmt: skip
        else:
            project = _region(_project_region, self.compile_mode)
            u, v, q, k = project(x, self.norm.weight, self.norm.bias, self.norm.eps,
                                 self.uvqk.weight, self.uvqk.bias, fp8)  # fmt: skip
            q, k, v = _jagged(q, self.heads), _jagged(k, self.heads), _jagged(v, self.heads)
            a = self._attention(q, k, v, offsets, max_seqlen, layout)
            a = a.reshape(x.shape[0], self.dim)
        gate = _region(_gate_region, self.compile_mode)
        return gate(x, a, u, self.attn_norm.weight, self.attn_norm.bias, self.attn_norm.eps,
                    self.out.weight, self.out.bias, self.dropout.p, self.training, fp8)  # fmt: skip


class PMAPooling(nn.Module):
    """Pooling by multi-head attention: ``queries`` learned vectors attend to each history.

    Returns ``[B, dim]``: the ``queries`` outputs of each request concatenated and
    projected. An empty history pools to the projection's bias (attention over no keys
    is zero).
    """

    def __init__(
        self, dim: int, heads: int, queries: int, *, validate: bool = True, impl: str = "hyperrec"
    ):
        super().__init__()
        _check_heads(dim, heads)
        _check_int("queries", queries, 1)
        _check_choice("impl", impl, IMPLS)
        self.dim, self.heads, self.num_queries, self.validate = dim, heads, queries, validate
        self.impl = impl
        self.queries = nn.Parameter(torch.randn(queries, dim) * dim**-0.5)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(queries * dim, dim)

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        max_seqlen: int,
        layout: JaggedLayout | None = None,
        num_requests: int | None = None,
    ) -> torch.Tensor:
        """x: [T, dim]; offsets: int64 [B + 1]; layout: as in :class:`SequenceBlock`;
        num_requests: pool only the first ``num_requests`` sequences (the rest pad ``x``
        to a bucketed row count). Returns [num_requests or B, dim].

        Raises:
            TypeError / ValueError: ``num_requests`` not an int in ``[1, B]``.
        """
        seqs = offsets.shape[0] - 1
        b = seqs if num_requests is None else num_requests
        if num_requests is not None:
            _check_int("num_requests", num_requests, 1)
            if num_requests > seqs:
                raise ValueError(
                    f"num_requests ({num_requests}) exceeds the {seqs} sequences of offsets"
                )
        p = self.num_queries
        k, v = self.kv(x).split(self.dim, dim=-1)
        # Under autocast the projection yields bf16 keys while the learned queries stay in
        # the parameter dtype: attention needs one dtype.
        queries = self.queries.to(k.dtype)
        scale = 1.0 / math.sqrt(self.dim // self.heads)
        if self.impl == "naive":
            if layout is None:
                layout = JaggedLayout.from_offsets(offsets, max_seqlen, x.shape[0])
            o = naive.pma_attention(
                queries, _jagged(k, self.heads), _jagged(v, self.heads), layout,
                heads=self.heads, scale=scale,
            )  # fmt: skip
            # The first b sequences (num_requests), as the hyperrec path pools.
            return self.out(o[:b].reshape(b, p * self.dim))
        q = queries.unsqueeze(0).expand(b, p, self.dim).reshape(b * p, self.dim)
        q_offsets = torch.arange(b + 1, device=x.device, dtype=offsets.dtype) * p
        if b == offsets.shape[0] - 1:
            o = jagged_attention(
                _jagged(q, self.heads),
                _jagged(k, self.heads),
                _jagged(v, self.heads),
                q_offsets,
                p,
                kv_offsets=offsets,
                max_seqlen_kv=max_seqlen,
                scale=scale,
                validate=self.validate,
            )
        else:  # padding sequences follow the real ones: read only the first b
            kv = (_jagged(k, self.heads), _jagged(v, self.heads))
            index = torch.arange(b, device=x.device)
            o = _indexed_softmax(_jagged(q, self.heads), *kv, q_offsets, offsets, p, max_seqlen,
                                 index, scale, self.validate)  # fmt: skip
        return self.out(o.reshape(b, p * self.dim))


class CandidateAttention(nn.Module):
    """Target attention: each candidate attends to its request's history (softmax).

    Each candidate is a query sequence of length 1 and ``owner[c]`` maps it to its
    request's kv sequence, so no history is copied per candidate (hyperrec path). The
    naive path pads the candidates of each request and runs one SDPA call per batch.
    """

    def __init__(self, dim: int, heads: int, *, validate: bool = True, impl: str = "hyperrec"):
        super().__init__()
        _check_heads(dim, heads)
        _check_choice("impl", impl, IMPLS)
        self.dim, self.heads, self.validate, self.impl = dim, heads, validate, impl
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
        layouts: tuple[JaggedLayout, JaggedLayout] | None = None,
    ) -> torch.Tensor:
        """candidates: [C, dim]; owner: int64 [C] request of each candidate; history: [T, dim];
        offsets: int64 [B + 1]; layouts: (candidates, history) padded layouts, required by
        the naive path. Returns [C, dim]."""
        c = candidates.shape[0]
        k, v = self.kv(history).split(self.dim, dim=-1)
        q = _jagged(self.q(candidates), self.heads)
        scale = 1.0 / math.sqrt(self.dim // self.heads)
        if self.impl == "naive":
            if layouts is None:
                raise ValueError("the naive path needs layouts=(candidates, history)")
            o = naive.candidate_attention(
                q, layouts[0], _jagged(k, self.heads), _jagged(v, self.heads), layouts[1],
                scale=scale,
            )  # fmt: skip
            return self.out(o.reshape(c, self.dim))
        q_offsets = torch.arange(c + 1, device=candidates.device, dtype=offsets.dtype)
        kv = (_jagged(k, self.heads), _jagged(v, self.heads))
        o = _indexed_softmax(q, *kv, q_offsets, offsets, 1, max_seqlen, owner, scale,
                             self.validate)  # fmt: skip
        return self.out(o.reshape(c, self.dim))


class CrossNetwork(nn.Module):
    """DCN-v2 cross layers: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` on ``[N, width]``.

    With ``rank > 0`` each ``W_l`` is the low-rank product ``U_l V_l`` (DCN-Mix without
    experts), which keeps wide inputs affordable. ``compile`` compiles the whole stack.
    """

    def __init__(self, width: int, layers: int, rank: int = 0, *, compile: str = "off"):
        super().__init__()
        _check_int("width", width, 1)
        _check_int("layers", layers, 0)
        _check_int("rank", rank, 0)  # negative: "negative dimension" from nn.Linear
        _check_choice("compile", compile, COMPILE_MODES)
        self.compile_mode = compile
        self.layers = nn.ModuleList(
            nn.Linear(width, width)
            if rank == 0 or rank >= width
            else nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
            for _ in range(layers)
        )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """x0: [N, width]. Returns [N, width]."""
        params = [[p for p in layer.parameters()] for layer in self.layers]
        return _region(_cross_region, self.compile_mode)(x0, params)


def _mlp(widths: list[int], dropout: float) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i in range(len(widths) - 1):
        mods += [nn.Linear(widths[i], widths[i + 1]), nn.SiLU(), nn.Dropout(dropout)]
    return nn.Sequential(*mods)


class TaskHead(nn.Module):
    """One task's tower: an MLP then a logit, ``[N, width] -> float32 [N]``."""

    def __init__(self, width: int, hidden: tuple[int, ...]):
        super().__init__()
        if not hidden:  # the logit reads hidden[-1] (an IndexError before)
            raise ValueError("hidden must list at least one width, got ()")
        self.mlp = _mlp([width, *hidden], 0.0)
        self.weight = nn.Parameter(torch.randn(hidden[-1]) * hidden[-1] ** -0.5)
        self.bias = nn.Parameter(torch.zeros(1))  # 1-D: FSDP2 cannot shard 0-d tensors

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, width]. Returns float32 [N] logits (a fresh tensor, not a view)."""
        return (self.mlp(h) @ self.weight.to(h.dtype)).float() + self.bias


def _table_rows(model: ModelConfig, data: DataSchema | DataConfig) -> dict[str, int]:
    schema = data.schema if isinstance(data, DataConfig) else data
    return {
        "item_embedding": schema.num_items,
        "category_embedding": schema.num_categories,
        "action_embedding": schema.num_actions,
        "time_embedding": model.time_buckets,
        "user_embedding": model.user_hash_size,
        "tag_embedding": schema.num_tags,
    }


class EmbeddingTables(nn.Module):
    """Every table of :data:`TABLES` in one ``[sum of rows, dim]`` weight.

    :meth:`lookup` serves all sparse features of a batch with one
    ``F.embedding_bag`` call: each history token is a bag of its four ids (item,
    category, action, age bucket) summed inside the kernel, each candidate item,
    candidate category and user a bag of one, and each request's user tags a bag whose
    per-sample weights ``1 / n`` make it a mean. One gather forward, one scatter backward
    instead of six lookups and three sums.

    Args:
        rows: rows per table, in :data:`TABLES` order.
        dim: width of every table.
    """

    def __init__(self, rows: dict[str, int], dim: int):
        super().__init__()
        if tuple(rows) != TABLES:
            raise ValueError(f"rows must list the tables {TABLES} in that order")
        self.rows = dict(rows)
        starts, total = {}, 0
        for name, n in rows.items():
            starts[name] = total
            total += n
        self.starts = starts
        self.weight = nn.Parameter(torch.empty(total, dim))

    def lookup(
        self, batch: Batch, age_bucket: torch.Tensor, user_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(history tokens [T, dim] (sum of 4 tables), candidate items [C, dim], candidate
        categories [C, dim], users [B, dim], mean of user tags [B, dim])."""
        o = self.starts
        t, c, b = batch.num_history_events, batch.num_candidates, batch.num_requests
        dev = batch.history_items.device
        tokens = torch.stack(
            [
                batch.history_items + o["item_embedding"],
                batch.history_categories + o["category_embedding"],
                batch.history_actions + o["action_embedding"],
                age_bucket + o["time_embedding"],
            ],
            dim=1,
        ).reshape(-1)
        ids = torch.cat(
            [
                tokens,
                batch.candidate_items + o["item_embedding"],
                batch.candidate_categories + o["category_embedding"],
                user_rows + o["user_embedding"],
                batch.tags + o["tag_embedding"],
            ]
        )
        singles = 2 * c + b
        bags = torch.cat(
            [
                torch.arange(t, device=dev) * 4,
                4 * t + torch.arange(singles, device=dev),
                (4 * t + singles) + batch.tag_offsets[:-1],
            ]
        )
        n_tags = batch.tag_offsets.diff()
        tag_weight = torch.repeat_interleave(
            1.0 / n_tags.to(self.weight.dtype), n_tags, output_size=batch.tags.shape[0]
        )
        weights = torch.cat([self.weight.new_ones(4 * t + singles), tag_weight])
        out = F.embedding_bag(ids, self.weight, bags, mode="sum", per_sample_weights=weights)
        return out.split([t, c, c, b, b])


class GEMModel(nn.Module):
    """A GEM-style CTR/CVR ranking model over a :class:`~hyperrec.integration.data.Batch`.

    Args:
        model: the network's sizes.
        data: the input schema (vocabularies, dense width, history cap, tasks), or a
            synthetic :class:`~hyperrec.integration.config.DataConfig` (its ``schema``).
        validate: let the attention ops check offsets and maxima (host syncs on GPU;
            the naive path checks the history and candidate maxima it pads to). The
            trainer validates each batch once on the CPU instead and passes False.
        impl: "hyperrec" (:mod:`hyperrec.jagged_attn` on jagged tokens) or "naive"
            (padded PyTorch attention, :mod:`hyperrec.integration.naive`). Same
            parameters, same function.
        fused_embeddings: all tables in one :class:`EmbeddingTables` weight with one
            lookup per batch (a different ``state_dict`` layout: see
            :func:`fuse_tables_state_dict`), else one ``nn.Embedding`` per table.
        compile: "off", "inductor", "inductor_autotune" (GEMM autotuning) or "aot_eager":
            ``torch.compile`` the small-op regions
            (token norm/projection, each layer's norm + projection + SiLU and norm + gate
            + output projection, the DCN stack).
        mlp_precision: "bf16" or "mxfp8" (the interaction MLP's linears of at least
            4,096 features become ``hyperrec.mxfp8.MXLinear`` with 128-element blocks).
        row_buckets: pad each batch's token and candidate counts up to one of this many
            sizes per power of two (see :func:`bucket_rows`; 0: off; the hyperrec path
            only, ``set_impl("naive")`` turns it off). Same outputs and gradients.
        attention_precision: "bf16", "fp8", "mxfp8", "fp8_bwd" or "fp8_fused": the sequence
            tower's attention runs ``hyperrec.jagged_attn``'s ``precision=`` path
            (block-quantized Q/K/V, P quantized online, bf16 backward); PMA and the
            candidate attention stay bf16. "fp8_fused": Q/K/V of the GDPA layers quantized
            in their projection's epilogue (see ``TrainConfig.attention_precision``).
            Needs ``impl="hyperrec"``.
        compile_scope: "regions" (default) or "layers": with ``compile``, each sequence
            layer compiled as one graph around its attention op (see
            ``TrainConfig.compile_scope``).
        residual_dtype: "float32" or "autocast": the sequence tower's residual stream
            under autocast (see ``TrainConfig.residual_dtype``).
        seq_linear_precision: "bf16" or "fp8": the sequence layers' projections through
            ``hyperrec.mxfp8.rowwise_linear`` (see ``TrainConfig.seq_linear_precision``).
            Needs ``impl="hyperrec"``.
        sharded: a :func:`sharded_tables` collection holding the item, category, user
            and tag tables (then ``fused_embeddings`` applies to no table: the action and
            time-bucket tables stay two small ``nn.Embedding`` s); ``None``: dense tables.

    ``forward(batch)`` returns ``(ctr_logit, cvr_logit)``, float32 ``[C]`` each (one per
    candidate, in ``batch.candidate_items`` order); ``cvr_logit`` is ``None`` when the
    schema has the CTR task only (there is no CVR head then).

    Raises:
        TypeError: configs of the wrong type; ``row_buckets`` not an int.
        ValueError: an unknown ``impl``, ``compile``, ``mlp_precision``,
            ``attention_precision``, ``seq_linear_precision``, ``residual_dtype`` or
            ``compile_scope``; a low
            ``attention_precision`` or ``seq_linear_precision`` with ``impl="naive"``;
            ``row_buckets`` not 0 or a power of two.
    """

    # The unfused tables, set by name in __init__ (absent when fused, or when
    # ``sharded`` holds them: see SHARDED_TABLES).
    item_embedding: nn.Embedding
    category_embedding: nn.Embedding
    action_embedding: nn.Embedding
    time_embedding: nn.Embedding
    user_embedding: nn.Embedding

    def __init__(
        self,
        model: ModelConfig,
        data: DataSchema | DataConfig,
        *,
        validate: bool = True,
        impl: str = "hyperrec",
        fused_embeddings: bool = False,
        compile: str = "off",
        mlp_precision: str = "bf16",
        sharded: Any = None,
        attention_precision: str = "bf16",
        row_buckets: int = 0,
        seq_linear_precision: str = "bf16",
        residual_dtype: str = "float32",
        compile_scope: str = "regions",
    ):
        super().__init__()
        if not isinstance(model, ModelConfig) or not isinstance(data, (DataSchema, DataConfig)):
            raise TypeError(
                "GEMModel expects (model: ModelConfig, data: DataSchema | DataConfig), got "
                f"({type(model).__name__}, {type(data).__name__})"
            )
        _check_choice("impl", impl, IMPLS)
        _check_choice("compile", compile, COMPILE_MODES)
        _check_choice("mlp_precision", mlp_precision, MLP_PRECISIONS)
        _check_choice("attention_precision", attention_precision, ATTENTION_PRECISIONS)
        _check_choice("seq_linear_precision", seq_linear_precision, SEQ_LINEAR_PRECISIONS)
        _check_choice("residual_dtype", residual_dtype, RESIDUAL_DTYPES)
        _check_choice("compile_scope", compile_scope, COMPILE_SCOPES)
        if impl == "naive" and seq_linear_precision != "bf16":
            raise ValueError(
                f"seq_linear_precision={seq_linear_precision!r} needs impl='hyperrec': the "
                "naive baseline runs its linears in bf16"
            )
        if impl == "naive" and attention_precision != "bf16":
            raise ValueError(
                f"attention_precision={attention_precision!r} needs impl='hyperrec': the "
                "naive padded attention has no low-precision path"
            )
        # Checked here, naming the argument (bucket_rows would name its own per_octave).
        if isinstance(row_buckets, bool) or not isinstance(row_buckets, int):
            raise TypeError(
                f"row_buckets must be an int (0 or a power of two), got "
                f"{type(row_buckets).__name__} {row_buckets!r}"
            )
        if row_buckets < 0 or row_buckets & (row_buckets - 1):
            raise ValueError(f"row_buckets must be 0 or a power of two, got {row_buckets}")
        self.row_buckets = row_buckets
        self.validate = validate
        schema = data.schema if isinstance(data, DataConfig) else data
        self.config, self.schema = model, schema
        self.data_config = data  # as given (kept for callers that read it)
        if sharded is not None:
            from hyperrec.parallel5d import ShardedEmbeddingCollection

            if not isinstance(sharded, ShardedEmbeddingCollection):
                raise TypeError(
                    "sharded must be a ShardedEmbeddingCollection (see sharded_tables), got "
                    f"{type(sharded).__name__}"
                )
            fused_embeddings = False
        self.impl, self.fused_embeddings, self.compile_mode = impl, fused_embeddings, compile
        self.mlp_precision, self.attention_precision = mlp_precision, attention_precision
        self.seq_linear_precision, self.residual_dtype = seq_linear_precision, residual_dtype
        d, e = model.dim, model.table_dim
        # Item ids are the biggest table; history and candidates share it (and its rows'
        # gradients), as production rankers do.
        rows = _table_rows(model, schema)
        if fused_embeddings:
            self.tables = EmbeddingTables(rows, e)
        else:
            # Uninitialised here (no RNG drawn): reset_parameters fills every table in
            # TABLES order, exactly as it fills the fused weight's row ranges, so both
            # layouts start from the same values for the same seed.
            for name in TABLES[:-1]:
                if sharded is None or name not in SHARDED_TABLES:
                    w = torch.empty(rows[name], e)
                    setattr(self, name, nn.Embedding(rows[name], e, _weight=w))
            if sharded is None:
                self.tag_embedding = nn.EmbeddingBag(
                    rows["tag_embedding"],
                    e,
                    mode="mean",
                    _weight=torch.empty(rows["tag_embedding"], e),
                )
        self.sharded = sharded
        self.token_proj = nn.Linear(e, d) if e != d else None
        self.candidate_proj = nn.Linear(e, d) if e != d else None
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
                impl=impl,
                compile=compile,
                precision=attention_precision,
                linear_precision=seq_linear_precision,
                compile_scope=compile_scope,
            )
            for i in range(model.seq_layers)
        )
        self.seq_norm = nn.LayerNorm(d)
        self.pma = (
            PMAPooling(d, model.heads, model.pma_queries, validate=validate, impl=impl)
            if model.pma_queries
            else None
        )
        self.cross_attention = CandidateAttention(d, model.heads, validate=validate, impl=impl)
        width = self.interaction_width(model)
        self.feature_norm = nn.LayerNorm(width)
        self.interaction = CrossNetwork(
            width, model.cross_layers, model.cross_rank, compile=compile
        )
        self.mlp = _mlp([width, *model.mlp_dims], model.dropout)
        top = model.mlp_dims[-1]
        self.ctr_head = TaskHead(top, model.head_dims)
        self.cvr_head = TaskHead(top, model.head_dims) if schema.has_conversion else None
        self.reset_parameters()
        if mlp_precision == "mxfp8":
            from hyperrec.mxfp8 import convert

            convert(self.mlp, mlp_policy())

    def _normalize_groups(self, groups: list[torch.Tensor]) -> list[torch.Tensor]:
        """LayerNorm of each feature group over its own width, with that group's slice of
        ``feature_norm``'s weight and bias (groups in the order of the features)."""
        norm, out, start = self.feature_norm, [], 0
        for g in groups:
            w = g.shape[-1]
            sl = slice(start, start + w)
            out.append(F.layer_norm(g, (w,), norm.weight[sl], norm.bias[sl], norm.eps))
            start += w
        return out

    @staticmethod
    def interaction_width(model: ModelConfig) -> int:
        """Width of the per-candidate feature vector: candidate item and category, user
        and tags at the table width; cross-attention output, dense features and PMA at
        ``dim``."""
        return 4 * model.table_dim + (3 if model.pma_queries else 2) * model.dim

    @classmethod
    def from_preset(
        cls,
        preset: Preset,
        *,
        schema: DataSchema | None = None,
        validate: bool = True,
        sharded: Any = None,
    ) -> GEMModel:
        """The model of ``preset`` with its ``TrainConfig``'s compute-path switches.

        Args:
            schema: the input schema; default: ``preset.data``'s, which only a synthetic
                :class:`~hyperrec.integration.config.DataConfig` knows without reading
                data (an event log's comes from its prepared source,
                ``EventLogSource.schema``).
            sharded: a :func:`sharded_tables` collection, or ``None`` (dense tables).

        Raises:
            ValueError: an :class:`~hyperrec.integration.config.EventLogConfig` preset
                without ``schema``.
        """
        if schema is None:
            if isinstance(preset.data, EventLogConfig):
                raise ValueError(
                    "GEMModel.from_preset: an event-log preset needs schema= (the prepared "
                    "log's EventLogSource.schema)"
                )
            schema = preset.data.schema
        t = preset.train
        return cls(
            preset.model,
            schema,
            validate=validate,
            impl=t.impl,
            fused_embeddings=t.fused_embeddings,
            compile=t.compile,
            mlp_precision=t.mlp_precision,
            sharded=sharded,
            attention_precision=t.attention_precision,
            row_buckets=t.row_buckets,
            seq_linear_precision=t.seq_linear_precision,
            residual_dtype=t.residual_dtype,
            compile_scope=t.compile_scope,
        )

    def set_impl(self, impl: str) -> None:
        """Switch every attention of the model to ``impl`` ("hyperrec" or "naive") in place.

        Both paths compute the same function with the same parameters (tested), so this
        changes speed and memory only; the ablation evaluates every row, the naive one
        included, with the same (jagged) evaluation code this way.

        Raises:
            ValueError: an unknown ``impl``.
        """
        _check_choice("impl", impl, IMPLS)
        if impl == "naive" and self.seq_linear_precision != "bf16":
            raise ValueError(
                f"set_impl('naive') on a model with seq_linear_precision="
                f"{self.seq_linear_precision!r}: the naive baseline runs its linears in bf16"
            )
        if impl == "naive" and self.attention_precision != "bf16":
            raise ValueError(
                f"set_impl('naive') on a model with attention_precision="
                f"{self.attention_precision!r}: the naive attention has no low-precision path"
            )
        self.impl = impl
        for m in self.modules():
            if isinstance(m, SequenceBlock | PMAPooling | CandidateAttention):
                m.impl = impl

    def reset_parameters(self) -> None:
        """Small-normal embeddings (std 1/sqrt(table width)), table by table in
        :data:`TABLES` order for either layout; PyTorch defaults elsewhere."""
        std = self.config.table_dim**-0.5
        if self.fused_embeddings:
            tables = self.tables.weight.detach().split(list(self.tables.rows.values()))
        else:
            tables = [getattr(self, name).weight.detach() for name in self._dense_tables()]
        with torch.no_grad():
            for table in tables:
                nn.init.normal_(table, std=std)

    def _dense_tables(self) -> list[str]:
        if self.sharded is None:
            return list(TABLES)
        return [name for name in TABLES if name not in SHARDED_TABLES]

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The dense embedding tables' weights (for a separate optimizer group); sharded
        tables are not parameters (see ``self.sharded``)."""
        if self.fused_embeddings:
            return [self.tables.weight]
        return [getattr(self, name).weight for name in self._dense_tables()]

    @torch.no_grad()
    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a dense model's ``state_dict`` (separate or fused tables) into this model.

        With sharded tables, the item, category, user and tag tables are copied into the
        collection (each rank keeps its rows; the full tables are read, ``O(T)``: for
        migrating a dense checkpoint or tests) and everything else is loaded as usual;
        a dense model loads it as it is (converting the table layout if needed).

        Raises:
            KeyError / RuntimeError: missing or unexpected entries, as ``load_state_dict``.
        """
        state = dict(state)
        if "tables.weight" in state and not self.fused_embeddings:
            state = split_tables_state_dict(state, self.config, self.schema)
        elif self.fused_embeddings and "tables.weight" not in state:
            state = fuse_tables_state_dict(state)
        if self.sharded is not None:
            full = {short: state.pop(f"{name}.weight") for name, short in SHARDED_TABLES.items()}
            self.sharded.load_full_weights(full)
            own = {f"sharded.{k}" for k in self.sharded.state_dict()}
            missing, unexpected = self.load_state_dict(state, strict=False)
            missing = [k for k in missing if k not in own]
            if missing or unexpected:
                raise RuntimeError(
                    f"load_dense_state_dict: missing keys {missing}, unexpected keys {unexpected}"
                )
            return
        self.load_state_dict(state)

    def check_batch(self, batch: Batch) -> None:
        """:meth:`Batch.validate` against this model's schema, plus the history and
        candidate caps.

        Raises:
            ValueError / TypeError: see :meth:`Batch.validate`; or a history longer than
                the schema's ``max_seqlen``, or a request with more candidates than its
                ``max_candidates``.
        """
        if not isinstance(batch, Batch):
            raise TypeError(f"expected a Batch, got {type(batch).__name__}")
        batch.validate(self.schema)
        if batch.max_history_len > self.schema.max_seqlen:
            raise ValueError(
                f"Batch.max_history_len = {batch.max_history_len} exceeds the model's "
                f"DataSchema.max_seqlen = {self.schema.max_seqlen}"
            )
        self._check_candidate_cap(batch)

    def _check_candidate_cap(self, batch: Batch, why: str = "") -> None:
        most = int(batch.candidate_offsets.diff().max())
        if most > self.schema.max_candidates:
            raise ValueError(
                f"Batch.candidate_offsets: a request has {most} candidates, more than the "
                f"model's DataSchema.max_candidates = {self.schema.max_candidates}{why}"
            )

    def _check_padded_sizes(self, batch: Batch) -> None:
        """The naive path's ``validate``: it pads histories to ``batch.max_history_len``
        and candidates to the schema's ``max_candidates``, so a batch beyond either failed
        inside ``index_put`` (an IndexError naming neither on the CPU, a device assert on
        CUDA) where the hyperrec path's attention raises a ValueError. Host syncs."""
        max_len = batch.max_history_len
        if isinstance(max_len, bool) or not isinstance(max_len, int):
            raise TypeError(
                f"Batch.max_history_len must be an int, got {type(max_len).__name__} {max_len!r}"
            )
        longest = int(batch.history_offsets.diff().max())
        if longest > max_len:
            raise ValueError(
                f"Batch.max_history_len = {max_len} but the longest history has {longest} events"
            )
        self._check_candidate_cap(batch, " (the naive path pads to it)")

    #: Top-level modules the forward calls once per step (besides the sequence layers),
    #: in call order: what ``TrainConfig.ac_regions="all"`` adds to autoac's regions.
    #: The embedding tables are not among them (each is called for the history and again
    #: for the candidates), nor ``feature_norm`` (once per feature group).
    ONCE_PER_STEP = ("seq_norm", "candidate_proj", "dense_proj", "cross_attention", "pma",
                     "interaction", "mlp", "ctr_head", "cvr_head")  # fmt: skip

    def ac_regions(self, scope: str = "layers") -> list[str]:
        """Module names for ``hyperrec.autoac``'s regions: the sequence layers
        (``scope="layers"``), or those and every module of :attr:`ONCE_PER_STEP` this
        model has (``"all"``).

        Raises:
            ValueError: another ``scope``.
        """
        if scope not in ("layers", "all"):
            raise ValueError(f"scope must be 'layers' or 'all', got {scope!r}")
        names = [f"seq_layers.{i}" for i in range(len(self.seq_layers))]
        if scope == "all":
            names += [n for n in self.ONCE_PER_STEP if getattr(self, n, None) is not None]
        return names

    def _lookups(
        self, batch: Batch, h_owner: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # History tokens: what, which category, how the user reacted, how long ago.
        age_minutes = (batch.request_time[h_owner] - batch.history_time).float() / 60.0
        bucket = torch.log2(1.0 + age_minutes.clamp_min(0.0)).floor().long()
        bucket = bucket.clamp(0, self.config.time_buckets - 1)
        user_rows = batch.user_ids % self.config.user_hash_size
        if self.fused_embeddings:
            return self.tables.lookup(batch, bucket, user_rows)
        if self.sharded is not None:
            out = self.sharded(
                {
                    "history_items": batch.history_items,
                    "candidate_items": batch.candidate_items,
                    "history_categories": batch.history_categories,
                    "candidate_categories": batch.candidate_categories,
                    "users": user_rows,
                    "tags": (batch.tags, batch.tag_offsets),
                }
            )
            tokens = (
                out["history_items"]
                + out["history_categories"]
                + self.action_embedding(batch.history_actions)
                + self.time_embedding(bucket)
            )
            return (
                tokens,
                out["candidate_items"],
                out["candidate_categories"],
                out["users"],
                out["tags"],
            )
        tokens = (
            self.item_embedding(batch.history_items)
            + self.category_embedding(batch.history_categories)
            + self.action_embedding(batch.history_actions)
            + self.time_embedding(bucket)
        )
        return (
            tokens,
            self.item_embedding(batch.candidate_items),
            self.category_embedding(batch.candidate_categories),
            self.user_embedding(user_rows),
            self.tag_embedding(batch.tags, batch.tag_offsets[:-1]),
        )

    def _residual_cast(self, device: torch.device) -> torch.dtype | None:
        """The dtype the residual stream is cast to under autocast: float32
        (``residual_dtype="float32"``) or autocast's dtype (``"autocast"``); None
        without autocast (the stream keeps the token norm's dtype)."""
        try:
            enabled = torch.is_autocast_enabled(device.type)
        except RuntimeError:  # a device type autocast does not know (meta): no autocast
            return None
        if not enabled:
            return None
        if self.residual_dtype == "autocast":
            return torch.get_autocast_dtype(device.type)
        return torch.float32

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of P(click) and P(conversion | click), float32 ``[C]`` each (the second
        ``None`` for a CTR-only schema).

        Reads no device values (no host synchronisation): every size comes from tensor
        shapes, ``batch.max_history_len`` and the schema's ``max_candidates``.
        """
        b, c, t = batch.num_requests, batch.num_candidates, batch.num_history_events
        if b == 0:
            raise ValueError("batch is empty: it must hold at least one request")
        dev = batch.history_items.device
        h_off, max_len = batch.history_offsets, batch.max_history_len
        rows = torch.arange(b, device=dev)
        h_owner = torch.repeat_interleave(rows, h_off.diff(), output_size=t)
        c_owner = torch.repeat_interleave(rows, batch.candidate_offsets.diff(), output_size=c)
        tokens, cand, cand_cat, user, tags = self._lookups(batch, h_owner)

        history = candidates = None
        if self.impl == "naive":
            if self.validate:
                self._check_padded_sizes(batch)
            pos = torch.arange(t, device=dev) - h_off[:-1][h_owner]
            history = JaggedLayout(b, max_len, h_owner, pos, h_off.diff())
            c_pos = torch.arange(c, device=dev) - batch.candidate_offsets[:-1][c_owner]
            candidates = JaggedLayout(
                b, self.schema.max_candidates, c_owner, c_pos,
                batch.candidate_offsets.diff(),
            )  # fmt: skip
        # Bucketed row counts (row_buckets, hyperrec path): zero rows after the real
        # tokens and candidates. Padding tokens form sequences of their own (no real token
        # attends to them, the candidate attention and PMA read the first b sequences
        # only) and padding candidates' logits are dropped, so the real rows' outputs and
        # every gradient are those of the unpadded batch.
        t_rows = c_rows = 0
        tower_off, tower_len = h_off, max_len
        if self.row_buckets and self.impl == "hyperrec":
            t_rows, c_rows = bucket_rows(t, self.row_buckets), bucket_rows(c, self.row_buckets)
            tokens = F.pad(tokens, (0, 0, 0, t_rows - t))
            cand = F.pad(cand, (0, 0, 0, c_rows - c))
            cand_cat = F.pad(cand_cat, (0, 0, 0, c_rows - c))
            c_owner = F.pad(c_owner, (0, c_rows - c))
            tower_off, tower_len = _pad_sequences(h_off, t, t_rows, max_len, self.schema.max_seqlen)
        proj = self.token_proj
        x = _region(_tokens_region, self.compile_mode)(
            tokens,
            None if proj is None else proj.weight,
            None if proj is None else proj.bias,
            self.token_norm.weight,
            self.token_norm.bias,
            self.token_norm.eps,
            self._residual_cast(dev),
        )
        for layer in self.seq_layers:
            x = layer(x, tower_off, tower_len, history)
        x = self.seq_norm(x)

        query = cand + cand_cat
        if self.candidate_proj is not None:
            query = self.candidate_proj(query)
        dense = self.dense_proj(batch.dense)
        layouts = None if candidates is None or history is None else (candidates, history)
        target = self.cross_attention(query, c_owner, x, tower_off, tower_len, layouts)
        request = [user, tags, dense]
        if self.pma is not None:
            request.append(self.pma(x, tower_off, tower_len, history, num_requests=b))
        # Each feature group is normalized on its own (request-level groups before they
        # are repeated per candidate). One LayerNorm over the concatenation let the group
        # of the largest scale set everyone's: Adam grows the PMA output (its projection's
        # fan-in is 16 * dim) to 13-34x the other groups' scale in 25 steps at width 1,024,
        # which squashed the candidate's own features and the model stopped learning.
        normed = self._normalize_groups([cand, cand_cat, target, *request])
        features = torch.cat([*normed[:3], *(f[c_owner] for f in normed[3:])], dim=-1)

        h = self.interaction(features)
        h = self.mlp(h)
        ctr = self.ctr_head(h)
        cvr = self.cvr_head(h) if self.cvr_head is not None else None
        if c_rows > c:
            ctr, cvr = ctr[:c], (None if cvr is None else cvr[:c])
        return ctr, cvr


def mlp_policy() -> Any:
    """The ``hyperrec.mxfp8.PrecisionPolicy`` of ``mlp_precision="mxfp8"``.

    The fast Hopper recipe (one power-of-two scale per 128 elements along K, cuBLAS
    block-scaled FP8 GEMMs); every linear of the interaction MLP is eligible, and the
    policy's default ``min_features=4096`` keeps the narrower ones in bf16 (the casts cost
    more than FP8 saves there, per the mxfp8 benchmark).
    """
    from hyperrec.mxfp8 import PrecisionPolicy

    return PrecisionPolicy(block_size=128, keep_first=False, keep_last=False)


def fuse_tables_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``state_dict`` of separate tables -> the fused layout (``tables.weight``).

    The six ``<table>.weight`` entries of :data:`TABLES` are concatenated in that order;
    every other entry is kept. Loads into a ``GEMModel(..., fused_embeddings=True)``.

    Raises:
        KeyError: a table is missing.
    """
    out = {k: v for k, v in state.items() if k.split(".")[0] not in TABLES}
    out["tables.weight"] = torch.cat([state[f"{name}.weight"] for name in TABLES])
    return out


def split_tables_state_dict(
    state: dict[str, torch.Tensor], model: ModelConfig, data: DataSchema | DataConfig
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_tables_state_dict` (needs the configs for the row counts).

    Raises:
        KeyError: no ``tables.weight``. ValueError: its row count does not match.
    """
    rows = _table_rows(model, data)
    weight = state["tables.weight"]
    if weight.shape[0] != sum(rows.values()):
        raise ValueError(
            f"tables.weight has {weight.shape[0]} rows, the configs need {sum(rows.values())}"
        )
    out = {k: v for k, v in state.items() if k != "tables.weight"}
    for name, part in zip(TABLES, weight.split(list(rows.values()))):
        out[f"{name}.weight"] = part
    return out


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler, 2012).

    ``x`` is clamped to at most minus the dtype's smallest normal number, where the
    result is still finite (about -87 in float32): only ``x == 0`` (log P(click & conv)
    rounded to 0) needs it. The clamp was at -1e-7, which flattened the loss and zeroed
    its gradient wherever ``pCTR * pCVR > 1 - 1e-7`` (both logits above ~16): a
    confidently wrong non-conversion stopped being penalised.
    """
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    near = x > -math.log(2.0)
    # Each branch only sees inputs where it is finite: torch.where sends the unselected
    # branch a zero gradient, and zero times its infinite derivative (log1p(-exp(x)) at
    # x -> 0) would be NaN.
    one = torch.full_like(x, -1.0)
    close = torch.log(-torch.expm1(torch.where(near, x, one)))
    far = torch.log1p(-torch.exp(torch.where(near, one, x)))
    return torch.where(near, close, far)


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
    optimizer_temporaries: int
    """Peak scratch of the optimizer step: PyTorch's foreach AdamW materialises one
    full-size fp32 temporary per group (``sqrt(v)``), 4 bytes per parameter of the
    largest group; the fused kernel needs none."""
    activations: int
    """Estimated saved activations of one step (see :func:`estimate_memory`)."""
    activation_bytes_per_token: int
    """The per-history-token term of ``activations``."""

    @property
    def total(self) -> int:
        """Sum of the terms (bytes)."""
        return self.weights_grads_optimizer + self.optimizer_temporaries + self.activations


def activation_bytes_per_token(
    model: ModelConfig, *, element_bytes: int = 2, fused_embeddings: bool = False
) -> int:
    """Bytes saved for backward per history token (hyperrec path, fused attention).

    ``element_bytes`` is the activations' size: 2 under bf16 autocast on CUDA (the
    trainer's default), 4 without autocast. The residual stream and LayerNorms stay fp32
    either way (CUDA autocast runs norms in fp32). With ``s = element_bytes`` and ``d``,
    ``e`` the model and table widths, each sequence layer saves: the fp32 residual (4d,
    for the norm), the projection's input (s*d: a bf16 cast, or the fp32 norm output),
    the ``4d``-wide projection output (4s*d, for SiLU) and the SiLU output (4s*d: q, k, v
    for the attention, u for the gate), the attention output (s*d; under autocast the
    norm then saves its fp32 cast, 4d more; without autocast the two are one tensor), the
    fp32 normed output (4d, for the gate's product) and the gated value (s*d, for the
    output projection); plus ``d`` bytes of dropout mask with dropout (CUDA's fused
    dropout keeps a bool mask; the CPU kernel keeps a float one). Above the layers:
    the final norm's input (4d) and the PMA and cross-attention K/V projections' input (a
    cast each under autocast, else one shared tensor) and outputs (2s*d each). Below them:
    the token stage (the embedding sum, or its cast for the projection, and the norm's
    4d input). Plus 8 bytes per norm (mean, rstd) and 32 for the lookup indices (72 with
    ``fused_embeddings``: the bag offsets, per-sample weights and bag map too). Attention
    is assumed fused (no ``L^2`` buffers), as the jagged_attn kernels are.

    Raises:
        ValueError: ``element_bytes`` not 2 or 4.
    """
    if element_bytes not in (2, 4):
        raise ValueError(f"element_bytes must be 2 or 4, got {element_bytes!r}")
    s, d, e = element_bytes, model.dim, model.table_dim
    cast = s < 4
    per_layer = 4 * d + s * d + 8 * s * d + (s * d if cast else 0) + 4 * d + 4 * d + s * d
    if model.dropout > 0:
        per_layer += d
    kv_users = 2 if model.pma_queries else 1
    kv_input = kv_users * s * d if cast else 4 * d
    top = 4 * d + kv_input + kv_users * 2 * s * d
    if e != d:
        tokens = (s * e if cast else 4 * e) + 4 * d
    else:
        tokens = 4 * e
    norms = 2 * model.seq_layers + 2
    indices = 72 if fused_embeddings else 32
    return model.seq_layers * per_layer + top + tokens + 8 * norms + indices


def estimate_memory(
    preset: Preset,
    *,
    world_size: int = 1,
    sample_requests: int = 65536,
    tables: str = "dense",
) -> MemoryEstimate:
    """Estimate the training memory of ``preset`` per rank, without allocating it.

    The parameter count is exact (the model is built on the meta device). Activations
    are :func:`activation_bytes_per_token` times the expected history tokens of a step
    (the mean of the data's length law over ``sample_requests`` requests, times the
    per-rank batch); the candidate-side tower (a few thousand rows) is ignored. Covers
    the hyperrec path; the naive path adds its padded copies. Weights, gradients and
    optimizer state divide by ``world_size`` under FSDP. ``tables="sharded"``: the item,
    category, user and tag tables hold their fp32 rows and one float of row-wise
    Adagrad state per row (no gradient, no AdamW moments), also divided by
    ``world_size``; the lookups' transient rows are not counted.

    Raises:
        ValueError: ``tables`` not "dense" or "sharded"; ``preset.data`` is an event log
            (its lengths are in the data, not in a law this function can sample).
    """
    _check_choice("tables", tables, ("dense", "sharded"))
    from hyperrec.integration.data import TRAIN, SyntheticRecsysData

    if not isinstance(preset.data, DataConfig):
        raise ValueError(
            "estimate_memory needs a synthetic preset (preset.data a DataConfig), got "
            f"{type(preset.data).__name__}"
        )

    with torch.device("meta"):
        model = GEMModel(preset.model, preset.data, fused_embeddings=preset.train.fused_embeddings)
    params = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for p in model.embedding_parameters())
    ids = torch.arange(sample_requests).numpy()
    lengths = SyntheticRecsysData(preset.data).history_lengths(TRAIN, ids)
    mean_len = float(lengths.mean())
    tokens = mean_len * preset.train.global_batch_size / world_size
    per_token = activation_bytes_per_token(
        preset.model, element_bytes=2, fused_embeddings=preset.train.fused_embeddings
    )
    state = 16 * params
    if tables == "sharded":
        rows = _table_rows(preset.model, preset.data)
        sharded_rows = sum(rows[name] for name in SHARDED_TABLES)
        sharded = sharded_rows * preset.model.table_dim
        state += -16 * sharded + 4 * sharded + 4 * sharded_rows
        emb -= sharded  # AdamW's table group keeps the two small dense tables only
    # The optimizer groups: embeddings, matrices, vectors; foreach scratch is per group.
    largest_group = max(emb, params - emb if tables == "dense" else params - emb - sharded)
    temporaries = 4 * largest_group // world_size if preset.train.optimizer_impl == "foreach" else 0
    return MemoryEstimate(
        parameters=params,
        embedding_parameters=emb if tables == "dense" else emb + sharded,
        mean_history_len=mean_len,
        tokens_per_step=tokens,
        weights_grads_optimizer=state // world_size,
        optimizer_temporaries=temporaries,
        activations=int(tokens * per_token),
        activation_bytes_per_token=per_token,
    )
