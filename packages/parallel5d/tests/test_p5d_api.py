"""fully_shard's call shape, errors and the module it returns (structure only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _p5d_models import make, shard_model
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d import FSDPModule, MixedPrecisionPolicy, dbuffers, fully_shard
from hyperrec.parallel5d._api import resolve_granularity
from hyperrec.raggedshard import RaggedShard
from hyperrec.testing import fake_mesh


def test_granularity_resolution():
    w, b = nn.Parameter(torch.zeros(6, 4)), nn.Parameter(torch.zeros(5))
    assert resolve_granularity(None, "w", w) == 1
    assert resolve_granularity("element", "w", w) == 1
    assert resolve_granularity("row", "w", w) == 4
    assert resolve_granularity("matrix", "w", w) == 24
    assert resolve_granularity("matrix", "b", b) == 1  # vectors stay element-wise
    assert resolve_granularity("tensor", "b", b) == 5
    assert resolve_granularity(2048, "w", w) == 2048
    assert resolve_granularity(lambda fqn, p: "row" if fqn == "w" else 3, "w", w) == 4
    with pytest.raises(ValueError, match="'w'"):
        resolve_granularity("rows?", "w", w)
    with pytest.raises(ValueError, match=">= 1"):
        resolve_granularity(0, "w", w)
    with pytest.raises(TypeError, match="granularity"):
        resolve_granularity(True, "w", w)
    with pytest.raises(TypeError, match="granularity"):
        resolve_granularity(2.5, "w", w)


def test_fully_shard_returns_an_fsdp_module_with_ragged_dtensor_params():
    with fake_mesh((4,), rank=2) as mesh:
        model = make("net")
        ignored = model.scale
        shard_model(model, mesh, ignored_params={ignored})
        assert isinstance(model, FSDPModule) and isinstance(model, nn.Module)
        assert isinstance(model.blocks[0], FSDPModule)
        assert type(model).__name__ == "FSDPNet"
        assert model.scale is ignored and not isinstance(model.scale, DTensor)
        sd = model.state_dict()
        for name, v in sd.items():
            if name == "scale":
                continue
            assert isinstance(v, DTensor), name
            assert any(isinstance(p, RaggedShard) for p in v.placements), name
        assert len(dbuffers(model)) == 4  # one per group, one dtype
        assert len(model.dbuffers) == 1
        # unshard/reshard swap plain views in and DTensors back.
        model.blocks[0].unshard()
        assert not isinstance(model.blocks[0].up.weight, DTensor)
        model.blocks[0].reshard()
        assert isinstance(model.blocks[0].up.weight, DTensor)
        # Setters reach every group below.
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_forward(False, recurse=False)
        model.set_modules_to_forward_prefetch([model.blocks[1]])
        model.set_modules_to_backward_prefetch([model.blocks[0]])
        from hyperrec.parallel5d.fsdp import get_state

        assert all(not get_state(b).group.requires_gradient_sync for b in model.blocks)
        assert not get_state(model).group.reshard_after_forward
        assert get_state(model.blocks[0]).group.reshard_after_forward
        # Container slicing builds the original class, not an unsharded FSDP wrapper.
        assert type(model.blocks[:2]) is nn.ModuleList


def test_hsdp_params_are_replicated_on_the_outer_axis():
    with fake_mesh((2, 4), ("replicate", "shard"), rank=5) as mesh:
        model = shard_model(make("net"), mesh)
        w = model.blocks[0].up.weight
        assert isinstance(w, DTensor) and w.placements[0].is_replicate()
        assert isinstance(w.placements[1], RaggedShard)


def test_torch_policy_is_accepted():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    with fake_mesh((2,)) as mesh:
        lin = fully_shard(
            nn.Linear(4, 4), mesh=mesh, mp_policy=TorchPolicy(param_dtype=torch.bfloat16)
        )
        buf = lin.dbuffers[0]
        assert buf.param_dtype == torch.bfloat16 and buf.reduce_dtype == torch.bfloat16
        assert buf.dtype == torch.float32


def test_errors():
    with fake_mesh((2,)) as mesh:
        with pytest.raises(TypeError, match="nn.Module"):
            fully_shard(torch.zeros(3), mesh=mesh)
        lin = fully_shard(nn.Linear(4, 4), mesh=mesh)
        with pytest.raises(ValueError, match="already"):
            fully_shard(lin, mesh=mesh)
        with pytest.raises(TypeError, match="reshard_after_forward"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward="yes")
        with pytest.raises(ValueError, match="divide the shard axis size 2, got 3"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
        with pytest.raises(TypeError, match="mp_policy"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy="bf16")
        with pytest.raises(ValueError, match="granularity"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, granularity="block")
        with pytest.raises(ValueError, match="not a fully_shard module"):
            lin.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
        with pytest.raises(TypeError):
            MixedPrecisionPolicy(torch.bfloat16)  # keyword-only
    with fake_mesh((2, 2, 2)) as mesh, pytest.raises(ValueError, match="mesh"):
        fully_shard(nn.Linear(4, 4), mesh=mesh)
