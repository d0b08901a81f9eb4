"""DBuffer across ranks: real gloo collectives for values, the fake backend for traces."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperrec.dbuffer import DBuffer, clip_grad_norm_
from hyperrec.raggedshard import enable_local_ops
from hyperrec.testing import fake_mesh, run_on_ranks

# Zero-size tensors, tensors smaller than a rank's shard, and block granularities that
# force uneven (and empty) shards.
SHAPES = [(37, 5), (0, 4), (3,), (64, 8), (1,), (9, 2, 3)]
GRANS = [5, 1, 1, 8 * 16, 1, 54]
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::clone", "split_with_sizes_copy")


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _inside(view: torch.Tensor, base: torch.Tensor) -> bool:
    storage = base.untyped_storage()
    if view.untyped_storage().data_ptr() != storage.data_ptr():
        return False
    if view.numel() == 0:
        return True
    end = view.data_ptr() + view.numel() * view.element_size()
    return storage.data_ptr() <= view.data_ptr() and end <= storage.data_ptr() + storage.nbytes()


def _checks(mesh) -> dict:
    """Every value check for one mesh."""
    dp = mesh.size()
    rank = 0  # data-parallel coordinate over all mesh axes
    for axis in range(mesh.ndim):
        rank = rank * mesh.size(axis) + mesh.get_local_rank(axis)
    ts = _tensors()
    out = {}
    for param_dtype in (torch.float32, torch.bfloat16):
        buf = DBuffer.from_tensors(ts, mesh=mesh, granularities=GRANS, param_dtype=param_dtype)
        # Whole blocks only, and every view inside its flat storage.
        for i, g in enumerate(GRANS):
            a, b = buf.local_range(i)
            assert a % g == 0 and (b % g == 0 or b == ts[i].numel())
            assert _inside(buf.shard_view(i), buf.shard)
        buf.unshard()
        buf.wait_unshard()
        for i, t in enumerate(ts):
            assert _inside(buf.full_view(i), buf.full)
            assert torch.equal(buf.full_view(i), t.to(param_dtype)), (param_dtype, i)
        buf.reshard()
        assert buf.is_unsharded == (buf.full is buf.shard)  # an alias is never freed
        # Gradient: rank r contributes (r + 1) * base; the reduction is the mean.
        base = _tensors(seed=1)
        for rounds in (1, 2):
            buf.begin_grad()
            for i, g in enumerate(base):
                buf.grad_full_view(i).add_(g * (rank + 1))  # gradients accumulate
                assert _inside(buf.grad_full_view(i), buf.grad_full)
            buf.reduce_grad()
            buf.wait_reduce()
            mean = (dp + 1) / 2
            for i, g in enumerate(base):
                a, b = buf.local_range(i)
                want = (g.reshape(-1)[a:b] * mean * rounds).to(param_dtype).float()
                torch.testing.assert_close(buf.grad_shard_view(i), want, rtol=1e-2, atol=1e-2)
                assert _inside(buf.grad_shard_view(i), buf.grad_shard)
        buf.zero_grad_()
    # Clipping across ranks equals clipping the full gradients.
    buf = DBuffer.from_tensors(ts, mesh=mesh, granularities=GRANS)
    buf.begin_grad()
    grads = _tensors(seed=2)
    for i, g in enumerate(grads):
        buf.grad_full_view(i).copy_(g)
    buf.reduce_grad()
    ref = [t.clone().requires_grad_() for t in ts]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    out["norm"] = float(clip_grad_norm_([buf], 1.0))
    out["ref_norm"] = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    for i, r in enumerate(ref):
        a, b = buf.local_range(i)
        torch.testing.assert_close(buf.grad_shard_view(i), r.grad.reshape(-1)[a:b])
    # The same tensors as ragged DTensors: zero-copy views with the layout's placement.
    sd = buf.state_dict()
    for i, (name, v) in enumerate(sd.items()):
        assert name == str(i) and tuple(v.shape) == SHAPES[i]
        assert _inside(v.to_local(), buf.shard)
    full = buf.gather_full()
    for f, t in zip(full, ts):
        assert torch.equal(f, t)
    # Stock torch on those views, as the README promises under raggedshard's local ops:
    # torch's own clip_grad_norm_ on the gradient DTensors clips like the full tensors.
    enable_local_ops()
    params = [torch.nn.Parameter(v) for v in buf.as_dtensors()]
    for p, g in zip(params, buf.as_dtensors(buf.grad_shard)):
        p.grad = g
    stock = torch.nn.utils.clip_grad_norm_(params, 0.5)
    out["stock_norm"] = float(stock.full_tensor() if isinstance(stock, DTensor) else stock)
    out["ref_norm_clipped"] = float(torch.nn.utils.clip_grad_norm_(ref, 0.5))
    for i, (p, r) in enumerate(zip(params, ref)):
        a, b = buf.local_range(i)
        torch.testing.assert_close(p.grad.to_local().reshape(-1), r.grad.reshape(-1)[a:b])
    out["padding"] = buf.padding
    return out


def _all_meshes() -> list[dict]:
    # One spawn of 4 ranks covers 4-way FSDP, 2-way FSDP (each replica row of the 2x2
    # mesh on its own), 2x2 HSDP and 4 replicas of one shard.
    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    mesh41 = init_device_mesh("cpu", (4, 1))  # replicas only: DDP through the same buffer
    return [_checks(mesh4), _checks(mesh22["shard"]), _checks(mesh22), _checks(mesh41)]


def test_values_on_gloo():
    for per_rank in run_on_ranks(_all_meshes, 4):
        for o in per_rank:
            assert o["norm"] == pytest.approx(o["ref_norm"], rel=1e-5)
            assert o["stock_norm"] == pytest.approx(o["ref_norm_clipped"], rel=1e-5)


def _in_collective(event) -> bool:
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith("c10d::"):
            return True
        p = p.cpu_parent
    return False


def _trace(fn) -> tuple[list[str], dict[str, int]]:
    """Copy ops issued outside any collective (the backend's own staging is excluded),
    and the collectives, from a CPU profiler trace of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    counts: dict[str, int] = {}
    for e in events:
        if e.name.startswith("c10d::"):
            counts[e.name] = counts.get(e.name, 0) + 1
    copies = [e.name for e in events if e.name.endswith(COPY_OPS) and not _in_collective(e)]
    return copies, counts


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=["fsdp8", "hsdp2x4"])
def test_one_collective_and_no_copies_in_trace(mesh_shape):
    # The fake backend stands in for NCCL: a structure-only 8-rank process group in
    # one process.
    with fake_mesh(mesh_shape, rank=3) as mesh:
        buf = DBuffer.from_tensors(_tensors(), mesh=mesh, granularities=GRANS)
        copies, counts = _trace(lambda: (buf.unshard(), buf.wait_unshard()))
        assert copies == [] and counts == {"c10d::_allgather_base_": 1}
        for b in range(2):  # a fresh reduction, then an accumulating one
            buf.begin_grad()
            copies, counts = _trace(lambda: (buf.reduce_grad(), buf.wait_reduce()))
            want = {"c10d::_reduce_scatter_base_": 1}
            if len(mesh_shape) == 2:
                want["c10d::allreduce_"] = 1
            assert copies == [] and counts == want, (b, copies, counts)
        # Mixed precision: the only copy is the fp32 -> bf16 cast into the gather slot.
        buf = DBuffer.from_tensors(_tensors(), mesh=mesh, param_dtype=torch.bfloat16)
        copies, counts = _trace(lambda: (buf.unshard(), buf.wait_unshard()))
        assert copies == ["aten::copy_"] and counts == {"c10d::_allgather_base_": 1}
        for i in range(len(SHAPES)):
            assert _inside(buf.full_view(i), buf.full)
            assert _inside(buf.shard_view(i), buf.shard)


def test_mesh_errors():
    with fake_mesh((2, 2, 2)) as mesh, pytest.raises(ValueError, match="mesh"):
        DBuffer([(4,)], mesh=mesh)
