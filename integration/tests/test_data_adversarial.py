"""Adversarial checks of the data path: the synthetic generator, :class:`Batch`, batch
validation, the request order and the :class:`StepLoader`.

Batches are compared with an independent numpy reference (each request generated alone,
sliced out by hand-computed offsets) on compositions the other test files do not use:
random jagged sizes with empty histories, duplicates and shuffled ids, the held-out
splits, histories long enough for float rounding to show, a batch of one request; the
loader with and without worker processes, after ``close`` and after a resume.
"""

from __future__ import annotations

import copy
import dataclasses
import signal

import numpy as np
import pytest
import torch

from hyperrec.integration import TEST, TRAIN, VALID, DataConfig, SyntheticRecsysData
from hyperrec.integration.data import Batch
from hyperrec.integration.loader import StepLoader, _Built, _pin, validate_batch
from hyperrec.integration.pipeline import RequestOrder, TrainStream, permute

_JAGGED = {
    "tag_offsets": ("tags",),
    "history_offsets": ("history_items", "history_categories", "history_actions", "history_time"),
    "candidate_offsets": ("candidate_items", "candidate_categories", "click", "conversion"),
}
_PER_REQUEST = ("sample_ids", "user_ids", "request_time", "dense")


def _numpy_fields(batch: Batch) -> dict[str, object]:
    return {
        f.name: getattr(batch, f.name).numpy()
        if torch.is_tensor(getattr(batch, f.name))
        else getattr(batch, f.name)
        for f in dataclasses.fields(batch)
    }


def _reference(source, split, ids) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The batch of ``ids`` built by hand: every request generated alone, concatenated
    field by field in order, offsets as the running sum of the per-request lengths."""
    alone = [source.batch_and_truth(split, [i]) for i in ids]
    out: dict[str, np.ndarray] = {}
    for name in _PER_REQUEST:
        out[name] = np.concatenate([getattr(b, name).numpy() for b, _ in alone])
    for off_name, names in _JAGGED.items():
        sizes = [int(getattr(b, off_name)[1]) for b, _ in alone]
        out[off_name] = np.array([0, *np.cumsum(sizes, dtype=np.int64).tolist()], np.int64)
        for name in names:
            out[name] = np.concatenate([getattr(b, name).numpy() for b, _ in alone])
    p_click = np.concatenate([t[0].numpy() for _, t in alone])
    p_cvr = np.concatenate([t[1].numpy() for _, t in alone])
    return out, p_click, p_cvr


def _assert_same_as_reference(source, split, ids) -> None:
    batch, (p_click, p_cvr) = source.batch_and_truth(split, ids)
    ref, ref_click, ref_cvr = _reference(source, split, ids)
    got = _numpy_fields(batch)
    for name, want in ref.items():
        assert got[name].dtype == want.dtype, name
        assert np.array_equal(got[name], want), name
    lengths = np.diff(ref["history_offsets"])
    assert batch.max_history_len == int(lengths.max())
    assert np.array_equal(lengths, source.history_lengths(split, np.asarray(ids)))
    assert np.array_equal(p_click.numpy(), ref_click) and np.array_equal(p_cvr.numpy(), ref_cvr)
    # Candidate / label / truth alignment: the owner of every candidate row.
    owner = np.repeat(np.arange(len(ids)), np.diff(ref["candidate_offsets"]))
    assert np.array_equal(batch.sample_ids.numpy()[owner], np.asarray(ids)[owner])
    assert p_click.shape[0] == batch.num_candidates == owner.shape[0]


# ------------------------------------------------------------------ the generator
@pytest.mark.parametrize("split", [TRAIN, VALID, TEST])
def test_random_compositions_equal_the_requests_built_alone(micro, split):
    # Empty histories (min_seqlen 0), 1..max candidates, shuffled ids with duplicates.
    cfg = dataclasses.replace(micro.data, min_seqlen=0, seqlen_scale=1.0, max_candidates=5)
    source = SyntheticRecsysData(cfg)
    rng = np.random.default_rng(split)
    for size in (1, 2, 7, 40):
        ids = rng.integers(0, cfg.eval_requests, size)
        ids[-1] = ids[0]  # a duplicate (size 1: the request itself)
        _assert_same_as_reference(source, split, ids)
    lengths = source.history_lengths(split, np.arange(cfg.eval_requests))
    assert (lengths == 0).any() and (lengths > 0).any()


def test_long_histories_do_not_depend_on_the_rest_of_the_batch():
    """Event times were differences of one prefix sum over the whole batch: its float
    rounding grew with the earlier requests' gaps, so a request's history_time (and its
    labels' ground truth) moved by a second depending on what shared its batch."""
    cfg = DataConfig(
        num_items=512, num_topics=16, num_users=1000, max_seqlen=32768, min_seqlen=32768
    )
    source = SyntheticRecsysData(cfg)
    ids = np.arange(100, 104)
    _assert_same_as_reference(source, TRAIN, ids)
    _assert_same_as_reference(source, TRAIN, ids[::-1].copy())


def test_requests_are_pure_functions_of_seed_split_and_index(micro):
    ids = np.array([3, 1000, 0, 3, 17])
    a = SyntheticRecsysData(micro.data)
    b = SyntheticRecsysData(copy.deepcopy(micro.data))
    per_split = {}
    for split in (TRAIN, VALID, TEST):
        x, y = _numpy_fields(a.batch(split, ids)), _numpy_fields(b.batch(split, ids))
        assert all(np.array_equal(x[k], y[k]) for k in x)
        per_split[split] = x
    # The splits hold different requests under the same indices (other users, items,
    # histories), and another seed is another world.
    for s, t in ((TRAIN, VALID), (TRAIN, TEST), (VALID, TEST)):
        assert not np.array_equal(per_split[s]["history_items"], per_split[t]["history_items"])
        assert not np.array_equal(per_split[s]["request_time"], per_split[t]["request_time"])
    other = SyntheticRecsysData(dataclasses.replace(micro.data, seed=micro.data.seed + 1))
    other_users = other.batch(VALID, ids).user_ids.numpy()
    assert not np.array_equal(other_users, per_split[VALID]["user_ids"])


@pytest.mark.parametrize(
    "ids", [[1.5, 2.7], np.array([0.0, 1.0]), np.array([True, False, True]), ["3"]]
)
def test_non_integer_ids_are_rejected_not_truncated(micro_data, ids):
    # 1.5 was read as request 1 and a boolean mask as the requests 1, 0, 1.
    for call in (micro_data.batch, micro_data.truth, micro_data.history_lengths):
        with pytest.raises(TypeError, match="ids must be integer request indices"):
            call(TRAIN, ids)


@pytest.mark.parametrize(
    ("split", "ids", "match"),
    [
        (7, [1], "split must be TRAIN"),
        (True, [1], "split must be TRAIN"),
        (TRAIN, [4, -1], "ids must be non-negative"),
        (VALID, [0, 1024], r"validation ids must be < eval_requests \(1024\), got 1024"),
        (TEST, [5000], r"test ids must be < eval_requests"),
    ],
)
def test_history_lengths_checks_what_batch_checks(micro_data, split, ids, match):
    # history_lengths answered for an unknown split, negative ids (wrapped to 2**64 - 1)
    # and held-out ids past the split's end; BBS plans steps from it.
    with pytest.raises(ValueError, match=match):
        micro_data.batch(split, ids)
    with pytest.raises(ValueError, match=match):
        micro_data.history_lengths(split, ids)


def test_integer_ids_of_every_kind_give_the_same_batch(micro_data):
    ref = _numpy_fields(micro_data.batch(TRAIN, np.array([4, 9], dtype=np.int64)))
    for ids in ([4, 9], np.array([4, 9], np.uint16), np.array([4, 9], np.int32), (4, 9)):
        got = _numpy_fields(micro_data.batch(TRAIN, ids))
        assert all(np.array_equal(got[k], ref[k]) for k in ref)
    assert micro_data.history_lengths(TRAIN, []).shape == (0,)


# ------------------------------------------------------------------------- Batch
def _assert_same_batch(a: Batch, b: Batch) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x.cpu(), y.cpu()), f.name
        else:
            assert type(x) is type(y) and x == y, f.name


def test_to_and_pinning_keep_every_field(micro_data, monkeypatch):
    batch = micro_data.batch(TRAIN, np.arange(6))
    _assert_same_batch(batch, batch.to("cpu"))
    meta = batch.to("meta")
    for f in dataclasses.fields(batch):
        x, y = getattr(batch, f.name), getattr(meta, f.name)
        if torch.is_tensor(x):
            assert y.device.type == "meta" and (y.dtype, y.shape) == (x.dtype, x.shape), f.name
    assert meta.max_history_len == batch.max_history_len
    # Pinning needs CUDA: stand-in that copies, to see every tensor go through it.
    pinned: list[torch.Tensor] = []

    def fake_pin(self, *args, **kwargs):
        pinned.append(self)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    out = _Built(3, "plan", batch).pin_memory()
    assert (out.seq, out.plan) == (3, "plan")
    _assert_same_batch(batch, out.batch)
    _assert_same_batch(batch, _pin(batch))
    n_tensors = sum(torch.is_tensor(getattr(batch, f.name)) for f in dataclasses.fields(batch))
    assert len(pinned) == 2 * n_tensors


# ---------------------------------------------------------------------- validation
def _truncate(name):
    return lambda b: {name: getattr(b, name)[:-1]}


def _poke(name, value, at=0):
    def change(b):
        t = getattr(b, name).clone()
        t[at] = value
        return {name: t}

    return change


_CASES = [
    *[(f"{n} short", _truncate(n), rf"Batch.{o}\[-1\] = \d+ but Batch.{n} has")
      for o, names in _JAGGED.items() for n in names],
    *[(f"{n} too big", _poke(n, hi), rf"Batch.{n} has ids in \[.*outside \[0, {hi}\)")
      for n, hi in (("history_items", 512), ("candidate_items", 512), ("tags", 16),
                    ("history_actions", 4), ("history_categories", 16),
                    ("candidate_categories", 16))],
    *[(f"{n} negative", _poke(n, -1, at=-1), rf"Batch.{n} has ids in \[-1, ")
      for n in ("history_items", "candidate_items", "tags", "history_actions")],
    ("+Inf dense", _poke("dense", float("inf")), "Batch.dense contains NaN or Inf"),
    ("tag offsets past the end", lambda b: {"tag_offsets": b.tag_offsets + 1},
     "Batch.tag_offsets must start at 0"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "match"), [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_every_jagged_and_id_field_is_checked_by_name(micro_data, change, match):
    good = micro_data.batch(TRAIN, np.arange(8))
    validate_batch(good, micro_data.schema)
    with pytest.raises(ValueError, match=match):
        validate_batch(dataclasses.replace(good, **change(good)), micro_data.config)


def test_validation_of_histories_across_empty_requests(micro):
    cfg = dataclasses.replace(micro.data, min_seqlen=0, seqlen_scale=1.0)
    source = SyntheticRecsysData(cfg)
    lengths = source.history_lengths(TRAIN, np.arange(200))
    # Requests a, (empty), b: times may drop from a's newest to b's oldest event, but a
    # drop inside b is caught even right after the empty request.
    a = int(np.flatnonzero(lengths >= 2)[0])
    z = int(np.flatnonzero(lengths == 0)[0])
    b = int(np.flatnonzero(lengths >= 2)[1])
    batch = source.batch(TRAIN, [a, z, b])
    validate_batch(batch, cfg)
    t = batch.history_time.clone()
    lo = int(batch.history_offsets[2])
    t[lo], t[lo + 1] = t[lo + 1].clone(), t[lo].clone() - 1
    with pytest.raises(ValueError, match="Batch.history_time must be non-decreasing"):
        validate_batch(dataclasses.replace(batch, history_time=t), cfg)


# ------------------------------------------------------------------- request order
def test_request_order_takes_numpy_sizes_and_rejects_non_integers():
    assert (
        RequestOrder(np.int64(10), seed=3)(np.arange(12)).tolist()
        == RequestOrder(10, seed=3)(np.arange(12)).tolist()
    )
    assert type(RequestOrder(np.int32(4)).num_requests) is int
    for bad in (2.0, True, "10"):
        with pytest.raises(TypeError, match="num_requests must be an int or None"):
            RequestOrder(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="training split is empty"):
        RequestOrder(np.int64(0))
    with pytest.raises(TypeError, match="seed must be an int"):
        RequestOrder(10, seed=1.7)  # type: ignore[arg-type]


def _alarm(signum, frame):
    raise TimeoutError("permute did not return")


@pytest.mark.parametrize("bad", [[5], [-1], [0, 7]])
def test_permute_rejects_indices_outside_the_range(bad):
    # Cycle walking never came back into [0, n): this hung (the alarm turns a hang into
    # a failure).
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, 10.0)
    try:
        with pytest.raises(ValueError, match=r"permute: i must lie in \[0, 5\)"):
            permute(np.array(bad), 5, (1,))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert permute(np.array([], dtype=np.int64), 5, (1,)).shape == (0,)


# -------------------------------------------------------------------------- loader
def _stream(source, **kw):
    args = {"sub_batch_size": 3, "sub_batches_per_step": 2, "window_steps": 3} | kw
    return TrainStream(source, **args)


def _steps(loader, n):
    return [loader.next() for _ in range(n)]


def _same_steps(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.plan.sub_batches == y.plan.sub_batches
        assert np.array_equal(x.plan.requests, y.plan.requests)
        assert np.array_equal(x.batch.sample_ids.numpy(), x.plan.requests)
        _assert_same_batch(x.batch, y.batch)


@pytest.mark.parametrize(
    "workers",
    [0, pytest.param(1, marks=pytest.mark.slow)],  # workers: not in `nox -s lowest`
)
def test_close_then_next_continues_after_the_last_step_handed_out(micro_data, workers):
    """close() dropped the batches read ahead but left the stream past them: the next
    step after a close skipped them silently."""
    reference = StepLoader(_stream(micro_data), torch.device("cpu"))
    want = _steps(reference, 6)
    loader = StepLoader(_stream(micro_data), torch.device("cpu"), workers=workers, prefetch=2)
    try:
        got = _steps(loader, 2)
        loader.prefetch()
        state = copy.deepcopy(loader.state_dict())
        loader.close()
        assert loader.state_dict() == state
        got += _steps(loader, 2)
        loader.close()
        loader.close()  # twice: still nothing lost
        got += _steps(loader, 2)
    finally:
        loader.close()
    _same_steps(got, want)


@pytest.mark.slow  # loader worker processes (own internals): not in `nox -s lowest`
@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"sub_batch_size": 1, "sub_batches_per_step": 1, "window_steps": 1},  # batch of 1
        {"sub_batch_size": 5, "sub_batches_per_step": 3, "window_steps": 2},
    ],
)
def test_workers_and_resume_deliver_the_inline_batches_bit_for_bit(micro, layout):
    cfg = dataclasses.replace(micro.data, min_seqlen=0, seqlen_scale=2.0)
    source = SyntheticRecsysData(cfg)
    inline = StepLoader(_stream(source, **layout), torch.device("cpu"))
    want = _steps(inline, 7)
    pooled = StepLoader(_stream(source, **layout), torch.device("cpu"), workers=2, prefetch=3)
    try:
        got = _steps(pooled, 4)
        state = copy.deepcopy(pooled.state_dict())  # taken while the workers read ahead
    finally:
        pooled.close()
    stream = _stream(SyntheticRecsysData(cfg), **layout)
    stream.load_state_dict(state)
    resumed = StepLoader(stream, torch.device("cpu"), workers=2, prefetch=3)
    resumed.reset()
    try:
        got += _steps(resumed, 3)
    finally:
        resumed.close()
    _same_steps(got, want)
    for step in want:
        validate_batch(step.batch, cfg)
