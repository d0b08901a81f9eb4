"""One geometry from the planner down: layout, DBuffer views, DTensor parameters, optimizers.

Which flat elements of a parameter a rank holds is decided once, by the raggedshard
``Layout`` a ``DBuffer`` wraps. Every consumer below (the shard views, the parameters'
``RaggedShard`` placements, the optimizers' ``local_range`` and block placements) must
name the same elements. Built on the fake backend for every rank of uneven meshes, so a
disagreement anywhere shows up as a wrong element on some rank, without any collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d import AdamW8bit, Muon, dbuffers, fully_shard
from hyperrec.parallel5d.optim._local import block_placements, element_ranges, local_range
from hyperrec.raggedshard import RaggedShard
from hyperrec.testing import fake_mesh


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5), nn.Linear(5, 1))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("mesh_shape", "granularity"),
    [((3,), None), ((4,), "row"), ((5,), "matrix"), ((2, 3), 16), ((1,), None)],
)
def test_every_consumer_reads_the_layout(mesh_shape, granularity):
    shard_axis = mesh_shape[-1]
    held = 0
    for coord in range(shard_axis):
        rank = coord if len(mesh_shape) == 1 else shard_axis + coord  # replica 1 for HSDP
        reference = dict(_model(0).named_parameters())
        with fake_mesh(mesh_shape, rank=rank) as mesh:
            model = fully_shard(_model(0), mesh=mesh, granularity=granularity)
            (buf,) = dbuffers(model)
            layout = buf.layout
            slot = {s.fqn: s for s in model._fsdp_state().group.slots}
            for name, p in model.named_parameters():
                i = slot[name].index
                assert "_hyperrec_local_range" not in vars(p)  # nothing patched on
                assert isinstance(p, DTensor)
                placement = next(pl for pl in p.placements if isinstance(pl, RaggedShard))
                assert placement == layout.placement(i, p.shape)
                want = layout.rank_range(i, coord)
                assert buf.local_range(i) == want == local_range(p)
                assert element_ranges(p) == tuple(
                    layout.rank_range(i, r) for r in range(shard_axis)
                )
                local = p.to_local()
                assert _same_storage(local, buf.shard)
                lo, hi = layout.shard_range(i, coord)
                assert local.numel() == hi - lo
                if hi > lo:
                    assert local.data_ptr() == buf.shard[lo:].data_ptr()
                full = reference[name].detach().reshape(-1)
                assert torch.equal(local.reshape(-1), full[want[0] : want[1]])
                held += hi - lo
    # Every element of every parameter is held by exactly one rank of the shard axis.
    assert held == sum(p.numel() for p in _model(0).parameters())


def test_optimizer_states_follow_the_parameter_layout():
    for rank in range(3):
        with fake_mesh((3,), rank=rank) as mesh:
            model = fully_shard(_model(1), mesh=mesh, granularity=16)
            params = list(model.parameters())
            opt = AdamW8bit(params, block_size=16)
            for p in params:
                a, b = local_range(p)
                assert a % 16 == 0 or a == b
                scales = opt.state[p]["exp_avg_scale"]
                on_blocks = block_placements(p, 16)
                assert tuple(scales.placements) == on_blocks
                # The scales this rank holds are exactly those of the blocks it holds.
                nb = scales.to_local().numel()
                assert nb == (-(-b // 16) - a // 16 if b > a else 0)
                assert opt.state[p]["exp_avg"].to_local().numel() == b - a
        with fake_mesh((3,), rank=rank) as mesh:
            model = fully_shard(_model(1), mesh=mesh, granularity="matrix")
            matrices = [p for p in model.parameters() if p.dim() == 2]
            opt = Muon(matrices)
            for p in matrices:
                a, b = local_range(p)
                assert a == b or (a, b) == (0, p.numel())  # whole matrices only
                assert opt.state[p]["momentum_buffer"].to_local().numel() == b - a
