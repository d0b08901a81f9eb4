"""The data-source protocol, the jagged :class:`Batch`, and the synthetic generator.

**The protocol** (:class:`DataSource`): what the trainer calls to get data. A source
serves *requests* (one user, that user's jagged history, one or more candidate items
with labels) by split and index: ``batch(split, ids)`` for any ids, in any order, on any
rank, the same every time. Random access is what lets ranks read disjoint shards
without communicating, Base Batch Shuffling plan steps from ``history_lengths`` alone,
and a resumed run replay exactly what it would have read. Two sources implement it:
:class:`SyntheticRecsysData` below and
:class:`~hyperrec.integration.eventlog.EventLogSource` (CSV / Parquet interaction logs).

**The generator**: each sample is a *request*: a user, that user's history of events
(item, action, timestamp; jagged, power-law length) and 1 to ``max_candidates``
candidate items with a click label and a conversion label. Labels come from a fixed
hidden model in which personalisation dominates, so a model that reads the history
beats item popularity:
Determinism: every random quantity is a counter-based hash of ``(seed, split, field,
sample index, position)`` (splitmix64), so any sample can be regenerated alone, in any
batch composition, on any rank, with no state and no communication. This is what
makes resume exact and lets ranks generate their own shards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from hyperrec.integration.config import ACTIONS, DENSE_FEATURES, DataConfig, DataSchema

__all__ = [
    "ACTIONS",
    "DENSE_FEATURES",
    "EVAL",
    "SPLITS",
    "TEST",
    "TRAIN",
    "VALID",
    "Batch",
    "DataSource",
    "SyntheticRecsysData",
]

TRAIN = 0
"""Split id of the training requests."""
VALID = 1
"""Split id of the validation requests (scored every ``eval_every`` steps)."""
EVAL = VALID
"""The validation split's former name (the generator's held-out set)."""
TEST = 2
"""Split id of the test requests (scored once, at the end of a run)."""
SPLITS = {TRAIN: "train", VALID: "validation", TEST: "test"}
"""Split id -> name."""


@runtime_checkable
class DataSource(Protocol):
    """What the trainer needs from a data source (a structural type: no base class).

    Requests are addressed by ``(split, index)``, ``split`` in :data:`SPLITS` and
    ``0 <= index < num_requests(split)``. Every method must be deterministic: the same
    ids give the same :class:`Batch` on every call, rank and process. The trainer owns
    the *position* in the data (the epoch, the next sub-batch of every rank, the Base
    Batch Shuffling window); it checkpoints that with the model, so a resumed run
    continues with exactly the requests an uninterrupted one would have read, for any
    source. A source's own :meth:`state_dict` identifies its data, so that resuming
    against other data fails instead of silently training on it.
    """

    @property
    def schema(self) -> DataSchema:
        """Vocabulary sizes, dense width, history cap and tasks (the model is built from it)."""
        ...

    def num_requests(self, split: int) -> int | None:
        """Requests in ``split``; ``None`` for an endless training stream."""
        ...

    def history_lengths(self, split: int, ids: np.ndarray) -> np.ndarray:
        """int64 [len(ids)] history lengths (cheap: Base Batch Shuffling costs steps by them)."""
        ...

    def batch(self, split: int, ids: np.ndarray) -> Batch:
        """The requests ``ids`` of ``split`` as one CPU :class:`Batch` (``sample_ids = ids``)."""
        ...

    def truth(self, split: int, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """True (P(click), P(conversion | click)) per candidate where the source knows them
        (a generator), else ``None``: the ground-truth row is reported only when it exists."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What identifies this source's data (picklable); saved with every checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check (or restore) a state saved by :meth:`state_dict`.

        Raises:
            ValueError: the state describes other data.
        """
        ...


_ACTION_WEIGHT = np.array([0.5, 1.0, 2.0, -1.0])
# Events on a topic the user likes are clicked/converted more and skipped less; this
# is what makes the action feature informative.
_ACTION_P_LIKED = np.array([0.35, 0.40, 0.15, 0.10])
_ACTION_P_OTHER = np.array([0.55, 0.12, 0.03, 0.30])

_EPOCH = 1_700_000_000  # request timestamps start here (seconds)
_SECONDS_PER_REQUEST = 7
_RECENCY_S = 3600.0
_NOISE_ROWS = 65536  # item-latent noise comes from a fixed table: O(1) memory in num_items

# Stream tags: each random field draws from its own hash stream.
(
    _S_USER,
    _S_SESSION,
    _S_SESSION_FAV,
    _S_SESSION_TOPIC,
    _S_LENGTH,
    _S_TIME,
    _S_H_CHOICE,
    _S_H_FAV,
    _S_H_TOPIC,
    _S_H_ITEM,
    _S_H_GAP,
    _S_H_ACTION,
    _S_NCAND,
    _S_C_CHOICE,
    _S_C_FAV,
    _S_C_TOPIC,
    _S_C_ITEM,
    _S_C_NOISE,
    _S_C_CLICK,
    _S_C_CVR_NOISE,
    _S_C_CONV,
    _S_NTAGS,
    _S_TAG_CHOICE,
    _S_TAG_FAV,
    _S_TAG_TOPIC,
    _S_USER_CTR,
    _E_USER_FAV,
    _E_USER_BIAS,
    _E_ITEM_BIAS,
    _E_ITEM_CVR_BIAS,
    _E_ITEM_NOISE,
) = range(1, 32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64, which is exactly what splitmix64 needs.
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(*keys: np.ndarray | int) -> np.ndarray:
    h = np.zeros(1, dtype=np.uint64)
    # Scalar-only key tuples would otherwise make numpy warn about the intended wrap-around.
    with np.errstate(over="ignore"):
        for k in keys:
            h = _splitmix64(h ^ np.asarray(k).astype(np.uint64))
    return h if any(np.ndim(k) for k in keys) else h.reshape(())


def _uniform(*keys: np.ndarray | int) -> np.ndarray:
    """float64 in the open interval (0, 1), a pure function of ``keys``."""
    return ((_hash(*keys) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _gauss(*keys: np.ndarray | int) -> np.ndarray:
    u1 = _uniform(*keys, 0)
    u2 = _uniform(*keys, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _zipf_rank(u: np.ndarray, n: int, exponent: float) -> np.ndarray:
    """Ranks in ``[0, n)`` with P(rank r) ~ (r + 1)^-exponent (bounded continuous inverse CDF)."""
    if abs(exponent - 1.0) < 1e-9:
        x = np.power(float(n + 1), u)
    else:
        e = 1.0 - exponent
        x = np.power(1.0 + u * (float(n + 1) ** e - 1.0), 1.0 / e)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, n - 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class Batch:
    """A batch of ``B`` requests in jagged layout (all tensors on one device).

    ``T`` = total history events, ``C`` = total candidates, ``G`` = total user tags.
    Vocabularies and widths are the source's :class:`~hyperrec.integration.config.DataSchema`.
    Offsets are int64, length ``B + 1``, start at 0, non-decreasing; request ``b`` owns
    rows ``offsets[b]:offsets[b + 1]`` of its jagged fields. Histories are in
    chronological order (oldest first).
    """

    sample_ids: torch.Tensor
    """int64 [B]: index of each request in its split (for exact-resume bookkeeping)."""
    user_ids: torch.Tensor
    """int64 [B]: non-negative user ids (the model hashes them into its table; GAUC
    groups impressions by them)."""
    request_time: torch.Tensor
    """int64 [B]: request timestamp, seconds."""
    dense: torch.Tensor
    """float32 [B, schema.num_dense]: dense features (the generator's: :data:`DENSE_FEATURES`)."""
    tag_offsets: torch.Tensor
    """int64 [B + 1]: offsets of the multi-hot user-tag feature."""
    tags: torch.Tensor
    """int64 [G]: user-tag ids in ``[0, schema.num_tags)``."""
    history_offsets: torch.Tensor
    """int64 [B + 1]: offsets of the history events."""
    history_items: torch.Tensor
    """int64 [T]: item ids in ``[0, schema.num_items)``."""
    history_categories: torch.Tensor
    """int64 [T]: the category of each history item, in ``[0, schema.num_categories)``."""
    history_actions: torch.Tensor
    """int64 [T]: action ids in ``[0, schema.num_actions)``."""
    history_time: torch.Tensor
    """int64 [T]: event timestamps, seconds, <= the request's ``request_time``."""
    candidate_offsets: torch.Tensor
    """int64 [B + 1]: offsets of the candidates (every request has at least one)."""
    candidate_items: torch.Tensor
    """int64 [C]: candidate item ids in ``[0, schema.num_items)``."""
    candidate_categories: torch.Tensor
    """int64 [C]: the category of each candidate, in ``[0, schema.num_categories)``."""
    click: torch.Tensor
    """float32 [C]: click label in {0, 1}."""
    conversion: torch.Tensor
    """float32 [C]: conversion label in {0, 1}; 1 only where ``click`` is 1 (all 0 for a
    CTR-only source)."""
    max_history_len: int
    """Longest history in the batch (a host int, so attention needs no device sync)."""

    @property
    def num_requests(self) -> int:
        """``B``."""
        return int(self.sample_ids.shape[0])

    @property
    def num_candidates(self) -> int:
        """``C``."""
        return int(self.candidate_items.shape[0])

    @property
    def num_history_events(self) -> int:
        """``T``."""
        return int(self.history_items.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device``."""
        kw: dict[str, Any] = {}  # every field, by name (mixed types)
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v
        return Batch(**kw)

    def validate(
        self,
        schema: DataSchema | None = None,
        *,
        num_items: int | None = None,
        num_topics: int | None = None,
    ) -> None:
        """Check structure, ranges and finiteness; costs a few host syncs on GPU.

        Args:
            schema: the vocabularies and dense width to check against. Without it,
                ``num_items`` and ``num_topics`` (categories and tags) give the
                vocabularies and the synthetic generator's actions and dense width apply.

        Raises:
            ValueError: empty batch; offsets of the wrong length, not starting at 0, not
                non-decreasing or not ending at their field's length; a request without
                candidates; ids out of range (naming the field); a history event later
                than its request, or a history not in chronological order; negative
                ``sample_ids``; NaN/Inf dense features; labels outside {0, 1} or a
                conversion without a click; ``max_history_len`` not the true maximum.
            TypeError: a field with the wrong dtype or rank; ``max_history_len`` not an int.
        """
        # A float (3.0) or bool compared equal to the true maximum and was taken as a
        # host int by attention; it must be an int.
        if isinstance(self.max_history_len, bool) or not isinstance(self.max_history_len, int):
            raise TypeError(
                f"Batch.max_history_len must be an int, got "
                f"{type(self.max_history_len).__name__} {self.max_history_len!r}"
            )
        if schema is None:
            if num_items is None or num_topics is None:
                raise TypeError("validate needs a schema, or num_items and num_topics")
            schema = DataSchema(
                num_items=num_items,
                num_categories=num_topics,
                num_tags=num_topics,
                actions=ACTIONS,
                dense_features=DENSE_FEATURES,
                max_seqlen=max(1, self.max_history_len),
            )
        elif not isinstance(schema, DataSchema):
            raise TypeError(f"schema must be a DataSchema, got {type(schema).__name__}")
        b = self.num_requests
        if b == 0:
            raise ValueError("batch is empty: it must hold at least one request")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "max_history_len":
                continue
            want = torch.float32 if f.name in ("dense", "click", "conversion") else torch.int64
            if not torch.is_tensor(v) or v.dtype != want:
                got = v.dtype if torch.is_tensor(v) else type(v).__name__
                raise TypeError(f"Batch.{f.name} must be a {want} tensor, got {got}")
            if v.dim() != (2 if f.name == "dense" else 1):
                raise TypeError(f"Batch.{f.name} has rank {v.dim()}, expected the documented shape")
        for name in ("user_ids", "request_time"):
            if getattr(self, name).shape[0] != b:
                raise ValueError(f"Batch.{name} has {getattr(self, name).shape[0]} rows, not B={b}")
        if tuple(self.dense.shape) != (b, schema.num_dense):
            raise ValueError(
                f"Batch.dense must have shape ({b}, {schema.num_dense}), "
                f"got {tuple(self.dense.shape)}"
            )
        jagged = (
            ("tag_offsets", ("tags",)),
            (
                "history_offsets",
                ("history_items", "history_categories", "history_actions", "history_time"),
            ),
            (
                "candidate_offsets",
                ("candidate_items", "candidate_categories", "click", "conversion"),
            ),
        )
        for off_name, value_names in jagged:
            off = getattr(self, off_name)
            if off.shape[0] != b + 1:
                raise ValueError(f"Batch.{off_name} must have B + 1 = {b + 1} entries")
            if int(off[0]) != 0 or bool((off[1:] < off[:-1]).any()):
                raise ValueError(f"Batch.{off_name} must start at 0 and be non-decreasing")
            for name in value_names:
                n = getattr(self, name).shape[0]
                if int(off[-1]) != n:
                    raise ValueError(
                        f"Batch.{off_name}[-1] = {int(off[-1])} but Batch.{name} has {n} rows"
                    )
        lengths = self.history_offsets.diff()
        if int(lengths.max()) != self.max_history_len:
            raise ValueError(
                f"Batch.max_history_len = {self.max_history_len} but the longest history "
                f"has {int(lengths.max())} events"
            )
        if bool((self.candidate_offsets.diff() == 0).any()):
            raise ValueError("every request needs at least one candidate (Batch.candidate_offsets)")
        for name, high in (
            ("history_items", schema.num_items),
            ("candidate_items", schema.num_items),
            ("history_actions", schema.num_actions),
            ("history_categories", schema.num_categories),
            ("candidate_categories", schema.num_categories),
            ("tags", schema.num_tags),
        ):
            v = getattr(self, name)
            if v.numel() and (int(v.min()) < 0 or int(v.max()) >= high):
                raise ValueError(
                    f"Batch.{name} has ids in [{int(v.min())}, {int(v.max())}], outside [0, {high})"
                )
        if self.user_ids.numel() and int(self.user_ids.min()) < 0:
            raise ValueError("Batch.user_ids must be non-negative")
        # Documented as split indices (exact-resume bookkeeping): never negative.
        if int(self.sample_ids.min()) < 0:
            raise ValueError("Batch.sample_ids must be non-negative (indices in their split)")
        owner = torch.repeat_interleave(self.request_time, lengths)
        if bool((self.history_time > owner).any()):
            raise ValueError("Batch.history_time has events later than their request_time")
        # Histories are documented oldest first; the model reads them in order (causal
        # attention), so a shuffled history trained silently on another sequence. Only
        # consecutive events of one request are compared (not across requests).
        same_request = torch.ones(self.history_time.shape[0], dtype=torch.bool)
        same_request[self.history_offsets[:-1][lengths > 0]] = False
        if bool((self.history_time.diff() < 0)[same_request[1:]].any()):
            raise ValueError(
                "Batch.history_time must be non-decreasing within each request (histories "
                "are in chronological order, oldest first)"
            )
        if not bool(torch.isfinite(self.dense).all()):
            raise ValueError("Batch.dense contains NaN or Inf")
        for name in ("click", "conversion"):
            v = getattr(self, name)
            if not bool(((v == 0) | (v == 1)).all()):
                raise ValueError(f"Batch.{name} labels must be 0 or 1")
        if bool((self.conversion > self.click).any()):
            raise ValueError("Batch.conversion is 1 where click is 0 (a conversion needs a click)")


def _check_split(split: Any) -> None:
    if isinstance(split, bool) or split not in SPLITS:
        raise ValueError(
            f"split must be TRAIN ({TRAIN}), VALID ({VALID}) or TEST ({TEST}), got {split!r}"
        )


def _segment_ids(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner row of every jagged element, its position inside its row)."""
    lengths = np.diff(offsets)
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    pos = np.arange(int(offsets[-1])) - offsets[:-1][owner]
    return owner, pos


def check_integer_ids(arr: np.ndarray) -> None:
    """TypeError unless ``arr`` holds integer request ids (not floats, booleans or strings):
    ``np.asarray(ids, int64)`` truncated 1.5 to request 1 and read a mask as 0 / 1."""
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"ids must be integer request indices, got dtype {arr.dtype}")


def _ages(gaps: np.ndarray, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Age of every history event: the sum of its gap and every later gap of its request.

    Summed within each request from 0 (rows of equal length as one 2-D cumsum), never as
    differences of one prefix sum over the whole batch: those carried the rounding of
    every earlier request of the batch, so long histories got event times 1 s apart
    depending on which requests shared the batch. Every request gets the values it has
    when generated alone.
    """
    age = np.empty_like(gaps)
    for n in np.unique(lengths[lengths > 0]).tolist():
        idx = offsets[:-1][lengths == n][:, None] + np.arange(n)
        csum = np.cumsum(gaps[idx], axis=1)
        before = np.concatenate([np.zeros((idx.shape[0], 1)), csum[:, :-1]], axis=1)
        age[idx] = csum[:, -1:] - before
    return age


class SyntheticRecsysData:
    """Generator of requests and their ground truth for one :class:`DataConfig`.

    A :class:`DataSource`: the training split is endless (``num_requests(TRAIN)`` is
    ``None``); validation and test hold ``config.eval_requests`` requests each; the
    ground truth is known (:meth:`truth`). Stateless apart from a few small tables
    built from ``config.seed``; thread-safe.
    """

    def __init__(self, config: DataConfig):
        if not isinstance(config, DataConfig):
            raise TypeError(f"config must be a DataConfig, got {type(config).__name__}")
        self.config = config
        rng = np.random.default_rng([config.seed, 0x5EED])
        k, d = config.num_topics, config.latent_dim
        centroids = rng.standard_normal((k, d))
        self._centroids = centroids / np.linalg.norm(centroids, axis=1, keepdims=True)
        self._topic_by_rank = rng.permutation(k)
        self._item_noise = rng.standard_normal((_NOISE_ROWS, d)) * (0.5 / math.sqrt(d))
        self._items_per_topic = config.num_items // k

    # -- entity properties (pure functions of the id) ------------------------------------
    def _popular_topic(self, u: np.ndarray) -> np.ndarray:
        return self._topic_by_rank[_zipf_rank(u, self.config.num_topics, self.config.topic_zipf)]

    def _user_favourites(self, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.config.seed
        return (
            self._popular_topic(_uniform(s, _E_USER_FAV, users, 0)),
            self._popular_topic(_uniform(s, _E_USER_FAV, users, 1)),
        )

    def _item_latent(self, items: np.ndarray) -> np.ndarray:
        row = (_hash(self.config.seed, _E_ITEM_NOISE, items) % np.uint64(_NOISE_ROWS)).astype(
            np.int64
        )
        return self._centroids[items % self.config.num_topics] + self._item_noise[row]

    def _item_in_topic(self, u: np.ndarray, topics: np.ndarray) -> np.ndarray:
        rank = _zipf_rank(u, self._items_per_topic, self.config.item_zipf)
        return rank * self.config.num_topics + topics

    def _choose_topic(
        self,
        u: np.ndarray,
        p_session: np.ndarray | float,
        p_favourite: float,
        session: np.ndarray,
        favs: tuple[np.ndarray, np.ndarray],
        u_fav: np.ndarray,
        u_topic: np.ndarray,
    ) -> np.ndarray:
        fav = np.where(u_fav < 0.5, favs[0], favs[1])
        other = self._popular_topic(u_topic)
        return np.where(u < p_session, session, np.where(u < p_session + p_favourite, fav, other))

    # -- the DataSource protocol --------------------------------------------------------
    @property
    def schema(self) -> DataSchema:
        """The config's schema (CTR and CVR labels)."""
        return self.config.schema

    def num_requests(self, split: int) -> int | None:
        """``None`` for :data:`TRAIN` (endless), ``eval_requests`` for the held-out splits.

        Raises:
            ValueError: unknown split.
        """
        _check_split(split)
        return None if split == TRAIN else self.config.eval_requests

    def state_dict(self) -> dict[str, Any]:
        """``{"source": "synthetic", "config": {...}}``: the generator's whole definition."""
        return {"source": "synthetic", "config": dataclasses.asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that ``state`` describes this generator.

        Raises:
            ValueError: another source or another config (the differing fields are named).
        """
        if not isinstance(state, dict) or state.get("source") != "synthetic":
            raise ValueError(
                f"the saved data source is not the synthetic generator: {state!r:.200}"
            )
        mine = dataclasses.asdict(self.config)
        diff = sorted(k for k in mine if state["config"].get(k) != mine[k])
        if diff:
            raise ValueError(
                "the saved synthetic data differs in "
                + ", ".join(f"{k}={state['config'].get(k)!r} (now {mine[k]!r})" for k in diff)
            )

    # -- requests -----------------------------------------------------------------------
    def history_lengths(self, split: int, ids: np.ndarray | list[int]) -> np.ndarray:
        """int64 history length of each request ``ids`` of ``split`` (cheap: for BBS costs).

        Raises:
            ValueError / TypeError: as :meth:`batch` (``ids`` may be empty here).
        """
        return self._lengths(split, self._check_ids(split, ids, allow_empty=True))

    def _check_ids(self, split: int, ids: Any, *, allow_empty: bool = False) -> np.ndarray:
        _check_split(split)
        arr = np.asarray(ids)
        if arr.size == 0:
            if not allow_empty:
                raise ValueError("ids is empty: a batch needs at least one request")
            return np.zeros(0, dtype=np.int64)
        check_integer_ids(arr)
        if int(arr.min()) < 0:
            raise ValueError("ids must be non-negative")
        if int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"ids must be < 2**63, got {int(arr.max())}")
        if split != TRAIN and int(arr.max()) >= self.config.eval_requests:
            raise ValueError(
                f"{SPLITS[split]} ids must be < eval_requests ({self.config.eval_requests}), "
                f"got {int(arr.max())}"
            )
        return arr.astype(np.int64).reshape(-1)

    def _lengths(self, split: int, ids: np.ndarray) -> np.ndarray:
        c = self.config
        u = _uniform(c.seed, split, _S_LENGTH, ids)
        extra = c.seqlen_scale * (np.power(u, -1.0 / c.seqlen_alpha) - 1.0)
        return np.minimum(c.min_seqlen + np.floor(extra), c.max_seqlen).astype(np.int64)

    def batch(self, split: int, ids: np.ndarray | list[int]) -> Batch:
        """The requests ``ids`` of ``split`` (:data:`TRAIN`, :data:`VALID`, :data:`TEST`).

        Raises:
            ValueError: empty ``ids``, negative ids, held-out ids past ``eval_requests``,
                unknown split.
            TypeError: ``ids`` not integers (floats, booleans, strings).
        """
        return self._generate(split, ids)[0]

    def truth(self, split: int, ids: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden model's (P(click), P(conversion | click)) for every candidate of ``ids``.

        float64 tensors [C] aligned with ``batch(split, ids).candidate_items``: the Bayes
        optimal scores, used to report how far a trained model is from the ceiling.
        """
        return self._generate(split, ids)[1]

    def batch_and_truth(
        self, split: int, ids: np.ndarray | list[int]
    ) -> tuple[Batch, tuple[torch.Tensor, torch.Tensor]]:
        """``(batch(split, ids), truth(split, ids))`` from a single generation pass."""
        return self._generate(split, ids)

    def _generate(
        self, split: int, ids: np.ndarray | list[int]
    ) -> tuple[Batch, tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        ids = self._check_ids(split, ids)
        s = c.seed
        b = ids.shape[0]

        users = _zipf_rank(_uniform(s, split, _S_USER, ids), c.num_users, c.user_zipf)
        favs = self._user_favourites(users)
        user_bias = 0.3 * _gauss(s, _E_USER_BIAS, users)
        session = np.where(
            _uniform(s, split, _S_SESSION, ids) < 0.5,
            np.where(_uniform(s, split, _S_SESSION_FAV, ids) < 0.5, favs[0], favs[1]),
            self._popular_topic(_uniform(s, split, _S_SESSION_TOPIC, ids)),
        )
        request_time = (
            _EPOCH
            + ids * _SECONDS_PER_REQUEST
            + np.floor(_uniform(s, split, _S_TIME, ids) * _SECONDS_PER_REQUEST).astype(np.int64)
            + split * 10**8
        )

        # History: the session topic dominates the most recent events.
        lengths = self._lengths(split, ids)
        h_off = np.concatenate([[0], np.cumsum(lengths)])
        h_row, h_pos = _segment_ids(h_off)
        h_id = ids[h_row]
        recent = lengths[h_row] - 1 - h_pos  # 0 = most recent event
        p_sess = 0.6 * np.exp(-recent / 6.0)
        h_topic = self._choose_topic(
            _uniform(s, split, _S_H_CHOICE, h_id, h_pos),
            p_sess,
            (1.0 - p_sess) * 0.5,
            session[h_row],
            (favs[0][h_row], favs[1][h_row]),
            _uniform(s, split, _S_H_FAV, h_id, h_pos),
            _uniform(s, split, _S_H_TOPIC, h_id, h_pos),
        )
        h_items = self._item_in_topic(_uniform(s, split, _S_H_ITEM, h_id, h_pos), h_topic)
        # Gaps grow with recency rank: minutes apart within a session, hours further back.
        gaps = -np.log(_uniform(s, split, _S_H_GAP, h_id, h_pos)) * 120.0 * (1.0 + recent)
        age = np.floor(_ages(gaps, lengths, h_off)).astype(np.int64)
        h_time = request_time[h_row] - age
        liked = (
            (h_topic == session[h_row]) | (h_topic == favs[0][h_row]) | (h_topic == favs[1][h_row])
        )
        cdf_liked, cdf_other = np.cumsum(_ACTION_P_LIKED), np.cumsum(_ACTION_P_OTHER)
        u_act = _uniform(s, split, _S_H_ACTION, h_id, h_pos)
        h_actions = np.where(
            liked,
            np.searchsorted(cdf_liked, u_act, side="right"),
            np.searchsorted(cdf_other, u_act, side="right"),
        ).clip(0, len(ACTIONS) - 1)

        # Short-term interest: action- and recency-weighted mean of history item latents.
        w = _ACTION_WEIGHT[h_actions] * np.exp(-age / _RECENCY_S)
        h_lat = self._item_latent(h_items)
        # bincount sums each request's events in order, independently of the other
        # requests of the batch: a request's labels must not depend on its batch.
        interest = np.stack(
            [np.bincount(h_row, weights=h_lat[:, j] * w, minlength=b) for j in range(c.latent_dim)],
            axis=1,
        )
        norm = np.bincount(h_row, weights=np.abs(w), minlength=b)
        interest = interest / (norm[:, None] + 1e-3)
        preference = 0.5 * (self._centroids[favs[0]] + self._centroids[favs[1]])

        # Candidates and labels.
        n_cand = 1 + np.floor(_uniform(s, split, _S_NCAND, ids) * c.max_candidates).astype(np.int64)
        c_off = np.concatenate([[0], np.cumsum(n_cand)])
        c_row, c_pos = _segment_ids(c_off)
        c_id = ids[c_row]
        c_topic = self._choose_topic(
            _uniform(s, split, _S_C_CHOICE, c_id, c_pos),
            0.35,
            0.2,
            session[c_row],
            (favs[0][c_row], favs[1][c_row]),
            _uniform(s, split, _S_C_FAV, c_id, c_pos),
            _uniform(s, split, _S_C_TOPIC, c_id, c_pos),
        )
        c_items = self._item_in_topic(_uniform(s, split, _S_C_ITEM, c_id, c_pos), c_topic)
        c_lat = self._item_latent(c_items)
        affinity = np.einsum("cd,cd->c", interest[c_row], c_lat)
        z_click = (
            c.base_ctr_logit
            + c.interest_strength * affinity
            + c.preference_strength * np.einsum("cd,cd->c", preference[c_row], c_lat)
            + c.item_bias_std * _gauss(s, _E_ITEM_BIAS, c_items)
            + user_bias[c_row]
            + c.noise_std * _gauss(s, split, _S_C_NOISE, c_id, c_pos)
        )
        z_cvr = (
            c.base_cvr_logit
            + 2.0 * affinity
            + c.item_bias_std * _gauss(s, _E_ITEM_CVR_BIAS, c_items)
            + c.noise_std * _gauss(s, split, _S_C_CVR_NOISE, c_id, c_pos)
        )
        p_click, p_cvr = _sigmoid(z_click), _sigmoid(z_cvr)
        click = (_uniform(s, split, _S_C_CLICK, c_id, c_pos) < p_click).astype(np.float32)
        conv = click * (_uniform(s, split, _S_C_CONV, c_id, c_pos) < p_cvr).astype(np.float32)

        # Pooled multi-hot user tags: mostly the favourite topics, some noise.
        n_tags = 1 + np.floor(_uniform(s, split, _S_NTAGS, ids) * c.max_user_tags).astype(np.int64)
        t_off = np.concatenate([[0], np.cumsum(n_tags)])
        t_row, t_pos = _segment_ids(t_off)
        t_id = ids[t_row]
        tags = self._choose_topic(
            _uniform(s, split, _S_TAG_CHOICE, t_id, t_pos),
            0.0,
            0.7,
            session[t_row],
            (favs[0][t_row], favs[1][t_row]),
            _uniform(s, split, _S_TAG_FAV, t_id, t_pos),
            _uniform(s, split, _S_TAG_TOPIC, t_id, t_pos),
        )

        clicks_in_history = np.bincount(
            h_row, weights=(h_actions == 1) | (h_actions == 2), minlength=b
        )
        hour = (request_time % 86400) / 3600.0
        dense = np.stack(
            [
                np.log1p(lengths) / math.log1p(c.max_seqlen),
                clicks_in_history / np.maximum(lengths, 1),
                _sigmoid(c.base_ctr_logit + user_bias) + 0.05 * _gauss(s, split, _S_USER_CTR, ids),
                np.sin(2 * np.pi * hour / 24.0),
                np.cos(2 * np.pi * hour / 24.0),
            ],
            axis=1,
        )

        def t(x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)

        batch = Batch(
            sample_ids=t(ids),
            user_ids=t(users),
            request_time=t(request_time),
            dense=t(dense, torch.float32),
            tag_offsets=t(t_off),
            tags=t(tags),
            history_offsets=t(h_off),
            history_items=t(h_items),
            history_categories=t(h_topic),
            history_actions=t(h_actions),
            history_time=t(h_time),
            candidate_offsets=t(c_off),
            candidate_items=t(c_items),
            candidate_categories=t(c_topic),
            click=t(click, torch.float32),
            conversion=t(conv, torch.float32),
            max_history_len=int(lengths.max()),
        )
        return batch, (torch.from_numpy(p_click), torch.from_numpy(p_cvr))
