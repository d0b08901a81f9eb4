"""Loading a full (unsharded) state dict into a ``fully_shard`` model.

torch's ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`` takes the ``RaggedShard`` placement as replicated and fails
on the first parameter split across ranks (an audit found it; our tests only loaded
models whose parameters each sat whole on one rank, where it happened to work).
``load_full_state_dict`` cuts each rank's rows itself. Checked on 2 and 3 gloo ranks and a
2x2 HSDP mesh, with rank 0 sending and with every rank holding the dict: the model's
full parameters, buffers and outputs equal an unsharded model loaded with the same dict;
a tied parameter loads under either name; bad dicts raise the same error on every rank
before anything is sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from hyperrec.testing import run_on_ranks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 64)
        self.fc = nn.Linear(64, 64)  # 64 x 64: split across ranks
        self.bn = nn.BatchNorm1d(64)
        self.head = nn.Linear(64, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.relu(self.fc(self.emb(ids)))))


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _load(mesh_shape: tuple[int, ...], broadcast: bool, tied_name: str) -> dict:
    from hyperrec.parallel5d import full_state_dict, fully_shard, load_full_state_dict

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", mesh_shape)
    m = _net(0)
    fully_shard(m.fc, mesh=mesh)
    fully_shard(m, mesh=mesh)
    src = _net(1).state_dict()
    src["bn.running_mean"] = torch.randn(64)
    del src["emb.weight" if tied_name == "head.weight" else "head.weight"]
    sd = src if (dist.get_rank() == 0 or not broadcast) else {}
    load_full_state_dict(m, sd, broadcast_from_rank0=broadcast)
    ref = _net(2)
    ref.load_state_dict(src, strict=False)  # the tied weight under one name
    full = full_state_dict(m)
    ids = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(dist.get_rank()))
    m.eval(), ref.eval()
    with torch.no_grad():
        out_err = float((m(ids) - ref(ids)).abs().max())
    want = {k: v for k, v in ref.state_dict().items() if k in full}
    return {
        "keys": sorted(full),
        "param_err": max(float((full[k] - want[k]).abs().max()) for k in full),
        "bn_err": float((m.bn.running_mean - src["bn.running_mean"]).abs().max()),
        "out_err": out_err,
    }


def _each(fn, cases: list[tuple]) -> list:
    """``fn(*case)`` for every case in turn, in one launch of the ranks (spawning the
    ranks costs more than a case)."""
    return [fn(*case) for case in cases]


LOAD_CASES = [
    (2, (2,), True, "head.weight"),
    (3, (3,), True, "emb.weight"),
    (3, (3,), False, "head.weight"),
    (4, (2, 2), True, "emb.weight"),
]


@pytest.fixture(scope="module")
def loaded():
    """Per world size, one launch that loads every case of that size: case -> per-rank
    results."""
    done: dict[tuple, list[dict]] = {}

    def get(world: int, *case) -> list[dict]:
        if (world, *case) not in done:
            cases = [c[1:] for c in LOAD_CASES if c[0] == world]
            runs = run_on_ranks(_each, world, _load, cases, timeout_s=300)
            for i, c in enumerate(cases):
                done[(world, *c)] = [r[i] for r in runs]
        return done[(world, *case)]

    return get


@pytest.mark.parametrize(("world", "shape", "broadcast", "tied"), LOAD_CASES)
def test_full_state_dict_loads_into_split_parameters(loaded, world, shape, broadcast, tied):
    results = loaded(world, shape, broadcast, tied)
    assert len(results) == world
    for r in results:
        # both names of the tied weight, as state_dict() has them
        keys = ["bn.bias", "bn.weight", "emb.weight", "fc.bias", "fc.weight", "head.weight"]
        assert r["keys"] == keys
        assert r["param_err"] == 0.0 and r["bn_err"] == 0.0 and r["out_err"] == 0.0


def _bad(case: str) -> str:
    from hyperrec.parallel5d import fully_shard, load_full_state_dict

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _net(0)
    fully_shard(m, mesh=mesh)
    sd = _net(1).state_dict()
    if case == "missing":
        del sd["fc.bias"]
    elif case == "unexpected":
        sd["extra"] = torch.zeros(1)
    else:
        sd["fc.weight"] = torch.zeros(64, 63)
    try:  # rank 1 passes nothing: the error comes from rank 0's check
        load_full_state_dict(m, sd if dist.get_rank() == 0 else {}, broadcast_from_rank0=True)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def bad_messages() -> dict[str, list[str]]:
    """Every bad dict, one after the other on the same two ranks (one launch): case ->
    each rank's message."""
    cases = ["missing", "unexpected", "shape"]
    runs = run_on_ranks(_each, 2, _bad, [(c,) for c in cases], timeout_s=300)
    return {c: [r[i] for r in runs] for i, c in enumerate(cases)}


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("missing", "missing keys ['fc.bias']"),
        ("unexpected", "unexpected keys ['extra']"),
        ("shape", "state_dict['fc.weight'] has shape (64, 63)"),
    ],  # fmt: skip
)
def test_bad_full_state_dicts_raise_on_every_rank(bad_messages, case, match):
    msgs = bad_messages[case]
    assert len(msgs) == 2
    for msg in msgs:
        assert match in msg, msg


def test_bad_arguments():
    from hyperrec.parallel5d import load_full_state_dict

    with pytest.raises(TypeError, match="module must be an nn.Module"):
        load_full_state_dict("x", {})
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        load_full_state_dict(nn.Linear(2, 2), [])
    with pytest.raises(TypeError, match="broadcast_from_rank0"):
        load_full_state_dict(nn.Linear(2, 2), {}, broadcast_from_rank0=1)
    with pytest.raises(ValueError, match="state_dict\\['weight'\\] must be a tensor"):
        load_full_state_dict(nn.Linear(2, 2), {"weight": 1.0, "bias": torch.zeros(2)})
