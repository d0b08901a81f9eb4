"""Scope of the process-global local-op handlers: explicit switch, ``with`` block, restore."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from hyperrec.raggedshard import (
    RaggedShard,
    enable_local_ops,
    from_local,
    local_ops,
    local_ops_enabled,
)
from hyperrec.raggedshard import dtensor_ops as ops_module
from hyperrec.testing import fake_mesh


def _ours(op) -> bool:
    handler = DTensor._op_dispatcher._custom_op_handlers.get(op)
    return handler is ops_module._local_handler


@pytest.fixture
def handlers_off():
    """Start with the handlers removed (another test of this process may have installed
    them; fully_shard does) and put the original state back afterwards."""
    was = local_ops_enabled()
    ops_module._uninstall()
    yield
    ops_module._uninstall()
    if was:
        enable_local_ops()


def test_local_ops_block_installs_and_restores(handlers_off):
    mul_ = torch.ops.aten.mul_.Tensor
    assert not local_ops_enabled() and not _ours(mul_)
    with local_ops():
        assert local_ops_enabled() and _ours(mul_)
        with local_ops():  # nested: still on after the inner block
            pass
        assert local_ops_enabled()
        enable_local_ops()  # inside a block: undone with the block
    assert not local_ops_enabled() and not _ours(mul_)
    enable_local_ops()
    with local_ops():
        pass
    assert local_ops_enabled() and _ours(mul_)  # enabled before the block: kept


def test_in_place_step_is_shard_local_only_inside_the_block(handlers_off):
    # Rank 1 of a fake 2-rank axis: collectives move no data there, so a result equal to
    # the local computation proves the op ran shard-locally.
    with fake_mesh((2,), rank=1) as mesh:
        placement = RaggedShard((0,), (1, 3))
        local = torch.arange(12.0).reshape(3, 4)
        w = from_local(local.clone(), mesh, [placement], shape=(4, 4))
        with local_ops():
            w.mul_(2.0).add_(1.0)
            assert w.placements == (placement,)
            assert torch.equal(w.to_local(), local * 2 + 1)
        # Outside the block upstream DTensor handles the op, which has no rule for a
        # custom placement's in-place update.
        with pytest.raises((RuntimeError, NotImplementedError, AssertionError)):
            w.mul_(2.0)
