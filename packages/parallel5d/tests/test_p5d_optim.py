"""Structure-aware optimizers: Muon on whole matrices, 8-bit AdamW on whole blocks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperrec.dbuffer import DBuffer
from hyperrec.parallel5d import AdamW8bit, Muon, fully_shard
from hyperrec.parallel5d.optim import dequantize_blocks, newton_schulz, quantize_blocks
from hyperrec.parallel5d.optim._local import element_ranges, local_range
from hyperrec.testing import fake_mesh, run_on_ranks

BLOCK = 64
SHAPES = [(40, 16), (100,), (3, 64), (7, 9)]


def test_quantize_round_trip_and_partial_block():
    torch.manual_seed(0)
    x = torch.randn(3 * BLOCK + 10)
    codes, scales = quantize_blocks(x, BLOCK, signed=True)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scales.shape == (4,)
    err = (dequantize_blocks(codes, scales, BLOCK) - x).abs()
    bound = scales.repeat_interleave(BLOCK)[: x.numel()] / 2 + 1e-7
    assert torch.all(err <= bound)
    u, s = quantize_blocks(x.abs(), BLOCK, signed=False)
    assert u.dtype == torch.uint8 and torch.all(dequantize_blocks(u, s, BLOCK) >= 0)
    z, zs = quantize_blocks(torch.zeros(5), BLOCK, signed=True)  # all-zero block: no NaN
    assert torch.equal(dequantize_blocks(z, zs, BLOCK), torch.zeros(5))


def test_adamw8bit_tracks_fp32_adamw():
    torch.manual_seed(0)
    target = torch.randn(300)
    p8, p32 = torch.zeros(300, requires_grad=True), torch.zeros(300, requires_grad=True)
    o8 = AdamW8bit([p8], lr=0.05, weight_decay=0.0, block_size=BLOCK)
    o32 = torch.optim.AdamW([p32], lr=0.05, weight_decay=0.0)
    for _ in range(60):
        for p, o in ((p8, o8), (p32, o32)):
            ((p - target) ** 2).sum().backward()
            o.step()
            o.zero_grad()
    assert float(((p8.detach() - target) ** 2).mean()) < 0.1 * float((target**2).mean())
    assert float((p8.detach() - p32.detach()).abs().max()) < 0.1


def _states_on(mesh) -> list[dict]:
    """3 steps of AdamW8bit on ragged DTensor views of a DBuffer; per-tensor states."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g) for s in SHAPES]
    buf = DBuffer.from_tensors(full, mesh=mesh, granularities=[BLOCK] * len(SHAPES))
    params = [torch.nn.Parameter(t) for t in buf.as_dtensors()]
    grads = buf.as_dtensors(buf.grad_shard)
    opt = AdamW8bit(params, lr=1e-2, block_size=BLOCK)
    for step in range(3):
        gs = torch.Generator().manual_seed(10 + step)
        for i, s in enumerate(SHAPES):
            a, b = buf.local_range(i)
            buf.grad_shard_view(i).copy_(torch.randn(s, generator=gs).reshape(-1)[a:b])
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
    out = []
    for p in params:
        a, b = local_range(p)
        assert a % BLOCK == 0 or a == b  # whole blocks only
        st = opt.state[p]
        # The global value of every state (DTensors gathered; the scales' placement must
        # put each block's scale where the block is for this to match one process).
        out.append(
            {k: (v.full_tensor() if isinstance(v, DTensor) else v).numpy() for k, v in st.items()}
        )
    return [out, [t.numpy() for t in buf.gather_full()]]


def _all_meshes() -> dict:
    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {1: _states_on(None), 2: _states_on(mesh22["shard"]), 4: _states_on(mesh4)}


def test_adamw8bit_states_do_not_depend_on_the_mesh():
    import numpy as np

    per_rank = run_on_ranks(_all_meshes, 4)
    ref = per_rank[0][1]  # one process holds everything
    for i in range(len(SHAPES)):
        for key in ("step", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            for world in (2, 4):
                for r in per_rank:
                    got = r[world][0][i][key]
                    assert got.dtype == ref[0][i][key].dtype, (i, key, world)
                    assert np.array_equal(got, ref[0][i][key]), (i, key, world)
        for world in (2, 4):
            assert np.array_equal(per_rank[0][world][1][i], ref[1][i])


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    for shape in ((32, 8), (8, 32), (16, 16)):
        o = newton_schulz(torch.randn(shape), steps=5)
        sv = torch.linalg.svdvals(o)
        assert o.shape == shape and sv.min() > 0.5 and sv.max() < 1.3
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(3, 3, 3))


def test_optimizer_errors_name_the_fix():
    with pytest.raises(ValueError, match="AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    for bad in ({"lr": 0}, {"momentum": 1.0}, {"ns_steps": 0}, {"weight_decay": -1}):
        with pytest.raises(ValueError):
            Muon([torch.nn.Parameter(torch.zeros(3, 3))], **bad)
    for bad in ({"lr": 0}, {"betas": (1.0, 0.9)}, {"eps": 0}, {"block_size": 0}):
        with pytest.raises(ValueError):
            AdamW8bit([torch.nn.Parameter(torch.zeros(3))], **bad)
    with pytest.raises(TypeError, match="block_size"):  # per param group too; not an int
        AdamW8bit([{"params": [torch.nn.Parameter(torch.zeros(3))], "block_size": 2.0}])
    with fake_mesh((2,), rank=1) as mesh:
        lin = fully_shard(torch.nn.Linear(30, 30), mesh=mesh, alignment=1)
        with pytest.raises(ValueError, match="granularity='matrix'"):
            Muon([lin.weight])
        with pytest.raises(ValueError, match="granularity=2048"):
            AdamW8bit([lin.weight])
        whole = fully_shard(torch.nn.Linear(30, 30), mesh=mesh, granularity="matrix")
        Muon([whole.weight])  # whole matrices: accepted
        AdamW8bit(
            list(fully_shard(torch.nn.Linear(64, 64), mesh=mesh, granularity=2048).parameters())
        )


def test_states_are_dtensors_sharded_like_their_parameters():
    with fake_mesh((4,), rank=1) as mesh:
        lin = fully_shard(torch.nn.Linear(64, 50), mesh=mesh, granularity=BLOCK, alignment=1)
        opt = AdamW8bit(lin.parameters(), block_size=BLOCK)
        for p in lin.parameters():
            st = opt.state[p]
            assert st["step"].shape == () and st["step"].dtype == torch.int64
            for name, dtype in (("exp_avg", torch.int8), ("exp_avg_sq", torch.uint8)):
                assert isinstance(st[name], DTensor) and st[name].dtype == dtype
                assert st[name].shape == p.shape and st[name].placements == p.placements
                assert st[name].to_local().shape == p.to_local().shape
            # One scale per block, on the rank that holds the block.
            nblocks = -(-p.numel() // BLOCK)
            for name in ("exp_avg_scale", "exp_avg_sq_scale"):
                scales = st[name]
                assert scales.shape == (nblocks,) and scales.dtype == torch.float32
                want = [
                    (a // BLOCK, -(-b // BLOCK)) if b > a else None for a, b in element_ranges(p)
                ]
                got = scales.placements[0].element_bounds(scales.shape)
                assert [g if g[1] > g[0] else None for g in got] == want
        assert opt.state[lin.weight]["exp_avg_scale"].to_local().numel() > 0  # rank 1 holds some
        whole = fully_shard(torch.nn.Linear(30, 30), mesh=mesh, granularity="matrix")
        buf = Muon([whole.weight]).state[whole.weight]["momentum_buffer"]
        assert buf.placements == whole.weight.placements and buf.shape == whole.weight.shape
        assert buf.to_local().shape == whole.weight.to_local().shape
