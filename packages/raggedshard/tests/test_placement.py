import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from hyperrec.raggedshard import RaggedShard, block_numel
from hyperrec.raggedshard._geometry import chunk_bounds, chunk_owner_count, row_range_boxes
from hyperrec.raggedshard.placement import _RaggedDim
from hyperrec.raggedshard.reference import local_tensor, ragged_split, ragged_unsplit

# -- construction, value semantics --------------------------------------------------------


def test_units_are_stored_in_lowest_terms_and_compare_by_value():
    p = RaggedShard((0,), (2, 0, 6))
    assert p.local_units == (1, 0, 3)
    assert p == RaggedShard([0], [1, 0, 3])
    assert hash(p) == hash(RaggedShard((0,), (1, 0, 3)))
    assert p != RaggedShard((0, 1), (1, 0, 3))
    assert p != RaggedShard((0,), (1, 3, 0))
    assert p != Shard(0) and p != Replicate()
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) is p
    assert "local_units=(1, 0, 3)" in repr(p)
    with pytest.raises(AttributeError):
        p.local_units = (1,)


@pytest.mark.parametrize(
    ("dims", "units", "err", "match"),
    [
        ((1,), (1, 1), ValueError, "dims"),
        ((0, 2), (1, 1), ValueError, "dims"),
        ((0,), (), ValueError, "local_units"),
        ((0,), (0, 0), ValueError, "positive"),
        ((0,), (1, -1), ValueError, "non-negative"),
        (0, (1, 1), TypeError, "dims"),
        ((0,), 3, TypeError, "local_units"),
        ((0,), (1.0, 2), TypeError, "local_units"),
        ((True,), (1, 2), TypeError, "dims"),
    ],
)
def test_constructor_errors(dims, units, err, match):
    with pytest.raises(err, match=match):
        RaggedShard(dims, units)


def test_upstream_routing_hooks():
    p = RaggedShard((0,), (1, 1))
    # is_shard() routes upstream redistribution to our methods; no single dim is chunked.
    assert p.is_shard() and not p.is_shard(0) and not p.is_replicate() and not p.is_partial()
    tok = p.dim
    assert isinstance(tok, _RaggedDim)
    assert tok != 0 and tok != 0 and tok == RaggedShard((0,), (2, 2)).dim
    assert tok != RaggedShard((0,), (1, 2)).dim
    with pytest.raises(NotImplementedError, match="hyperrec.raggedshard.redistribute"):
        [0, 1][tok]
    with pytest.raises(NotImplementedError):
        _ = tok < 0


# -- geometry ---------------------------------------------------------------------------


def test_geometry_example_and_errors():
    p = RaggedShard((0,), (1, 0, 2))
    assert p.row_bounds((6, 4)) == ((0, 2), (2, 2), (2, 6))
    assert p.element_bounds((6, 4)) == ((0, 8), (8, 8), (8, 24))
    assert p.local_shape((6, 4), 1) == torch.Size((0, 4))
    assert p.local_shape((6, 4), 2) == torch.Size((4, 4))
    with pytest.raises(ValueError, match="not divisible"):
        p.unit_rows((7, 4))
    with pytest.raises(ValueError, match="index"):
        p.local_shape((6, 4), 3)
    with pytest.raises(ValueError, match="flattens"):
        RaggedShard((0, 1), (1, 1)).row_bounds((4,))
    # dims=() with one-hot units: the whole tensor on one rank, with a leading dim of 1.
    w = RaggedShard.whole(2, 4)
    assert w.dims == () and w.local_units == (0, 0, 1, 0)
    assert w.local_shape((3, 5), 2) == torch.Size((1, 3, 5))
    assert w.local_shape((3, 5), 0) == torch.Size((0, 3, 5))
    with pytest.raises(ValueError, match="owner"):
        RaggedShard.whole(4, 4)


def _units(draw, total_rows, world):
    divisors = [d for d in range(1, total_rows + 1) if total_rows % d == 0] or [1]
    u = draw(st.sampled_from(divisors))
    if draw(st.booleans()):
        units = [0] * world
        units[draw(st.integers(0, world - 1))] = u
        return units
    cuts = sorted(draw(st.lists(st.integers(0, u), min_size=world - 1, max_size=world - 1)))
    edges = [0, *cuts, u]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def ragged_cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    k = draw(st.integers(0, len(shape)))
    world = draw(st.integers(1, 5))
    rows = math.prod(shape[:k])
    units = _units(draw, rows, world) if rows else [1] + [0] * (world - 1)
    if sum(units) == 0:
        units[0] = 1
    return shape, RaggedShard(tuple(range(k)), units)


@settings(deadline=None, max_examples=60)
@given(ragged_cases())
def test_split_unsplit_round_trip(case):
    shape, p = case
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    parts = ragged_split(full, p)
    assert [t.shape for t in parts] == [p.local_shape(shape, i) for i in range(len(parts))]
    flat = torch.cat([t.reshape(-1) for t in parts])
    assert torch.equal(flat, full.reshape(-1))  # consecutive, in rank order, no gaps
    bounds = p.element_bounds(shape)
    assert [e - s for s, e in bounds] == [t.numel() for t in parts]
    assert torch.equal(ragged_unsplit(parts, p, shape), full)


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=3),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_from_numels_picks_the_fewest_dims(shape, world, rnd):
    shape = tuple(shape)
    n = math.prod(shape)
    cuts = sorted(rnd.randint(0, n) for _ in range(world - 1))
    numels = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    p = RaggedShard.from_numels(shape, numels)
    if world == 1 and shape:
        # One rank: the local shape must be the global one (dims=(0,)), also when the
        # tensor is empty (it was (1, *shape) there: full_tensor() had that shape).
        assert p.dims == (0,) and p.local_shape(shape, 0) == torch.Size(shape)
        return
    if n:
        assert [e - s for s, e in p.element_bounds(shape)] == numels
        k = len(p.dims)
        # No shorter prefix would put every boundary between rows.
        for shorter in range(k):
            row = math.prod(shape[shorter:])
            assert any(c % row for c in cuts) if row else True


def test_from_granularity_and_impossible_splits():
    p = RaggedShard.from_granularity((40, 8), "32 rows", (1, 1))
    assert p.row_bounds((40, 8)) == ((0, 32), (32, 40)) and p.dims == (0,)
    p = RaggedShard.from_granularity((6, 4), "rows", (0, 2, 4))
    assert p.local_units == (0, 1, 2)
    p = RaggedShard.from_granularity((3, 1000), "2048 elements", (1, 1))
    assert p.dims == (0, 1) and p.element_bounds((3, 1000)) == ((0, 2048), (2048, 3000))
    p = RaggedShard.from_granularity((5, 7), "tensor", (0, 1, 0))
    assert p == RaggedShard.whole(1, 3)
    p = RaggedShard.from_granularity((4, 3, 5), "matrix", (3, 1))
    assert p.dims == (0,) and p.local_units == (3, 1)
    with pytest.raises(ValueError, match="impossible split"):
        RaggedShard.from_granularity((5, 7), "whole tensor", (1, 1))
    with pytest.raises(ValueError, match="impossible split"):
        RaggedShard.from_granularity((40, 8), "32 rows", (1, 0))
    with pytest.raises(ValueError, match="non-negative"):
        RaggedShard.from_granularity((4, 4), "rows", (5, -1))
    with pytest.raises(ValueError, match="sum"):
        RaggedShard.from_numels((4, 4), (3, 4))


@pytest.mark.parametrize(
    ("spec", "shape", "expected"),
    [
        ("element", (4, 8), 1),
        ("rows", (4, 8, 2), 16),
        ("row", (5,), 1),
        ("32 rows", (100, 64), 2048),
        ("2048 elements", (3,), 2048),
        (" Whole Matrix ", (3, 4, 5), 20),
        ("matrix", (7,), 7),
        ("tensor", (3, 4), 12),
        ("tensor", (0, 4), 1),
        (17, (3, 4), 17),
    ],
)
def test_block_numel(spec, shape, expected):
    assert block_numel(shape, spec) == expected


@pytest.mark.parametrize(
    ("spec", "err"),
    [
        (0, ValueError),
        ("0 rows", ValueError),
        ("3 blocks", ValueError),
        (2.0, TypeError),
        (True, TypeError),
    ],
)
def test_block_numel_errors(spec, err):
    with pytest.raises(err, match="granularity"):
        block_numel((4, 4), spec)
    with pytest.raises(ValueError, match="shape"):
        block_numel((4, -1), "row")


# -- index helpers -----------------------------------------------------------------------


@settings(deadline=None, max_examples=80)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=4), st.data())
def test_row_range_boxes_tile_the_range_in_order(leading, data):
    total = math.prod(leading)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    boxes = row_range_boxes(leading, start, end)
    assert len(boxes) <= max(1, 2 * (len(leading) - 1) + 1)
    index = torch.arange(total).reshape(leading) if leading else torch.arange(1).reshape(())
    covered = []
    for offs, sizes, first in boxes:
        sl = tuple(slice(o, o + s) for o, s in zip(offs, sizes))
        block = index[sl].reshape(-1).tolist()
        assert block == list(range(first, first + len(block)))  # contiguous rows
        covered += block
    assert covered == list(range(start, end))


@settings(deadline=None, max_examples=80)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 4), st.integers(1, 5), st.data())
def test_chunk_owner_count_matches_brute_force(lo, span, stride, size, data):
    c0 = data.draw(st.integers(0, size))
    c1 = data.draw(st.integers(c0, size))
    hi = lo + span
    brute = sum(c0 <= (g // stride) % size < c1 for g in range(lo, hi))
    assert chunk_owner_count(lo, hi, stride, size, c0, c1) == brute


def test_chunk_bounds_is_torch_chunk():
    for n in range(0, 12):
        for parts in range(1, 6):
            sizes = [e - s for s, e in chunk_bounds(n, parts)]
            ref = [len(c) for c in torch.arange(n).chunk(parts)] if n else []
            assert sizes[: len(ref)] == ref and sum(sizes) == n


def test_reference_local_tensor_composes_axes():
    full = torch.arange(24.0).reshape(6, 4)
    got = local_tensor(full, (2, 2), (1, 0), [RaggedShard((0,), (1, 2)), Shard(1)])
    assert torch.equal(got, full[2:6, 0:2])
    got = local_tensor(full, (2, 2), (0, 1), [Replicate(), RaggedShard((0, 1), (5, 7))])
    assert torch.equal(got, full.reshape(-1)[10:24])


def test_local_ops_collect_every_upstream_container(monkeypatch):
    """The ops the optimizers use are found whatever container upstream keeps them in
    (torch 2.11 holds mul_/add_/copy_ only in a dict, op -> linearity)."""
    from torch.distributed.tensor._ops import _pointwise_ops

    from hyperrec.raggedshard.dtensor_ops import _local_op_set

    aten = torch.ops.aten
    ops = _local_op_set()
    for op in (aten.mul_.Tensor, aten.add_.Tensor, aten.lerp_.Scalar, aten.addcmul_.default,
               aten.addcdiv_.default, aten.sqrt.default, aten.div_.Tensor):  # fmt: skip
        assert op in ops, op
    probe = aten.logaddexp2.default  # stands in for an op only a dict or a set lists
    for name, container in (("dict", {probe: 0}), ("set", {probe})):
        for key, value in list(vars(_pointwise_ops).items()):
            if isinstance(value, list | tuple | set | frozenset | dict) and probe in value:
                monkeypatch.delattr(_pointwise_ops, key)
        monkeypatch.setattr(_pointwise_ops, f"_probe_{name}", container, raising=False)
        assert probe in _local_op_set(), name
        monkeypatch.delattr(_pointwise_ops, f"_probe_{name}")
