"""Bad-input catalogue of hyperrec.raggedshard: one line per case, plus fuzzing.

Each case names the exception type and a substring of the message that names the
argument as the caller spelled it; every type must also be listed in the ``Raises:``
section of the public function's docstring. Cases that need a mesh build a fake one
(structure only: every check runs before any collective).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from hyperrec.raggedshard import (
    RaggedShard,
    Strategy,
    block_numel,
    check_placements,
    checkpointable,
    distribute_tensor,
    from_local,
    full_tensor,
    local_chunks,
    plan_layout,
    ragged_foreach,
    ragged_map,
    redistribute,
    to_local,
    total_norm,
    wrap_local,
)
from hyperrec.testing import fake_mesh
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
RS = RaggedShard((0,), (1, 2))
L = plan_layout([24, 8], 1, 2)


def _on_mesh(fn, shape=(2,)):
    with fake_mesh(shape) as mesh:
        return fn(mesh)


def _ragged(mesh):
    return from_local(torch.ones(2, 4), mesh, [RS], shape=(6, 4))


def _perm(n, b):
    return np.arange(len(n))


CASES = [
    # RaggedShard(dims, local_units)
    case(T, "dims", RaggedShard, 0, (1, 2)),
    case(T, "dims", RaggedShard, "0", (1, 2)),
    case(T, "dims", RaggedShard, (0.0,), (1, 2)),
    case(V, "dims", RaggedShard, (1,), (1, 2)),
    case(V, "dims", RaggedShard, (0, 2), (1, 2)),
    case(T, "local_units", RaggedShard, (0,), (1.5, 2)),
    case(T, "local_units", RaggedShard, (0,), "12"),
    case(T, "local_units", RaggedShard, (0,), None),
    case(T, "local_units", RaggedShard, (0,), (True, 2)),
    case(V, "local_units", RaggedShard, (0,), (-1, 2)),
    case(V, "local_units", RaggedShard, (0,), (0, 0)),
    case(V, "local_units", RaggedShard, (0,), ()),
    # geometry methods
    case(V, "index", RS.local_shape, (6, 4), 5),
    case(V, "index", RS.local_shape, (6, 4), -1),
    case(T, "index", RS.local_shape, (6, 4), 1.0),
    case(T, "index", RS.local_shape, (6, 4), True),
    case(V, "cannot split shape (7, 4)", RS.local_shape, (7, 4), 0),
    case(V, "flattens 2 dims", RaggedShard((0, 1), (1, 2)).local_shape, (6,), 0),
    case(V, "cannot split shape (7, 4)", RS.unit_rows, (7, 4)),
    case(V, "shape", RS.unit_rows, (-6, 4)),
    case(T, "shape", RS.unit_rows, (6.0, 4)),
    case(T, "shape", RS.unit_rows, "ab"),
    # from_numels / from_granularity / whole
    case(V, "numels", RaggedShard.from_numels, (6, 4), (10, 10)),
    case(V, "numels", RaggedShard.from_numels, (6, 4), (-4, 28)),
    case(V, "numels", RaggedShard.from_numels, (6, 4), ()),
    case(T, "numels", RaggedShard.from_numels, (6, 4), (12.0, 12)),
    case(T, "numels", RaggedShard.from_numels, (6, 4), 24),
    case(T, "shape", RaggedShard.from_numels, "ab", (12, 12)),
    case(T, "shape", RaggedShard.from_numels, None, (12, 12)),
    case(V, "shape", RaggedShard.from_numels, (6, -4), (12, 12)),
    case(V, "impossible split", RaggedShard.from_granularity, (6, 4), "tensor", (1, 1)),
    case(V, "impossible split", RaggedShard.from_granularity, (6, 4), "rows", ()),
    case(V, "granularity", RaggedShard.from_granularity, (6, 4), "blah", (1, 1)),
    case(V, "granularity", RaggedShard.from_granularity, (6, 4), 0, (24,)),
    case(T, "granularity", RaggedShard.from_granularity, (6, 4), 2.5, (24,)),
    case(V, "blocks", RaggedShard.from_granularity, (6, 4), "rows", (-1, 7)),
    case(T, "blocks", RaggedShard.from_granularity, (6, 4), "rows", (3.0, 3)),
    case(V, "owner", RaggedShard.whole, 2, 2),
    case(V, "owner", RaggedShard.whole, -1, 2),
    case(T, "owner", RaggedShard.whole, True, 2),
    case(T, "owner", RaggedShard.whole, 0.0, 2),
    case(V, "world_size", RaggedShard.whole, 0, 0),
    case(T, "world_size", RaggedShard.whole, 0, 2.0),
    # block_numel
    case(V, "granularity", block_numel, (6, 4), "0 rows"),
    case(V, "granularity", block_numel, (6, 4), "3 bananas"),
    case(V, "granularity", block_numel, (6, 4), -1),
    case(T, "granularity", block_numel, (6, 4), 2.5),
    case(T, "granularity", block_numel, (6, 4), None),
    case(T, "granularity", block_numel, (6, 4), True),
    case(T, "shape", block_numel, "ab", 1),
    case(T, "shape", block_numel, 6, 1),
    case(V, "shape", block_numel, (-1,), 1),
    case(T, "shape", block_numel, (2.5,), 1),
    # plan_layout
    case(T, "numels", plan_layout, "abc", 1, 2),
    case(T, "numels", plan_layout, 4, 1, 2),
    case(T, "numels", plan_layout, [2.5], 1, 2),
    case(T, "numels", plan_layout, [True], 1, 2),
    case(V, "numels", plan_layout, [-2], 1, 2),
    case(T, "numels", plan_layout, np.array([2.5]), 1, 2),
    case(T, "numels", plan_layout, np.array([[2]]), 1, 2),
    case(T, "granularities", plan_layout, [4], 2.5, 2),
    case(T, "granularities", plan_layout, [4], "rows", 2),
    case(T, "granularities", plan_layout, [4], [2.0], 2),
    case(V, "granularities", plan_layout, [4], 0, 2),
    case(V, "granularities", plan_layout, [4, 4], [1], 2),
    case(V, "world_size", plan_layout, [4], 1, 0),
    case(T, "world_size", plan_layout, [4], 1, 2.0),
    case(T, "world_size", plan_layout, [4], 1, None),
    case(V, "alignment", plan_layout, [4], 1, 2, alignment=0),
    case(T, "alignment", plan_layout, [4], 1, 2, alignment=1.5),
    case(V, "strategies", plan_layout, [4], 1, 2, strategies=[]),
    case(T, "strategies", plan_layout, [4], 1, 2, strategies=["x"]),
    case(T, "strategies", plan_layout, [4], 1, 2, strategies="greedy"),
    case(V, "order=", Strategy, name="x"),
    case(V, "order=", Strategy, name="x", order=_perm, place=_perm),
    case(T, "name", Strategy, name=3, order=_perm),
    case(T, "order", Strategy, name="x", order=5),
    case(T, "place", Strategy, name="x", place="fill"),
    case(V, "25 elements", L.placement, 0, (5, 5)),
    # check_placements
    case(V, "cannot split shape (10, 4)", check_placements, [RS], (10, 4)),
    case(V, "cannot split shape (7,)", check_placements, [RaggedShard((0,), (1, 1))], (7,)),
    case(V, "flattens more dims", check_placements, [RaggedShard((0, 1), (1,))], (4,)),
    case(V, "at most one RaggedShard", check_placements, [RS, RS], (6, 4)),
    case(V, "Shard(dim=0)", check_placements, [RS, Shard(0)], (6, 4)),
    case(V, "placements", check_placements, [Shard(3)], (4,)),
    case(V, "placements", check_placements, [Shard(-3)], (4,)),
    case(T, "placements", check_placements, "R", (4,)),
    case(T, "placements", check_placements, Replicate(), (4,)),
    case(T, "placements", check_placements, [None], (4,)),
    case(T, "shape", check_placements, [Replicate()], None),
    case(T, "shape", check_placements, [Replicate()], "ab"),
    case(V, "shape", check_placements, [Replicate()], (-1, 4)),
    case(T, "shape", check_placements, [Replicate()], (2.5, 4)),
    case(T, "mesh", check_placements, [Replicate()], (4,), mesh="x"),
    case(
        V,
        "2 entries",
        lambda: _on_mesh(lambda m: check_placements([Replicate(), Replicate()], (4,), m)),
        doc=check_placements,
    ),
    case(
        V,
        "3 units",
        lambda: _on_mesh(lambda m: check_placements([RaggedShard((0,), (1, 1, 1))], (6,), m)),
        doc=check_placements,
    ),
    # wrap_local
    case(
        T,
        "local_tensor",
        lambda: _on_mesh(lambda m: wrap_local([1], m, [Replicate()], shape=(4,))),
        doc=wrap_local,
    ),
    case(
        T,
        "device_mesh",
        lambda: wrap_local(torch.ones(4), "mesh", [Replicate()], shape=(4,)),
        doc=wrap_local,
    ),
    case(
        T,
        "shape",
        lambda: _on_mesh(lambda m: wrap_local(torch.ones(4), m, [Replicate()], shape=(4.0,))),
        doc=wrap_local,
    ),
    case(
        V,
        "shape",
        lambda: _on_mesh(lambda m: wrap_local(torch.ones(4), m, [Replicate()], shape=(-4,))),
        doc=wrap_local,
    ),
    # from_local / distribute_tensor / redistribute
    case(
        T,
        "local_tensor",
        lambda: _on_mesh(lambda m: from_local([1], m, [Replicate()], shape=(4,))),
        doc=from_local,
    ),
    case(
        V,
        "local_tensor has shape (3, 4)",
        lambda: _on_mesh(lambda m: from_local(torch.ones(3, 4), m, [RS], shape=(6, 4))),
        doc=from_local,
    ),
    case(
        V,
        "cannot split shape (7, 4)",
        lambda: _on_mesh(lambda m: from_local(torch.ones(3, 4), m, [RS], shape=(7, 4))),
        doc=from_local,
    ),
    case(
        T,
        "shape",
        lambda: _on_mesh(lambda m: from_local(torch.ones(6, 4), m, [Replicate()], shape=(6.5, 4))),
        doc=from_local,
    ),
    case(
        T,
        "shape",
        lambda: _on_mesh(lambda m: from_local(torch.ones(6, 4), m, [Replicate()], shape="ab")),
        doc=from_local,
    ),
    case(
        V,
        "stride",
        lambda: _on_mesh(
            lambda m: from_local(torch.ones(6, 4), m, [Replicate()], shape=(6, 4), stride=(1,))
        ),
        doc=from_local,
    ),
    case(
        T,
        "stride",
        lambda: _on_mesh(
            lambda m: from_local(torch.ones(6, 4), m, [Replicate()], shape=(6, 4), stride=(4.0, 1))
        ),
        doc=from_local,
    ),
    case(T, "device_mesh", from_local, torch.ones(6, 4), "m", [Replicate()], shape=(6, 4)),
    case(
        V,
        "cannot split shape (7, 4)",
        lambda: _on_mesh(lambda m: distribute_tensor(torch.ones(7, 4), m, [RS])),
        doc=distribute_tensor,
    ),
    case(
        T,
        "tensor",
        lambda: _on_mesh(lambda m: distribute_tensor([1.0], m, [RS])),
        doc=distribute_tensor,
    ),
    case(T, "device_mesh", distribute_tensor, torch.ones(6, 4), None, [RS]),
    case(T, "dtensor", redistribute, torch.ones(2), [Replicate()]),
    case(
        V,
        "2 entries",
        lambda: _on_mesh(lambda m: redistribute(_ragged(m), [Replicate(), Replicate()])),
        doc=redistribute,
    ),
    case(
        T,
        "placements",
        lambda: _on_mesh(lambda m: redistribute(_ragged(m), "R")),
        doc=redistribute,
    ),
    case(
        V,
        "cannot split shape (6, 4)",
        lambda: _on_mesh(lambda m: redistribute(_ragged(m), [RaggedShard((0,), (1, 3))])),
        doc=redistribute,
    ),
    case(
        V,
        "Partial",
        lambda: _on_mesh(
            lambda m: redistribute(
                from_local(torch.ones(6, 4), m, [Replicate()], shape=(6, 4)), [Partial()]
            )
        ),
        doc=redistribute,
    ),
    # local ops and checkpointing
    case(T, "dtensor", to_local, torch.ones(2)),
    case(T, "dtensor", full_tensor, torch.ones(2)),
    case(V, "tensors", total_norm, []),
    case(T, "tensors", total_norm, [torch.ones(2)]),
    case(T, "tensors", total_norm, torch.ones(2)),
    case(T, "tensors", total_norm, None),
    case(
        V,
        "norm_type",
        lambda: _on_mesh(lambda m: total_norm([_ragged(m)], norm_type=0)),
        doc=total_norm,
    ),
    case(
        V,
        "norm_type",
        lambda: _on_mesh(lambda m: total_norm([_ragged(m)], norm_type=math.nan)),
        doc=total_norm,
    ),
    case(
        T,
        "norm_type",
        lambda: _on_mesh(lambda m: total_norm([_ragged(m)], norm_type="fro")),
        doc=total_norm,
    ),
    case(T, "fn", ragged_map, 3, torch.ones(2)),
    case(V, "DTensor", ragged_map, torch.neg, torch.ones(2)),
    case(T, "fn", ragged_foreach, "neg", [torch.ones(2)]),
    case(V, "DTensors", ragged_foreach, torch._foreach_neg, [torch.ones(2)]),
    case(T, "state_dict", checkpointable, [1]),
    case(T, "state_dict", checkpointable, None),
    case(T, "dtensor", local_chunks, torch.ones(2)),
    case(
        V,
        "RaggedShard",
        lambda: _on_mesh(
            lambda m: local_chunks(from_local(torch.ones(6), m, [Replicate()], shape=(6,)))
        ),
        doc=local_chunks,
    ),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 100


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_INT_OR_JUNK = st.one_of(st.integers(-3, 12), st.sampled_from([2.5, "4", None, True]))


def _is_int(v, minimum):
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


@_FUZZ
@given(
    numels=st.lists(_INT_OR_JUNK, max_size=6),
    grans=st.one_of(_INT_OR_JUNK, st.lists(_INT_OR_JUNK, max_size=6)),
    world_size=_INT_OR_JUNK,
    alignment=st.sampled_from([1, 2, 8, 0, 1.0]),
)
def test_fuzz_plan_layout(numels, grans, world_size, alignment):
    good = (
        all(_is_int(n, 0) for n in numels)
        and (
            _is_int(grans, 1)
            if not isinstance(grans, list)
            else len(grans) == len(numels) and all(_is_int(g, 1) for g in grans)
        )
        and _is_int(world_size, 1)
        and _is_int(alignment, 1)
    )
    err = rejects_cleanly(plan_layout, numels, grans, world_size, alignment=alignment)
    assert (err is None) == good, err
    if good:
        lay = plan_layout(numels, grans, world_size, alignment=alignment)
        assert lay.shard_numel * world_size >= sum(numels)


@_FUZZ
@given(
    shape=st.lists(st.integers(-1, 9), max_size=3),
    units=st.lists(st.integers(-1, 4), max_size=4),
    k=st.integers(0, 3),
)
def test_fuzz_check_placements(shape, units, k):
    """No mesh: the split of ``shape`` into ``sum(units)`` units is still checked."""
    try:
        p = RaggedShard(tuple(range(k)), units)
    except (TypeError, ValueError):
        return  # the placement itself is invalid (covered by the catalogue)
    rows = math.prod(shape[:k]) if len(shape) >= k else None
    good = all(s >= 0 for s in shape) and rows is not None and rows % sum(p.local_units) == 0
    err = rejects_cleanly(check_placements, [p], tuple(shape))
    assert (err is None) == good, err


@_FUZZ
@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=3), data=st.data())
def test_fuzz_from_numels(shape, data):
    total = math.prod(shape)
    n = data.draw(st.integers(1, 4))
    numels = data.draw(st.lists(st.integers(-1, total + 1), min_size=n, max_size=n))
    good = all(c >= 0 for c in numels) and sum(numels) == total
    err = rejects_cleanly(RaggedShard.from_numels, tuple(shape), numels)
    assert (err is None) == good, err
    if good and total:
        p = RaggedShard.from_numels(tuple(shape), numels)
        assert [p.local_shape(shape, i).numel() for i in range(n)] == numels
