"""Interaction logs (CSV or Parquet) as a :class:`~hyperrec.integration.data.DataSource`.

**Input**: one file, or a directory of ``.csv`` / ``.parquet`` files (read in name
order), with a header row naming at least a user column, an item column, a numeric
timestamp and a label (0/1, or a rating turned into 0/1 by ``rating_threshold``); the
column names and the optional ones (item category, categorical user features, numeric
columns, a conversion label) are set by :class:`~hyperrec.integration.config.EventLogConfig`.
Ids may be any integers or strings: they are read as text and never parsed.

**Requests**: every event is one request whose candidate is the event's item and
whose label is the event's label. Its history is the same user's events with a
*strictly earlier* timestamp (events sharing its timestamp are not in it, so nothing
that happened at the same moment leaks), the latest ``max_seqlen`` of them (older ones
are dropped), oldest first; a history event's action is its own label (negative,
positive, or conversion). Dense features: ``log(1 + history length) / log(1 + cap)``,
the history's positive rate, ``log(1 + earlier events) / log(1 + cap)`` (uncapped
count), the hour of day as sine and cosine, then the extra numeric columns
standardised with the training split's mean and standard deviation.

**Splits** (``split="time"``, the default): two global time cutoffs put the last
``test_fraction`` of the events (by time) in test and the ``valid_fraction`` before
them in validation, so every evaluated event happens after every training event.
Events at exactly a cutoff time go to the later split, so the fractions are met up to
ties. ``split="user"``: the last ``floor(n * test_fraction + 1/2)`` of each user's ``n``
events are test and the events before them up to the last
``floor(n * (valid_fraction + test_fraction) + 1/2)`` validation (halves round up, and the
two fractions are rounded together: 5 events at 0.1 / 0.1 give 1 test event and no
validation event); a user with one event keeps it in training. Histories always reach
back across splits: a test event's history holds the user's earlier training and
validation events.

**Vocabulary**: raw ids are remapped to dense ids ``1..K`` in order of first appearance,
counting only ids that occur in the *training* split; every other id (an item only in
test, a user only in validation) maps to the reserved row 0. The vocabularies are
saved (``vocab/<column>.jsonl``: line ``i`` holds the raw id of dense id ``i``, line 0
the reserved unknown row) and :meth:`EventLogSource.encode` maps new raw ids with them.

**Memory and speed** (:func:`prepare_event_log`): files are *streamed* in chunks (about
a million rows), ids are encoded chunk by chunk, and only compact columns (int32 codes,
int64 times, int8 labels: about 17 bytes per event plus 4 per extra column) are kept
for one in-memory sort by (user, time). The prepared columns are written as ``.npy``
files and *memory-mapped* by :class:`EventLogSource`, so training reads only the pages
of the requests it touches, and every rank of a run shares one copy through the page
cache (a pickled source, e.g. in a ``DataLoader`` worker, maps the files again rather
than carrying copies). ``bench/bench_eventlog.py`` measures it (see the README).

**Identity**: ``prepared.json`` records a sha256 of every prepared array and vocabulary
(``content_digest``); :meth:`EventLogSource.state_dict` carries it into checkpoints, so
a resume against other data is refused even when its counts and sums match.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyperrec.integration.config import TIME_UNITS, DataSchema, EventLogConfig
from hyperrec.integration.data import SPLITS, TEST, TRAIN, VALID, Batch, check_integer_ids

__all__ = [
    "EVENT_DENSE_FEATURES",
    "EventLogError",
    "EventLogSource",
    "prepare_event_log",
    "write_example_log",
]

EVENT_DENSE_FEATURES = (
    "log_history_length",
    "history_positive_rate",
    "log_prior_events",
    "hour_sin",
    "hour_cos",
)
"""The dense features every event-log request has (extra numeric columns follow)."""

# 2: split membership, row order and time parsing fixed; version 1 preparations are
# redone rather than reused.
_FORMAT_VERSION = 2
_CHUNK_ROWS = 1 << 20
_CSV_BLOCK_BYTES = 1 << 25
_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
# Fields that change what the preparation writes; the others (cap, order, cache, CSV
# engine, validation subset) apply when reading, so a prepared log serves them all.
_PREPARED_FIELDS = (
    "user_column",
    "item_column",
    "time_column",
    "time_unit",
    "label_column",
    "rating_threshold",
    "conversion_column",
    "category_column",
    "user_feature_columns",
    "dense_columns",
    "split",
    "valid_fraction",
    "test_fraction",
)


class EventLogError(ValueError):
    """A log that cannot be read as documented; the message names the file and column."""


def _require_pyarrow(why: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ImportError(
            f"{why} needs pyarrow: pip install 'hyperrec-integration[parquet]' "
            "(CSV files also work without it, with EventLogConfig.reader='python')"
        ) from None
    return pyarrow


def _have_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


# -- discovering and reading files ----------------------------------------------------
def _input_files(cfg: EventLogConfig) -> list[tuple[Path, str]]:
    root = Path(cfg.path)
    if not root.exists():
        raise FileNotFoundError(f"EventLogConfig.path: no such file or directory: {root}")
    if root.is_dir():
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in _SUFFIXES)
        if not files:
            raise EventLogError(
                f"{root}: no .csv, .parquet or .pq files in this directory (EventLogConfig.path)"
            )
    else:
        files = [root]
    out = []
    for f in files:
        fmt = cfg.format if cfg.format != "auto" else _SUFFIXES.get(f.suffix.lower())
        if fmt is None:
            raise EventLogError(
                f"{f}: cannot tell CSV from Parquet by the extension {f.suffix!r}; set "
                "EventLogConfig.format"
            )
        out.append((f, fmt))
    return out


def _csv_header(path: Path) -> list[str]:
    # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first name.
    with open(path, newline="", encoding="utf-8-sig") as fh:
        try:
            header = next(csv.reader(fh))
        except StopIteration:
            raise EventLogError(f"{path}: the file is empty (no header row)") from None
        except (csv.Error, UnicodeDecodeError) as err:
            raise EventLogError(f"{path}: cannot read the CSV header: {err}") from None
    return [h.strip() for h in header]


def _check_columns(path: Path, present: list[str], cfg: EventLogConfig) -> None:
    for c in cfg.columns():
        if c not in present:
            raise EventLogError(
                f"{path}: missing column {c!r} (the file has {', '.join(map(repr, present))}); "
                "set the EventLogConfig column names to match"
            )
        # A header naming a needed column twice is ambiguous: the readers would silently
        # take the first of the two.
        if present.count(c) > 1:
            raise EventLogError(f"{path}: the header names the column {c!r} twice")


def _chunks_python_csv(path: Path, columns: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader)]
        index = [header.index(c) for c in columns]
        width = len(header)
        rows: list[list[str]] = []
        line = 1
        for row in reader:
            line += 1
            if not row:
                continue
            if len(row) != width:
                raise EventLogError(
                    f"{path}: line {line} has {len(row)} fields, the header has {width}"
                )
            rows.append(row)
            if len(rows) == _CHUNK_ROWS:
                yield _columns_of(rows, columns, index)
                rows = []
        if rows:
            yield _columns_of(rows, columns, index)


def _columns_of(
    rows: list[list[str]], columns: tuple[str, ...], index: list[int]
) -> dict[str, np.ndarray]:
    return {c: np.array([r[i] for r in rows], dtype=str) for c, i in zip(columns, index)}


def _chunks_pyarrow_csv(
    path: Path, columns: tuple[str, ...], header: list[str]
) -> Iterator[dict[str, Any]]:
    pa = _require_pyarrow("reading CSV with reader='pyarrow'")
    import pyarrow.csv as pacsv

    # Everything as text: ids are never parsed (so "007" stays "007"), and numbers are
    # converted by us, with an error that names the file, the column and the value.
    # The column names are the header as the Python reader reads it (names stripped of
    # spaces), so both engines accept the same files.
    try:
        reader = pacsv.open_csv(
            str(path),
            read_options=pacsv.ReadOptions(
                block_size=_CSV_BLOCK_BYTES, column_names=header, skip_rows=1
            ),
            convert_options=pacsv.ConvertOptions(
                include_columns=list(columns),
                column_types={c: pa.string() for c in columns},
                strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowKeyError) as err:
        raise EventLogError(f"{path}: {err}") from None
    try:
        for rb in reader:
            if rb.num_rows:
                yield {c: rb.column(c) for c in columns}
    except pa.ArrowInvalid as err:
        raise EventLogError(f"{path}: {err}") from None


def _chunks_parquet(path: Path, cfg: EventLogConfig) -> Iterator[dict[str, Any]]:
    _require_pyarrow("reading Parquet files")
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise EventLogError(f"{path}: the file is empty")
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as err:  # pyarrow raises several types for a non-Parquet file
        raise EventLogError(f"{path}: not a readable Parquet file: {err}") from None
    _check_columns(path, list(pf.schema_arrow.names), cfg)
    columns = cfg.columns()
    for rb in pf.iter_batches(batch_size=_CHUNK_ROWS, columns=list(columns)):
        if rb.num_rows:
            yield {c: rb.column(c) for c in columns}


def _read_chunks(path: Path, fmt: str, cfg: EventLogConfig) -> Iterator[dict[str, Any]]:
    columns = cfg.columns()
    if fmt == "parquet":
        yield from _chunks_parquet(path, cfg)
        return
    header = _csv_header(path)
    _check_columns(path, header, cfg)
    engine = cfg.reader
    if engine == "auto":
        engine = "pyarrow" if _have_pyarrow() else "python"
    if engine == "pyarrow":
        yield from _chunks_pyarrow_csv(path, columns, header)
    else:
        yield from _chunks_python_csv(path, columns)


# -- converting one chunk --------------------------------------------------------------
def _as_text(values: Any, where: str) -> Any:
    """A chunk column as text: a numpy str array, or a pyarrow string array.

    Raises:
        EventLogError: a Parquet column of a type that holds no id (a list, a struct, a
            map), or binary values that are not UTF-8; naming ``where`` (file and column)
            and the type.
    """
    if isinstance(values, np.ndarray):
        return values
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        t = values.type
        if pa.types.is_nested(t):  # pyarrow's own error named neither file nor column
            raise EventLogError(
                f"{where} must hold ids (text or numbers), got a column of Arrow type {t}"
            )
        try:
            values = pc.cast(values, pa.string())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise EventLogError(
                f"{where} must hold ids (text or numbers); its Arrow type {t} cannot be read "
                f"as text: {err}"
            ) from None
    return values


def _first_bad(values: list[Any], ok: Callable[[Any], bool]) -> tuple[int, Any]:
    for i, v in enumerate(values):
        if not ok(v):
            return i, v
    return -1, None  # pragma: no cover - only called when a conversion failed


def _is_number(v: Any) -> bool:
    if v is None:
        return False
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _numeric(
    values: Any, where: str, row0: int, *, time_unit: str = "s", is_time: bool = False
) -> np.ndarray:
    """int64 (when every value is an integer) or float64 numpy array of a chunk column.

    A Parquet timestamp, date or duration column is read as integer ``time_unit`` units
    (exactly: a null, or a value that does not fit the unit, is an error). With
    ``is_time`` (the timestamp column) a boolean Parquet column is an error: it used to
    be read as times 0 and 1."""
    if isinstance(values, np.ndarray):
        # numpy parses text with Python's int(), which reads "1_000" as 1000; pyarrow
        # rejects it. Reject it here too, so both CSV engines read a file the same way.
        under = np.flatnonzero(np.char.find(values, "_") >= 0)
        if under.size:
            i = int(under[0])
            raise EventLogError(
                f"{where} must be numeric, got {str(values[i])!r} at data row {row0 + i + 1}"
            )
        try:
            return values.astype(np.int64)
        except (ValueError, OverflowError):
            pass
        try:
            out = values.astype(np.float64)
        except ValueError:
            i, v = _first_bad(values.tolist(), _is_number)
            raise EventLogError(
                f"{where} must be numeric, got {v!r} at data row {row0 + i + 1}"
            ) from None
        return out
    import pyarrow as pa
    import pyarrow.compute as pc

    t = values.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t):
        # Temporal types carry their own unit. An unsafe cast used to turn a null into
        # INT64_MIN, truncate timestamp[ms] to whole seconds (events in one second then
        # became "simultaneous" and vanished from each other's histories) and wrap on
        # overflow; a date64 (milliseconds) was read as seconds. Convert exactly or fail.
        if values.null_count:
            i, _ = _first_bad(values.to_pylist(), lambda v: v is not None)
            raise EventLogError(f"{where} must be a time, got a null at data row {row0 + i + 1}")
        target = pa.duration(time_unit) if pa.types.is_duration(t) else pa.timestamp(time_unit)
        try:
            values = pc.cast(values, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise EventLogError(
                f"{where} is {t} and cannot be converted exactly to time_unit "
                f"{time_unit!r} ({err}); set EventLogConfig.time_unit to a finer unit"
            ) from None
        return values.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.int64)
    if is_time and pa.types.is_boolean(t):
        raise EventLogError(
            f"{where} is a boolean column (Arrow type {t}): a time must be a number or a "
            "timestamp, not true/false (is EventLogConfig.time_column the time column?)"
        )
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        if values.null_count:
            i, _ = _first_bad(values.to_pylist(), lambda v: v is not None)
            raise EventLogError(f"{where} must be numeric, got a null at data row {row0 + i + 1}")
        return values.cast(pa.int64()).to_numpy().astype(np.int64)
    if pa.types.is_floating(t):
        return values.cast(pa.float64()).to_numpy(zero_copy_only=False)
    if pa.types.is_dictionary(t):
        values = values.dictionary_decode()
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        # Surrounding spaces, as the Python reader (numpy) accepts them: " 1" is 1.
        values = pc.utf8_trim_whitespace(values)
    try:
        return pc.cast(values, pa.int64()).to_numpy().astype(np.int64)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    try:
        return pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        # The first value pyarrow cannot cast (Python's float() accepts more, so asking
        # it named no value: "got None at data row 0"), by bisection.
        lo, hi = 0, len(values)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                pc.cast(values.slice(lo, mid - lo), pa.float64())
                lo = mid
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                hi = mid
        i, v = lo, values[lo].as_py()
        raise EventLogError(
            f"{where} must be numeric, got {v!r} at data row {row0 + i + 1}"
        ) from None


class _Encoder:
    """Raw ids (text) -> provisional int codes in order of first appearance."""

    def __init__(self, where: str):
        self.where = where
        self.codes: dict[str, int] = {}

    def encode(self, values: Any, row0: int) -> np.ndarray:
        if not isinstance(values, np.ndarray):
            import pyarrow as pa
            import pyarrow.compute as pc

            # A float id column (Parquet) marks missing ids with NaN, which the cast to
            # text used to turn into the id "nan": every missing id one user or item.
            if pa.types.is_floating(values.type):
                nan = pc.fill_null(pc.is_nan(values), False).to_numpy(zero_copy_only=False)
                if nan.any():
                    i = int(np.flatnonzero(nan)[0])
                    raise EventLogError(
                        f"{self.where} has a missing id (NaN) at data row {row0 + i + 1}"
                    )
        values = _as_text(values, self.where)
        if isinstance(values, np.ndarray):
            uniq, first, inverse = np.unique(values, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")
            keys = uniq[order].tolist()
        else:
            enc = values.dictionary_encode()
            if values.null_count:
                i, _ = _first_bad(values.to_pylist(), lambda v: v is not None)
                raise EventLogError(f"{self.where} has a missing id at data row {row0 + i + 1}")
            keys = enc.dictionary.to_pylist()
            inverse = enc.indices.to_numpy(zero_copy_only=False)
            order = None
        if "" in keys:
            i = int(np.flatnonzero(np.asarray(_as_numpy_text(values)) == "")[0])
            raise EventLogError(f"{self.where} has an empty id at data row {row0 + i + 1}")
        d = self.codes
        mapped = np.fromiter((d.setdefault(k, len(d)) for k in keys), np.int64, len(keys))
        if order is not None:  # np.unique's sorted uniques, mapped back to that order
            m = np.empty_like(mapped)
            m[order] = mapped
            mapped = m
        return mapped[inverse.reshape(-1)]


def _as_numpy_text(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    return np.array(values.to_pylist(), dtype=object)


# -- preparation ------------------------------------------------------------------------
_DIGEST_WHOLE = 1 << 20
_DIGEST_EDGE = 1 << 18


def _content_digest(path: Path, size: int) -> str:
    """sha256 of the file (of its first and last 256 KiB above 1 MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= _DIGEST_WHOLE:
            h.update(fh.read())
        else:
            h.update(fh.read(_DIGEST_EDGE))
            fh.seek(size - _DIGEST_EDGE)
            h.update(fh.read(_DIGEST_EDGE))
    return h.hexdigest()


_HASH_BYTES = 1 << 24  # hashed 16 MiB at a time: a memory map is never read whole


def _prepared_digest(directory: Path) -> str:
    """sha256 over every prepared array (name, dtype, shape, bytes) and vocabulary file
    in ``directory``, in name order: what identifies the prepared data.

    The aggregates of the ``fingerprint`` (counts, sums) let a log with two labels
    swapped, or an event moved to another user, pass for the same data; this digest
    does not. Streamed from the memory-mapped files, 16 MiB at a time.
    """
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.npy")):
        arr = np.load(path, mmap_mode="r")
        h.update(json.dumps([path.stem, arr.dtype.str, list(arr.shape)]).encode())
        flat = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)
        for lo in range(0, flat.shape[0], _HASH_BYTES):
            h.update(np.ascontiguousarray(flat[lo : lo + _HASH_BYTES]).data)
        del arr, flat
    for path in sorted((directory / "vocab").glob("*.jsonl")):
        h.update(json.dumps(["vocab", path.stem, path.stat().st_size]).encode())
        with open(path, "rb") as fh:
            while block := fh.read(_HASH_BYTES):
                h.update(block)
    return h.hexdigest()


def _input_signature(files: list[tuple[Path, str]]) -> list[list[Any]]:
    out = []
    for f, fmt in files:
        st = f.stat()
        # Size and mtime alone let a rewritten file with the same size and an equal
        # mtime (coarse clocks, `touch -r`, `cp -p`, restored backups) reuse the stale
        # preparation silently; a digest of the content (its ends, for big files) does not.
        digest = _content_digest(f, st.st_size)
        out.append([str(f.resolve()), fmt, st.st_size, st.st_mtime_ns, digest])
    return out


def _preparation_key(cfg: EventLogConfig, files: list[tuple[Path, str]]) -> dict[str, Any]:
    fields = dataclasses.asdict(cfg)
    key = {
        "version": _FORMAT_VERSION,
        "config": {k: fields[k] for k in _PREPARED_FIELDS},
        "inputs": _input_signature(files),
    }
    return json.loads(json.dumps(key))  # as it reads back from prepared.json


def _kth(values: np.ndarray, k: int) -> Any:
    if k >= values.shape[0]:
        return math.inf
    # The value in the column's own dtype: float() rounded int64 nanosecond times to
    # multiples of 256 ns, so events strictly before the cutoff could land after it.
    return np.partition(values, k)[k]


def _remap_known(
    codes: np.ndarray, train: np.ndarray, ncodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Codes seen in training -> 1..K (first-appearance order), others -> 0."""
    known = np.zeros(ncodes, dtype=bool)
    known[codes[train]] = True
    new = np.cumsum(known, dtype=np.int64) * known
    return new[codes].astype(np.int32), np.flatnonzero(known)


def _write_vocab(path: Path, encoder: _Encoder, known: np.ndarray) -> None:
    raw = list(encoder.codes)  # insertion order = code order
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("null\n")  # row 0: the reserved unknown id
        for code in known.tolist():
            fh.write(json.dumps(raw[code]) + "\n")


def prepare_event_log(
    config: EventLogConfig, cache_dir: str | Path, *, force: bool = False
) -> dict[str, Any]:
    """Read, validate, sort, split and remap a log once; write it for memory mapping.

    Streams every input file in chunks, encodes ids, sorts by (user, time), assigns
    splits, remaps ids to the training vocabulary and writes ``.npy`` columns, the
    vocabularies and ``prepared.json`` into ``cache_dir``. A preparation already there
    with the same inputs (paths, sizes, modification times, content digests) and the same
    preparation-relevant config is reused unless ``force``. The directory is written
    under a temporary name and renamed when complete, so a crash leaves no half cache.

    Returns:
        The ``prepared.json`` record (counts, vocabulary sizes, cutoffs, timings).

    Raises:
        FileNotFoundError: ``config.path`` does not exist.
        EventLogError: an empty file or log, a missing column, a non-numeric timestamp,
            a label that is not 0/1 (without ``rating_threshold``), a conversion
            without a click, NaN/Inf in a numeric column, an empty id (all naming the
            file and column), an empty training split, or a ``cache_dir`` that holds
            files other than a previous preparation (it would be replaced).
        ImportError: a Parquet file (or ``reader="pyarrow"``) without pyarrow.
    """
    if not isinstance(config, EventLogConfig):
        raise TypeError(f"config must be an EventLogConfig, got {type(config).__name__}")
    cache = Path(cache_dir)
    files = _input_files(config)
    key = _preparation_key(config, files)
    info_path = cache / "prepared.json"
    if not force and info_path.is_file():
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("key") == key:
            return info
    if cache.exists() and not cache.is_dir():
        raise EventLogError(f"{cache}: the event-log cache path is a file, not a directory")
    # The cache directory is replaced as a whole (and the old one deleted): refuse one
    # that is not a previous preparation, or that holds the log itself, rather than
    # silently deleting the user's files (e.g. cache_dir set to the log's own folder).
    if cache.is_dir():
        if any(cache.iterdir()) and not info_path.is_file():
            raise EventLogError(
                f"{cache}: the event-log cache directory (cache_dir) exists and holds files "
                "that are not a prepared log; it would be replaced, so name an empty or new "
                "directory"
            )
        inside = cache.resolve()
        for f, _ in files:
            if inside in f.resolve().parents:
                raise EventLogError(
                    f"{cache}: the event-log cache directory (cache_dir) holds the input "
                    f"file {f}; it would be deleted when the cache is replaced"
                )
    t0 = time.perf_counter()
    cfg = config
    unit = TIME_UNITS[cfg.time_unit]
    enc = {
        "user": _Encoder(f"column {cfg.user_column!r}"),
        "item": _Encoder(f"column {cfg.item_column!r}"),
    }
    if cfg.category_column:
        enc["category"] = _Encoder(f"column {cfg.category_column!r}")
    feat_enc = [_Encoder(f"column {c!r}") for c in cfg.user_feature_columns]
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("user", "item", "category", "time", "label", "conversion")
    }
    feats: list[list[np.ndarray]] = [[] for _ in cfg.user_feature_columns]
    dense: list[list[np.ndarray]] = [[] for _ in cfg.dense_columns]
    n_rows = 0
    time_where: list[tuple[str, int]] = []  # (file and column, first row) of each time chunk
    fractional: list[tuple[str, int, float]] = []  # the first fractional time of a chunk
    for path, fmt in files:
        file_rows = 0
        for chunk in _read_chunks(path, fmt, cfg):
            row0 = file_rows

            def where(column: str, path: Path = path) -> str:
                return f"{path}: column {column!r}"

            for name, column in (("user", cfg.user_column), ("item", cfg.item_column)):
                enc[name].where = where(column)
                cols[name].append(_narrow(enc[name].encode(chunk[column], row0)))
            if cfg.category_column:
                enc["category"].where = where(cfg.category_column)
                cols["category"].append(
                    _narrow(enc["category"].encode(chunk[cfg.category_column], row0))
                )
            for j, c in enumerate(cfg.user_feature_columns):
                feat_enc[j].where = where(c)
                feats[j].append(_narrow(feat_enc[j].encode(chunk[c], row0)))
            t = _numeric(
                chunk[cfg.time_column],
                where(cfg.time_column),
                row0,
                time_unit=cfg.time_unit,
                is_time=True,
            )
            if t.dtype == np.float64 and not np.isfinite(t).all():
                i = int(np.flatnonzero(~np.isfinite(t))[0])
                raise EventLogError(
                    f"{where(cfg.time_column)} must be finite, got {t[i]} at data row "
                    f"{row0 + i + 1}"
                )
            # A number beyond int64 (read as a float) used to become INT64_MIN seconds
            # silently when the times were converted; no unit makes it a real time.
            if t.dtype == np.float64 and (np.abs(t) >= 2.0**63).any():
                i = int(np.flatnonzero(np.abs(t) >= 2.0**63)[0])
                raise EventLogError(
                    f"{where(cfg.time_column)} is out of the int64 range, got {t[i]} at data "
                    f"row {row0 + i + 1}"
                )
            if t.dtype == np.float64:
                # Whole numbers as int64: concatenated with another file's int64 times a
                # float chunk made every time float64, rounding nanosecond times to
                # multiples of 256 ns (distinct events became simultaneous).
                frac = np.flatnonzero(np.floor(t) != t)
                if frac.size:
                    i = int(frac[0])
                    fractional.append((where(cfg.time_column), row0 + i + 1, float(t[i])))
                else:
                    t = t.astype(np.int64)
            cols["time"].append(t)
            time_where.append((where(cfg.time_column), row0))
            lab = _numeric(chunk[cfg.label_column], where(cfg.label_column), row0)
            if cfg.rating_threshold is not None:
                if lab.dtype == np.float64 and np.isnan(lab).any():
                    i = int(np.flatnonzero(np.isnan(lab))[0])
                    raise EventLogError(
                        f"{where(cfg.label_column)} has NaN at data row {row0 + i + 1}"
                    )
                lab = (lab >= cfg.rating_threshold).astype(np.int8)
            else:
                _check_binary(lab, where(cfg.label_column), row0, "set rating_threshold to "
                              "turn ratings into labels")  # fmt: skip
                lab = lab.astype(np.int8)
            cols["label"].append(lab)
            if cfg.conversion_column:
                conv = _numeric(chunk[cfg.conversion_column], where(cfg.conversion_column), row0)
                _check_binary(conv, where(cfg.conversion_column), row0, "a conversion label")
                conv = conv.astype(np.int8)
                bad = np.flatnonzero(conv > lab)
                if bad.size:
                    raise EventLogError(
                        f"{where(cfg.conversion_column)} is 1 where the label is 0 at data row "
                        f"{row0 + int(bad[0]) + 1} (a conversion needs a click)"
                    )
                cols["conversion"].append(conv)
            for j, c in enumerate(cfg.dense_columns):
                v = _numeric(chunk[c], where(c), row0).astype(np.float64)
                if not np.isfinite(v).all():
                    i = int(np.flatnonzero(~np.isfinite(v))[0])
                    raise EventLogError(
                        f"{where(c)} must be finite, got {v[i]} at data row {row0 + i + 1}"
                    )
                # Kept as float32: a finite value beyond its range used to become Inf
                # here, after the check, and NaN/Inf features after standardising.
                big = np.flatnonzero(np.abs(v) > float(np.finfo(np.float32).max))
                if big.size:
                    i = int(big[0])
                    raise EventLogError(
                        f"{where(c)} must fit a float32 (|x| <= 3.4e38), got {v[i]} at data "
                        f"row {row0 + i + 1}"
                    )
                dense[j].append(v.astype(np.float32))
            file_rows += len(lab)
        n_rows += file_rows
    if n_rows == 0:
        raise EventLogError(
            f"{cfg.path}: the log holds no events (only header rows)"
            if files
            else f"{cfg.path}: no files"
        )
    t_read = time.perf_counter() - t0

    user = np.concatenate(cols.pop("user"))
    _check_time_precision(cols["time"], time_where, fractional)
    times = np.concatenate(cols.pop("time"))
    if times.dtype != np.int64:
        times = times.astype(np.float64)
    # One stable sort by (user, time): the file order breaks ties.
    order = np.argsort(times, kind="stable")
    order = order[np.argsort(user[order], kind="stable")]
    user = user[order]
    times = times[order]
    n = n_rows
    # Row positions fit int32 below 2^31 events: 4 bytes per event less at each step.
    pos_dtype = np.int32 if n < 2**31 else np.int64
    idx = np.arange(n, dtype=pos_dtype)
    new_user = np.empty(n, dtype=bool)
    new_user[0] = True
    np.not_equal(user[1:], user[:-1], out=new_user[1:])
    user_start = np.maximum.accumulate(np.where(new_user, idx, pos_dtype(0)))
    new_time = new_user.copy()
    new_time[1:] |= times[1:] != times[:-1]
    tie_start = np.maximum.accumulate(np.where(new_time, idx, pos_dtype(0)))
    del new_time
    prior = (tie_start - user_start).astype(np.int32)  # strictly earlier events of the user
    tie_pos = (idx - tie_start).astype(np.int32)
    del tie_start

    # Splits.
    split = np.zeros(n, dtype=np.int8)
    cutoffs: dict[str, float] | None = None
    if cfg.split == "time":
        k_valid = int(math.floor(n * (1.0 - cfg.valid_fraction - cfg.test_fraction)))
        k_test = int(math.floor(n * (1.0 - cfg.test_fraction)))
        t_valid, t_test = _kth(times, k_valid), _kth(times, k_test)
        split[times >= t_valid] = VALID
        split[times >= t_test] = TEST
        cutoffs = {"valid_from": float(t_valid / unit), "test_from": float(t_test / unit)}
    else:
        counts = np.diff(np.append(np.flatnonzero(new_user), n))
        per_event = np.repeat(counts, counts)
        pos: np.ndarray = idx - user_start
        n_test = np.floor(per_event * cfg.test_fraction + 0.5).astype(np.int64)
        n_eval_f = np.floor(per_event * (cfg.valid_fraction + cfg.test_fraction) + 0.5)
        n_eval = np.maximum(n_eval_f.astype(np.int64), n_test)
        # As documented, a user with one event keeps it in training (with
        # test_fraction >= 0.5 the rounding used to move it to test).
        n_test[per_event == 1] = 0
        n_eval[per_event == 1] = 0
        split[pos >= per_event - n_eval] = VALID
        split[pos >= per_event - n_test] = TEST
        del counts, per_event, pos, n_test, n_eval_f, n_eval
    del new_user, user_start, idx
    train = split == TRAIN
    if not train.any():
        raise EventLogError(f"{cfg.path}: the training split is empty (check the split fractions)")

    tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "vocab").mkdir(parents=True)

    def save(name: str, array: np.ndarray) -> None:
        np.save(tmp / f"{name}.npy", np.ascontiguousarray(array))

    vocab_sizes: dict[str, int] = {}
    user_ids, known = _remap_known(user, train, len(enc["user"].codes))
    _write_vocab(tmp / "vocab" / "user.jsonl", enc["user"], known)
    vocab_sizes["user"] = len(known) + 1
    save("user", user_ids)
    del user, user_ids
    item = np.concatenate(cols.pop("item"))[order]
    item_ids, known = _remap_known(item, train, len(enc["item"].codes))
    _write_vocab(tmp / "vocab" / "item.jsonl", enc["item"], known)
    vocab_sizes["item"] = len(known) + 1
    save("item", item_ids)
    checksum_items = int(item_ids.astype(np.int64).sum())
    del item, item_ids
    if cfg.category_column:
        cat = np.concatenate(cols.pop("category"))[order]
        cat_ids, known = _remap_known(cat, train, len(enc["category"].codes))
        _write_vocab(tmp / "vocab" / "category.jsonl", enc["category"], known)
        vocab_sizes["category"] = len(known) + 1
        save("category", cat_ids)
        del cat, cat_ids
    if cfg.user_feature_columns:
        tags = np.empty((n, len(cfg.user_feature_columns)), dtype=np.int32)
        offset = 0
        for j, c in enumerate(cfg.user_feature_columns):
            codes = np.concatenate(feats[j])[order]
            local, known = _remap_known(codes, train, len(feat_enc[j].codes))
            _write_vocab(tmp / "vocab" / f"feature_{j}.jsonl", feat_enc[j], known)
            # One shared bag table: 0 = unknown (any column), then each column's values.
            tags[:, j] = np.where(local > 0, local + offset, 0)
            vocab_sizes[f"feature_{j}:{c}"] = len(known) + 1
            offset += len(known)
        save("tags", tags)
        del tags
    labels = np.concatenate(cols.pop("label"))[order]
    save("label", labels)
    if cfg.conversion_column:
        save("conversion", np.concatenate(cols.pop("conversion"))[order])
    dense_stats = []
    if cfg.dense_columns:
        mat = np.empty((n, len(cfg.dense_columns)), dtype=np.float32)
        for j, c in enumerate(cfg.dense_columns):
            v = np.concatenate(dense[j])[order]
            mean = float(v[train].astype(np.float64).mean())
            std = float(v[train].astype(np.float64).std())
            std = std if std > 0 else 1.0
            # In float64: float32 arithmetic could overflow (v - mean) near the range.
            mat[:, j] = (v.astype(np.float64) - mean) / std
            dense_stats.append({"column": c, "mean": mean, "std": std})
        save("dense", mat)
        del mat
    seconds = (times // unit).astype(np.int64) if times.dtype == np.int64 else None
    if seconds is None:
        seconds = np.floor(times / unit).astype(np.int64)
    save("time", seconds)
    save("prior", prior)
    save("tie_pos", tie_pos)
    split_counts = {}
    for s, name in SPLITS.items():
        rows = np.flatnonzero(split == s)
        # Time order inside each split ("shuffle=False" trains in time order), by the
        # raw times: whole seconds would order sub-second events by user instead.
        rows = rows[np.argsort(times[rows], kind="stable")]
        save(f"rows_{name}", rows.astype(np.int64))
        split_counts[name] = int(rows.shape[0])
    positives = {name: int(labels[split == s].astype(np.int64).sum()) for s, name in SPLITS.items()}
    fingerprint = hashlib.sha256(
        json.dumps(
            [n, split_counts, vocab_sizes, positives, checksum_items, int(seconds.sum())],
            sort_keys=True,
        ).encode()
    ).hexdigest()[:32]
    info = {
        "key": key,
        "events": n,
        "splits": split_counts,
        "positives": positives,
        "vocab_sizes": vocab_sizes,
        "cutoffs_s": cutoffs,
        "dense_columns": dense_stats,
        "has_category": bool(cfg.category_column),
        "has_conversion": bool(cfg.conversion_column),
        "user_features": list(cfg.user_feature_columns),
        "fingerprint": fingerprint,
        "content_digest": _prepared_digest(tmp),
        "read_s": t_read,
        "prepare_s": time.perf_counter() - t0,
    }
    (tmp / "prepared.json").write_text(json.dumps(info, indent=1) + "\n")
    if cache.exists():
        old = cache.with_name(f".{cache.name}.old-{os.getpid()}")
        cache.rename(old)
        tmp.rename(cache)
        shutil.rmtree(old)
    else:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(cache)
    return info


def _check_time_precision(
    chunks: list[np.ndarray],
    where: list[tuple[str, int]],
    fractional: list[tuple[str, int, float]],
) -> None:
    """Refuse fractional times beside integer times that a float64 cannot hold exactly.

    Fractional times make the whole time column float64, exact for integers up to
    2^53 only (seconds and milliseconds since 1970 are far below; microseconds and
    nanoseconds are not): rounding them would merge distinct events into ties silently.
    """
    if not fractional:
        return
    exact = 2**53
    for chunk, (column, row0) in zip(chunks, where):
        if chunk.dtype != np.int64:
            continue
        big = np.flatnonzero(np.abs(chunk) > exact)
        if big.size:
            i = int(big[0])
            f_where, f_row, f_value = fractional[0]
            raise EventLogError(
                f"{f_where} has a fractional time ({f_value!r} at data row {f_row}) while "
                f"{column} has integer times beyond 2^53 ({int(chunk[i])} at data row "
                f"{row0 + i + 1}), which a float64 would round: write whole "
                "numbers in the time column (a finer EventLogConfig.time_unit if needed)"
            )


def _narrow(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.int32) if codes.size and int(codes.max()) < 2**31 - 1 else codes


def _check_binary(values: np.ndarray, where: str, row0: int, hint: str) -> None:
    bad = np.flatnonzero((values != 0) & (values != 1))
    if bad.size:
        i = int(bad[0])
        raise EventLogError(
            f"{where} must hold 0 or 1 ({hint}), got {values[i]!r} at data row {row0 + i + 1}"
        )


# -- the source ---------------------------------------------------------------------------
class EventLogSource:
    """A prepared event log served as a :class:`~hyperrec.integration.data.DataSource`.

    Use :meth:`open` (prepares when needed). Every column is a read-only memory map;
    a batch gathers only its requests' rows and their histories.

    Args:
        config: the log description.
        cache_dir: a directory written by :func:`prepare_event_log` for ``config``.

    Raises:
        FileNotFoundError: ``cache_dir`` holds no preparation.
        ValueError: the preparation was made for another config or other files.
    """

    def __init__(self, config: EventLogConfig, cache_dir: str | Path):
        if not isinstance(config, EventLogConfig):
            raise TypeError(f"config must be an EventLogConfig, got {type(config).__name__}")
        self.config = config
        self.cache_dir = Path(cache_dir)
        info_path = self.cache_dir / "prepared.json"
        if not info_path.is_file():
            raise FileNotFoundError(f"{self.cache_dir} holds no prepared event log")
        self.info = json.loads(info_path.read_text())
        want = _preparation_key(config, _input_files(config))
        if self.info.get("key") != want:
            raise ValueError(
                f"{self.cache_dir} was prepared for other files or another EventLogConfig; "
                "prepare it again (prepare_event_log)"
            )

        self._map_arrays()
        # Preparations before the digest existed: computed here (streamed), not stored.
        self.content_digest: str = self.info.get("content_digest") or _prepared_digest(
            self.cache_dir
        )
        """sha256 of the prepared arrays and vocabularies (see :meth:`state_dict`)."""
        sizes = self.info["vocab_sizes"]
        num_tags = 1 + sum(v - 1 for k, v in sizes.items() if k.startswith("feature_"))
        actions: tuple[str, ...] = ("negative", "positive")
        if self._conversion is not None:
            actions += ("conversion",)
        self._schema = DataSchema(
            num_items=sizes["item"],
            num_categories=sizes.get("category", 1),
            num_tags=num_tags,
            actions=actions,
            dense_features=EVENT_DENSE_FEATURES + tuple(config.dense_columns),
            max_seqlen=config.max_seqlen,
            tasks=("ctr", "cvr") if self._conversion is not None else ("ctr",),
        )

    # The memory-mapped columns: mapped again from the cache directory when unpickled.
    _ARRAYS = ("_user", "_item", "_time", "_label", "_prior", "_tie_pos", "_category",
               "_conversion", "_tags", "_dense", "_rows")  # fmt: skip

    def _map_arrays(self) -> None:
        def load(name: str) -> np.ndarray:
            return np.load(self.cache_dir / f"{name}.npy", mmap_mode="r")

        self._user = load("user")
        self._item = load("item")
        self._time = load("time")
        self._label = load("label")
        self._prior = load("prior")
        self._tie_pos = load("tie_pos")
        self._category = load("category") if self.info["has_category"] else None
        self._conversion = load("conversion") if self.info["has_conversion"] else None
        self._tags = load("tags") if self.info["user_features"] else None
        self._dense = load("dense") if self.info["dense_columns"] else None
        self._rows = {s: load(f"rows_{name}") for s, name in SPLITS.items()}

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the memory maps: a pickled np.memmap is a full in-memory copy,
        so each ``DataLoader`` worker (``train.data_workers``) received the whole
        prepared log. The worker maps the files of ``cache_dir`` again instead."""
        state = {k: v for k, v in self.__dict__.items() if k not in self._ARRAYS}
        # Absolute: a worker process need not share this process's working directory.
        state["cache_dir"] = self.cache_dir.absolute()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Map the prepared columns of ``cache_dir`` again.

        Raises:
            ValueError: ``cache_dir`` now holds another preparation than the pickled
                source had (it was prepared again in between).
        """
        self.__dict__.update(state)
        try:
            info = json.loads((self.cache_dir / "prepared.json").read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("key") != self.info.get("key") or info.get("content_digest") not in (
            None,
            self.content_digest,
        ):
            raise ValueError(
                f"{self.cache_dir} no longer holds the prepared event log this source was "
                "opened on (it was prepared again)"
            )
        self._map_arrays()

    @classmethod
    def open(cls, config: EventLogConfig, cache_dir: str | Path) -> EventLogSource:
        """Prepare ``config``'s log into ``cache_dir`` unless a matching preparation is
        there, then open it. Raises as :func:`prepare_event_log`."""
        prepare_event_log(config, cache_dir)
        return cls(config, cache_dir)

    # -- the DataSource protocol -----------------------------------------------------
    @property
    def schema(self) -> DataSchema:
        """Item / category / tag vocabularies (with the reserved row 0), dense columns,
        the history cap and the tasks (CTR, plus CVR with a conversion column)."""
        return self._schema

    def num_requests(self, split: int) -> int:
        """Events in ``split``.

        Raises:
            ValueError: unknown split.
        """
        _check_split(split)
        return int(self._rows[split].shape[0])

    def truth(self, split: int, ids: np.ndarray) -> None:
        """``None``: a log has no ground truth."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """``{"source": "event_log", "fingerprint": ..., "content_digest": ..., "events":
        ..., "splits": ...}``: ``fingerprint`` hashes aggregates (counts, sums),
        ``content_digest`` every byte of the prepared arrays and vocabularies."""
        return {
            "source": "event_log",
            "fingerprint": self.info["fingerprint"],
            "content_digest": self.content_digest,
            "events": self.info["events"],
            "splits": self.info["splits"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that ``state`` describes this prepared log: the same prepared arrays and
        vocabularies, byte for byte (states saved before ``content_digest`` existed are
        checked by their aggregate ``fingerprint`` only).

        Raises:
            ValueError: another source, or a log whose content or split differs.
        """
        mine = self.state_dict()
        if not isinstance(state, dict) or state.get("source") != "event_log":
            raise ValueError(f"the saved data source is not an event log: {state!r:.200}")
        digest = state.get("content_digest", mine["content_digest"])
        if state.get("fingerprint") != mine["fingerprint"] or digest != mine["content_digest"]:
            same_counts = state.get("fingerprint") == mine["fingerprint"]
            raise ValueError(
                f"the saved event log ({state.get('events')} events, splits "
                f"{state.get('splits')}) is not this one ({mine['events']} events, splits "
                f"{mine['splits']}"
                + (
                    f"; the same counts, other content: prepared data digest "
                    f"{str(digest)[:16]}... saved, {mine['content_digest'][:16]}... here"
                    if same_counts
                    else ""
                )
                + "): a resumed run must read the same data"
            )

    def _rows_of(self, split: int, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        _check_split(split)
        arr = np.asarray(ids)
        check_integer_ids(arr)
        ids = arr.astype(np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("ids is empty: a batch needs at least one request")
        n = self._rows[split].shape[0]
        if int(ids.min()) < 0 or int(ids.max()) >= n:
            raise ValueError(
                f"ids must lie in [0, {n}) for the {SPLITS[split]} split, got "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        return ids, np.asarray(self._rows[split][ids])

    def history_lengths(self, split: int, ids: np.ndarray) -> np.ndarray:
        """int64 history length (capped) of each request."""
        _, rows = self._rows_of(split, ids)
        return np.minimum(self._prior[rows], self.config.max_seqlen).astype(np.int64)

    def batch(self, split: int, ids: np.ndarray | list[int]) -> Batch:
        """The events ``ids`` of ``split`` as requests (one candidate each).

        Raises:
            ValueError: unknown split, empty ids or ids outside the split.
            TypeError: ``ids`` not integers (floats, booleans, strings).
        """
        ids, rows = self._rows_of(split, ids)
        cap = self.config.max_seqlen
        prior = self._prior[rows].astype(np.int64)
        lengths = np.minimum(prior, cap)
        end = rows - self._tie_pos[rows]  # first event sharing the request's timestamp
        h_off = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=h_off[1:])
        total = int(h_off[-1])
        flat = np.repeat(end - lengths - h_off[:-1], lengths) + np.arange(total)
        h_label = self._label[flat].astype(np.int64)
        if self._conversion is not None:
            h_action = h_label + self._conversion[flat].astype(np.int64)
        else:
            h_action = h_label
        request_time = self._time[rows].astype(np.int64)
        owner = np.repeat(np.arange(rows.shape[0]), lengths)
        positives = np.bincount(owner, weights=h_label, minlength=rows.shape[0])
        hour = (request_time % 86400) / 3600.0
        log_cap = math.log1p(cap)
        derived = [
            np.log1p(lengths) / log_cap,
            positives / np.maximum(lengths, 1),
            np.log1p(prior) / log_cap,
            np.sin(2 * np.pi * hour / 24.0),
            np.cos(2 * np.pi * hour / 24.0),
        ]
        dense = np.stack(derived, axis=1).astype(np.float32)
        if self._dense is not None:
            dense = np.concatenate([dense, np.asarray(self._dense[rows])], axis=1)
        b = rows.shape[0]
        if self._tags is not None:
            k = self._tags.shape[1]
            tags = np.asarray(self._tags[rows]).reshape(-1).astype(np.int64)
            t_off = np.arange(b + 1, dtype=np.int64) * k
        else:
            tags = np.zeros(0, dtype=np.int64)
            t_off = np.zeros(b + 1, dtype=np.int64)
        if self._category is not None:
            h_cat = self._category[flat].astype(np.int64)
            c_cat = self._category[rows].astype(np.int64)
        else:
            h_cat = np.zeros(total, dtype=np.int64)
            c_cat = np.zeros(b, dtype=np.int64)
        click = self._label[rows].astype(np.float32)
        conv = (
            self._conversion[rows].astype(np.float32)
            if self._conversion is not None
            else np.zeros(b, dtype=np.float32)
        )

        def t(x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)

        return Batch(
            sample_ids=t(ids),
            user_ids=t(self._user[rows].astype(np.int64)),
            request_time=t(request_time),
            dense=t(dense, torch.float32),
            tag_offsets=t(t_off),
            tags=t(tags),
            history_offsets=t(h_off),
            history_items=t(self._item[flat].astype(np.int64)),
            history_categories=t(h_cat),
            history_actions=t(h_action),
            history_time=t(self._time[flat].astype(np.int64)),
            candidate_offsets=t(np.arange(b + 1, dtype=np.int64)),
            candidate_items=t(self._item[rows].astype(np.int64)),
            candidate_categories=t(c_cat),
            click=t(click, torch.float32),
            conversion=t(conv, torch.float32),
            max_history_len=int(lengths.max()),
        )

    # -- vocabularies -----------------------------------------------------------------
    def vocabulary(self, column: str) -> list[str | None]:
        """Raw ids by dense id (index 0 = ``None``, the unknown row) of ``column``:
        "user", "item", "category" or a user-feature column name.

        Raises:
            ValueError: no such vocabulary.
        """
        name = column
        if column in self.info["user_features"]:
            name = f"feature_{self.info['user_features'].index(column)}"
        path = self.cache_dir / "vocab" / f"{name}.jsonl"
        if not path.is_file():
            raise ValueError(
                f"column must be 'user', 'item', 'category' or a user feature, got {column!r}"
            )
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    def encode(self, column: str, raw_ids: list[Any]) -> np.ndarray:
        """Dense ids (int64) of ``raw_ids`` in ``column``'s vocabulary; unknown ids -> 0.

        Raw ids are compared as text, as the reader read them (``7`` and ``"7"`` match).
        """
        table = {v: i for i, v in enumerate(self.vocabulary(column)) if i}
        return np.array([table.get(str(r), 0) for r in raw_ids], dtype=np.int64)


def _check_split(split: Any) -> None:
    if isinstance(split, bool) or split not in SPLITS:
        raise ValueError(
            f"split must be TRAIN ({TRAIN}), VALID ({VALID}) or TEST ({TEST}), got {split!r}"
        )


# -- an example log -----------------------------------------------------------------------
def write_example_log(
    path: str | Path,
    *,
    users: int = 500,
    items: int = 1000,
    events_per_user: int = 40,
    topics: int = 20,
    seed: int = 0,
    rating: bool = False,
    string_ids: bool = True,
) -> Path:
    """Write a small synthetic interaction log in the documented format (for examples
    and tests; nothing is downloaded).

    Columns: ``user_id`` (``"u17"``, or ints with ``string_ids=False``), ``item_id``,
    ``timestamp`` (seconds), ``label`` (0/1; with ``rating=True`` a ``rating`` 1-5
    instead, 4 and 5 meaning "liked"), ``category`` (the item's topic), ``country`` (a
    user feature) and ``price`` (a numeric column). Users browse in sessions: the topic
    of the session's recent events and the user's two favourite topics make a click
    likely, so the order of events matters and a model reading the history beats item
    popularity. ``.parquet`` paths need pyarrow.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    fav = rng.integers(0, topics, size=(users, 2))
    country = rng.integers(0, 7, size=users)
    item_topic = rng.integers(0, topics, size=items)
    item_bias = rng.normal(0.0, 0.5, size=items)
    price = rng.lognormal(3.0, 1.0, size=items)
    by_topic = [np.flatnonzero(item_topic == k) for k in range(topics)]
    rows = []
    for u in range(users):
        t = 1_700_000_000 + int(rng.integers(0, 86_400 * 3))
        session = int(fav[u, rng.integers(0, 2)])
        n = max(1, int(rng.poisson(events_per_user)))
        for _ in range(n):
            if rng.random() < 0.15:  # a new session: new topic, hours later
                session = (
                    int(fav[u, rng.integers(0, 2)])
                    if rng.random() < 0.5
                    else int(rng.integers(0, topics))
                )
                t += int(rng.integers(3_600, 86_400 * 4))
            else:
                t += int(rng.integers(0, 600))  # 0: duplicate timestamps happen
            r = rng.random()
            k = session if r < 0.5 else int(fav[u, 0]) if r < 0.65 else int(rng.integers(0, topics))
            pool = by_topic[k] if by_topic[k].size else np.arange(items)
            item = int(pool[min(int(rng.zipf(1.3)) - 1, pool.size - 1)])
            logit = -1.6 + 1.6 * (k == session) + 1.0 * (k in fav[u]) + item_bias[item]
            p = 1.0 / (1.0 + math.exp(-logit))
            liked = rng.random() < p
            if rating:
                value = int(rng.integers(4, 6)) if liked else int(rng.integers(1, 4))
            else:
                value = int(liked)
            rows.append(
                (
                    f"u{u}" if string_ids else u,
                    item,
                    t,
                    value,
                    f"topic{item_topic[item]}",
                    f"c{country[u]}",
                    round(float(price[item]), 2),
                )
            )
    names = ["user_id", "item_id", "timestamp", "rating" if rating else "label", "category",
             "country", "price"]  # fmt: skip
    order = rng.permutation(len(rows))  # logs are rarely sorted: the reader sorts
    rows = [rows[i] for i in order]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in (".parquet", ".pq"):
        pa = _require_pyarrow("writing a Parquet example log")
        import pyarrow.parquet as pq

        table = pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})
        pq.write_table(table, str(path))
    else:
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(names)
            w.writerows(rows)
    return path
