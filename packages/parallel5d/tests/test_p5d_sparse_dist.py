"""Sparse embeddings on real gloo ranks: parity with single-process training on 2, 4 and
8 ranks (1-D and 2-D meshes, hierarchical and flat routing), bytes through the
collectives against the counters and the traffic model, agreement on bad input, DCP
save on 2 ranks and load on 4 and on 1.

Spawning ranks dominates the cost, so each spawn runs several scenarios and the tests
check their parts of the results.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _p5d_sparse_cases import (
    FEATURES,
    STATES,
    Reference,
    make_inputs,
    make_optimizer,
    max_err,
    rank_loss,
    tables,
)
from torch.distributed.device_mesh import init_device_mesh

from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    ShardedEmbeddingCollection,
    TableConfig,
)
from hyperrec.parallel5d.sparse.traffic import TableTraffic, sparse_traffic
from hyperrec.raggedshard import RaggedLoadPlanner, RaggedSavePlanner
from hyperrec.testing import run_on_ranks

TOL = 2e-6


def _mesh(shape):
    if len(shape) == 1:
        return init_device_mesh("cpu", shape, mesh_dim_names=("shard",))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _full_states(opt, kind) -> dict:
    return {
        (t, s): opt.full_state(t, s) for t in opt.collection.table_configs for s in STATES[kind]
    }


def _parity(mesh, routing: str, kind: str, steps: int, *, first_step: int = 0) -> dict:
    """Train ``steps`` steps on this mesh and the single-process reference; max errors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    coll = ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh, routing=routing)
    opt = make_optimizer(kind, coll)
    ref = Reference(kind, coll.full_weights())
    out_err = 0.0
    for step in range(first_step, first_step + steps):
        out = coll(make_inputs(step, rank))
        ref_out = ref.step(step, world)[rank]
        out_err = max(out_err, *(max_err(out[k], ref_out[k]) for k in out))
        rank_loss(out, step, rank).backward()
        opt.step()
    full = coll.full_weights()
    ref_states = ref.states()
    return {
        "outputs": out_err,
        "weights": max(max_err(full[t], ref.w[t]) for t in full),
        "states": max(
            max_err(v, ref_states[t][s]) for (t, s), v in _full_states(opt, kind).items()
        ),
        "local_rows": {t: int(coll.weight(t)._local_tensor.shape[0]) for t in full},
    }


@contextlib.contextmanager
def _count_all_to_all(owner_of_rank: dict[int, int], group_size: int):
    """Count bytes sent to other ranks through ``dist.all_to_all_single``, by tier,
    independently of the collection's own counters."""
    seen = {"intra_group": 0, "inter_group": 0}
    real = dist.all_to_all_single
    me = owner_of_rank[dist.get_rank()]

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        ranks = (
            dist.get_process_group_ranks(group)
            if group is not None
            else list(range(dist.get_world_size()))
        )
        n = len(ranks)
        splits = input_split_sizes or [input.shape[0] // n] * n
        row = input.element_size() * (input[0].numel() if input.dim() > 1 else 1)
        for peer_rank, count in zip(ranks, splits, strict=True):
            owner = owner_of_rank[peer_rank]
            if owner != me:
                tier = "intra_group" if owner // group_size == me // group_size else "inter_group"
                seen[tier] += count * row
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = counting
    try:
        yield seen
    finally:
        dist.all_to_all_single = real


def _bytes(mesh, routing: str, inputs: dict, cfgs, feats) -> dict:
    coll = ShardedEmbeddingCollection(cfgs, feats, mesh=mesh, routing=routing, validate=False)
    grid = coll._grid.reshape(-1).tolist()
    owner_of_rank = {r: o for o, r in enumerate(grid)}
    with _count_all_to_all(owner_of_rank, coll.group_size) as seen:
        out = coll(inputs)
        sum(o.sum() for o in out.values()).backward()
    return {"patched": dict(seen), "counters": {t: coll.comm_stats.total(t) for t in seen}}


def _zipf_inputs(rank: int, n: int, rows: int, s: float, seed: int) -> dict:
    rng = np.random.default_rng([seed, rank])
    p = np.arange(1, rows + 1, dtype=np.float64) ** -s
    ids = rng.choice(rows, size=n, p=p / p.sum())
    return {"ids": torch.from_numpy(ids)}


def _bad_input_agreement(mesh) -> list:
    rank = dist.get_rank()
    coll = ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh)
    results = []
    for bad_rank, mutate in ((1, "negative"), (2, "dtype")):
        inputs = make_inputs(0, rank)
        if rank == bad_rank:
            inputs["history"] = (
                torch.tensor([3, -1]) if mutate == "negative" else inputs["history"].double()
            )
        try:
            coll(inputs)
            results.append(None)
        except (TypeError, ValueError) as exc:
            results.append((type(exc).__name__, str(exc)))
    # every rank still agrees on the collectives: a valid lookup works afterwards
    out = coll(make_inputs(1, rank))
    results.append(sorted(out))
    return results


def _save(path: str) -> dict:
    mesh = _mesh((dist.get_world_size(),))
    rank, saved = dist.get_rank(), {}
    state = {}
    for key, kind in (("a", "rowwise_adagrad"), ("b", "adam")):
        coll = ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh)
        opt = make_optimizer(kind, coll)
        for step in range(2):
            rank_loss(coll(make_inputs(step, rank)), step, rank).backward()
            opt.step()
        model = torch.nn.ModuleDict({"sparse": coll})
        state[key] = {"model": model.state_dict(), "optim": opt.state_dict()}
        saved[key] = {
            "weights": {k: v.numpy() for k, v in coll.full_weights().items()},
            "states": {k: v.numpy() for k, v in _full_states(opt, kind).items()},
        }
    dcp.save(state, checkpoint_id=path, planner=RaggedSavePlanner())
    return saved


def _load_and_resume(path: str | None, mesh, steps: tuple[int, ...]) -> dict:
    """Load the checkpoint into fresh collections (another seed), report the loaded full
    values, then train ``steps`` and compare with the uninterrupted reference (2 steps
    on 2 ranks, then ``steps`` on this world size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out, state, parts = {}, {}, {}
    for key, kind in (("a", "rowwise_adagrad"), ("b", "adam")):
        coll = ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh, seed=11)
        opt = make_optimizer(kind, coll)
        model = torch.nn.ModuleDict({"sparse": coll})
        state[key] = {"model": model.state_dict(), "optim": opt.state_dict()}
        parts[key] = (coll, opt, model, kind)
    dcp.load(state, checkpoint_id=path, planner=RaggedLoadPlanner(), no_dist=world == 1)
    for key, (coll, opt, model, kind) in parts.items():
        model.load_state_dict(state[key]["model"])
        opt.load_state_dict(state[key]["optim"])
        loaded = {
            "weights": {k: v.numpy() for k, v in coll.full_weights().items()},
            "states": {k: v.numpy() for k, v in _full_states(opt, kind).items()},
        }
        # the reference replays the whole run from the same initial tables
        init = ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh).full_weights()
        ref = Reference(kind, init)
        for step in range(2):
            ref.step(step, 2)
        for step in steps:
            ref.step(step, world)
            rank_loss(coll(make_inputs(step, rank)), step, rank).backward()
            opt.step()
        full, ref_states = coll.full_weights(), ref.states()
        out[key] = {
            "loaded": loaded,
            "weights": max(max_err(full[t], ref.w[t]) for t in full),
            "states": max(
                max_err(v, ref_states[t][s]) for (t, s), v in _full_states(opt, kind).items()
            ),
        }
    return out


# --------------------------------------------------------------------------- spawns
def _four_ranks(path: str) -> dict:
    res: dict = {}
    hier, one_d = _mesh((2, 2)), _mesh((4,))
    for kind in ("rowwise_adagrad", "adagrad", "adam"):
        res[("hierarchical", kind)] = _parity(hier, "hierarchical", kind, 3)
    res[("flat", "adam")] = _parity(hier, "flat", "adam", 3)
    res[("1d", "rowwise_adagrad")] = _parity(one_d, "hierarchical", "rowwise_adagrad", 2)
    # bytes: Zipf ids shared across ranks (duplicates merged inside a group)
    rank = dist.get_rank()
    cfgs = [TableConfig(name="t", num_rows=4000, dim=16, sharding="row")]
    feats = [FeatureConfig(name="ids", table="t")]
    zipf = _zipf_inputs(rank, 600, 4000, 1.1, seed=3)
    res["bytes_zipf"] = {r: _bytes(hier, r, zipf, cfgs, feats) for r in ("hierarchical", "flat")}
    uniform = {"ids": torch.from_numpy(np.random.default_rng([5, rank]).integers(0, 4000, 1500))}
    res["bytes_uniform"] = {
        r: _bytes(hier, r, uniform, cfgs, feats) for r in ("hierarchical", "flat")
    }
    res["bad_input"] = _bad_input_agreement(hier)
    res["resume"] = _load_and_resume(path, hier, (2, 3))
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sparse_ckpt"))
    return {
        "two": run_on_ranks(_two_ranks, 2, path),
        "four": run_on_ranks(_four_ranks, 4, path),
        "one": _load_and_resume(path, None, (2,)),
        "path": path,
    }


def _unused_features(mesh) -> float:
    """LazyAdam when a looked-up feature's output does not reach the loss on some ranks
    (step 1: rank 0 uses ``fc``, rank 1 does not) or on none (step 2), against
    ``nn.Embedding(sparse=True)``-style gradients and ``SparseAdam`` over every rank's
    loss in one process. Returns the largest weight error."""
    import torch.nn.functional as F

    from hyperrec.parallel5d.sparse import LazyAdam

    rank, world = dist.get_rank(), dist.get_world_size()
    tabs = [TableConfig(name="a", num_rows=7, dim=4), TableConfig(name="c", num_rows=5, dim=2)]
    feats = [FeatureConfig(name="fa", table="a"), FeatureConfig(name="fc", table="c")]
    coll = ShardedEmbeddingCollection(tabs, feats, mesh=mesh)
    opt = LazyAdam(coll, lr=0.1)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in coll.full_weights().items()}
    ref_opt = torch.optim.SparseAdam(list(ref.values()), lr=0.1)
    ids = {r: {"fa": torch.tensor([r, r + 2]), "fc": torch.tensor([r + 1])} for r in range(world)}
    uses = [(True, True), (True, False), (False, False), (True, True)]
    for use in uses:
        out = coll(ids[rank])
        (out["fa"].square().sum() + (out["fc"].sum() if use[rank] else 0)).backward()
        opt.step()
        opt.zero_grad()
        total = sum(
            F.embedding(ids[r]["fa"], ref["a"]).square().sum()
            + (F.embedding(ids[r]["fc"], ref["c"]).sum() if use[r] else 0)
            for r in range(world)
        )
        (total / world).backward()  # the collection's default gradient_reduction="mean"
        for prm in ref.values():
            if prm.grad is not None:
                prm.grad = prm.grad.to_sparse()
        ref_opt.step()
        ref_opt.zero_grad()
    full = coll.full_weights()
    return max(max_err(full[k], ref[k].detach()) for k in ref)


def _two_ranks(path: str) -> dict:
    mesh = _mesh((2,))
    res = {kind: _parity(mesh, "hierarchical", kind, 3) for kind in ("rowwise_adagrad", "adam")}
    res["unused"] = _unused_features(mesh)
    res["saved"] = _save(path)
    return res


def _check(res: dict) -> None:
    assert res["outputs"] < TOL and res["weights"] < TOL and res["states"] < TOL, res


def test_parity_two_ranks(runs):
    for kind in ("rowwise_adagrad", "adam"):
        for rank_res in runs["two"]:
            _check(rank_res[kind])


def test_lazy_adam_with_features_unused_on_some_ranks(runs):
    # rows looked up only by unused outputs stay as they are, and a table no rank used
    # in a step does not advance its step count (SparseAdam gets no gradient for it)
    for rank_res in runs["two"]:
        assert rank_res["unused"] < TOL, rank_res["unused"]


def test_parity_four_ranks_hierarchical_flat_and_1d(runs):
    for rank_res in runs["four"]:
        for key in (
            ("hierarchical", "rowwise_adagrad"),
            ("hierarchical", "adagrad"),
            ("hierarchical", "adam"),
            ("flat", "adam"),
            ("1d", "rowwise_adagrad"),
        ):
            _check(rank_res[key])
    # the 3-row table on 4 ranks: one rank holds no row of it
    rows = [r[("hierarchical", "adam")]["local_rows"]["action"] for r in runs["four"]]
    assert sorted(rows) == [0, 1, 1, 1]


def test_bytes_through_the_collectives(runs):
    for which in ("bytes_zipf", "bytes_uniform"):
        for rank_res in runs["four"]:
            for routing in ("hierarchical", "flat"):
                b = rank_res[which][routing]
                assert b["patched"] == b["counters"], (which, routing, b)
    # Zipf ids shared by the ranks of a group: merged before they leave it
    inter = {
        r: sum(x["bytes_zipf"][r]["patched"]["inter_group"] for x in runs["four"])
        for r in ("hierarchical", "flat")
    }
    assert inter["hierarchical"] < 0.9 * inter["flat"], inter


def test_traffic_model_matches_measured_bytes(runs):
    """Uniform ids on a 2x2 mesh: the model, given the measured unique counts, predicts
    the bytes each tier carried (its only assumption, ids spread evenly over owners,
    holds for uniform ids)."""
    n, rows, groups = 1500, 4000, ((0, 1), (2, 3))
    ids = [np.random.default_rng([5, r]).integers(0, rows, n) for r in range(4)]
    u = float(np.mean([len(np.unique(x)) for x in ids]))
    ug = float(np.mean([len(np.unique(np.concatenate([ids[a], ids[b]]))) for a, b in groups]))
    model = sparse_traffic(
        [
            TableTraffic(
                num_rows=rows, dim=16, ids_per_rank=n, unique_per_rank=u, unique_per_group=ug
            )
        ],
        group_size=2,
        replicas=2,
    )
    for routing in ("hierarchical", "flat"):
        for tier in ("intra_group", "inter_group"):
            measured = np.mean([x["bytes_uniform"][routing]["patched"][tier] for x in runs["four"]])
            assert abs(measured - model[routing][tier]) < 0.05 * model[routing][tier], (
                routing,
                tier,
                measured,
                model[routing][tier],
            )


def test_bad_input_on_one_rank_raises_on_every_rank(runs):
    for rank, res in enumerate(runs["four"]):
        neg, dtype, after = res["bad_input"]
        if rank == 1:
            assert neg == (
                "ValueError",
                "features['history'] ids must be >= 0, got a minimum of -1",
            )
        else:
            assert neg[0] == "ValueError" and "failed validation on rank 1" in neg[1]
        if rank == 2:
            assert dtype[0] == "TypeError" and "int32 or int64" in dtype[1]
        else:
            assert dtype[0] == "ValueError" and "failed validation on rank 2" in dtype[1]
        assert after == sorted(f.name for f in FEATURES)


def test_checkpoint_saved_on_two_ranks_loads_on_four_and_one(runs):
    saved = runs["two"][0]["saved"]
    for loaded_run in (runs["four"][0]["resume"], runs["one"]):
        for key in ("a", "b"):
            got = loaded_run[key]["loaded"]
            for t, w in saved[key]["weights"].items():
                assert np.array_equal(got["weights"][t], w), (key, t)
            for k, s in saved[key]["states"].items():
                assert np.array_equal(got["states"][k], s), (key, k)
            # exact resume: training on matches the uninterrupted run
            assert loaded_run[key]["weights"] < TOL and loaded_run[key]["states"] < TOL


def _eight_ranks() -> dict:
    mesh = _mesh((2, 4))
    res = {kind: _parity(mesh, "hierarchical", kind, 2) for kind in ("rowwise_adagrad", "adam")}
    cfgs = [TableConfig(name="t", num_rows=4000, dim=16, sharding="row")]
    feats = [FeatureConfig(name="ids", table="t")]
    zipf = _zipf_inputs(dist.get_rank(), 400, 4000, 1.1, seed=4)
    res["bytes"] = {r: _bytes(mesh, r, zipf, cfgs, feats) for r in ("hierarchical", "flat")}
    return res


@pytest.mark.slow  # tens of seconds; `nox -s lowest` leaves it to the normal session
def test_eight_ranks_two_replicas_of_four():
    runs = run_on_ranks(_eight_ranks, 8)
    for rank_res in runs:
        _check(rank_res["rowwise_adagrad"])
        _check(rank_res["adam"])
        for r in ("hierarchical", "flat"):
            assert rank_res["bytes"][r]["patched"] == rank_res["bytes"][r]["counters"]
    # 3 rows over 8 ranks: 5 ranks hold none of them; each row exactly once
    rows = [r["adam"]["local_rows"]["action"] for r in runs]
    assert sorted(rows) == [0] * 5 + [1] * 3
    inter = {
        r: sum(x["bytes"][r]["patched"]["inter_group"] for x in runs)
        for r in ("hierarchical", "flat")
    }
    assert inter["hierarchical"] < inter["flat"], inter
