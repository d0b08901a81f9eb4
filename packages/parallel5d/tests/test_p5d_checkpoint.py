"""DCP: save on N ranks, load on M; load a checkpoint written by PyTorch FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _p5d_models import batch, dp_rank_and_size, local_slice, loss_fn, make, shard_model
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from hyperrec.parallel5d import full_state_dict
from hyperrec.raggedshard import RaggedLoadPlanner, RaggedSavePlanner
from hyperrec.testing import run_on_ranks


def _step(model, opt, mesh, step: int) -> None:
    x, y = batch(step)
    rank, dp = dp_rank_and_size(mesh)
    loss_fn(model(local_slice(x, rank, dp)), local_slice(y, rank, dp)).backward()
    opt.step()
    opt.zero_grad()


def _save(path: str, impl: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = make("net")
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dcp.save(model.state_dict(), checkpoint_id=path)
        return
    model = shard_model(make("net"), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        _step(model, opt, mesh, s)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path, planner=RaggedSavePlanner())


def _load_and_continue(path: str, with_optim: bool) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_model(make("net", seed=123), mesh)  # different init: must be overwritten
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if with_optim:
        _step(model, opt, mesh, 99)  # materialise optimizer states to load into
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path, planner=RaggedLoadPlanner())
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    else:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path, planner=RaggedLoadPlanner())
    loaded = {k: v.numpy() for k, v in full_state_dict(model).items()}
    if with_optim:
        _step(model, opt, mesh, 2)
    return {
        "loaded": loaded,
        "continued": {k: v.numpy() for k, v in full_state_dict(model).items()},
    }


def _uninterrupted() -> dict:
    mesh = init_device_mesh("cpu", (1,))
    model = shard_model(make("net"), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        _step(model, opt, mesh, s)
    at2 = {k: v.numpy() for k, v in full_state_dict(model).items()}
    _step(model, opt, mesh, 2)
    return {"at2": at2, "at3": {k: v.numpy() for k, v in full_state_dict(model).items()}}


def _close(a: dict, b: dict, tol: float) -> float:
    assert a.keys() == b.keys()
    return max(float(abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.slow  # minutes of gloo ranks; `nox -s lowest` leaves it to the normal session
def test_save_on_2_load_on_4_and_1_then_resume(tmp_path):
    ckpt = str(tmp_path / "hyperrec")
    run_on_ranks(_save, 2, ckpt, "hyperrec")
    ref = run_on_ranks(_uninterrupted, 1)[0]
    for world in (4, 1):
        out = run_on_ranks(_load_and_continue, world, ckpt, True)
        for o in out:
            # Loading reproduces the saved parameters exactly ...
            assert _close(o["loaded"], ref["at2"], 0) <= 2e-6
            # ... and the optimizer state too: the next step matches uninterrupted training.
            assert _close(o["continued"], ref["at3"], 0) <= 1e-5


@pytest.mark.slow  # minutes of gloo ranks; `nox -s lowest` leaves it to the normal session
def test_load_a_pytorch_fsdp2_checkpoint(tmp_path):
    ckpt = str(tmp_path / "fsdp2")
    run_on_ranks(_save, 2, ckpt, "fsdp2")
    want = {k: v.numpy() for k, v in make("net").state_dict().items()}
    for o in run_on_ranks(_load_and_continue, 4, ckpt, False):
        assert _close(o["loaded"], want, 0) == 0.0  # bitwise: the same fp32 values
