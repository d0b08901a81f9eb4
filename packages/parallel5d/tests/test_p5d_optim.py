"""Structure-aware optimizers: Muon on whole matrices, 8-bit AdamW on whole blocks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from hyperrec.dbuffer import DBuffer
from hyperrec.parallel5d import AdamW8bit, Muon, fully_shard
from hyperrec.parallel5d.optim import dequantize_blocks, newton_schulz, quantize_blocks
from hyperrec.parallel5d.optim._local import local_range
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
        st = opt.state.get(p, {})
        out.append(
            {
                "range": (a, b),
                **{k: st[k].numpy() for k in ("exp_avg", "exp_avg_sq") if k in st},
                **{k: st[k].numpy() for k in ("exp_avg_scale", "exp_avg_sq_scale") if k in st},
            }
        )
    return [out, [t.numpy() for t in buf.gather_full()]]


def _all_meshes() -> dict:
    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {1: _states_on(None), 2: _states_on(mesh22["shard"]), 4: _states_on(mesh4)}


def _assemble(per_rank: list, world: int, key: str, i: int):
    import numpy as np

    pieces = sorted((r[world][0][i]["range"], r[world][0][i].get(key)) for r in per_rank)
    return np.concatenate([p for (a, b), p in pieces if b > a])


def test_adamw8bit_states_do_not_depend_on_the_mesh():
    import numpy as np

    per_rank = run_on_ranks(_all_meshes, 4)
    for i in range(len(SHAPES)):
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            ref = per_rank[0][1][0][i][key]  # one rank holds everything
            for world in (2, 4):
                got = _assemble(per_rank[: 2 if world == 2 else 4], world, key, i)
                assert np.array_equal(got, ref), (i, key, world)
        for world in (2, 4):
            assert np.array_equal(per_rank[0][world][1][i], per_rank[0][1][1][i])


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
