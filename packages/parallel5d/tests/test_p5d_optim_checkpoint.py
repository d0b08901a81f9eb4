"""Muon / AdamW8bit states through DCP: save on 2 ranks, load on 4 and on 1, resume.

Three spawns in all (save on 2; load on a 4-rank FSDP mesh and on a 2x2 HSDP mesh with
coarser shard units; load on 1 next to the uninterrupted single-process run). Two
configurations: AdamW8bit on every parameter with 64-element blocks (matrices cut into
blocks across ranks), and Muon on the matrices (whole, one owner each) + AdamW8bit on
the vectors, saved through torch's ``get_optimizer_state_dict`` helper (names as keys).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _p5d_models import Net, batch, dp_rank_and_size, local_slice, loss_fn, make, shard_model
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d import AdamW8bit, Muon, full_state_dict
from hyperrec.raggedshard import RaggedLoadPlanner, RaggedSavePlanner, full_tensor
from hyperrec.testing import run_on_ranks

BLOCK = 64  # AdamW8bit blocks of the "adamw8bit" configuration
VEC_BLOCK = 8  # AdamW8bit blocks of the vectors in the "muon" configuration
STEPS, MORE = 3, 2  # steps before the checkpoint, steps after it
CONFIGS = ("adamw8bit", "muon")


def _granularity(config: str, coarse: bool):
    # coarse: other shard units than the saving run's for the same world size.
    if config == "adamw8bit":
        return 2 * BLOCK if coarse else BLOCK
    return lambda fqn, p: "matrix" if p.dim() >= 2 else (2 if coarse else 1) * VEC_BLOCK


def _optimizers(model: torch.nn.Module, config: str) -> list[torch.optim.Optimizer]:
    if config == "adamw8bit":
        return [AdamW8bit(model.parameters(), lr=1e-2, block_size=BLOCK)]
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    return [Muon(mats, lr=0.02), AdamW8bit(vecs, lr=1e-2, block_size=VEC_BLOCK)]


def _build(config: str, mesh=None, *, coarse: bool = False, seed: int = 0):
    model = make("wide" if config == "adamw8bit" else "net", seed=seed)
    if mesh is not None:
        # Coarse: other block sizes and no alignment padding, so other shard units.
        kw = {"alignment": 1} if coarse else {}
        shard_model(model, mesh, granularity=_granularity(config, coarse), **kw)
    return model, _optimizers(model, config)


def _train(model, opts, mesh, steps, *, split: bool = True) -> list[float]:
    """Train on ``batch(step)``: split over the data-parallel ranks, or (``split=False``)
    the whole batch on every rank, whose averaged gradient ``(g + g) / 2`` on 2 ranks is
    exactly the single-process ``g``."""
    losses = []
    for step in steps:
        x, y = batch(step)
        if mesh is not None and split:
            rank, dp = dp_rank_and_size(mesh)
            x, y = local_slice(x, rank, dp), local_slice(y, rank, dp)
        loss = loss_fn(model(x), y)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        total = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses


def _full_states(opts) -> dict:
    """Every state's global value (test-only gather), keyed by optimizer/param/name."""
    out = {}
    for i, o in enumerate(opts):
        for j, p in enumerate(p for g in o.param_groups for p in g["params"]):
            for name, v in o.state[p].items():
                # raggedshard's full_tensor: upstream's returns a whole-tensor piece's
                # local shape (1, *shape) on a 1-rank mesh.
                full = full_tensor(v) if isinstance(v, DTensor) else v
                out[f"{i}.{j}.{name}"] = full.numpy().copy()  # a snapshot, not a view
    return out


def _checkpoint(model, opts, config: str) -> dict:
    if config == "muon":  # torch's helper: keys by parameter name, both optimizers merged
        return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opts)}
    return {
        "model": model.state_dict(),
        "optim": {str(i): o.state_dict() for i, o in enumerate(opts)},
    }


def _restore(model, opts, config: str, path: str) -> None:
    state = _checkpoint(model, opts, config)
    dcp.load(state, checkpoint_id=path, planner=RaggedLoadPlanner())
    model.load_state_dict(state["model"])
    if config == "muon":
        set_optimizer_state_dict(model, opts, state["optim"])
    else:
        for i, o in enumerate(opts):
            o.load_state_dict(state["optim"][str(i)])


def _save(root: str) -> dict:
    """2 ranks: STEPS steps on the whole batch (bitwise the single-process run), save."""
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for config in CONFIGS:
        model, opts = _build(config, mesh)
        losses = _train(model, opts, mesh, range(STEPS), split=False)
        dcp.save(
            _checkpoint(model, opts, config),
            checkpoint_id=os.path.join(root, config),
            planner=RaggedSavePlanner(),
        )
        out[config] = {
            "losses": losses,
            "states": _full_states(opts),
            "params": {k: v.numpy() for k, v in full_state_dict(model).items()},
        }
    return out


def _load_and_continue(root: str, layouts: list[str]) -> dict:
    """Load both checkpoints into another init on this world size, train MORE steps with
    the batch split over the ranks; on 1 rank also run the references."""
    out = {}
    for layout in layouts:
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for config in CONFIGS:
            # Another initialisation and fresh optimizers: everything must be overwritten.
            model, opts = _build(config, mesh, coarse=layout == "hsdp", seed=123)
            _restore(model, opts, config, os.path.join(root, config))
            loaded = {k: v.numpy() for k, v in full_state_dict(model).items()}
            if layout == "fsdp" and dist.get_world_size() > 1:
                out[f"in-memory/{config}"] = _load_in_memory(opts, config, mesh)
            out[f"{layout}/{config}"] = {
                "states": _full_states(opts),
                "loaded": loaded,
                "losses": _train(model, opts, mesh, range(STEPS, STEPS + MORE)),
                "params": {k: v.numpy() for k, v in full_state_dict(model).items()},
            }
    if dist.get_world_size() == 1:
        out["reference"] = _uninterrupted()
        out["bad_input"] = _load_another_shape(root)
    return out


def _load_in_memory(opts, config: str, mesh) -> dict:
    """``load_state_dict`` without DCP into optimizers with other shard units on the same
    mesh: from the DTensor states (redistributed) and from full plain tensors."""
    out, moved = {}, 0
    for source in ("dtensors", "full"):
        _, others = _build(config, mesh, coarse=True, seed=7)
        for o, other in zip(opts, others):
            sd = o.state_dict()
            moved += sum(
                a.placements != b.placements
                for st, ost in zip(o.state.values(), other.state.values())
                for a, b in zip(st.values(), ost.values())
                if isinstance(a, DTensor)
            )
            if source == "full":
                sd["state"] = {
                    k: {n: full_tensor(v) if isinstance(v, DTensor) else v for n, v in st.items()}
                    for k, st in sd["state"].items()
                }
            other.load_state_dict(sd)
        out[source] = _full_states(others)
    out["redistributed"] = moved  # states whose shard units differ between the two
    return out


def _uninterrupted() -> dict:
    """Plain single-process training (no fully_shard, no checkpoint) of both configs."""
    out = {}
    for config in CONFIGS:
        model, opts = _build(config)
        losses = _train(model, opts, None, range(STEPS))
        at_save = _full_states(opts)
        losses += _train(model, opts, None, range(STEPS, STEPS + MORE))
        out[config] = {
            "losses": losses,
            "states": at_save,
            "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            "moved": _max_err(
                {k: v.detach().numpy() for k, v in model.state_dict().items()},
                {k: v.numpy() for k, v in _build(config)[0].state_dict().items()},
            ),
        }
    return out


def _load_another_shape(root: str) -> str:
    # The checkpoint of the d=40 model loaded into the optimizer of a d=12 model.
    model, _ = _build("muon", init_device_mesh("cpu", (1,)))
    state = {"optim": {"0": AdamW8bit(model.parameters(), block_size=BLOCK).state_dict()}}
    try:
        dcp.load(state, checkpoint_id=os.path.join(root, "adamw8bit"), planner=RaggedLoadPlanner())
    except CheckpointException as e:  # DCP's wrapper (a BaseException) of the ValueError
        return str(e)
    return ""


def _max_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


@pytest.mark.slow  # minutes of gloo ranks; `nox -s lowest` leaves it to the normal session
def test_optimizer_states_save_on_2_load_on_4_and_1_then_resume(tmp_path):
    root = str(tmp_path)
    saved = run_on_ranks(_save, 2, root)[0]
    runs = run_on_ranks(_load_and_continue, 4, root, ["fsdp", "hsdp"])
    single = run_on_ranks(_load_and_continue, 1, root, ["fsdp"])[0]
    ref = single["reference"]
    for config in CONFIGS:
        # Saving side: 2 ranks on the same batch do the single-process arithmetic, so
        # their states (8-bit codes and scales, counters, momenta) equal one process's.
        assert saved[config]["losses"] == ref[config]["losses"][:STEPS], config
        assert _bitwise(saved[config]["states"], ref[config]["states"]), config
        assert ref[config]["moved"] > 1e-2  # training moved the parameters (not vacuous)
    st = saved["adamw8bit"]["states"]
    assert int(st["0.0.step"]) == STEPS and np.abs(st["0.1.exp_avg"]).max() > 100

    checked = 0
    for out in [*runs, single]:
        for name, r in out.items():
            if name.startswith("in-memory/"):
                assert r.pop("redistributed") > 0, name
                for states in r.values():
                    assert _bitwise(states, saved[name.split("/")[1]]["states"]), name
                continue
            if "/" not in name:
                continue
            config = name.split("/")[1]
            s, want = saved[config], ref[config]
            # The round trip moves bytes: on every mesh the states and parameters are
            # bit-identical to the saved ones.
            assert _bitwise(r["states"], s["states"]), name
            assert _bitwise(r["loaded"], s["params"]), name
            if out is single:
                # One rank: exactly the uninterrupted single-process run.
                assert r["losses"] == want["losses"][STEPS:], name
                assert _bitwise(r["params"], want["params"]), name
            else:
                # 4 ranks split the batch: the reductions round differently from one
                # process; parameters move by ~1e-2 per step.
                assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"][STEPS:])) < 1e-6
                assert _max_err(r["params"], want["params"]) < 2e-6, name
            checked += 1
    assert checked == 4 * 2 * 2 + 2  # 4 ranks x (fsdp, hsdp) x configs, 1 rank x configs

    # Loading into the optimizer of a model of other shapes fails, naming the state.
    assert "Size mismatch" in single["bad_input"], single["bad_input"]
    assert "optim.0.state.1.exp_avg" in single["bad_input"]
    # Each rank wrote only its own pieces: a state cut between the two saving ranks is
    # stored as several chunks that cover it once (no rank gathered it whole).
    md = dcp.FileSystemReader(os.path.join(root, "adamw8bit")).read_metadata()
    split = {
        k: v
        for k, v in md.state_dict_metadata.items()
        if k.endswith((".exp_avg", ".exp_avg_sq_scale")) and len(v.chunks) > 1
    }
    assert len(split) >= 4, sorted(md.state_dict_metadata)
    for k, v in split.items():
        assert sum(int(np.prod(c.sizes)) for c in v.chunks) == int(np.prod(v.size)), k


# ------------------------------------------------------------- single-process checks


def _plain(config: str, seed: int = 0):
    model, opts = _build(config, seed=seed)
    _train(model, opts, None, range(2))
    return model, opts


@pytest.mark.parametrize("config", CONFIGS)
def test_load_state_dict_restores_the_exact_trajectory(config):
    model, opts = _plain(config)
    saved = [copy.deepcopy(o.state_dict()) for o in opts]
    params = copy.deepcopy(model.state_dict())
    _train(model, opts, None, range(2, 4))
    # Another model with fresh optimizers, loaded from copies (not the live tensors).
    other, other_opts = _build(config, seed=5)
    other.load_state_dict(params)
    for o, sd in zip(other_opts, saved):
        o.load_state_dict(sd)
    _train(other, other_opts, None, range(2, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k  # bitwise: same arithmetic
    # A parameter without a saved state starts afresh.
    partial = copy.deepcopy(saved[-1])
    del partial["state"][0]
    opts[-1].load_state_dict(partial)
    fresh = opts[-1].state_dict()["state"][0]
    assert all(not t.any() for t in fresh.values()), fresh


def test_load_state_dict_rejects_bad_input_and_changes_nothing():
    _, (opt,) = _plain("adamw8bit")
    before = copy.deepcopy(opt.state_dict())

    def rejects(exc, match, state_dict, target=opt):
        with pytest.raises(exc, match=match):
            target.load_state_dict(state_dict)

    # The state of a model with other shapes (width 12, not 40; same parameter count).
    small = AdamW8bit(Net(d=12, layers=2).parameters(), block_size=BLOCK).state_dict()
    rejects(
        ValueError,
        r"parameter 1 \(shape \(40, 5\)\): 'exp_avg' has shape \(12, 5\), expected \(40, 5\)",
        small,
    )
    # Other numbers of groups / parameters.
    two_groups = {"state": {}, "param_groups": before["param_groups"] * 2}
    rejects(ValueError, "state_dict has 2 param groups, this optimizer has 1", two_groups)
    tiny = AdamW8bit(torch.nn.Linear(7, 3).parameters(), block_size=BLOCK).state_dict()
    rejects(ValueError, "param group 0 of state_dict has 2 parameters", tiny)
    # Another optimizer's state (torch's AdamW) for the same model.
    model, _ = _build("adamw8bit")
    adamw = torch.optim.AdamW(model.parameters())
    _train(model, [adamw], None, range(1))
    rejects(ValueError, "another optimizer", adamw.state_dict())
    # Float values where 8-bit codes are expected.
    wrong = copy.deepcopy(before)
    wrong["state"][0]["exp_avg"] = wrong["state"][0]["exp_avg"].float()
    rejects(ValueError, "'exp_avg' has dtype torch.float32, expected torch.int8", wrong)
    # States quantized with another block size cannot be reinterpreted.
    coarse = AdamW8bit(_build("adamw8bit")[0].parameters(), block_size=2 * BLOCK)
    rejects(ValueError, "block_size=64, this optimizer uses block_size=128", before, coarse)
    rejects(TypeError, "'state' and 'param_groups'", {"state": {}})
    # Every failed load left the optimizer as it was (validation precedes any change).
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, v in before["state"].items():
        for name, t in v.items():
            assert torch.equal(t, after["state"][k][name]), (k, name)
