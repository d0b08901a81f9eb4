"""Sparse embeddings in one process: configs, the sharding plan, lookups, gradients and
the optimizers against single-process references, bad input, the traffic model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _p5d_sparse_cases import (
    FEATURES,
    HP,
    STATES,
    Reference,
    make_inputs,
    make_optimizer,
    max_err,
    rank_loss,
    tables,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d import sparse as sp
from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
    init_rows,
    plan_sharding,
)
from hyperrec.parallel5d.sparse.reference import lookup_reference
from hyperrec.parallel5d.sparse.traffic import (
    TableTraffic,
    expected_unique,
    sparse_memory,
    sparse_traffic,
)


def _collection(**kw) -> ShardedEmbeddingCollection:
    return ShardedEmbeddingCollection(tables(kw.pop("dtype", torch.float32)), FEATURES, **kw)


# ------------------------------------------------------------------------- configs, plan
def test_table_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"TableConfig.num_rows must be >= 1, got 0"):
        TableConfig(name="t", num_rows=0, dim=4)
    with pytest.raises(TypeError, match=r"TableConfig.dim must be an int"):
        TableConfig(name="t", num_rows=3, dim=4.0)
    with pytest.raises(TypeError, match=r"TableConfig.dtype must be one of"):
        TableConfig(name="t", num_rows=3, dim=4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"TableConfig.sharding must be one of"):
        TableConfig(name="t", num_rows=3, dim=4, sharding="column")
    with pytest.raises(ValueError, match=r"TableConfig.name must be a Python identifier"):
        TableConfig(name="a.b", num_rows=3, dim=4)
    with pytest.raises(ValueError, match=r"FeatureConfig.pooling must be one of"):
        FeatureConfig(name="f", table="t", pooling="max")
    with pytest.raises(ValueError, match=r"reads table 'nope'"):
        ShardedEmbeddingCollection(tables(), [FeatureConfig(name="f", table="nope")])
    with pytest.raises(ValueError, match=r"unique names, got repeated \['item'\]"):
        plan_sharding([*tables(), TableConfig(name="item", num_rows=2, dim=2)], 2)
    with pytest.raises(ValueError, match=r"routing must be one of"):
        ShardedEmbeddingCollection(tables(), routing="ring")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    world=st.integers(1, 64),
    threshold=st.sampled_from([0, 64, 1 << 20]),
)
def test_plan_places_every_row_on_exactly_one_owner(rows, world, threshold):
    cfgs = [
        TableConfig(name=f"t{i}", num_rows=n, dim=1 + i % 3, dtype=torch.float32)
        for i, n in enumerate(rows)
    ]
    plan = plan_sharding(cfgs, world, table_wise_max_bytes=threshold)
    for cfg, p in zip(cfgs, plan.tables, strict=True):
        starts = np.asarray(p.row_starts)
        assert starts[0] == 0 and starts[-1] == cfg.num_rows and (np.diff(starts) >= 0).all()
        if p.kind == "row":
            sizes = np.diff(starts)
            assert sizes.max() - sizes.min() <= 1  # balanced
        else:
            assert (np.diff(starts) > 0).sum() == 1  # whole on one owner
            assert cfg.nbytes <= threshold
    # owners' local storages hold each table's rows, back to back
    for gp in plan.groups:
        names = list(gp.tables)
        for o in range(world):
            want = sum(plan.table(n).rows_on(o) for n in names)
            assert gp.local_rows[o] == want
        keys = np.arange(gp.key_offsets[-1])
        seg = np.searchsorted(gp.seg_key_start, keys, side="right") - 1
        owner = gp.seg_owner[seg]
        for i, n in enumerate(names):
            ids = keys[gp.key_offsets[i] : gp.key_offsets[i + 1]] - gp.key_offsets[i]
            expect = np.searchsorted(np.asarray(plan.table(n).row_starts), ids, side="right") - 1
            assert (owner[gp.key_offsets[i] : gp.key_offsets[i + 1]] == expect).all()


def test_plan_balances_table_wise_tables():
    cfgs = [
        TableConfig(name=f"t{i}", num_rows=10 * (i + 1), dim=4, sharding="table") for i in range(6)
    ]
    plan = plan_sharding(cfgs, 3)
    owners = [int(np.flatnonzero(np.diff(p.row_starts))[0]) for p in plan.tables]
    load = np.zeros(3)
    for cfg, o in zip(cfgs, owners, strict=True):
        load[o] += cfg.nbytes
    assert load.max() - load.min() <= max(c.nbytes for c in cfgs)
    assert len(set(owners)) == 3


def test_init_is_mesh_independent():
    cfg = TableConfig(name="t", num_rows=200_000, dim=3, init_std=0.5)
    whole = init_rows(cfg, 2, 0, cfg.num_rows, seed=9)
    for lo, hi in [(0, 1), (65_535, 65_537), (131_000, 200_000), (7, 7)]:
        assert torch.equal(init_rows(cfg, 2, lo, hi, seed=9), whole[lo:hi])
    assert abs(float(whole.std()) - 0.5) < 0.01
    assert not torch.equal(init_rows(cfg, 3, 0, 10, seed=9), whole[:10])


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5000))
def test_hashed_row_order_is_a_permutation(rows):
    cfg = TableConfig(name="t", num_rows=rows, dim=1, row_order="hashed")
    a = cfg.hash_multiplier
    stored = (np.arange(rows, dtype=np.int64) * a) % rows
    assert np.array_equal(np.sort(stored), np.arange(rows))


def test_hashed_row_order_spreads_hot_ids_and_round_trips():
    cfg = TableConfig(name="t", num_rows=10_000, dim=2, row_order="hashed", sharding="row")
    coll = ShardedEmbeddingCollection([cfg])
    plan = plan_sharding([cfg], 8)
    hot = coll._stored_rows("t", torch.arange(1000)).numpy()  # the 1,000 lowest ids
    owners = np.searchsorted(np.asarray(plan.tables[0].row_starts), hot, side="right") - 1
    counts = np.bincount(owners, minlength=8)
    assert counts.max() <= 1.1 * counts.mean(), counts  # "id" order: all on owner 0
    full = torch.randn(10_000, 2)
    coll.load_full_weights({"t": full})
    assert torch.equal(coll.full_weights()["t"], full)
    ids = torch.tensor([0, 1, 2, 9_999, 5])
    assert torch.equal(coll({"t": ids})["t"], full[ids])
    with pytest.raises(ValueError, match=r"TableConfig.num_rows must be <= 3037000499"):
        TableConfig(name="t", num_rows=4_000_000_000, dim=1, row_order="hashed")


# ------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad", "adam"])
def test_one_process_matches_reference_training(kind):
    coll = _collection()
    opt = make_optimizer(kind, coll)
    ref = Reference(kind, coll.full_weights())
    for step in range(4):
        inputs = make_inputs(step, 0)
        out = coll(inputs)
        ref_out = ref.step(step, 1)[0]
        for name in out:
            assert out[name].dtype == torch.float32
            # lookups are copies of the rows: bitwise before any update
            assert max_err(out[name], ref_out[name]) <= (0.0 if step == 0 else 2e-6), name
        rank_loss(out, step, 0).backward()
        opt.step()
    full = coll.full_weights()
    ref_states = ref.states()
    for name, w in ref.w.items():
        assert max_err(full[name], w) < 2e-6, name
        for s in STATES[kind]:
            assert max_err(opt.full_state(name, s), ref_states[name][s]) < 2e-6, (name, s)


def test_duplicates_empty_bags_and_empty_features():
    coll = ShardedEmbeddingCollection(
        [TableConfig(name="t", num_rows=5, dim=3)],
        [
            FeatureConfig(name="seq", table="t"),
            FeatureConfig(name="bag", table="t", pooling="mean"),
        ],
    )
    w = coll.full_weights()["t"].clone().requires_grad_(True)
    seq = torch.tensor([4, 4, 4, 0])
    bag = (torch.tensor([1, 1, 2]), torch.tensor([0, 0, 3, 3]))
    out = coll({"seq": seq, "bag": bag})
    ref = lookup_reference({"t": w}, coll.feature_configs.values(), {"seq": seq, "bag": bag})
    assert torch.equal(out["seq"], ref["seq"]) and torch.allclose(out["bag"], ref["bag"])
    assert torch.equal(out["bag"][0], torch.zeros(3)) and torch.equal(out["bag"][2], torch.zeros(3))
    g_seq, g_bag = torch.randn(4, 3), torch.randn(3, 3)
    ((out["seq"] * g_seq).sum() + (out["bag"] * g_bag).sum()).backward()
    ((ref["seq"] * g_seq).sum() + (ref["bag"] * g_bag).sum()).backward()
    ((rows, grad),) = coll._pending[0]
    assert rows.tolist() == [0, 1, 2, 4]  # each touched row once, duplicates summed
    assert torch.allclose(grad, w.grad[rows], atol=1e-6)
    # nothing at all: no ids, no bags
    coll.zero_grad_rows()
    out = coll(
        {
            "seq": torch.empty(0, dtype=torch.long),
            "bag": (torch.empty(0, dtype=torch.long), torch.zeros(1, dtype=torch.long)),
        }
    )
    assert out["seq"].shape == (0, 3) and out["bag"].shape == (0, 3)


def test_gradient_accumulation_merges_rows_of_several_backwards():
    a, b = _collection(), _collection()
    opt_a, opt_b = RowWiseAdagrad(a, lr=0.1), RowWiseAdagrad(b, lr=0.1)
    i0, i1 = make_inputs(0, 0), make_inputs(1, 0)
    # a: two micro-batches, one step; b: one backward of the summed loss
    rank_loss(a(i0), 0, 0).backward()
    rank_loss(a(i1), 1, 0).backward()
    opt_a.step()
    (rank_loss(b(i0), 0, 0) + rank_loss(b(i1), 1, 0)).backward()
    opt_b.step()
    for name, w in a.full_weights().items():
        assert max_err(w, b.full_weights()[name]) < 1e-6


def test_bf16_tables_match_float64_reference_within_rounding():
    coll = _collection(dtype=torch.bfloat16)
    inputs = make_inputs(2, 0)
    out = coll(inputs)
    w64 = {k: v.double() for k, v in coll.full_weights().items()}
    ref = lookup_reference(w64, FEATURES, inputs)
    for name in out:
        assert out[name].dtype == torch.bfloat16
        tol = 2 * 2**-8 * float(ref[name].abs().max()) + 1e-6
        assert max_err(out[name], ref[name]) <= tol, name
    opt = RowWiseAdagrad(coll, lr=0.1)
    rank_loss(out, 2, 0).backward()
    opt.step()
    assert all(torch.isfinite(w.float()).all() for w in coll.full_weights().values())


def test_lazy_adam_leaves_untouched_rows_and_states_alone():
    coll = _collection()
    opt = LazyAdam(coll, lr=0.1)
    before = coll.full_weights()
    inputs = {
        "history": torch.tensor([3]),
        "candidates": torch.tensor([3]),
        "history_cat": torch.tensor([1]),
        "actions": torch.tensor([2]),
        "user": (torch.tensor([5]), torch.tensor([0, 1])),
        "tags": (torch.tensor([1]), torch.tensor([0, 1])),
    }
    rank_loss(coll(inputs), 0, 0).backward()
    opt.step()
    after = coll.full_weights()
    changed = (after["item"] != before["item"]).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3]
    exp_avg = opt.full_state("item", "exp_avg")
    assert (exp_avg.abs().sum(dim=1) > 0).nonzero().flatten().tolist() == [3]
    assert int(opt.state_dict()["state"]["item"]["step"]) == 1


# ------------------------------------------------------------------------- bad input
def _good() -> dict:
    return make_inputs(0, 1)


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (
            lambda f: f.update(history=f["history"].float()),
            TypeError,
            r"features\['history'\] ids must be an int32 or int64 tensor, got torch.float32",
        ),
        (
            lambda f: f.update(history=torch.tensor([1, -2])),
            ValueError,
            r"features\['history'\] ids must be >= 0, got a minimum of -2",
        ),
        (
            lambda f: f.update(history=torch.tensor([1, 61])),
            ValueError,
            r"features\['history'\] ids must be < 61 \(rows of table 'item'\), got a maximum of 61",
        ),
        (
            lambda f: f.update(tags=(torch.tensor([1, 2]), torch.tensor([0, 1]))),
            ValueError,
            r"features\['tags'\] offsets must end at len\(ids\) = 2, got 1",
        ),
        (
            lambda f: f.update(tags=(torch.tensor([1, 2]), torch.tensor([1, 2]))),
            ValueError,
            r"features\['tags'\] offsets must start at 0, got 1",
        ),
        (
            lambda f: f.update(tags=(torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2]))),
            ValueError,
            r"features\['tags'\] offsets must be non-decreasing, got offsets\[1\] = 2 > "
            r"offsets\[2\] = 1",
        ),
        (
            lambda f: f.update(tags=(torch.tensor([1, 2]), torch.tensor([0.0, 2.0]))),
            TypeError,
            r"features\['tags'\] offsets must be an int32 or int64 tensor",
        ),
        (
            lambda f: f.update(tags=torch.tensor([1, 2])),
            ValueError,
            r"features\['tags'\] is pooled \(pooling='mean'\): pass \(ids, offsets\)",
        ),
        (
            lambda f: f.update(history=torch.tensor([[1]])),
            ValueError,
            r"features\['history'\] ids must be 1-D",
        ),
        (lambda f: f.pop("user"), ValueError, r"missing \['user'\], unexpected \[\]"),
        (lambda f: f.update(extra=torch.tensor([1])), ValueError, r"unexpected \['extra'\]"),
        (
            lambda f: f.update(user=[1, 2]),
            TypeError,
            r"features\['user'\] ids must be a torch.Tensor",
        ),
    ],
)
def test_bad_input_names_the_argument(mutate, exc, match):
    coll = _collection()
    before = coll.full_weights()
    feats = _good()
    mutate(feats)
    with pytest.raises(exc, match=match):
        coll(feats)
    assert all(torch.equal(v, coll.full_weights()[k]) for k, v in before.items())
    with pytest.raises(TypeError, match="features must be a mapping"):
        coll([1, 2])


def test_optimizer_argument_errors():
    coll = _collection()
    with pytest.raises(ValueError, match=r"lr must be >= 0.0, got -1.0"):
        RowWiseAdagrad(coll, lr=-1.0)
    with pytest.raises(ValueError, match=r"weight_decay_mode must be one of"):
        RowWiseAdagrad(coll, weight_decay_mode="l1")
    with pytest.raises(ValueError, match=r"betas must be in \[0, 1\)"):
        LazyAdam(coll, betas=(0.9, 1.0))
    with pytest.raises(TypeError, match=r"collection must be a ShardedEmbeddingCollection"):
        LazyAdam(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"build it with device= instead of moving it"):
        coll.to("meta")


# ------------------------------------------------------------------------- checkpoints
def test_one_process_checkpoint_round_trip(tmp_path):
    coll = _collection()
    opt = make_optimizer("adam", coll)
    for step in range(2):
        rank_loss(coll(make_inputs(step, 0)), step, 0).backward()
        opt.step()
    model = torch.nn.ModuleDict({"sparse": coll})
    assert sorted(model.state_dict()) == [
        f"sparse.tables.{t.name}.weight" for t in sorted(tables(), key=lambda t: t.name)
    ]
    dcp.save(
        {"model": model.state_dict(), "optim": opt.state_dict()},
        checkpoint_id=tmp_path,
        no_dist=True,
    )
    saved_w, saved_s = (
        coll.full_weights(),
        {t: {s: opt.state_view(t, s).clone() for s in STATES["adam"]} for t in coll.table_configs},
    )

    fresh = _collection(seed=5)
    fresh_opt = make_optimizer("adam", fresh)
    fresh_model = torch.nn.ModuleDict({"sparse": fresh})
    state = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    fresh_model.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    for name, w in saved_w.items():
        assert torch.equal(fresh.full_weights()[name], w)
        for s in STATES["adam"]:
            assert torch.equal(fresh_opt.state_view(name, s), saved_s[name][s])
        assert int(fresh_opt.state_dict()["state"][name]["step"]) == 2
    # exact resume
    for c, o in ((coll, opt), (fresh, fresh_opt)):
        rank_loss(c(make_inputs(2, 0)), 2, 0).backward()
        o.step()
    for name, w in coll.full_weights().items():
        assert torch.equal(fresh.full_weights()[name], w)


def test_optimizer_load_rejects_other_states():
    coll = _collection()
    adam, ada = make_optimizer("adam", coll), make_optimizer("rowwise_adagrad", coll)
    with pytest.raises(
        ValueError, match=r"must hold \['exp_avg', 'exp_avg_sq', 'step'\] \(a state of LazyAdam\)"
    ):
        adam.load_state_dict(ada.state_dict())
    sd = ada.state_dict()
    sd["state"]["item"]["momentum"] = torch.zeros(3)
    with pytest.raises(
        ValueError,
        match=r"state_dict\['state'\]\['item'\]\['momentum'\] must be torch.float32 \(61,\)",
    ):
        ada.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"load_state_dict|must hold the tables"):
        ada.load_state_dict({"state": {}, "param_groups": []})


# ------------------------------------------------------------------------- traffic model
def test_expected_unique_matches_sampling():
    rng = np.random.default_rng(0)
    rows, n, s = 5000, 3000, 1.1
    p = np.arange(1, rows + 1, dtype=np.float64) ** -s
    p /= p.sum()
    counts = [len(np.unique(rng.choice(rows, size=n, p=p))) for _ in range(40)]
    assert abs(np.mean(counts) - expected_unique(n, rows, s)) < 0.02 * np.mean(counts)
    assert math.isclose(expected_unique(n, rows), rows * (1 - (1 - 1 / rows) ** n), rel_tol=1e-9)
    assert expected_unique(0, rows) == 0.0
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        expected_unique(3, 0)


def test_traffic_model_orders_the_designs():
    t = [TableTraffic(num_rows=2_000_000, dim=128, ids_per_rank=100_000, zipf_exponent=1.05)]
    traffic = sparse_traffic(t, group_size=8, replicas=16)
    h, f = traffic["hierarchical"], traffic["flat"]
    assert h["inter_group"] < f["inter_group"]  # host-level dedup saves slow-tier bytes
    assert h["intra_group"] > f["intra_group"]  # ... paid on the fast tier
    assert traffic["torchrec_2d"]["inter_group"] > h["inter_group"]  # weight sync dominates
    mem = sparse_memory(t, group_size=8, replicas=16)
    assert mem["hierarchical"]["at_rest"] * 16 == pytest.approx(
        mem["torchrec_2d"]["at_rest"], rel=1e-6
    )
    assert mem["dense_fully_shard"]["peak"] > 100 * mem["hierarchical"]["peak"]
    # one rank, no replicas: nothing is sent
    one = sparse_traffic(t, group_size=1, replicas=1)
    assert all(v == 0 for d in one.values() for v in d.values())


def test_public_api_is_exported():
    import hyperrec.parallel5d as p5d

    for name in sp.__all__:
        assert getattr(sp, name) is not None
    for name in (
        "ShardedEmbeddingCollection",
        "TableConfig",
        "FeatureConfig",
        "RowWiseAdagrad",
        "LazyAdagrad",
        "LazyAdam",
    ):
        assert getattr(p5d, name) is getattr(sp, name)
    assert HP.keys() == STATES.keys()


def test_torch_state_dict_helpers_see_the_tables():
    """``torch.distributed.checkpoint.state_dict`` (the trainer's checkpoint path) reads
    and writes the tables of a collection inside a model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

    model = torch.nn.ModuleDict({"sparse": _collection(), "head": torch.nn.Linear(8, 1)})
    msd, _ = get_state_dict(model, torch.optim.AdamW(model["head"].parameters()))
    assert "sparse.tables.item.weight" in msd and "head.weight" in msd
    msd["sparse.tables.user.weight"] = torch.ones(29, 4)
    set_model_state_dict(model, msd)
    assert torch.equal(model["sparse"].full_weights()["user"], torch.ones(29, 4))
