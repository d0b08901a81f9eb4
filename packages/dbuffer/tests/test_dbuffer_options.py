"""DBuffer's FSDP2-compatibility options on real gloo ranks: host offload, resharding to
a subgroup, and every ReduceOptions knob, each against a hand-computed reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hyperrec.dbuffer import DBuffer, ReduceOptions
from hyperrec.testing import run_on_ranks

SHAPES = [(7, 3), (0, 2), (5,), (4, 4)]


def _tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _dp(mesh) -> tuple[int, int]:
    rank, size = 0, 1
    for axis in range(mesh.ndim):
        rank = rank * mesh.size(axis) + mesh.get_local_rank(axis)
        size *= mesh.size(axis)
    return rank, size


def _reduce(buf: DBuffer, grads_by_rank, options=None) -> None:
    """Every rank contributes ``grads_by_rank(rank)``; reduce with ``options``."""
    rank, _ = _dp(buf.mesh)
    buf.begin_grad()
    for i, g in enumerate(grads_by_rank(rank)):
        buf.grad_full_view(i).copy_(g)
    buf.reduce_grad(options=options)
    buf.wait_reduce()


def _shard_of(buf: DBuffer, tensors) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(tensors):
        a, b = buf.local_range(i)
        out.append(t.reshape(-1)[a:b])
    return out


def _close(buf: DBuffer, want: list[torch.Tensor], atol: float = 1e-5) -> bool:
    return all(
        torch.allclose(buf.grad_shard_view(i).double(), w.double(), atol=atol)
        for i, w in enumerate(_shard_of(buf, want))
    )


def _checks(mesh) -> dict:
    out = {}
    rank, world = _dp(mesh)
    base = _tensors(0)

    def grads(r):
        return [t * (r + 1) for t in _tensors(1)]

    total = [sum((r + 1) * t for r in range(world)) for t in _tensors(1)]
    mean = [t / world for t in total]

    # Offload: host shards, device-side full storage (both the CPU here, but separate
    # storages, as on a GPU), same values.
    buf = DBuffer.from_tensors(base, mesh=mesh, offload=True, pin_memory=False)
    out["offload_separate_full"] = buf.full.untyped_storage().data_ptr() != (
        buf.shard.untyped_storage().data_ptr()
    )
    buf.unshard()
    buf.wait_unshard()
    out["offload_gather"] = all(torch.equal(buf.full_view(i), t) for i, t in enumerate(base))
    buf.reshard()
    _reduce(buf, grads)
    out["offload_mean"] = _close(buf, mean)
    _reduce(buf, grads)  # accumulates (add after the device-to-host copy)
    out["offload_accumulate"] = _close(buf, [2 * m for m in mean])
    out["offload_full_gather"] = all(torch.equal(a, b) for a, b in zip(buf.gather_full(), base))

    # Divide factor, with and without SUM-only collectives; fp64 (FSDP2's pre/post split).
    for force_sum in (False, True):
        buf = DBuffer.from_tensors(base, mesh=mesh)
        _reduce(buf, grads, ReduceOptions(divide_factor=3.0, force_sum=force_sum))
        out[f"factor_force_sum={force_sum}"] = _close(buf, [t / 3 for t in total])
    buf = DBuffer.from_tensors(_tensors(0, torch.float64), mesh=mesh)
    _reduce(buf, lambda r: [g.double() for g in grads(r)])
    out["fp64_mean"] = _close(buf, mean, atol=1e-12)

    # Hook: sees the reduced gradient before it lands, and can change it.
    seen = []

    def hook(t: torch.Tensor) -> None:
        seen.append(t.clone())
        t.mul_(2)

    buf = DBuffer.from_tensors(base, mesh=mesh)
    _reduce(buf, grads, ReduceOptions(hook=hook))
    out["hook_called_with_shard"] = len(seen) == 1 and seen[0].numel() == buf.shard_numel
    out["hook_effect"] = _close(buf, [2 * m for m in mean])

    # A custom reduce-scatter collective replaces the built-in one.
    calls = []

    def scatter(*, output_tensor, input_tensor, group, op):
        calls.append(op)
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)

    buf = DBuffer.from_tensors(base, mesh=mesh)
    _reduce(buf, grads, ReduceOptions(reduce_scatter=scatter))
    shard_size = mesh.size(mesh.ndim - 1)
    out["custom_collective"] = len(calls) == (1 if shard_size > 1 else 0) and _close(buf, mean)

    # HSDP: reduce-scatter only, then one all-reduce of the sum.
    if mesh.ndim == 2:
        buf = DBuffer.from_tensors(base, mesh=mesh)
        _reduce(buf, grads, ReduceOptions(all_reduce=False))
        out["partial_not_exposed"] = not buf.has_grad
        _reduce(buf, grads, ReduceOptions(all_reduce=True))
        out["partial_then_all_reduce"] = _close(buf, [2 * m for m in mean])

    # One rank on the shard axis: grad_full is grad_shard; unalias before a factor.
    buf = DBuffer.from_tensors(base, mesh=mesh)
    _reduce(buf, grads)
    buf.unalias_grad_()
    _reduce(buf, grads, ReduceOptions(divide_factor=float(world)))
    out["factor_after_accumulation"] = _close(buf, [2 * m for m in mean])
    buf.set_grad_(torch.ones(buf.shard_numel))
    out["set_grad"] = buf.has_grad and bool((buf.grad_shard == 1).all())

    # Reshard to a subgroup of 2 ranks of the shard axis: the next gather runs over it.
    if shard_size >= 2 and shard_size % 2 == 0:
        shard_group = mesh.get_group(mesh.ndim - 1)
        ranks = dist.get_process_group_ranks(shard_group)
        me = mesh.get_local_rank(mesh.ndim - 1)
        pair = ranks[(me // 2) * 2 : (me // 2) * 2 + 2]
        sub = dist.new_group(pair, use_local_synchronization=True)
        buf = DBuffer.from_tensors(base, mesh=mesh, param_dtype=torch.bfloat16)
        buf.unshard()
        buf.wait_unshard()
        buf.reshard(keep=sub)
        piece, _ = buf._post_forward
        out["kept_piece"] = piece.numel() == shard_size * buf.shard_numel // 2
        out["freed"] = not buf.is_unsharded
        buf.unshard()
        buf.wait_unshard()
        out["regathered"] = all(
            torch.equal(buf.full_view(i), t.to(torch.bfloat16)) for i, t in enumerate(base)
        )
        buf.reshard()
        try:
            buf.reshard(keep=sub)  # nothing gathered to keep
            out["keep_needs_full"] = False
        except ValueError:
            out["keep_needs_full"] = True
    return out


def _all() -> list[dict]:
    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    mesh41 = init_device_mesh("cpu", (4, 1))
    return [_checks(mesh4), _checks(mesh22), _checks(mesh41)]


def test_options_on_gloo():
    for per_rank in run_on_ranks(_all, 4):
        for res in per_rank:
            bad = {k: v for k, v in res.items() if v is not True}
            assert not bad, bad


def test_option_errors():
    buf = DBuffer.from_tensors(_tensors(0))  # one process: grad_full is grad_shard
    buf.begin_grad()
    buf.grad_full.fill_(1.0)
    buf.reduce_grad()
    buf.begin_grad()
    with pytest.raises(RuntimeError, match="unalias_grad_"):
        buf.reduce_grad(options=ReduceOptions(divide_factor=2.0))
    with pytest.raises(ValueError, match="flat must have shape"):
        buf.set_grad_(torch.ones(3))
