"""The event-log reader against a brute-force reference, on small generated logs."""

import csv
import dataclasses
import json
import math
import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from hyperrec.integration import (
    TEST,
    TRAIN,
    VALID,
    EventLogConfig,
    EventLogError,
    EventLogSource,
    prepare_event_log,
    write_example_log,
)
from hyperrec.integration import eventlog as eventlog_module

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

NAMES = ["user_id", "item_id", "timestamp", "label", "category", "country", "row"]


def _random_log(seed=0, users=30, events=600):
    """Rows with string user ids, int item ids, many duplicate timestamps, users with one
    event, long histories, and items that first appear in the last tenth of the time."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(events):
        u = int(rng.zipf(1.5)) % users  # heavy users: histories longer than the cap
        t = 1_000_000 + int(rng.integers(0, 300)) * 60  # 300 distinct times: many ties
        item = int(rng.integers(0, 40))
        if t >= 1_000_000 + 280 * 60 and rng.random() < 0.5:
            item = 1000 + int(rng.integers(0, 5))  # new items, only in the latest events
        rows.append([f"user-{u}", item, t, int(rng.random() < 0.4), f"c{item % 7}",
                     ["fr", "de", "us"][u % 3], r])  # fmt: skip
    for k in range(3):  # users with exactly one event
        rows.append([f"solo-{k}", 3, 1_000_000 + 10 * k, 1, "c3", "fr", len(rows)])
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def _write_csv(path, rows, names=NAMES):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(names)
        w.writerows(rows)
    return path


def _write_parquet(path, rows, names=NAMES):
    pq.write_table(pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)}), str(path))
    return path


def _cfg(path, **kw):
    base = dict(
        path=str(path),
        max_seqlen=8,
        category_column="category",
        user_feature_columns=("country",),
        dense_columns=("row",),
    )
    base.update(kw)
    return EventLogConfig(**base)


def _reference_histories(rows, cap):
    """row id -> raw items of its history (strictly earlier events of the user, file order
    breaking ties, the latest ``cap``), by brute force."""
    by_user = {}
    for r in rows:  # the list is in file order
        by_user.setdefault(r[0], []).append(r)
    out = {}
    for r in rows:
        earlier = [e for e in by_user[r[0]] if e[2] < r[2]]
        earlier.sort(key=lambda e: e[2])  # stable: file order among equal times
        out[r[6]] = earlier[-cap:] if cap else []
    return out


def _row_ids(src, batch):
    std = src.info["dense_columns"][0]["std"]
    mean = src.info["dense_columns"][0]["mean"]
    return np.rint(batch.dense[:, -1].double().numpy() * std + mean).astype(int)


@pytest.mark.parametrize("fmt", ["csv", "csv-python", "parquet"])
def test_requests_match_a_brute_force_reference(tmp_path, fmt):
    rows = _random_log()
    if fmt == "parquet":
        path = _write_parquet(tmp_path / "log.parquet", rows)
    else:
        path = _write_csv(tmp_path / "log.csv", rows)
    cfg = _cfg(path, reader="python" if fmt == "csv-python" else "auto")
    src = EventLogSource.open(cfg, tmp_path / "cache")
    ref = _reference_histories(rows, cfg.max_seqlen)
    by_id = {r[6]: r for r in rows}
    seen = set()
    longest = 0
    for split in (TRAIN, VALID, TEST):
        n = src.num_requests(split)
        batch = src.batch(split, np.arange(n))
        batch.validate(src.schema)
        rids = _row_ids(src, batch)
        seen.update(rids.tolist())
        h = batch.history_offsets.numpy()
        for b, rid in enumerate(rids):
            r = by_id[rid]
            hist = ref[rid]
            lo, hi = h[b], h[b + 1]
            assert hi - lo == len(hist)
            longest = max(longest, len(hist))
            want_items = src.encode("item", [e[1] for e in hist])
            assert batch.history_items[lo:hi].tolist() == want_items.tolist()
            assert batch.history_time[lo:hi].tolist() == [e[2] for e in hist]
            assert batch.history_actions[lo:hi].tolist() == [e[3] for e in hist]
            assert int(batch.request_time[b]) == r[2]
            assert int(batch.click[b]) == r[3]
            assert int(batch.candidate_items[b]) == src.encode("item", [r[1]])[0]
            assert int(batch.user_ids[b]) == src.encode("user", [r[0]])[0]
            assert int(batch.candidate_categories[b]) == src.encode("category", [r[4]])[0]
            earlier = sum(1 for e in rows if e[0] == r[0] and e[2] < r[2])
            assert math.isclose(float(batch.dense[b, 2]), math.log1p(earlier) / math.log1p(8),
                                rel_tol=1e-6)  # fmt: skip
            pos = sum(e[3] for e in hist) / max(len(hist), 1)
            assert math.isclose(float(batch.dense[b, 1]), pos, rel_tol=1e-6, abs_tol=1e-7)
    assert seen == set(by_id)  # every event is exactly one request
    assert longest == cfg.max_seqlen  # some histories were truncated (oldest dropped)
    assert src.schema.tasks == ("ctr",) and src.truth(TRAIN, [0]) is None


def test_csv_engines_and_parquet_prepare_the_same_arrays(tmp_path):
    rows = _random_log(seed=3)
    csv_path = _write_csv(tmp_path / "log.csv", rows)
    pq_path = _write_parquet(tmp_path / "log.parquet", rows)
    infos = [
        prepare_event_log(_cfg(csv_path, reader="pyarrow"), tmp_path / "a"),
        prepare_event_log(_cfg(csv_path, reader="python"), tmp_path / "b"),
        prepare_event_log(_cfg(pq_path), tmp_path / "c"),
    ]
    assert len({i["fingerprint"] for i in infos}) == 1
    assert len({i["content_digest"] for i in infos}) == 1  # the same data to a resume
    for name in ("user", "item", "time", "label", "prior", "tie_pos", "category", "tags"):
        a = np.load(tmp_path / "a" / f"{name}.npy")
        for other in ("b", "c"):
            assert np.array_equal(a, np.load(tmp_path / other / f"{name}.npy")), (name, other)


def test_time_split_cutoffs_and_training_vocabulary(tmp_path):
    rows = _random_log(seed=1)
    src = EventLogSource.open(_cfg(_write_csv(tmp_path / "l.csv", rows)), tmp_path / "c")
    times = {s: src.batch(s, np.arange(src.num_requests(s))).request_time for s in (0, 1, 2)}
    assert int(times[TRAIN].max()) < int(times[VALID].min())
    assert int(times[VALID].max()) < int(times[TEST].min())
    n = len(rows)
    assert src.num_requests(TRAIN) + src.num_requests(VALID) + src.num_requests(TEST) == n
    assert abs(src.num_requests(TEST) - 0.1 * n) < 0.05 * n  # up to ties at the cutoff
    # Items that only occur after the training period map to the reserved row 0.
    test = src.batch(TEST, np.arange(src.num_requests(TEST)))
    new_items = [r for r in rows if r[1] >= 1000]
    train_items = {r[1] for r in rows if r[2] < src.info["cutoffs_s"]["valid_from"]}
    assert new_items and not ({r[1] for r in new_items} & train_items)
    assert (test.candidate_items == 0).any()
    assert src.encode("item", [1000, 1001, "never seen"]).tolist() == [0, 0, 0]
    vocab = src.vocabulary("item")
    assert vocab[0] is None and len(vocab) == src.schema.num_items
    assert set(vocab[1:]) == {str(i) for i in train_items}
    # A vocabulary file is one JSON value per line, row 0 the unknown id.
    lines = (tmp_path / "c" / "vocab" / "user.jsonl").read_text().splitlines()
    assert lines[0] == "null" and json.loads(lines[1]).startswith(("user-", "solo-"))


def test_per_user_split_keeps_each_users_latest_events_for_test(tmp_path):
    rows = _random_log(seed=2)
    cfg = _cfg(_write_csv(tmp_path / "l.csv", rows), split="user", valid_fraction=0.2,
               test_fraction=0.2)  # fmt: skip
    src = EventLogSource.open(cfg, tmp_path / "c")
    split_of = {}
    for s in (TRAIN, VALID, TEST):
        batch = src.batch(s, np.arange(src.num_requests(s)))
        for rid in _row_ids(src, batch):
            split_of[int(rid)] = s
    by_user = {}
    for r in sorted(rows, key=lambda r: r[2]):  # stable: file order among equal times
        by_user.setdefault(r[0], []).append(r[6])
    for user, rids in by_user.items():
        n = len(rids)
        n_test = math.floor(n * 0.2 + 0.5)
        n_eval = max(math.floor(n * 0.4 + 0.5), n_test)
        want = [TRAIN] * (n - n_eval) + [VALID] * (n_eval - n_test) + [TEST] * n_test
        assert [split_of[r] for r in rids] == want, user
    assert [split_of[r[6]] for r in rows if r[0].startswith("solo")] == [TRAIN] * 3


def test_ratings_with_a_threshold_a_conversion_label_and_a_directory(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    names = ["user_id", "item_id", "timestamp", "rating", "bought"]
    events = [(1, 7, 5), (1, 8, 2), (2, 7, 4), (2, 9, 5), (1, 9, 3),
              (2, 8, 1), (1, 7, 4), (2, 7, 5), (1, 8, 5), (2, 9, 2)]  # fmt: skip
    rows = [[u, i, 100 * t, r, int(r == 5 and t % 2 == 0)] for t, (u, i, r) in enumerate(events)]
    _write_csv(folder / "part-0.csv", rows[:5], names)
    _write_parquet(folder / "part-1.parquet", rows[5:], names)
    cfg = EventLogConfig(path=str(folder), label_column="rating", rating_threshold=4.0,
                         conversion_column="bought", max_seqlen=4, valid_fraction=0.2,
                         test_fraction=0.2)  # fmt: skip
    src = EventLogSource.open(cfg, tmp_path / "c")
    assert src.schema.tasks == ("ctr", "cvr")
    assert src.schema.actions == ("negative", "positive", "conversion")
    batch = src.batch(TRAIN, np.arange(src.num_requests(TRAIN)))
    batch.validate(src.schema)
    by_time = {r[2]: r for r in rows}
    for b in range(batch.num_requests):
        r = by_time[int(batch.request_time[b])]
        assert int(batch.click[b]) == int(r[3] >= 4) and int(batch.conversion[b]) == r[4]
    assert src.info["events"] == 10


@pytest.mark.parametrize(
    ("content", "kw", "match"),
    [
        ("", {}, "the file is empty"),
        ("user_id,item_id,timestamp,label\n", {}, "holds no events"),
        ("user_id,item_id,label\nu,1,0\n", {}, "missing column 'timestamp'"),
        ("user_id,item_id,timestamp,label\nu,1,100,0\nv,2,yesterday,1\n", {},
         r"column 'timestamp' must be numeric, got 'yesterday' at data row 2"),
        ("user_id,item_id,timestamp,label\nu,1,100,3\n", {},
         r"column 'label' must hold 0 or 1 \(set rating_threshold"),
        ("user_id,item_id,timestamp,label,price\nu,1,100,1,nan\n", {"dense_columns": ("price",)},
         "column 'price' must be finite"),
        ("user_id,item_id,timestamp,label,conv\nu,1,100,0,1\n", {"conversion_column": "conv"},
         "conversion needs a click"),
        ("user_id,item_id,timestamp,label\n,1,100,0\n", {}, "column 'user_id' has an empty id"),
        ("user_id,item_id,timestamp,label\nu,1,100\n", {"reader": "python"},
         "line 2 has 3 fields"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("reader", ["pyarrow", "python"])
def test_bad_csv_logs_name_the_file_and_column(tmp_path, content, kw, match, reader):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    cfg = EventLogConfig(path=str(path), **{"reader": reader, **kw})
    with pytest.raises(EventLogError, match=match) as info:
        prepare_event_log(cfg, tmp_path / "c")
    assert str(path) in str(info.value)
    assert not (tmp_path / "c").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"user_id": ["a"], "item_id": [1], "label": [0]}, "missing column 'timestamp'"),
        ({"user_id": ["a"], "item_id": [1], "timestamp": ["soon"], "label": [0]},
         "column 'timestamp' must be numeric, got 'soon'"),
        ({"user_id": ["a"], "item_id": [1], "timestamp": pa.array([None], pa.int64()),
          "label": [0]}, "column 'timestamp' must be numeric, got a null"),
    ],
)  # fmt: skip
def test_bad_parquet_logs_name_the_file_and_column(tmp_path, table, match):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(table), str(path))
    with pytest.raises(EventLogError, match=match) as info:
        prepare_event_log(EventLogConfig(path=str(path)), tmp_path / "c")
    assert str(path) in str(info.value)
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(EventLogError, match="the file is empty"):
        prepare_event_log(EventLogConfig(path=str(empty)), tmp_path / "c")


def test_missing_paths_and_bad_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="EventLogConfig.path"):
        prepare_event_log(EventLogConfig(path=str(tmp_path / "nope.csv")), tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    with pytest.raises(EventLogError, match="no .csv, .parquet"):
        prepare_event_log(EventLogConfig(path=str(tmp_path / "d")), tmp_path / "c")
    (tmp_path / "x.log").write_text("user_id\n")
    with pytest.raises(EventLogError, match="set EventLogConfig.format"):
        prepare_event_log(EventLogConfig(path=str(tmp_path / "x.log")), tmp_path / "c")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    path = _write_parquet(tmp_path / "l.parquet", _random_log(events=20))

    def no_pyarrow(why):
        raise ImportError(f"{why} needs pyarrow: pip install 'hyperrec-integration[parquet]'")

    monkeypatch.setattr(eventlog_module, "_require_pyarrow", no_pyarrow)
    monkeypatch.setattr(eventlog_module, "_have_pyarrow", lambda: False)
    with pytest.raises(ImportError, match=r"hyperrec-integration\[parquet\]"):
        prepare_event_log(EventLogConfig(path=str(path)), tmp_path / "c")
    # CSV still works: the standard-library reader.
    csv_path = _write_csv(tmp_path / "l.csv", _random_log(events=20))
    info = prepare_event_log(EventLogConfig(path=str(csv_path)), tmp_path / "c2")
    assert info["events"] == 23


def test_preparation_is_reused_and_redone_when_the_inputs_change(tmp_path):
    path = _write_csv(tmp_path / "l.csv", _random_log(events=50))
    cfg = _cfg(path)
    first = prepare_event_log(cfg, tmp_path / "c")
    assert prepare_event_log(dataclasses.replace(cfg, max_seqlen=3), tmp_path / "c") == first
    _write_csv(path, _random_log(seed=9, events=60))
    again = prepare_event_log(cfg, tmp_path / "c")
    assert again["events"] == 63 and again["fingerprint"] != first["fingerprint"]
    src = EventLogSource(cfg, tmp_path / "c")
    with pytest.raises(ValueError, match="not this one"):
        src.load_state_dict({**src.state_dict(), "fingerprint": first["fingerprint"]})
    with pytest.raises(ValueError, match="prepared for other files"):
        EventLogSource(dataclasses.replace(cfg, split="user"), tmp_path / "c")


def test_a_resume_state_tells_logs_with_the_same_counts_apart(tmp_path):
    # Before: the state's fingerprint hashed aggregates only (counts, vocabulary sizes,
    # positives, sums of item ids and times), so a log with two training labels swapped,
    # or an event moved to another user, resumed silently as the same data.
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rows = _random_log(seed=seed, events=300)
    (tmp_path / "a").mkdir()
    src = EventLogSource.open(_cfg(_write_csv(tmp_path / "a" / "log.csv", rows)), tmp_path / "ca")
    early = sorted(range(len(rows)), key=lambda i: rows[i][2])[: len(rows) // 2]  # training
    zero = next(i for i in early if rows[i][3] == 0)
    one = next(i for i in early if rows[i][3] == 1)
    swapped = [list(r) for r in rows]
    swapped[zero][3], swapped[one][3] = 1, 0
    users = Counter(rows[i][0] for i in early)
    donor = next(i for i in early if users[rows[i][0]] > 1)
    moved = [list(r) for r in rows]
    moved[donor][0] = next(u for u in users if u != rows[donor][0])
    for name, variant in (("swapped", swapped), ("moved", moved)):
        (tmp_path / name).mkdir()
        other = EventLogSource.open(_cfg(_write_csv(tmp_path / name / "log.csv", variant)),
                                    tmp_path / f"c{name}")  # fmt: skip
        assert other.info["fingerprint"] == src.info["fingerprint"], (seed, name)  # same counts
        with pytest.raises(ValueError, match="other content.*must read the same data"):
            src.load_state_dict(other.state_dict())
    # The same log elsewhere (moved, another cache) is the same data.
    (tmp_path / "b").mkdir()
    same = EventLogSource.open(_cfg(_write_csv(tmp_path / "b" / "log.csv", rows)), tmp_path / "cb")
    assert same.state_dict() == src.state_dict()
    src.load_state_dict(same.state_dict())
    # A state saved before the digest existed is checked by its fingerprint.
    old = {k: v for k, v in src.state_dict().items() if k != "content_digest"}
    same.load_state_dict(old)
    # A preparation made before the digest existed gets it from its arrays when opened.
    info = json.loads((tmp_path / "cb" / "prepared.json").read_text())
    del info["content_digest"]
    (tmp_path / "cb" / "prepared.json").write_text(json.dumps(info))
    assert EventLogSource(_cfg(tmp_path / "b" / "log.csv"), tmp_path / "cb").content_digest == (
        src.content_digest
    )


def test_a_pickled_source_maps_its_columns_again_instead_of_copying_them(tmp_path):
    # Before: np.memmap columns pickle as full copies, so every DataLoader worker
    # (train.data_workers > 0) received the whole prepared log through a pipe.
    seed = int(np.random.SeedSequence().entropy % 2**31)
    path = _write_csv(tmp_path / "l.csv", _random_log(seed=seed, events=3000))
    src = EventLogSource.open(_cfg(path), tmp_path / "c")
    blob = pickle.dumps(src)
    npy = sum(f.stat().st_size for f in (tmp_path / "c").glob("*.npy"))
    assert len(blob) < 16_384 < npy, (len(blob), npy)
    copy = pickle.loads(blob)
    for name in EventLogSource._ARRAYS:
        mine, theirs = getattr(src, name), getattr(copy, name)
        if name == "_rows":
            assert mine.keys() == theirs.keys()
            pairs = [(mine[k], theirs[k]) for k in mine]
        else:
            pairs = [(mine, theirs)] if mine is not None else []
            assert (theirs is None) == (mine is None), name
        for a, b in pairs:
            assert isinstance(b, np.memmap), name  # mapped, not copied
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert copy.state_dict() == src.state_dict() and copy.schema == src.schema
    ids = np.random.default_rng(seed).choice(src.num_requests(TRAIN), 50, replace=False)
    a, b = src.batch(TRAIN, ids), copy.batch(TRAIN, ids)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("history_items", "dense",
                                                                     "tags", "click"))  # fmt: skip
    # A cache prepared again in between is not silently read as the pickled source.
    _write_csv(path, _random_log(seed=seed + 1, events=100))
    prepare_event_log(_cfg(path), tmp_path / "c")
    with pytest.raises(ValueError, match="no longer holds the prepared event log"):
        pickle.loads(blob)


def test_bad_request_ids(tmp_path):
    src = EventLogSource.open(_cfg(_write_csv(tmp_path / "l.csv", _random_log(events=40))),
                              tmp_path / "c")  # fmt: skip
    with pytest.raises(ValueError, match="ids is empty"):
        src.batch(TRAIN, [])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, "):
        src.batch(TEST, [src.num_requests(TEST)])
    with pytest.raises(ValueError, match="split must be"):
        src.batch(5, [0])
    for bad in ([1.5, 2.7], [True, False, True], ["3"]):  # were truncated / read as 0 and 1
        with pytest.raises(TypeError, match="ids must be integer"):
            src.batch(TRAIN, bad)
        with pytest.raises(TypeError, match="ids must be integer"):
            src.history_lengths(TRAIN, np.asarray(bad))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"valid_fraction": 0.6, "test_fraction": 0.4}, "must be < 1"),
        ({"split": "random"}, "EventLogConfig.split"),
        ({"user_column": ""}, "user_column must not be empty"),
        ({"label_column": "item_id"}, "names the column 'item_id' twice"),
        ({"dense_columns": "price"}, "dense_columns must be a tuple"),
        ({"rating_threshold": math.nan}, "rating_threshold"),
        ({"max_seqlen": 0}, "max_seqlen"),
    ],
)
def test_event_log_config_is_validated(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EventLogConfig(path="x.csv", **kw)


def test_example_log_round_trips(tmp_path):
    path = write_example_log(tmp_path / "ex.parquet", users=20, events_per_user=10)
    src = EventLogSource.open(
        EventLogConfig(path=str(path), category_column="category",
                       user_feature_columns=("country",), dense_columns=("price",)),
        tmp_path / "c",
    )  # fmt: skip
    assert src.num_requests(TRAIN) > 0 and src.schema.num_dense == 6
    src.batch(TRAIN, np.arange(src.num_requests(TRAIN))).validate(src.schema)


def test_logs_command_writes_an_example_and_prepares_it(tmp_path, capsys):
    from hyperrec.integration.logs import main as logs_main

    path = tmp_path / "ex.csv"
    assert logs_main(["example", str(path), "--users", "10", "--events-per-user", "5"]) == 0
    assert logs_main(["prepare", str(path), "--cache", str(tmp_path / "c"),
                      "--set", "category_column=category"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{") :])["vocab_sizes"]["category"] > 1
    assert logs_main(["prepare", str(path), "--cache", str(tmp_path / "c"), "--set", "x=1"]) == 2
    assert "EventLogConfig has no field 'x'" in capsys.readouterr().err
