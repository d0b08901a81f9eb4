"""One rank against PyTorch FSDP2: on the CPU (gloo) and on CUDA (marker ``gpu``).

On one GPU with one NCCL rank the buffers still gather (mixed precision keeps a
separate full storage), cast, reduce and prefetch on their own streams, ordered by
events. The reference is PyTorch FSDP2 with the same policy on the same rank: same
math, so losses and parameters must agree to fp32 rounding. The CPU run checks the
same on gloo (and that parameters of a one-rank mesh have their global shapes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _p5d_models import loss_fn, make

_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.fixture(params=["cpu", _CUDA])
def mesh(request, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    device = request.param
    if device == "cuda":
        torch.cuda.set_device(0)
    # A file store in this test's own directory: no TCP port that a parallel test
    # process could also pick.
    store = dist.FileStore(str(tmp_path / "store"), 1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh(device, (1,))
    finally:
        dist.destroy_process_group()


def _train(
    impl: str,
    mesh,
    mp,
    *,
    reshard: bool,
    accumulate: int,
    steps: int = 4,
    offload: bool = False,
    move: bool = False,
):
    if impl == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from hyperrec.parallel5d import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    device = mesh.device_type
    model = make("wide", seed=3).to(device)
    policy = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    kw = {"mp_policy": policy, "reshard_after_forward": reshard}
    if offload:  # pinned host memory where there is a GPU
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if move:  # model.cuda() after fully_shard: offloaded parameters go back to the host
        model.to(device)
    if offload:
        for p in model.parameters():
            assert p.to_local().device.type == "cpu"
            assert p.to_local().is_pinned() == (device == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator(device=device).manual_seed(7)
    losses = []
    for _ in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            x = torch.randn(64, 5, device=device, generator=g)
            y = torch.randn(64, 3, device=device, generator=g)
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    params = [p.full_tensor().float().cpu() for p in model.parameters()]
    for p, full in zip(model.parameters(), params):
        assert full.shape == p.shape
    return torch.stack(losses).cpu(), params


@pytest.mark.parametrize(
    "mp",
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (None, None)],
    ids=["bf16-fp32", "bf16-bf16", "fp32"],
)
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("accumulate", [1, 3], ids=["sync", "accum3"])
def test_one_rank_matches_fsdp2(mesh, mp, reshard, accumulate):
    ours_loss, ours = _train("hyperrec", mesh, mp, reshard=reshard, accumulate=accumulate)
    ref_loss, ref = _train("fsdp2", mesh, mp, reshard=reshard, accumulate=accumulate)
    assert torch.isfinite(ours_loss).all()
    torch.testing.assert_close(ours_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mp", [(torch.bfloat16, torch.float32), (None, None)], ids=["bf16-fp32", "fp32"]
)
def test_one_rank_cpu_offload_matches_fsdp2(mesh, mp):
    """CPUOffloadPolicy: host shards copied in before each gather (on CUDA: pinned, on the
    gather stream), reduced gradients copied back, AdamW stepping on the CPU."""
    ours_loss, ours = _train("hyperrec", mesh, mp, reshard=True, accumulate=2, offload=True)
    ref_loss, ref = _train("fsdp2", mesh, mp, reshard=True, accumulate=2, offload=True)
    assert torch.isfinite(ours_loss).all()
    torch.testing.assert_close(ours_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_rank_cpu_offload_then_model_to_device_matches_fsdp2(mesh):
    """Moving an offloaded model to the mesh's device after fully_shard (``model.cuda()``)
    is accepted by ours (the shards go back to pinned host memory) and trains exactly as
    FSDP2 does without the move; FSDP2 itself rejects the move at its first forward on a
    GPU (measured with torch 2.11: "FSDP parameters should be materialized on CPU")."""
    mp = (torch.bfloat16, torch.float32)
    kw = {"reshard": True, "accumulate": 1, "steps": 2, "offload": True}
    ours_loss, ours = _train("hyperrec", mesh, mp, move=True, **kw)
    ref_loss, ref = _train("fsdp2", mesh, mp, **kw)
    if mesh.device_type == "cuda":
        with pytest.raises(RuntimeError, match="materialized on CPU"):
            _train("fsdp2", mesh, mp, move=True, **kw)
    torch.testing.assert_close(ours_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_full_storages_freed_after_backward(mesh):
    """No full-size storage survives a backward: only shards, shard grads."""
    from hyperrec.parallel5d import MixedPrecisionPolicy, dbuffers, fully_shard

    device = mesh.device_type
    model = make("wide", seed=1).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x, y = torch.randn(32, 5, device=device), torch.randn(32, 3, device=device)
    loss_fn(model(x), y).backward()
    for buf in dbuffers(model):
        assert not buf.is_unsharded
        assert not buf.grad_full_live
