"""Cases an audit against the same ops on full tensors found wrong (each failed before
0.2.4): local ops and ``ragged_map`` on a DTensor with a ``Partial`` axis computed
``f(piece)`` instead of ``f(sum of pieces)``; a 0-d ragged DTensor could not be made by
``from_local``/``distribute_tensor``/``ragged_map``/``redistribute``, nor saved by DCP."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate

from hyperrec.raggedshard import (
    RaggedLoadPlanner,
    RaggedSavePlanner,
    RaggedShard,
    distribute_tensor,
    from_local,
    full_tensor,
    local_ops,
    ragged_map,
    redistribute,
    wrap_local,
)
from hyperrec.testing import run_on_ranks


def _partial() -> list[str]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    ragged = RaggedShard((0,), (1, 2))
    rows = ragged.row_bounds(full.shape)[mesh.get_local_rank(1)]
    local = full[rows[0] : rows[1]] / 2  # two pending halves on the Partial axis
    x = wrap_local(local, mesh, [Partial(), ragged], shape=full.shape)
    out = []
    with local_ops():
        for name, f in (("mul", lambda t: t * t), ("add", lambda t: t + 1), ("exp", torch.exp)):
            try:
                f(x)
                out.append(f"{name}: no error")
            except NotImplementedError as e:
                out.append(f"{name}: {str(e)[:60]}")
    try:
        ragged_map(lambda a: a * a, x)
        out.append("ragged_map: no error")
    except ValueError as e:
        out.append(f"ragged_map: {str(e)[:40]}")
    # reduced first, the same op is right
    y = x.redistribute(mesh, [Replicate(), ragged])
    with local_ops():
        sq = full_tensor(y * y)
    out.append(f"after redistribute: {torch.equal(sq, full * full)}")
    return out


def test_local_ops_refuse_a_partial_axis():
    for got in run_on_ranks(_partial, 4, timeout_s=300):
        for line, op in zip(got[:3], ("mul", "add", "exp"), strict=True):
            assert line.startswith(f"{op}: aten.{op}") and "ragged DTensor with" in line, line
        assert got[3].startswith("ragged_map: ragged_map on a DTensor with a Part"), got[3]
        assert got[4] == "after redistribute: True"


def _zero_d(path: str) -> list[object]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    value = torch.tensor(3.5)
    p = RaggedShard.from_numels((), [1, 0])
    local = value.reshape(1) if rank == 0 else torch.empty(0)
    got: list[object] = []
    a = from_local(local, mesh, [p], shape=())
    got.append(float(full_tensor(a)))
    got.append(float(full_tensor(distribute_tensor(value, mesh, [p]))))
    got.append(float(full_tensor(ragged_map(lambda t: t * 2, a))))
    rep = distribute_tensor(value, mesh, [Replicate()])
    got.append(float(full_tensor(redistribute(rep, [p]))))
    # differentiable like from_local
    leaf = local.clone().requires_grad_(True)
    full_tensor(from_local(leaf, mesh, [p], shape=())).backward()
    got.append(leaf.grad.tolist())
    dcp.save({"s": a}, checkpoint_id=path, planner=RaggedSavePlanner())
    b = from_local(torch.zeros_like(local), mesh, [p], shape=())
    state = {"s": b}
    dcp.load(state, checkpoint_id=path, planner=RaggedLoadPlanner())
    got.append(float(full_tensor(state["s"])))
    return got


def test_zero_d_ragged_tensors(tmp_path):
    path = os.path.join(tmp_path, "ck")
    r0, r1 = run_on_ranks(_zero_d, 2, path, timeout_s=300)
    assert r0[:4] == r1[:4] == [3.5, 3.5, 7.0, 3.5]
    assert r0[4] == [1.0] and r1[4] == []
    assert r0[5] == r1[5] == 3.5
