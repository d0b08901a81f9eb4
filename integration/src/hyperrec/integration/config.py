"""Configs as code: frozen, keyword-only dataclasses and the named presets.

A run is described by one :class:`Preset` = a data source (:class:`DataConfig`, the
synthetic world, or :class:`EventLogConfig`, interaction logs on disk) +
:class:`ModelConfig` (the network) + :class:`TrainConfig` (optimisation, batching,
checkpointing). What the model needs to know about its input (vocabulary sizes, dense
width, tasks) is a :class:`DataSchema`, which every data source reports: for the
generator it follows from the :class:`DataConfig`; for a log it comes from the data.
Every field is validated when the dataclass is built, so a bad value fails at
construction with a ``ValueError``/``TypeError`` that names the field, not deep inside
a training step. Derive variants with :func:`dataclasses.replace` (which re-validates)
or :func:`override` (``"model.dim=64"`` strings, as the CLI does).

Presets (:data:`PRESETS`):

- ``micro``: the test suite's size; a few seconds per run on one CPU core.
- ``tiny``: the default CPU run (``nox -s train``), about a minute on two cores.
- ``small``: a single-GPU or many-core smoke run with realistic proportions.
- ``h200``: sized to fill one 141 GB H200 with a small dense part (2.7 B parameters, 99% of
  them embeddings; see :func:`hyperrec.integration.model.estimate_memory`).
- ``gem``: a production-shaped dense part on one H200: width 1024, 8 heads of 128, 12
  sequence layers, histories up to 8,192 events, a 4,096-wide interaction MLP, every
  speed switch of :class:`TrainConfig` on.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACTIONS",
    "DENSE_FEATURES",
    "PRESETS",
    "TASKS",
    "DataConfig",
    "DataSchema",
    "EventLogConfig",
    "ModelConfig",
    "Preset",
    "TrainConfig",
    "get_preset",
    "override",
]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "softmax")
IMPLS = ("hyperrec", "naive")
COMPILE_MODES = ("off", "inductor", "inductor_autotune", "aot_eager")
COMPILE_SCOPES = ("regions", "layers")
MLP_PRECISIONS = ("bf16", "mxfp8")
SEQ_LINEAR_PRECISIONS = ("bf16", "fp8")
RESIDUAL_DTYPES = ("float32", "autocast")
OPTIMIZER_IMPLS = ("foreach", "fused")
ACTIVATION_CHECKPOINTING = ("off", "autoac")
AC_STRATEGIES = ("fastest", "pack_all")
AC_REGIONS = ("layers", "all")
ATTENTION_PRECISIONS = ("bf16", "fp8", "mxfp8", "fp8_bwd", "fp8_fused")
MESHES = ("auto", "5d", "flat")
SPARSE_PLACEMENTS = ("auto", "dense", "sharded")
EMBEDDING_OPTIMIZERS = ("auto", "adamw", "adagrad", "rowwise_adagrad", "adam")
DENSE_TABLE_OPTIMIZERS = ("adamw", "adagrad")
"""Optimizers of dense (``sparse="dense"``) tables: AdamW (with the other parameters'
moments) or ``torch.optim.Adagrad``."""
SHARDED_TABLE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "adam")
"""Optimizers of sharded tables (``hyperrec.parallel5d``'s lazy row optimizers):
``RowWiseAdagrad``, ``LazyAdagrad`` (``torch.optim.Adagrad``'s rule on touched rows) and
``LazyAdam`` (``torch.optim.SparseAdam``'s)."""
AC_FORMATS = ("mxfp8", "fp8_e4m3", "fp8_e5m2", "mx4", "mxint8")

NOT_AVAILABLE: dict[tuple[str, str], str] = {}
"""Config values that exist so that runs and ablations can name them, but whose
implementation has not been integrated yet: choosing one raises a ``ValueError``."""

ACTIONS = ("view", "click", "conversion", "skip")
"""History action types of the synthetic generator; the index is the id in
``Batch.history_actions``."""

DENSE_FEATURES = (
    "log_history_length",
    "history_click_rate",
    "user_ctr_estimate",
    "hour_sin",
    "hour_cos",
)
"""Names of the synthetic generator's ``Batch.dense`` columns."""

TASKS = (("ctr",), ("ctr", "cvr"))
"""Task sets a model can train: CTR alone, or CTR and CVR (ESMM)."""


#: Largest seed: the trainer seeds torch with ``seed + 1 + rank`` (a signed 64-bit
#: integer) and the synthetic data hashes it as an unsigned 64-bit one.
MAX_SEED = 2**62
#: Largest ``cpu_threads`` (``torch.set_num_threads`` crashes far above any core count).
MAX_CPU_THREADS = 4096


def _require_int(obj: Any, name: str, *, minimum: int, maximum: int | None = None) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(obj).__name__}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{type(obj).__name__}.{name} must be <= {maximum}, got {value}")


def _require_float(
    obj: Any, name: str, *, low: float, high: float = math.inf, open_low: bool = False
) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{type(obj).__name__}.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        bracket = "(" if open_low else "["
        # an unbounded range is open at infinity (a finite number is required)
        close = ")" if high == math.inf else "]"
        raise ValueError(
            f"{type(obj).__name__}.{name} must be in {bracket}{low}, {high}{close}, got {value}"
        )


def _require_float_tuple(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, tuple) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise TypeError(f"{type(obj).__name__}.{name} must be a tuple of numbers, got {value!r}")
    if not all(math.isfinite(v) and v >= 0 for v in value):
        raise ValueError(
            f"{type(obj).__name__}.{name} must hold finite numbers >= 0, got {value!r}"
        )


def _require_dims(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise TypeError(
            f"{type(obj).__name__}.{name} must be a tuple of positive ints, got {value!r}"
        )
    if not all(v >= 1 for v in value):
        raise ValueError(
            f"{type(obj).__name__}.{name} must be a tuple of positive ints, got {value!r}"
        )


def _require_choice(obj: Any, name: str, choices: tuple[Any, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ValueError(f"{type(obj).__name__}.{name} must be one of {choices}, got {value!r}")


def _require_str(obj: Any, name: str, *, empty: bool = False) -> None:
    value = getattr(obj, name)
    if not isinstance(value, str):
        raise TypeError(f"{type(obj).__name__}.{name} must be a str, got {value!r}")
    if not empty and not value:
        raise ValueError(f"{type(obj).__name__}.{name} must not be empty")


def _require_names(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(
            f"{type(obj).__name__}.{name} must be a tuple of non-empty strs, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True)
class DataSchema:
    """What the model needs to know about its input, whatever produced it.

    Every data source reports one (``source.schema``): the synthetic generator derives it
    from its :class:`DataConfig`, the event-log reader from the log (vocabulary sizes
    after id remapping, the dense columns, whether there is a conversion label). The
    model's tables and input widths are built from it, never from a generator's knobs.
    """

    num_items: int
    """Rows of the item table: item ids (history and candidates) lie in ``[0, num_items)``."""
    num_categories: int
    """Rows of the item-category table: category ids lie in ``[0, num_categories)``."""
    num_tags: int
    """Rows of the pooled multi-hot user feature ("tags"): ids in ``[0, num_tags)``."""
    actions: tuple[str, ...]
    """Names of the history action types; ``Batch.history_actions`` indexes them."""
    dense_features: tuple[str, ...]
    """Names of the columns of ``Batch.dense`` (its width is their number)."""
    max_seqlen: int
    """Longest history of a request (the cap every source applies)."""
    tasks: tuple[str, ...] = ("ctr", "cvr")
    """``("ctr",)``: click only; ``("ctr", "cvr")``: click and conversion (ESMM)."""
    max_candidates: int = 1
    """Most candidates of one request (an event log: 1). The naive baseline pads each
    request's candidates to it (a static shape, so its step needs no host sync)."""

    def __post_init__(self) -> None:
        for name in ("num_items", "num_categories", "num_tags", "max_seqlen", "max_candidates"):
            _require_int(self, name, minimum=1)
        _require_names(self, "actions")
        _require_names(self, "dense_features")
        if not self.actions:
            raise ValueError("DataSchema.actions must name at least one action")
        _require_choice(self, "tasks", TASKS)

    @property
    def num_actions(self) -> int:
        """``len(actions)``."""
        return len(self.actions)

    @property
    def num_dense(self) -> int:
        """``len(dense_features)``: the width of ``Batch.dense``."""
        return len(self.dense_features)

    @property
    def has_conversion(self) -> bool:
        """True when the CVR task (a conversion label) exists."""
        return "cvr" in self.tasks


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The synthetic generator: vocabularies, length/popularity laws, hidden ground truth.

    Samples are *requests*: one user, that user's jagged history and 1 to
    ``max_candidates`` candidate items with click / conversion labels drawn from a hidden
    ground-truth model. Every sample is a pure function of ``(seed, split, index)``.
    The model's input sizes are :attr:`schema` (derived from these fields).

    Raises:
        TypeError: a field of the wrong type (the message names ``DataConfig.<field>``).
        ValueError: a field out of range or inconsistent with another (named likewise).
    """

    num_items: int
    """Item vocabulary size (history and candidate items share it). Must be a multiple of
    ``num_topics``: item ``i`` belongs to topic ``i % num_topics``."""
    num_topics: int
    """Latent item categories of the ground truth; also the vocabulary of the item-category
    and user-tag features."""
    num_users: int
    """User vocabulary size; user ids are Zipf-distributed over it."""
    max_seqlen: int
    """Cap on the history length (tokens) of one request."""
    min_seqlen: int = 1
    """Shortest history. 0 is allowed (new users) and exercises empty sequences."""
    seqlen_scale: float = 8.0
    """Scale of the Lomax (Pareto II) history-length law:
    ``L = min(max_seqlen, min_seqlen + floor(scale * (u^(-1/alpha) - 1)))``, u ~ U(0, 1)."""
    seqlen_alpha: float = 1.2
    """Tail exponent of the history-length law; smaller is heavier-tailed."""
    item_zipf: float = 1.05
    """Zipf exponent of item popularity within a topic."""
    topic_zipf: float = 0.6
    """Zipf exponent of topic popularity (for the non-personal part of histories/candidates)."""
    user_zipf: float = 0.9
    """Zipf exponent of user activity (how often each user id occurs)."""
    max_candidates: int = 4
    """Candidates per request are uniform in ``[1, max_candidates]``."""
    max_user_tags: int = 4
    """The multi-hot user-tag feature has ``1..max_user_tags`` ids per request."""
    latent_dim: int = 16
    """Dimension of the ground truth's topic/item latent vectors."""
    interest_strength: float = 3.0
    """Weight of short-term interest (recency-weighted history) in the true click logit."""
    preference_strength: float = 1.5
    """Weight of long-term user preference (favourite topics) in the true click logit."""
    item_bias_std: float = 0.5
    """Std of the per-item click bias: the part a popularity model can learn."""
    noise_std: float = 0.3
    """Std of Gaussian noise added to the true logits (irreducible error beyond Bernoulli)."""
    base_ctr_logit: float = -2.0
    """Intercept of the true click logit (sets the base click rate, roughly 20-30%)."""
    base_cvr_logit: float = -1.5
    """Intercept of the true conversion-given-click logit."""
    eval_requests: int = 4096
    """Size of the held-out evaluation split (requests)."""
    seed: int = 0
    """Seed of the synthetic world (ground truth and every sample)."""

    def __post_init__(self) -> None:
        for name, minimum in (
            ("num_topics", 2),
            ("num_items", 2),
            ("num_users", 1),
            ("max_seqlen", 1),
            ("min_seqlen", 0),
            ("max_candidates", 1),
            ("max_user_tags", 1),
            ("latent_dim", 1),
            ("eval_requests", 1),
        ):
            _require_int(self, name, minimum=minimum)
        _require_int(self, "seed", minimum=0, maximum=MAX_SEED)
        if self.num_items % self.num_topics:
            raise ValueError(
                f"DataConfig.num_items ({self.num_items}) must be a multiple of "
                f"num_topics ({self.num_topics})"
            )
        if self.min_seqlen > self.max_seqlen:
            raise ValueError(
                f"DataConfig.min_seqlen ({self.min_seqlen}) exceeds max_seqlen ({self.max_seqlen})"
            )
        _require_float(self, "seqlen_scale", low=0.0)
        _require_float(self, "seqlen_alpha", low=0.0, open_low=True)
        for name in ("item_zipf", "topic_zipf", "user_zipf"):
            _require_float(self, name, low=0.0, high=5.0)
        for name in ("interest_strength", "preference_strength", "item_bias_std", "noise_std"):
            _require_float(self, name, low=0.0, high=100.0)
        for name in ("base_ctr_logit", "base_cvr_logit"):
            _require_float(self, name, low=-20.0, high=20.0)

    @property
    def schema(self) -> DataSchema:
        """The model-facing schema of the generated data (CTR and CVR labels)."""
        return DataSchema(
            num_items=self.num_items,
            num_categories=self.num_topics,
            num_tags=self.num_topics,
            actions=ACTIONS,
            dense_features=DENSE_FEATURES,
            max_seqlen=self.max_seqlen,
            tasks=("ctr", "cvr"),
            max_candidates=self.max_candidates,
        )


SPLIT_MODES = ("time", "user")
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
LOG_FORMATS = ("auto", "csv", "parquet")
CSV_READERS = ("auto", "pyarrow", "python")


@dataclass(frozen=True, kw_only=True)
class EventLogConfig:
    """Interaction logs on disk (CSV or Parquet files) as the data source.

    One row per event: a user, an item, a timestamp and a label (or a rating turned
    into a label by ``rating_threshold``); optionally an item category, categorical user
    features, numeric columns and a conversion label. Every event becomes one request:
    its item is the candidate, and its history is the same user's *strictly earlier*
    events (events sharing its timestamp are not in it), the latest ``max_seqlen`` of
    them. See :mod:`hyperrec.integration.eventlog` for the full contract.
    """

    path: str
    """A ``.csv`` or ``.parquet`` file, or a directory of them (read in name order)."""
    max_seqlen: int = 64
    """History cap: a request keeps the latest ``max_seqlen`` earlier events of its user
    (older ones are dropped). The CLI's ``--data`` takes the preset's cap."""
    user_column: str = "user_id"
    """Column of user ids (any integers or strings)."""
    item_column: str = "item_id"
    """Column of item ids (any integers or strings)."""
    time_column: str = "timestamp"
    """Column of numeric event times (integers or floats, in ``time_unit``)."""
    time_unit: str = "s"
    """Unit of ``time_column``: "s", "ms", "us" or "ns"."""
    label_column: str = "label"
    """Click label column: 0 or 1, or a rating when ``rating_threshold`` is set."""
    rating_threshold: float | None = None
    """When set, the label is ``label_column >= rating_threshold`` (ratings as clicks)."""
    conversion_column: str = ""
    """Optional second label (0/1, only where the label is 1): trains CTR and CVR (ESMM).
    Empty: CTR only."""
    category_column: str = ""
    """Optional item-category column (any integers or strings)."""
    user_feature_columns: tuple[str, ...] = ()
    """Optional categorical user features (pooled, one id per column and request)."""
    dense_columns: tuple[str, ...] = ()
    """Optional numeric features of the event, standardised with the training split's
    mean and standard deviation; NaN or Inf is an error."""
    split: str = "time"
    """"time": one global cutoff in time (the last ``test_fraction`` of events by time is
    test, the ``valid_fraction`` before it validation); "user": the same fractions of
    each user's own events, latest last."""
    valid_fraction: float = 0.1
    """Share of events in the validation split."""
    test_fraction: float = 0.1
    """Share of events in the test split."""
    valid_requests: int = 0
    """Score at most this many validation requests per evaluation (a fixed random
    subset); 0: all. The test split is always scored in full."""
    shuffle: bool = True
    """Visit the training requests in a fresh pseudo-random order every epoch (False:
    in time order)."""
    seed: int = 0
    """Seed of the epoch orders and of the validation subset."""
    format: str = "auto"
    """"csv", "parquet" or "auto" (by file extension)."""
    reader: str = "auto"
    """CSV parser: "pyarrow" (fast, needs pyarrow), "python" (standard library) or
    "auto" (pyarrow when installed)."""
    cache_dir: str = ""
    """Where the prepared (sorted, remapped, memory-mapped) log and its vocabulary are
    written; empty: ``<run dir>/data``. A matching preparation there is reused."""

    def __post_init__(self) -> None:
        _require_str(self, "path")
        for name in ("user_column", "item_column", "time_column", "label_column"):
            _require_str(self, name)
        for name in ("conversion_column", "category_column", "cache_dir"):
            _require_str(self, name, empty=True)
        for name in ("user_feature_columns", "dense_columns"):
            _require_names(self, name)
        _require_int(self, "max_seqlen", minimum=1)
        _require_int(self, "valid_requests", minimum=0)
        _require_int(self, "seed", minimum=0)
        _require_choice(self, "time_unit", tuple(TIME_UNITS))
        _require_choice(self, "split", SPLIT_MODES)
        _require_choice(self, "format", LOG_FORMATS)
        _require_choice(self, "reader", CSV_READERS)
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"EventLogConfig.shuffle must be a bool, got {self.shuffle!r}")
        if self.rating_threshold is not None:
            _require_float(self, "rating_threshold", low=-math.inf)
        _require_float(self, "valid_fraction", low=0.0, high=1.0)
        _require_float(self, "test_fraction", low=0.0, high=1.0)
        if self.valid_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                f"EventLogConfig.valid_fraction + test_fraction must be < 1, got "
                f"{self.valid_fraction} + {self.test_fraction}"
            )
        columns = self.columns()
        seen: set[str] = set()
        for c in columns:
            if c in seen:
                raise ValueError(f"EventLogConfig names the column {c!r} twice")
            seen.add(c)

    def columns(self) -> tuple[str, ...]:
        """Every column the reader needs, required ones first."""
        out = [self.user_column, self.item_column, self.time_column, self.label_column]
        for c in (self.conversion_column, self.category_column):
            if c:
                out.append(c)
        return (*out, *self.user_feature_columns, *self.dense_columns)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The GEM-style ranking network (see :class:`hyperrec.integration.model.GEMModel`).

    Raises:
        TypeError: a field of the wrong type (the message names ``ModelConfig.<field>``).
        ValueError: a field out of range or inconsistent with another (named likewise).
    """

    dim: int
    """Width of the sequence tower's tokens and of the attention outputs."""
    heads: int
    """Attention heads; must divide ``dim``."""
    seq_layers: int
    """HSTU-style GDPA blocks in the sequence tower (0 disables the tower)."""
    block_attention_layers: int = 0
    """How many of the *lowest* sequence layers use O(L) block attention instead of full
    causal GDPA: the cheap local layers come first, for long histories."""
    attn_block_size: int = 64
    """Tokens per block in the block-attention layers."""
    activation: str = "silu"
    """GDPA activation of the full-attention layers (one of silu, gelu, gelu_tanh, relu,
    softmax). HSTU normalisation (1/max_seqlen) applies unless it is softmax."""
    pma_queries: int = 4
    """Learned queries of the PMA pooling of each history (0 disables PMA)."""
    time_buckets: int = 16
    """Log2 buckets of the age of a history event (``floor(log2(1 + age_minutes))``)."""
    user_hash_size: int = 4096
    """Rows of the user-id table; ids are hashed into it (collisions are intended)."""
    cross_layers: int = 2
    """DCN-v2 cross layers of the interaction tower."""
    cross_rank: int = 0
    """Rank of the low-rank DCN-v2 cross matrices; 0 means full rank."""
    mlp_dims: tuple[int, ...] = (64, 32)
    """Hidden widths of the shared MLP above the interaction tower."""
    head_dims: tuple[int, ...] = (32,)
    """Hidden widths of each task head (CTR and CVR)."""
    dropout: float = 0.0
    """Dropout in the sequence tower and MLPs (its RNG state is checkpointed)."""
    embedding_dim: int = 0
    """Width of the embedding tables; 0 means ``dim``. When it differs from ``dim``, one
    linear projects the summed history-token embeddings and one the candidates' (item +
    category) query to ``dim``; the pooled sparse features enter the interaction tower at
    this width. Production rankers keep tables narrow (64-256) under a wide dense part."""

    def __post_init__(self) -> None:
        for name, minimum in (
            ("dim", 1),
            ("embedding_dim", 0),
            ("heads", 1),
            ("seq_layers", 0),
            ("block_attention_layers", 0),
            ("attn_block_size", 1),
            ("pma_queries", 0),
            ("time_buckets", 1),
            ("user_hash_size", 1),
            ("cross_layers", 0),
            ("cross_rank", 0),
        ):
            _require_int(self, name, minimum=minimum)
        if self.dim % self.heads:
            raise ValueError(
                f"ModelConfig.heads ({self.heads}) must divide ModelConfig.dim ({self.dim})"
            )
        if self.block_attention_layers > self.seq_layers:
            raise ValueError(
                f"ModelConfig.block_attention_layers ({self.block_attention_layers}) exceeds "
                f"seq_layers ({self.seq_layers})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        _require_dims(self, "mlp_dims")
        _require_dims(self, "head_dims")
        _require_float(self, "dropout", low=0.0, high=1.0)
        if self.dropout >= 1.0:
            raise ValueError(f"ModelConfig.dropout must be < 1, got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """``dim // heads``."""
        return self.dim // self.heads

    @property
    def table_dim(self) -> int:
        """Width of the embedding tables: ``embedding_dim`` or, when 0, ``dim``."""
        return self.embedding_dim or self.dim


EARLY_STOPPING_METRICS = {"ctr_auc": 1.0, "ctr_gauc": 1.0, "ctr_ne": -1.0, "loss": -1.0}
"""Validation metrics early stopping can watch, with +1 where higher is better."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation, batching (BBS), evaluation and checkpointing.

    Batch sizes are *global* (summed over data-parallel ranks) so one config means the
    same optimisation problem on any world size; each rank trains
    ``global_batch_size / (sub_batch_size * world_size)`` sub-batches per step.

    Raises:
        TypeError: a field of the wrong type (the message names ``TrainConfig.<field>``).
        ValueError: a field out of range or inconsistent with another (named likewise).
    """

    steps: int
    """Optimizer steps of the run (also the length of the LR schedule); replaced by the
    step count of ``epochs`` passes when ``epochs > 0``."""
    global_batch_size: int
    """Requests per optimizer step over all ranks; a multiple of ``sub_batch_size``."""
    sub_batch_size: int = 32
    """Requests per reader sub-batch: the unit Base Batch Shuffling moves between steps."""
    window_steps: int = 4
    """BBS window W: sub-batches of W steps are pooled and dealt heavy-with-light. A sample
    is delayed by fewer than W steps. 1 disables shuffling."""
    lr: float = 2e-3
    """Peak AdamW learning rate of the dense parameters."""
    embedding_lr: float = 1e-2
    """Peak AdamW learning rate of the embedding tables (no weight decay on them)."""
    weight_decay: float = 0.01
    """Decoupled weight decay of the dense weight matrices (not norms, biases, embeddings)."""
    warmup_steps: int = 20
    """Linear warm-up steps, followed by cosine decay to 10% of the peak."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    epochs: int = 0
    """Passes over a finite training split (an event log); 0: train ``steps`` steps. The
    run then takes ``ceil(epochs * train_requests / global_batch_size)`` steps (the last
    step may reach into the next pass by less than one batch)."""
    eval_every: int = 0
    """Evaluate on the validation split every this many steps (0: only at the end). The
    test split is scored once, at the end of the run."""
    early_stopping_patience: int = 0
    """Stop when this many validation evaluations in a row did not improve on the best
    ``early_stopping_metric`` (0: never stop early)."""
    early_stopping_metric: str = "ctr_auc"
    """Validation metric of early stopping: "ctr_auc", "ctr_gauc" (higher is better),
    "ctr_ne" or "loss" (lower is better)."""
    nonfinite: str = "stop"
    """Policy for a step whose loss or gradient norm is NaN or Inf: "stop" raises
    :class:`~hyperrec.integration.faults.NonFiniteError` naming the step, the ranks and
    the first module (in backward order) with a non-finite gradient; "skip" drops that
    step's update (its batch is consumed), records the same report and goes on."""
    baseline_requests: int = 65536
    """Training requests the logistic-regression baseline is fitted on at the end (the
    first ones the run trained; 0 disables that baseline). Regenerating them dominates
    its cost, which grows with the history length: the ``h200`` and ``gem`` presets use
    8,192 and 4,096 (seconds on one CPU core), and the ablation rows 0."""
    ckpt_every: int = 0
    """Write a DCP checkpoint every this many steps (0: never)."""
    log_every: int = 1
    """Record train metrics (loss, AUC over recent steps, samples/s) every this many steps."""
    auc_window: int = 20
    """Training AUC is computed over the predictions of the last ``auc_window`` steps."""
    amp: str = "auto"
    """Autocast dtype: "auto" (bf16 on CUDA, off on CPU), "bf16" or "off"."""
    validate_inputs: bool = True
    """Check every batch (offsets, id ranges, NaN, the history cap) once where it is built,
    on the CPU before the copy to the device; the model itself never validates (its
    attention calls pass ``validate=False``), so the device step needs no host sync."""
    cpu_threads: int = 0
    """Intra-op threads per process when training on the CPU (0: PyTorch's default). Small
    models run many tiny ops whose threading overhead exceeds the gain, and one thread
    per process keeps several ranks (or a busy machine) from oversubscribing the cores."""
    seed: int = 0
    """Seed of parameter initialisation and dropout."""
    sharding: str = "hyperrec"
    """Data-parallel sharding on several ranks: "hyperrec" (``hyperrec.parallel5d``'s
    zero-copy ``fully_shard``) or "fsdp2" (PyTorch's ``fully_shard``), same units. Applied
    whenever a process group exists, also with one rank (the single-GPU ablation)."""

    # -- the compute path and its speed switches (README: "Performance") ---------------
    impl: str = "hyperrec"
    """Attention implementation: "hyperrec" (``hyperrec.jagged_attn`` on unpadded jagged
    tokens) or "naive" (the same math as a user without hyperrec writes it: padded
    ``scaled_dot_product_attention`` with masks, the HSTU SiLU attention in plain PyTorch
    on padded tensors). The naive path is the baseline of every speed claim."""
    fused_embeddings: bool = False
    """Keep every embedding table in one concatenated weight and look up all sparse
    features of a step with one ``embedding_bag`` (the history tokens' four ids summed
    inside it). Same function as separate tables; a different parameter layout."""
    compile: str = "off"
    """``torch.compile`` the small-op regions (LayerNorms, SiLU, gating, the DCN):
    "off", "inductor", "inductor_autotune" (Inductor's GEMM autotuning: it times cuBLAS
    against Triton GEMM templates, which can take the SiLU or residual add as an epilogue;
    longer compilation) or "aot_eager" (graph capture without code generation; tests)."""
    compile_scope: str = "regions"
    """What ``compile`` compiles in each sequence layer: "regions" (the two small-op
    regions around the attention, which runs eagerly between them) or "layers" (the whole
    layer as one graph, the attention as an opaque op inside it: the compiler then also
    fuses across the attention, e.g. the residual gradient's sum into the layer norm's
    backward). No effect with ``compile="off"`` or ``impl="naive"``."""
    mlp_precision: str = "bf16"
    """"mxfp8": the interaction MLP's large linears become ``hyperrec.mxfp8.MXLinear`` (the
    128-block Hopper recipe, chosen by a ``PrecisionPolicy``); "bf16": ``nn.Linear``."""
    optimizer_impl: str = "foreach"
    """AdamW kernels: "foreach" (PyTorch's default) or "fused" (one kernel per parameter
    group, no full-size temporaries)."""
    data_workers: int = 0
    """Worker processes that build batches ahead of the step (0: in the training loop).
    On CUDA batches are pinned and copied on a side stream in either case."""
    prefetch_batches: int = 2
    """Batches each data worker keeps ready (with ``data_workers > 0``)."""
    activation_checkpointing: str = "off"
    """"off" or "autoac": ``hyperrec.autoac`` plans, per sequence layer (each
    ``SequenceBlock`` is a region; more with ``ac_regions``), what to keep, recompute or
    keep quantized so that a training step's peak memory stays within ``ac_budget_gb``,
    from one profiled step of the heaviest of the first steps' batches; the plan is
    checkpointed with the run."""
    ac_budget_gb: float = 0.0
    """Peak-memory budget of a training step for autoac, in GB (1e9 bytes); 0 means 90% of
    the GPU's memory (a CPU run needs an explicit budget)."""
    ac_layer_budgets_gb: tuple[float, ...] = ()
    """Per sequence layer, the bytes (GB) it may hold from forward to backward (autoac's
    region budgets; 0: no bound of its own); empty, or one entry per layer."""
    ac_formats: tuple[str, ...] = ()
    """Packed formats autoac may keep saved activations in (``mxfp8``, ``fp8_e4m3``,
    ``fp8_e5m2``, ``mx4``, ``mxint8``), each only where its measured gradient error is
    within autoac's bound; empty: keep or recompute only. With ``compile`` only
    ``mxint8``: autoac then compiles each sequence layer itself with the packing traced
    into its graphs (``hyperrec.autoac``'s compiled packing; the trainer raises where the
    installed torch cannot inline it). Without ``compile`` packed layers run eagerly."""
    ac_regions: str = "layers"
    """autoac's regions: "layers" (each ``SequenceBlock``) or "all" (those and every
    other module the forward calls once per step: pooling, candidate attention, cross
    network, MLP, heads; ``GEMModel.ONCE_PER_STEP``), whose saves can then be packed or
    recomputed too. "all" needs ``compile="off"`` (the model's compiled regions and
    autoac's would overlap)."""
    ac_strategy: str = "fastest"
    """autoac's ``PlanConfig.strategy``: "fastest" (the plan that adds the least time
    within ``ac_budget_gb``) or "pack_all" (no layer recomputed, every saved activation
    kept in the first of ``ac_formats`` its class passed autoac's gradient-error bound:
    what packing alone saves; needs ``ac_formats``; ``ac_budget_gb`` 0 means no budget,
    one given must hold the packed step)."""
    ac_pack_inputs: bool = True
    """autoac's ``PlanConfig.pack_inputs``: an un-checkpointed region may pack the inputs
    its ops save (a layer's input, the previous layer's output) where autoac's profile
    shows no other holder of them; False keeps them as given (autoac before 0.1.18)."""
    attention_precision: str = "bf16"
    """"bf16", "fp8", "mxfp8" or "fp8_bwd": the sequence tower's attention through
    ``hyperrec.jagged_attn``'s ``precision=`` path (FP8 forward with block-quantized Q/K/V
    and P quantized online; the backward stays bf16, except "fp8_bwd": the FP8 forward
    and ``FP8Config(backward="fp8")``, FP8 operands in the backward too, about 24 dB
    gradient SNR). "mxfp8" is emulated on Hopper (MX scales applied to bf16 operands:
    slower than bf16). "fp8_fused": "fp8" with the SiLU-attention (GDPA) layers' Q/K/V
    quantized in the epilogue of their input projection
    (``hyperrec.jagged_attn.linear_quantize_qkv``) instead of a second pass; the block
    (softmax) layers quantize as "fp8" does, since their key smoothing needs every key
    first. Needs ``compile_scope="regions"`` and ``seq_linear_precision="bf16"``.
    Needs ``impl="hyperrec"``."""
    seq_linear_precision: str = "bf16"
    """"bf16" or "fp8": the sequence layers' two projections through
    ``hyperrec.mxfp8.rowwise_linear`` (row-wise scaled E4M3, fp32 accumulation): the
    input projection's forward GEMM, and the output projection's forward and dgrad GEMMs;
    the weight gradients stay bf16. Inside the compiled regions (``compile``) the
    quantization fuses into the layer norms and the gate. The input projection's dgrad
    stays bf16 because its row scale would need a second pass over the SiLU backward
    (measured slower on the H200). Needs ``impl="hyperrec"`` and a width divisible by 16."""
    residual_dtype: str = "float32"
    """The sequence tower's residual stream under autocast: "float32" (the token norm's
    output is float32, as CUDA autocast's layer norms return it anyway; on a CPU, where
    autocast's norms return bf16, it is cast) or "autocast" (the autocast dtype, bf16:
    the token norm's output is cast once and the residual adds stay bf16, halving the
    bytes of every norm input, residual add and residual gradient). No effect without
    autocast."""
    row_buckets: int = 0
    """Pad each step's history-token and candidate counts up to one of ``row_buckets``
    sizes per power of two (a power of two; 0: off; no effect with ``impl="naive"``, which
    pads every sequence to the longest), with rows
    that no real row reads and whose outputs are dropped: the same outputs and gradients,
    at most ``1 / row_buckets`` more rows. Jagged batches give the GEMMs a new row count
    every step, and a cuBLAS call on an unseen shape pays a heuristic query on the host
    (~115 us on an H200 against ~25 us cached); bucketed counts repeat. Useful FLOPs (MFU)
    count the real rows only."""
    mesh: str = "auto"
    """The device mesh: "5d" (``hyperrec.parallel5d.ParallelMesh``: the dense modules are
    sharded on its dense mesh, ``replicate x fsdp``, the sharded tables on its sparse mesh;
    built on any world size, a process group of one rank is created when there is none),
    "flat" (one data-parallel axis over every rank, for comparison) or "auto" ("5d" when a
    process group exists, e.g. under ``torchrun``; nothing is sharded in a plain single
    process)."""
    mesh_replicate: int = 0
    """Dense replicas of the 5-D mesh (HSDP's outer axis); 0: inferred (FSDP inside a
    zone of ``HYPERREC_HOSTS_PER_ZONE`` hosts, replicas across zones)."""
    sparse_replicate: int = 0
    """Ranks of the 5-D mesh's ``sparse_replicate`` axis: consecutive ranks (one host's
    GPUs) between which the sharded tables' lookups take their first, NVLink hop; 0: the
    GPUs per host (``LOCAL_WORLD_SIZE``)."""
    sparse: str = "auto"
    """Where the item, category, user and tag tables live: "dense" (parameters of the
    model, sharded by ``fully_shard`` like any matrix, dense gradients), "sharded"
    (``hyperrec.parallel5d.ShardedEmbeddingCollection``: every row and its optimizer
    state on one rank, lazy row-wise updates, no dense gradient) or "auto" (sharded on more
    than one rank and on a GPU, dense on a single CPU process). The action and time-bucket
    tables (a few rows) stay dense. Sharded tables take no part in gradient clipping."""
    embedding_optimizer: str = "auto"
    """The tables' optimizer: dense tables "adamw" (default) or "adagrad"; sharded tables
    "rowwise_adagrad" (default: FBGEMM's exact row-wise Adagrad), "adagrad" or "adam"
    (lazy). "auto" picks the default of the placement. Learning rate ``embedding_lr``,
    with the warm-up/cosine schedule. On the ``tiny`` preset (CPU, 500 steps) row-wise
    Adagrad reached a lower held-out AUC than AdamW on dense tables (0.009-0.013 CTR),
    "adam" the same within 0.0025 (integration README)."""

    def __post_init__(self) -> None:
        if self.sharding not in ("hyperrec", "fsdp2"):
            raise ValueError(
                f"TrainConfig.sharding must be 'hyperrec' or 'fsdp2', got {self.sharding!r}"
            )
        for name, choices in (
            ("impl", IMPLS),
            ("compile", COMPILE_MODES),
            ("compile_scope", COMPILE_SCOPES),
            ("mlp_precision", MLP_PRECISIONS),
            ("optimizer_impl", OPTIMIZER_IMPLS),
            ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
            ("attention_precision", ATTENTION_PRECISIONS),
            ("seq_linear_precision", SEQ_LINEAR_PRECISIONS),
            ("residual_dtype", RESIDUAL_DTYPES),
            ("mesh", MESHES),
            ("sparse", SPARSE_PLACEMENTS),
            ("embedding_optimizer", EMBEDDING_OPTIMIZERS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"TrainConfig.{name} must be one of {choices}, got {value!r}")
            if (name, value) in NOT_AVAILABLE:
                raise ValueError(
                    f"TrainConfig.{name}={value!r} is not available yet: it needs "
                    f"{NOT_AVAILABLE[name, value]}, which this release does not integrate"
                )
        if self.impl == "naive" and self.attention_precision != "bf16":
            raise ValueError(
                f"TrainConfig.attention_precision={self.attention_precision!r} needs "
                "impl='hyperrec': the naive padded attention has no low-precision path"
            )
        if self.attention_precision == "fp8_fused" and (
            self.compile_scope != "regions" or self.seq_linear_precision != "bf16"
        ):
            raise ValueError(
                "TrainConfig.attention_precision='fp8_fused' needs compile_scope='regions' "
                "and seq_linear_precision='bf16' (the fused projection is its own bf16 "
                f"kernel), got compile_scope={self.compile_scope!r}, "
                f"seq_linear_precision={self.seq_linear_precision!r}"
            )
        if self.impl == "naive" and self.seq_linear_precision != "bf16":
            raise ValueError(
                f"TrainConfig.seq_linear_precision={self.seq_linear_precision!r} needs "
                "impl='hyperrec': the naive baseline runs its linears in bf16"
            )
        _require_int(self, "row_buckets", minimum=0)
        if self.row_buckets & (self.row_buckets - 1):
            raise ValueError(
                f"TrainConfig.row_buckets must be 0 or a power of two, got {self.row_buckets}"
            )
        if not isinstance(self.fused_embeddings, bool):
            raise TypeError(
                f"TrainConfig.fused_embeddings must be a bool, got {self.fused_embeddings!r}"
            )
        for name, minimum in (
            ("steps", 1),
            ("global_batch_size", 1),
            ("sub_batch_size", 1),
            ("window_steps", 1),
            ("warmup_steps", 0),
            ("epochs", 0),
            ("eval_every", 0),
            ("early_stopping_patience", 0),
            ("baseline_requests", 0),
            ("ckpt_every", 0),
            ("log_every", 1),
            ("auc_window", 1),
            ("data_workers", 0),
            ("prefetch_batches", 1),
            ("mesh_replicate", 0),
            ("sparse_replicate", 0),
        ):
            _require_int(self, name, minimum=minimum)
        _require_int(self, "seed", minimum=0, maximum=MAX_SEED)
        _require_int(self, "cpu_threads", minimum=0, maximum=MAX_CPU_THREADS)
        self._check_tables_and_ac()
        if self.global_batch_size % self.sub_batch_size:
            raise ValueError(
                f"TrainConfig.global_batch_size ({self.global_batch_size}) must be a multiple "
                f"of sub_batch_size ({self.sub_batch_size})"
            )
        for name in ("lr", "embedding_lr"):
            _require_float(self, name, low=0.0, high=10.0, open_low=True)
        _require_float(self, "weight_decay", low=0.0, high=1.0)
        _require_float(self, "grad_clip", low=0.0)
        _require_choice(self, "early_stopping_metric", tuple(EARLY_STOPPING_METRICS))
        _require_choice(self, "nonfinite", ("stop", "skip"))
        if self.amp not in ("auto", "bf16", "off"):
            raise ValueError(f"TrainConfig.amp must be 'auto', 'bf16' or 'off', got {self.amp!r}")
        if not isinstance(self.validate_inputs, bool):
            raise TypeError(
                f"TrainConfig.validate_inputs must be a bool, got {self.validate_inputs!r}"
            )
        if not isinstance(self.ac_pack_inputs, bool):
            raise TypeError(
                f"TrainConfig.ac_pack_inputs must be a bool, got {self.ac_pack_inputs!r}"
            )

    def _check_tables_and_ac(self) -> None:
        opt = self.embedding_optimizer
        for placement, allowed in (
            ("dense", DENSE_TABLE_OPTIMIZERS),
            ("sharded", SHARDED_TABLE_OPTIMIZERS),
        ):
            if self.sparse == placement and opt != "auto" and opt not in allowed:
                raise ValueError(
                    f"TrainConfig.embedding_optimizer={opt!r} does not train "
                    f"TrainConfig.sparse={placement!r} tables: choose one of {allowed} or 'auto'"
                )
        if self.sparse == "auto" and opt not in ("auto", "adagrad"):
            raise ValueError(
                f"TrainConfig.embedding_optimizer={opt!r} needs an explicit TrainConfig.sparse "
                "('dense' or 'sharded'): with 'auto' only 'auto' or 'adagrad' (both exist for "
                "either placement) are allowed"
            )
        _require_float(self, "ac_budget_gb", low=0.0)
        _require_float_tuple(self, "ac_layer_budgets_gb")
        if not isinstance(self.ac_formats, tuple) or not all(
            isinstance(f, str) for f in self.ac_formats
        ):
            raise TypeError(
                f"TrainConfig.ac_formats must be a tuple of strings, got {self.ac_formats!r}"
            )
        bad = [f for f in self.ac_formats if f not in AC_FORMATS]
        if bad:
            raise ValueError(f"TrainConfig.ac_formats must hold names from {AC_FORMATS}, got {bad}")
        if self.ac_regions not in AC_REGIONS:
            raise ValueError(
                f"TrainConfig.ac_regions must be one of {AC_REGIONS}, got {self.ac_regions!r}"
            )
        if self.ac_regions == "all" and self.compile != "off":
            raise ValueError(
                f"TrainConfig.ac_regions='all' needs TrainConfig.compile='off', got "
                f"{self.compile!r}: the model's compiled regions and autoac's would overlap"
            )
        if self.ac_strategy not in AC_STRATEGIES:
            raise ValueError(
                f"TrainConfig.ac_strategy must be one of {AC_STRATEGIES}, got {self.ac_strategy!r}"
            )
        if self.ac_strategy == "pack_all" and not self.ac_formats:
            raise ValueError(
                "TrainConfig.ac_strategy='pack_all' needs TrainConfig.ac_formats (the formats "
                "to pack in), got ()"
            )
        eager_only = [f for f in self.ac_formats if f != "mxint8"]
        if eager_only and self.compile != "off":
            raise ValueError(
                f"TrainConfig.ac_formats={self.ac_formats!r} with TrainConfig.compile="
                f"{self.compile!r}: only 'mxint8' is packed inside compiled graphs; "
                f"{eager_only} need TrainConfig.compile='off'"
            )

    def sub_batches_per_rank(self, world_size: int) -> int:
        """Sub-batches each of ``world_size`` ranks trains per step.

        Raises:
            TypeError: ``world_size`` is not an int.
            ValueError: the global batch does not split into whole sub-batches per rank.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        per_step = self.global_batch_size // self.sub_batch_size
        if world_size < 1 or per_step % world_size:
            raise ValueError(
                f"TrainConfig.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"sub_batch_size * world_size ({self.sub_batch_size} * {world_size})"
            )
        return per_step // world_size


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named, complete run description.

    Raises:
        TypeError: ``name``/``description`` not strings, or a section of the wrong type.
        ValueError: sections that contradict each other.
    """

    name: str
    """Short name (used in the default output directory)."""
    data: DataConfig | EventLogConfig
    """The data source: the synthetic generator or an event log on disk."""
    model: ModelConfig
    """The network."""
    train: TrainConfig
    """Optimisation, batching and checkpointing."""
    description: str = ""
    """One line for ``--help`` and the README."""

    def __post_init__(self) -> None:
        for name in ("name", "description"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Preset.{name} must be a str, got {getattr(self, name)!r}")
        if not isinstance(self.data, (DataConfig, EventLogConfig)):
            raise TypeError(
                f"Preset.data must be a DataConfig or an EventLogConfig, got "
                f"{type(self.data).__name__}"
            )
        for name, cls in (("model", ModelConfig), ("train", TrainConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"Preset.{name} must be a {cls.__name__}")
        budgets = self.train.ac_layer_budgets_gb
        if budgets and len(budgets) != self.model.seq_layers:
            raise ValueError(
                f"TrainConfig.ac_layer_budgets_gb must be empty or hold one entry per sequence "
                f"layer ({self.model.seq_layers}), got {len(budgets)}"
            )
        check_model_fits(self.model, self.data.max_seqlen, type(self.data).__name__)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``data["source"]`` names the data source)."""
        out = dataclasses.asdict(self)
        is_log = isinstance(self.data, EventLogConfig)
        out["data"]["source"] = "event_log" if is_log else "synthetic"
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preset:
        """The preset :meth:`to_dict` described (as read back from JSON).

        Raises:
            ValueError / TypeError: a missing section, an unknown field or data source, or
                a bad value (a ``name`` or ``description`` that is not a str included).
        """
        if not isinstance(d, dict):
            raise TypeError(f"a preset dict must be a dict, got {type(d).__name__}")
        for section in ("data", "model", "train"):
            if not isinstance(d.get(section), dict):
                raise ValueError(f"a preset dict needs a {section!r} section")
        data = dict(d["data"])
        source = data.pop("source", "event_log" if "path" in data else "synthetic")
        if source not in ("synthetic", "event_log"):
            # Anything else used to build the synthetic generator without a word.
            raise ValueError(
                f"a preset dict's data.source must be 'synthetic' or 'event_log', got {source!r}"
            )
        data_cls = EventLogConfig if source == "event_log" else DataConfig
        return cls(
            name=d.get("name", "preset"),
            description=d.get("description", ""),
            data=_build(data_cls, data),
            model=_build(ModelConfig, d["model"]),
            train=_build(TrainConfig, d["train"]),
        )


def check_model_fits(model: ModelConfig, max_seqlen: int, where: str = "DataSchema") -> None:
    """Check ``model`` against the history cap ``max_seqlen`` of its data.

    Raises:
        ValueError: block attention with blocks longer than the longest history.
    """
    if model.block_attention_layers and model.attn_block_size > max_seqlen:
        raise ValueError(
            f"ModelConfig.attn_block_size ({model.attn_block_size}) exceeds "
            f"{where}.max_seqlen ({max_seqlen}): block attention would be full"
        )


def _build(cls: Any, values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}")
    kw = {}
    for name, value in values.items():
        if isinstance(value, list) and str(fields[name].type).startswith("tuple"):
            value = tuple(value)
        kw[name] = value
    return cls(**kw)


def micro() -> Preset:
    """The test suite's size: one sequence layer, 16-token histories, seconds per run."""
    return Preset(
        name="micro",
        description="test size: seconds per run on one core",
        data=DataConfig(
            num_items=512,
            num_topics=16,
            num_users=256,
            max_seqlen=16,
            seqlen_scale=4.0,
            eval_requests=1024,
        ),
        model=ModelConfig(
            dim=16,
            heads=2,
            seq_layers=1,
            pma_queries=2,
            time_buckets=8,
            user_hash_size=256,
            cross_layers=1,
            mlp_dims=(32,),
            head_dims=(16,),
        ),
        train=TrainConfig(
            steps=40,
            global_batch_size=64,
            sub_batch_size=16,
            window_steps=2,
            warmup_steps=4,
            lr=3e-3,
            embedding_lr=2e-2,
            auc_window=10,
            cpu_threads=1,
        ),
    )


def tiny() -> Preset:
    """The default CPU run: about a minute on two cores, clearly beats popularity."""
    return Preset(
        name="tiny",
        description="default CPU run, about a minute on two cores",
        data=DataConfig(
            num_items=4096,
            num_topics=32,
            num_users=4096,
            max_seqlen=64,
            eval_requests=4096,
        ),
        model=ModelConfig(
            dim=32,
            heads=2,
            seq_layers=2,
            block_attention_layers=1,
            attn_block_size=16,
            pma_queries=4,
            time_buckets=16,
            user_hash_size=2048,
            cross_layers=2,
            mlp_dims=(64, 32),
            head_dims=(32,),
        ),
        train=TrainConfig(
            steps=500,
            global_batch_size=128,
            sub_batch_size=32,
            window_steps=4,
            lr=3e-3,
            embedding_lr=2e-2,
            warmup_steps=20,
            eval_every=250,
            ckpt_every=250,
            log_every=1,
            cpu_threads=1,
        ),
    )


def small() -> Preset:
    """Realistic proportions at single-GPU scale (or a long many-core CPU run)."""
    return Preset(
        name="small",
        description="single-GPU smoke run with realistic proportions",
        data=DataConfig(
            num_items=1_048_576,
            num_topics=1024,
            num_users=1_000_000,
            max_seqlen=512,
            min_seqlen=4,
            seqlen_scale=32.0,
            seqlen_alpha=1.3,
            max_candidates=8,
            max_user_tags=8,
            latent_dim=32,
            eval_requests=32768,
        ),
        model=ModelConfig(
            dim=128,
            heads=4,
            seq_layers=4,
            block_attention_layers=2,
            attn_block_size=64,
            pma_queries=8,
            time_buckets=24,
            user_hash_size=262_144,
            cross_layers=3,
            cross_rank=64,
            mlp_dims=(512, 256),
            head_dims=(128,),
            dropout=0.1,
        ),
        train=TrainConfig(
            steps=5000,
            global_batch_size=1024,
            sub_batch_size=128,
            window_steps=8,
            lr=1e-3,
            embedding_lr=5e-3,
            warmup_steps=200,
            eval_every=1000,
            ckpt_every=1000,
            log_every=10,
            auc_window=50,
        ),
    )


def h200() -> Preset:
    """Sized to fill one H200 (141 GB); see the README for the memory estimate."""
    return Preset(
        name="h200",
        description="fills one H200: 2.7B parameters, 4k-token histories",
        data=DataConfig(
            num_items=8_388_608,
            num_topics=4096,
            num_users=50_000_000,
            max_seqlen=4096,
            min_seqlen=16,
            seqlen_scale=256.0,
            seqlen_alpha=1.5,
            max_candidates=16,
            max_user_tags=16,
            latent_dim=64,
            eval_requests=65536,
        ),
        model=ModelConfig(
            dim=256,
            heads=4,
            seq_layers=8,
            block_attention_layers=4,
            attn_block_size=128,
            pma_queries=16,
            time_buckets=32,
            user_hash_size=2_097_152,
            cross_layers=4,
            cross_rank=256,
            mlp_dims=(2048, 1024, 512),
            head_dims=(256,),
            dropout=0.1,
        ),
        train=TrainConfig(
            steps=20000,
            global_batch_size=2048,
            sub_batch_size=128,
            window_steps=8,
            lr=1e-3,
            embedding_lr=5e-3,
            warmup_steps=500,
            eval_every=2000,
            ckpt_every=2000,
            log_every=20,
            auc_window=50,
            validate_inputs=False,
            # The end-of-run logistic baseline regenerates its requests on the CPU, and
            # 4k-event histories dominate that: 8,192 requests keep it to seconds.
            baseline_requests=8192,
        ),
    )


def gem() -> Preset:
    """A production-shaped ranker on one H200, every available speed switch on.

    Dense part as a GEM-style ranker's per GPU: width 1024, 8 heads of 128, 12 HSTU
    layers (the lowest 4 block attention), power-law histories of mean ~800 and up to
    8,192 events, 16 PMA queries, candidate cross attention, 3 low-rank DCN layers over a
    4,096-wide feature vector and a 4,096-wide MLP. Tables are 256 wide (2.7 B parameters)
    under the 1024-wide tower. See ``estimate_memory`` for the fit on 141 GB.
    """
    return Preset(
        name="gem",
        description="GEM-scale dense part on one H200: d=1024, 12 layers, 8k histories",
        data=DataConfig(
            num_items=8_388_608,
            num_topics=4096,
            num_users=50_000_000,
            max_seqlen=8192,
            min_seqlen=32,
            seqlen_scale=512.0,
            seqlen_alpha=1.5,
            max_candidates=32,
            max_user_tags=16,
            latent_dim=64,
            eval_requests=16384,
        ),
        model=ModelConfig(
            dim=1024,
            heads=8,
            seq_layers=12,
            block_attention_layers=4,
            attn_block_size=128,
            pma_queries=16,
            time_buckets=32,
            user_hash_size=2_097_152,
            embedding_dim=256,
            cross_layers=3,
            cross_rank=512,
            mlp_dims=(4096, 4096, 1024),
            head_dims=(256,),
            dropout=0.0,
        ),
        train=TrainConfig(
            steps=20000,
            global_batch_size=128,
            sub_batch_size=16,
            window_steps=8,
            lr=1e-3,
            embedding_lr=5e-3,
            warmup_steps=500,
            eval_every=2000,
            ckpt_every=2000,
            log_every=20,
            auc_window=50,
            impl="hyperrec",
            fused_embeddings=True,
            compile="inductor",
            mlp_precision="mxfp8",
            optimizer_impl="fused",
            row_buckets=64,
            # bf16 residual stream: 2.5% faster step on the H200, held-out AUC equal within
            # 0.0006 in a CPU autocast run (integration README, "A bf16 residual stream").
            residual_dtype="autocast",
            data_workers=8,
            # As h200's: histories of mean ~800 events make each request costly to
            # regenerate for the end-of-run logistic baseline; 4,096 keep it to seconds.
            baseline_requests=4096,
        ),
    )


PRESETS: dict[str, typing.Callable[[], Preset]] = {
    "micro": micro,
    "tiny": tiny,
    "small": small,
    "h200": h200,
    "gem": gem,
}
"""Preset name -> a function building it (configs as code)."""


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: unknown name (the message lists the known ones).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a preset name (a str), got {type(name).__name__}")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def _parse_value(raw: str, annotation: Any, where: str) -> Any:
    if annotation in (bool, "bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected a bool, got {raw!r}")
    if annotation in (int, "int"):
        try:
            # Python's own grammar: "1_000" is 1000, but "_1_0_" or "1__0" are refused
            # (removing every "_" first read them as 10).
            return int(raw)
        except ValueError:
            raise ValueError(f"{where}: expected an int, got {raw!r}") from None
    if annotation in (float, "float"):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {raw!r}") from None
    if annotation in ("tuple[int, ...]", "tuple[float, ...]", "tuple[str, ...]"):
        # "" is the empty tuple; otherwise every entry must be there ("64,,32" used to
        # drop the missing one without a word).
        items = [v.strip() for v in raw.split(",")]
        if items == [""]:
            return ()
        if "" in items:
            raise ValueError(f"{where}: an empty entry in the comma-separated {raw!r}")
        kind = annotation[len("tuple[") : -len(", ...]")]
        if kind == "str":
            return tuple(items)
        try:
            return tuple(int(v) if kind == "int" else float(v) for v in items)
        except ValueError:
            what = "ints" if kind == "int" else "numbers"
            raise ValueError(f"{where}: expected comma-separated {what}, got {raw!r}") from None
    if annotation in ("float | None",):
        if raw.lower() in ("", "none"):
            return None
        return _parse_value(raw, float, where)
    return raw


def override(preset: Preset, assignments: list[str] | tuple[str, ...]) -> Preset:
    """Apply ``"section.field=value"`` strings (``section`` in data/model/train).

    Example: ``override(tiny(), ["model.dim=64", "train.steps=50", "model.mlp_dims=128,64"])``.
    The result is re-validated.

    Raises:
        TypeError: ``preset`` is not a :class:`Preset`, ``assignments`` not a list of
            strings (a single string is refused: it would be read character by
            character), or a value of the wrong type for its field.
        ValueError: malformed assignment, unknown section or field, a field assigned
            twice, or an invalid value.
    """
    if not isinstance(preset, Preset):
        raise TypeError(f"preset must be a Preset, got {type(preset).__name__}")
    if isinstance(assignments, str) or not isinstance(assignments, list | tuple):
        raise TypeError(
            f"assignments must be a list of 'section.field=value' strings, got {assignments!r}"
        )
    for item in assignments:
        if not isinstance(item, str):
            raise TypeError(f"assignments must hold strings, got {type(item).__name__} {item!r}")
    sections: dict[str, dict[str, Any]] = {"data": {}, "model": {}, "train": {}}
    for item in assignments:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"override {item!r} must look like 'section.field=value'")
        if section not in sections:
            raise ValueError(f"override {item!r}: section must be one of {sorted(sections)}")
        cfg = getattr(preset, section)
        fields = {f.name: f for f in dataclasses.fields(cfg)}
        if name not in fields:
            raise ValueError(
                f"override {item!r}: {type(cfg).__name__} has no field {name!r} "
                f"(fields: {', '.join(sorted(fields))})"
            )
        if name in sections[section]:
            # The earlier value would be dropped without a word.
            raise ValueError(f"override {item!r}: {section}.{name} is assigned twice")
        sections[section][name] = _parse_value(raw.strip(), fields[name].type, key)
    return dataclasses.replace(
        preset,
        **{s: dataclasses.replace(getattr(preset, s), **kw) for s, kw in sections.items() if kw},
    )
