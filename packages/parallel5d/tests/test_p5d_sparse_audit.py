"""Sparse-table optimizer and mesh cases an audit found wrong (each test here failed
before parallel5d 0.2.14):

- ``LazyAdagrad(lr_decay > 0)`` with two tables of one ``(dim, dtype)`` group at different
  step counts updated both with one table's count (against ``torch.optim.Adagrad``).
- With ``sync_free=True`` and the Triton update, a group whose tables have different
  hyperparameters split its rows by table assuming they were sorted; the padding rows
  of unused lookups sit between real rows, so rows got another table's learning rate.
- A 2-D mesh laid out ``(shard, replicate)`` placed rows by one rank numbering and
  gathered them by another (scrambled ``full_weights`` / checkpoints, or a shape error);
  such a mesh is now a ``ValueError``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdagrad,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)
from hyperrec.testing import run_on_ranks


def test_lazy_adagrad_lr_decay_counts_steps_per_table():
    tables = [TableConfig(name="a", num_rows=5, dim=3), TableConfig(name="b", num_rows=7, dim=3)]
    feats = [FeatureConfig(name="fa", table="a"), FeatureConfig(name="fb", table="b")]
    coll = ShardedEmbeddingCollection(tables, feats)
    opt = LazyAdagrad(coll, lr=0.5, lr_decay=1.0)
    full = coll.full_weights()
    ref = {n: torch.nn.Embedding.from_pretrained(full[n].clone(), freeze=False) for n in full}
    ropt = torch.optim.Adagrad(
        [{"params": ref[n].parameters()} for n in "ab"], lr=0.5, lr_decay=1.0
    )
    ids = {"a": torch.tensor([0, 1, 1]), "b": torch.tensor([2, 3])}
    for used in ("a", "a", "ab", "ab"):  # table b starts two steps later
        opt.zero_grad()
        ropt.zero_grad(set_to_none=True)
        out = coll({"fa": ids["a"], "fb": ids["b"]})
        sum((out["f" + n] ** 2).sum() for n in used).backward()
        opt.step()
        sum((ref[n](ids[n]) ** 2).sum() for n in used).backward()
        ropt.step()
    got = coll.full_weights()
    for n in "ab":
        torch.testing.assert_close(got[n], ref[n].weight.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("sync_free", "backend"), [(True, "triton"), (True, "torch"),
                                                    (False, "triton")])  # fmt: skip
def test_per_table_hyperparameters_with_unused_lookups(sync_free, backend):
    tables = [TableConfig(name="a", num_rows=6, dim=4), TableConfig(name="b", num_rows=6, dim=4)]
    feats = [
        FeatureConfig(name="fa", table="a"),
        FeatureConfig(name="fa_unused", table="a"),  # looked up, never reaches the loss
        FeatureConfig(name="fb", table="b"),
    ]
    x = {
        "fa": torch.tensor([0, 5]),
        "fa_unused": torch.tensor([1, 2, 3, 4]),
        "fb": torch.tensor([0, 1, 5]),
    }

    def run(sync_free: bool, backend: str) -> dict[str, torch.Tensor]:
        coll = ShardedEmbeddingCollection(tables, feats, sync_free=sync_free)
        opt = RowWiseAdagrad(coll, lr=0.1, backend=backend)
        opt.param_groups[1]["lr"] = 1.0  # table b
        for _ in range(2):
            opt.zero_grad()
            out = coll(x)
            (out["fa"].sum() + out["fb"].sum()).backward()
            opt.step()
        return coll.full_weights()

    want, got = run(False, "torch"), run(sync_free, backend)
    for n in "ab":
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)


def _shard_first(order: str) -> str:
    torch.set_num_threads(1)
    names = ("shard", "replicate") if order == "shard_first" else ("replicate", "shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    tables = [TableConfig(name="t", num_rows=8, dim=4)]
    try:
        coll = ShardedEmbeddingCollection(tables, mesh=mesh, shard_axis="shard")
    except ValueError as e:
        return str(e)
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    coll.load_full_weights({"t": w})
    ok = torch.equal(coll.full_weights()["t"], w)
    dist.barrier()
    return f"ok={ok}"


def _each(fn, cases: list) -> list[str]:
    """``fn`` on every case in turn, in one launch of the ranks (a spawn of four ranks
    costs more than the cases themselves)."""
    return [fn(case) for case in cases]


def test_a_shard_first_mesh_is_refused_and_the_usual_one_round_trips():
    runs = run_on_ranks(_each, 4, _shard_first, ["shard_first", "replicate_first"], timeout_s=300)
    for refused, round_trip in runs:
        assert "shard groups must be runs of consecutive ranks" in refused, refused
        assert round_trip == "ok=True", round_trip
    assert len(runs) == 4


def _one_d(order: list[int]) -> str:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.tensor(order))
    # 9 rows on 3 ranks: equal blocks, so a wrong numbering raised no shape error and
    # silently swapped row blocks in full_weights() and state_dict()
    tables = [TableConfig(name="t", num_rows=9, dim=3, sharding="row")]
    try:
        coll = ShardedEmbeddingCollection(tables, mesh=mesh)
    except ValueError as exc:
        return str(exc)
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    w = torch.randn(9, 3, generator=g)
    dist.broadcast(w, 0)
    coll.load_full_weights({"t": w})
    ids = torch.randperm(9)
    looked_up = coll({"t": ids})["t"]
    ok = torch.equal(looked_up, w[ids]) and torch.equal(coll.full_weights()["t"], w)
    saved = coll.state_dict()["tables.t.weight"].full_tensor()
    return f"ok={ok and torch.equal(saved, w)}"


def test_a_one_d_mesh_out_of_rank_order_is_refused_and_an_ordered_one_round_trips():
    runs = run_on_ranks(_each, 3, _one_d, [[1, 0, 2], [0, 1, 2]], timeout_s=300)
    for refused, round_trip in runs:
        assert "must list its ranks in increasing order" in refused, refused
        assert round_trip == "ok=True", round_trip
    assert len(runs) == 3
