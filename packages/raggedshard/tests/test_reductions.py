"""Reductions of ragged DTensors equal the same ops on the full tensors (1, 2, 4 gloo ranks).

Every case builds a random ``RaggedShard`` (uneven units, zero units, one-hot, element- and
row-granular, ``dims=()``), runs a reduction through stock torch calls on the DTensor and
compares ``full_tensor()`` of the result with the op on the full tensor. No rank ever
calls ``enable_local_ops`` except in the implicit-replication case, which runs last.
One spawn per world size runs every case.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from _ragged_cases import random_ragged
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from hyperrec.raggedshard import RaggedShard, from_local, full_tensor
from hyperrec.raggedshard.reductions import installed
from hyperrec.raggedshard.reference import local_tensor
from hyperrec.testing import run_on_ranks

SHAPES = [(6, 4), (12,), (2, 3, 4), (4, 1, 5), (0, 3), (5, 0), (1,)]

REDUCTIONS = {
    "sum": lambda t: t.sum(),
    "sum0": lambda t: t.sum(0),
    "sum_last_keep": lambda t: t.sum(-1, keepdim=True),
    "sum_f64": lambda t: t.sum(dim=0, dtype=torch.float64),
    "sum_dims": lambda t: torch.sum(t, dim=(0, t.dim() - 1)),
    "mean": lambda t: t.mean(),
    "mean_last": lambda t: t.mean(-1),
    "mean0_keep": lambda t: t.mean(0, keepdim=True),
    "norm": lambda t: torch.linalg.vector_norm(t),
    "norm1_dim0": lambda t: torch.linalg.vector_norm(t, 1, dim=0),
    "norm3_last": lambda t: torch.linalg.vector_norm(t, 3.0, dim=-1),
    "norm_inf_dim0": lambda t: torch.linalg.vector_norm(t, math.inf, dim=0),
    "norm_ninf": lambda t: torch.linalg.vector_norm(t, -math.inf),
    "norm0": lambda t: torch.linalg.vector_norm(t, 0),
    "Tensor.norm_dim0": lambda t: t.norm(dim=0),
    "torch.norm_p1": lambda t: torch.norm(t, p=1),
    "amax0": lambda t: t.amax(0),
    "amin_all": lambda t: t.amin(),
    "max": lambda t: t.max(),
    "min": lambda t: t.min(),
    "isfinite_all": lambda t: torch.isfinite(t).all(),
    "gt0_any_dim0": lambda t: (t > 0).any(0),
}
# Reductions over an empty set raise in torch; the DTensor must raise too.
EMPTY_RAISES = {"amax0", "amin_all", "max", "min", "norm_inf_dim0", "norm_ninf"}


def _ragged(rng, shape, world, k=None):
    # On a one-rank axis upstream takes the local tensor for the global one, so only
    # dims=(0,) is a valid layout there (what from_numels builds).
    return random_ragged(rng, shape, world, k=k if world > 1 else 1)


def _dtensor(full, mesh, placement, axis_coord):
    local = local_tensor(full, (mesh.size(),), (axis_coord,), [placement])
    return from_local(local, mesh, [placement], shape=full.shape)


def _check(name, fn, full, dt, out, tol):
    try:
        want = fn(full)
    except (RuntimeError, IndexError) as e:
        try:
            fn(dt)
            out[name] = "did not raise"
        except type(e):
            out[name] = True
        return
    got = fn(dt)
    got_full = full_tensor(got) if isinstance(got, DTensor) else got
    ok = got_full.shape == want.shape and got_full.dtype == want.dtype
    if ok and want.numel():
        ok = torch.allclose(got_full.double(), want.double(), rtol=tol, atol=tol, equal_nan=True)
    out[name] = True if ok else f"{got_full} != {want}"


def _suite(seed: int) -> dict:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    world, rank = mesh.size(), mesh.get_local_rank()
    rng = random.Random(seed)
    out = {"installed": installed()}
    for case in range(28):
        shape = SHAPES[case % len(SHAPES)]
        placement = _ragged(rng, shape, world)
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        g = torch.Generator().manual_seed(seed * 1000 + case)
        full = torch.randn(shape, generator=g).to(dtype)
        if case % 5 == 0 and full.numel():
            full.view(-1)[0] = float("nan") if case % 10 == 0 else float("inf")
        dt = _dtensor(full, mesh, placement, rank)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for name, fn in REDUCTIONS.items():
            if full.dim() < 2 and name in ("sum_dims",):
                continue
            key = f"{case}:{shape}:{placement}:{dtype}:{name}"
            try:
                _check(key, fn, full, dt, out, tol)
            except Exception as e:  # report, don't stop the suite
                out[key] = f"{type(e).__name__}: {e}"
        # Reductions over dims no boundary cuts keep the layout (no communication).
        if 0 < len(placement.dims) < full.dim() and full.numel():
            kept = full.dim() - 1
            rows = torch.linalg.vector_norm(dt, dim=kept)
            out[f"{case}:keeps_layout"] = tuple(rows.placements) == (placement,)
    # Integer sums are exact; bool any/all exact.
    full = torch.randint(-5, 5, (6, 4), generator=torch.Generator().manual_seed(seed))
    p = _ragged(rng, (6, 4), world, k=2)
    dt = _dtensor(full, mesh, p, rank)
    out["int_sum"] = torch.equal(full_tensor(dt.sum(0)), full.sum(0))
    # HSDP-style (Replicate, RaggedShard) on a 2-D mesh: reduced over the ragged axis only.
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        full = torch.randn(6, 5, generator=torch.Generator().manual_seed(seed + 1))
        pl = (Replicate(), RaggedShard((0,), (1, 2)))
        coord = tuple(mesh2.get_coordinate())
        local = local_tensor(full, (2, 2), coord, list(pl))
        d2 = from_local(local, mesh2, pl, shape=full.shape)
        out["hsdp_sum0"] = torch.allclose(full_tensor(d2.sum(0)), full.sum(0), atol=1e-5)
        out["hsdp_norm"] = torch.allclose(
            full_tensor(torch.linalg.vector_norm(d2)), torch.linalg.vector_norm(full)
        )
    # Whole-tensor norms of many tensors (clip_grad_norm_'s _foreach_norm) in one call,
    # without enable_local_ops.
    fulls = [
        torch.randn(s, generator=torch.Generator().manual_seed(seed + i))
        for i, s in enumerate([(6, 4), (12,), (2, 3, 4)])
    ]
    dts = [_dtensor(f, mesh, _ragged(rng, f.shape, world), rank) for f in fulls]
    for ord in (2.0, 1.0, math.inf):
        got = torch._foreach_norm(dts, ord)
        want = torch._foreach_norm(fulls, ord)
        out[f"foreach_norm_{ord}"] = all(
            torch.allclose(full_tensor(a), b, rtol=1e-5) for a, b in zip(got, want)
        )
    # Under autograd the handlers refuse instead of returning a wrong gradient.
    leaf = _dtensor(fulls[0], mesh, _ragged(rng, (6, 4), world), rank).requires_grad_()
    try:
        leaf.sum()
        out["grad_refused"] = False
    except RuntimeError as e:
        out["grad_refused"] = "not differentiable" in str(e)
    with torch.no_grad():
        out["no_grad_ok"] = torch.allclose(full_tensor(leaf.sum()), fulls[0].sum(), atol=1e-5)
    # In-place add_ of a plain tensor under implicit_replication (with the local ops on).
    from torch.distributed.tensor.experimental import implicit_replication

    from hyperrec.raggedshard import enable_local_ops

    enable_local_ops()
    for case, (shape, other_shape) in enumerate(
        [((6, 4), (6, 4)), ((6, 4), (4,)), ((2, 3, 4), (3, 1))]
    ):
        for k in range(len(shape) + 1):
            full = torch.randn(shape, generator=torch.Generator().manual_seed(seed + case))
            other = torch.randn(other_shape, generator=torch.Generator().manual_seed(seed - case))
            p = _ragged(rng, shape, world, k=k)
            dt = _dtensor(full, mesh, p, rank)
            with implicit_replication():
                dt.add_(other)
                dt.mul_(other)
                y = dt + other
            key = f"implicit:{shape}+{other_shape}:{p}"
            out[key] = (
                tuple(dt.placements) == (p,)
                and torch.allclose(full_tensor(dt), (full + other) * other)
                and torch.allclose(full_tensor(y), (full + other) * other + other)
            )
    # Without implicit_replication upstream's error is kept.
    try:
        dt.add_(torch.ones(shape))
        out["plain_without_implicit_rejected"] = False
    except Exception:
        out["plain_without_implicit_rejected"] = True
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reductions_match_full_tensor_ops(world):
    results = run_on_ranks(_suite, world, 7 + world)
    for rank_out in results:
        bad = {k: v for k, v in rank_out.items() if v is not True}
        assert not bad, list(bad.items())[:10]
        assert len(rank_out) > 200
