"""Single-process checks of the redistribution entry points: placement rules on large
fake-backend meshes and bad requests. The multi-rank behaviour is in test_ragged_distributed.py.
"""

import random

import pytest
import torch
from _ragged_cases import random_units
from torch.distributed.tensor import Partial, Replicate, Shard

from hyperrec.raggedshard import (
    RaggedShard,
    check_placements,
    from_local,
    redistribute,
    wrap_local,
)
from hyperrec.testing import fake_mesh


def test_placement_rules_on_large_fake_meshes():
    with fake_mesh((4096,), rank=4095) as mesh:
        units = random_units(random.Random(0), 8192, 4096)
        p = RaggedShard((0,), units)
        shape = (8192, 16)
        rows = p.local_shape(shape, 4095)[0]
        x = from_local(torch.empty(rows, 16), mesh, [p], shape=shape)
        assert x.placements == (p,) and x.to_local().shape == (rows, 16)
        with pytest.raises(ValueError, match="units but mesh axis"):
            check_placements([RaggedShard((0,), (1, 1))], shape, mesh)
    with fake_mesh((2, 2048), rank=3000) as mesh:
        p = RaggedShard((0,), [1] * 2048)
        x = from_local(torch.empty(2, 7), mesh, [Replicate(), p], shape=(4096, 7))
        assert x.to_local().shape == (2, 7)
        with pytest.raises(ValueError, match="at most one RaggedShard"):
            check_placements([RaggedShard((0,), (1, 1)), p], (4096, 7), mesh)
        with pytest.raises(ValueError, match="dims=\\(0,\\)"):
            check_placements([Shard(1), RaggedShard((0, 1), [1] * 2048)], (4096, 7), mesh)
        with pytest.raises(ValueError, match="d >= 1"):
            check_placements([Shard(0), p], (4096, 7), mesh)
        with pytest.raises(ValueError, match="placements has 1"):
            check_placements([p], (4096, 7), mesh)
        with pytest.raises(TypeError, match="Placement"):
            check_placements([p, "R"], (4096, 7), mesh)
        with pytest.raises(ValueError, match="not divisible"):
            check_placements([Replicate(), p], (4095, 7), mesh)


def test_redistribute_rejects_bad_requests():
    with fake_mesh((2,)) as mesh:
        p = RaggedShard((0,), (1, 1))
        x = from_local(torch.zeros(2, 3), mesh, [Replicate()], shape=(2, 3))
        with pytest.raises(TypeError, match="DTensor"):
            redistribute(torch.zeros(2), [p])
        with pytest.raises(ValueError, match="Partial targets"):
            redistribute(x, [Partial()])
        r = from_local(torch.zeros(1, 3), mesh, [p], shape=(2, 3))
        with pytest.raises(ValueError, match="not supported"):
            redistribute(r, [Partial("bxor")])
        assert redistribute(x, [Replicate()]) is x
        with pytest.raises(TypeError, match="plain"):
            from_local(x, mesh, [p], shape=(2, 3))


def test_local_ops_and_dcp_helpers_reject_bad_input():
    from hyperrec.raggedshard import (
        checkpointable,
        local_chunks,
        ragged_foreach,
        ragged_map,
        to_local,
        total_norm,
    )

    with fake_mesh((2,)) as mesh:
        p, q = RaggedShard((0,), (1, 1)), RaggedShard((0,), (1, 3))
        a = from_local(torch.zeros(2, 3), mesh, [p], shape=(4, 3))
        b = from_local(torch.zeros(1, 3), mesh, [q], shape=(4, 3))
        with pytest.raises(TypeError, match="callable"):
            ragged_map(3, a)
        with pytest.raises(ValueError, match="at least one DTensor"):
            ragged_map(torch.neg, torch.zeros(2))
        with pytest.raises(ValueError, match="one layout"):
            ragged_map(torch.add, a, b)
        assert ragged_map(torch.neg, a).placements == (p,)
        with pytest.raises(ValueError, match="mixes"):
            ragged_foreach(torch._foreach_neg, [a, torch.zeros(2)])
        with pytest.raises(ValueError, match="first list has 1"):
            ragged_foreach(torch._foreach_add, [a], [a, a])
        with pytest.raises(ValueError, match="position 0"):
            ragged_foreach(torch._foreach_add, [a], [b])
        with pytest.raises(ValueError, match="list of DTensors"):
            ragged_foreach(torch._foreach_neg, [torch.zeros(2)])
        with pytest.raises(ValueError, match="at least one"):
            total_norm([])
        with pytest.raises(TypeError, match="DTensors"):
            total_norm([torch.zeros(2)])
        with pytest.raises(ValueError, match="norm_type"):
            total_norm([a], 0.0)
        with pytest.raises(TypeError, match="DTensor"):
            to_local(torch.zeros(2))
        # DCP: only ragged, non-Partial, contiguous DTensors become boxes.
        with pytest.raises(TypeError, match="DTensor"):
            local_chunks(torch.zeros(2))
        with pytest.raises(ValueError, match="RaggedShard placement"):
            local_chunks(from_local(torch.zeros(2, 3), mesh, [Replicate()], shape=(2, 3)))
        with pytest.raises(TypeError, match="mapping"):
            checkpointable([a])
        boxes = local_chunks(a)
        assert [(o, s) for o, s, _ in boxes] == [((0, 0), (2, 3))]
        assert boxes[0][2].data_ptr() == a.to_local().data_ptr()  # a view, not a copy
        wrapped = checkpointable({"a": a, "n": {"b": b, "x": 1}, "t": torch.ones(1)})
        assert type(wrapped["a"]).__name__ == "_RaggedCheckpointView"
        assert wrapped["n"]["x"] == 1 and wrapped["t"] is not None
        assert tuple(wrapped["n"]["b"].shape) == (4, 3)
        with pytest.raises(NotImplementedError, match="inside DCP"):
            wrapped["a"] + 1
    with fake_mesh((2, 2)) as mesh:
        pl = [Partial(), RaggedShard((0,), (1, 1))]
        with pytest.raises(ValueError, match="Partial"):
            local_chunks(from_local(torch.zeros(2, 3), mesh, pl, shape=(4, 3)))
        with pytest.raises(ValueError, match="Partial"):
            total_norm([from_local(torch.zeros(2, 3), mesh, pl, shape=(4, 3))])


def test_wrap_local_keeps_the_tensor_itself():
    """No copy, no check, no grad: the DTensor's local tensor is the argument (what the
    sharding code relies on to keep views into its flat buffers)."""
    with fake_mesh((4,), rank=1) as mesh:
        placement = RaggedShard((0,), (1, 2, 0, 3))
        local = torch.arange(8.0).view(2, 4)
        d = wrap_local(local, mesh, [placement], shape=(6, 4))
        assert d.to_local() is local or d.to_local().data_ptr() == local.data_ptr()
        assert d.placements == (placement,) and d.shape == (6, 4) and d.stride() == (4, 1)
        assert not d.requires_grad
        local.add_(1.0)  # a view: the DTensor sees the write
        assert torch.equal(d.to_local(), local)
        # the same as the checked constructor, where that one accepts the input
        ref = from_local(local.clone(), mesh, [placement], shape=(6, 4))
        assert ref.placements == d.placements and ref.shape == d.shape
        # trusted: a local shape from_local rejects is taken as it is
        wrap_local(torch.ones(3, 4), mesh, [placement], shape=(6, 4))
        with pytest.raises(ValueError, match="local_tensor has shape"):
            from_local(torch.ones(3, 4), mesh, [placement], shape=(6, 4))
