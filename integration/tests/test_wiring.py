"""The landed packages wired into the trainer: sharded embedding tables (parallel5d's
ShardedEmbeddingCollection + row optimizers), the 5-D mesh and autoac, on one process and
on two real gloo ranks."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, Trainer, override
from hyperrec.integration.checkpoint import checkpoint_dir
from hyperrec.integration.model import sharded_tables
from hyperrec.integration.trainer import resolve_tables
from hyperrec.testing import run_on_ranks


def _micro(micro, *overrides):
    base = ["train.steps=6", "train.eval_every=0", "data.eval_requests=256"]
    last = {o.partition("=")[0]: o for o in (*base, *overrides)}  # later ones win
    return override(micro, list(last.values()))


def _losses(trainer):
    try:
        return trainer.fit(plot=False).metrics["history"]["loss"]
    finally:
        trainer.close()


def test_table_placement_and_optimizer_resolve(micro):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    t = micro.train
    assert resolve_tables(t, 1, cpu) == ("dense", "adamw")
    assert resolve_tables(t, 2, cpu) == ("sharded", "rowwise_adagrad")
    assert resolve_tables(t, 1, cuda) == ("sharded", "rowwise_adagrad")
    adagrad = dataclasses.replace(t, embedding_optimizer="adagrad")
    assert resolve_tables(adagrad, 1, cpu) == ("dense", "adagrad")
    assert resolve_tables(adagrad, 4, cpu) == ("sharded", "adagrad")
    dense = dataclasses.replace(t, sparse="dense")
    assert resolve_tables(dense, 8, cuda) == ("dense", "adamw")
    # Resuming: "auto" takes the checkpoint's placement and optimizer; explicit values stay.
    saved = ("sharded", "adam")
    assert resolve_tables(t, 1, cpu, saved=saved) == saved
    assert resolve_tables(t, 2, cpu, saved=("dense", "adagrad")) == ("dense", "adagrad")
    assert resolve_tables(dense, 2, cpu, saved=saved) == ("dense", "adamw")
    with pytest.raises(ValueError, match="embedding_optimizer='rowwise_adagrad' does not train"):
        override(micro, ["train.sparse=dense", "train.embedding_optimizer=rowwise_adagrad"])
    with pytest.raises(ValueError, match="embedding_optimizer='adamw' does not train"):
        override(micro, ["train.sparse=sharded", "train.embedding_optimizer=adamw"])
    with pytest.raises(ValueError, match="needs an explicit TrainConfig.sparse"):
        override(micro, ["train.embedding_optimizer=adam"])


def test_sharded_tables_compute_the_dense_model(micro):
    """Same rows, same function: the collection's lookups (history and candidates share
    the item table, mean-pooled tags) give the dense model's outputs and gradients."""
    p = _micro(
        micro, "model.seq_layers=2", "model.block_attention_layers=1", "model.attn_block_size=4"
    )
    batch = SyntheticRecsysData(p.data).batch(TRAIN, np.arange(48))
    torch.manual_seed(0)
    dense = GEMModel(p.model, p.data)
    sharded = GEMModel(p.model, p.data, sharded=sharded_tables(p.model, p.data))
    sharded.load_dense_state_dict(dense.state_dict())
    a, b = dense(batch), sharded(batch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A fused dense model's state loads too, and the collection's keys are in the state.
    fused = GEMModel(p.model, p.data, fused_embeddings=True)
    fused.load_dense_state_dict(dense.state_dict())
    torch.testing.assert_close(fused(batch), a, rtol=1e-6, atol=1e-6)
    assert "sharded.tables.item.weight" in sharded.state_dict()
    assert all("item_embedding" not in n for n, _ in sharded.named_parameters())
    with pytest.raises(TypeError, match="sharded must be a ShardedEmbeddingCollection"):
        GEMModel(p.model, p.data, sharded=torch.nn.Embedding(2, 2))


def test_sharded_lazy_adagrad_trains_like_dense_adagrad(micro, tmp_path):
    """LazyAdagrad on the sharded tables equals torch.optim.Adagrad on the dense tables'
    gradients: same losses step by step from the same rows (no clipping: sharded rows take
    no part in it)."""
    common = ["train.embedding_optimizer=adagrad", "train.grad_clip=0", "train.steps=8"]
    runs = {}
    for placement in ("dense", "sharded"):
        p = _micro(micro, f"train.sparse={placement}", *common)
        t = Trainer(p, out_dir=tmp_path / placement, progress=False)
        if placement == "dense":
            state = {k: v.clone() for k, v in t.model.state_dict().items()}
            assert type(t.dense_table_optimizer).__name__ == "Adagrad"
        else:
            t.model.load_dense_state_dict(state)
            assert type(t.sparse_optimizer).__name__ == "LazyAdagrad"
        runs[placement] = _losses(t)
    np.testing.assert_allclose(runs["sharded"], runs["dense"], rtol=1e-5, atol=1e-6)


def test_sharded_rowwise_adagrad_resumes_exactly_on_the_5d_mesh(micro, tmp_path):
    """Sharded tables + row-wise Adagrad + the 5-D mesh on one process (it creates a
    one-rank process group): the rows and the optimizer's states are checkpointed, so the
    resumed run repeats the uninterrupted one bit for bit."""
    p = _micro(micro, "train.sparse=sharded", "train.mesh=5d", "train.ckpt_every=3")
    first = Trainer(p, out_dir=tmp_path, progress=False)
    assert first.mesh is not None and first.tables == "sharded"
    assert type(first.sparse_optimizer).__name__ == "RowWiseAdagrad"
    # The small dense tables (actions, time buckets) are trained too: by AdamW.
    adamw = {id(q) for g in first.optimizer.param_groups for q in g["params"]}
    assert all(id(q) in adamw for q in first.model.parameters())
    losses = _losses(first)
    assert not dist.is_initialized()  # the trainer's own group is gone
    again = Trainer(p, resume=checkpoint_dir(tmp_path, 3), progress=False)
    assert _losses(again) == losses
    other = override(p, ["train.sparse=dense"])
    with pytest.raises(ValueError, match="trained with train.sparse='sharded', this run has"):
        Trainer(other, resume=checkpoint_dir(tmp_path, 3), progress=False)
    if dist.is_initialized():  # the failed trainer's one-rank group
        dist.destroy_process_group()


def test_autoac_keeps_the_losses_and_resumes_with_its_plan(micro, tmp_path):
    """A budget between full recompute and no checkpointing: the layers recompute (with
    dropout, replayed with the same random numbers) and the losses are bit-identical to
    training without checkpointing; the plan is reported and checkpointed."""
    base = ["model.seq_layers=2", "model.dropout=0.1", "train.ckpt_every=3"]
    off = _losses(Trainer(_micro(micro, *base), out_dir=tmp_path / "off", progress=False))
    probe = Trainer(
        _micro(micro, *base, "train.activation_checkpointing=autoac", "train.ac_budget_gb=1"),
        out_dir=tmp_path / "probe",
        progress=False,
    )
    summary = probe.autoac_summary()
    probe.close()
    assert all(r["mode"] == "none" for r in summary["regions"].values())  # 1 GB: no AC
    floor, top = summary["floor_gb"], summary["no_ac_peak_gb"]
    assert 0 < floor < top
    budget = f"train.ac_budget_gb={(floor + top) / 2:.9f}"
    p = _micro(micro, *base, "train.activation_checkpointing=autoac", budget)
    t = Trainer(p, out_dir=tmp_path / "ac", progress=False)
    s = t.autoac_summary()
    assert any(r["mode"] == "sac" for r in s["regions"].values())
    # per region, the outputs kept against its mode's default and those packed (none:
    # no formats allowed, so every decision off the default is a keep). Whether a
    # selective region keeps any output depends on the recompute times autoac measures
    # on this machine, so that is not asserted (it did not hold on every CPU).
    plan_regions = {r.name: r for r in t.autoac.plan.regions}
    for name, r in s["regions"].items():
        decisions = list(plan_regions[name].saves.values())
        assert r["packed"] == {} and r["kept"] == len(decisions)
        assert all(d == "keep" for d in decisions)
    assert s["predicted_peak_gb"] <= (floor + top) / 2 + 1e-9
    metrics = t.fit(plot=False).metrics
    t.close()
    assert metrics["history"]["loss"] == off
    assert metrics["autoac"]["regions"] == s["regions"]
    again = Trainer(p, resume=checkpoint_dir(tmp_path / "ac", 3), progress=False)
    assert again.autoac.plan.to_dict() == t.autoac.plan.to_dict()  # the saved plan
    assert _losses(again) == off
    with pytest.raises(ValueError, match="TrainConfig.ac_budget_gb=1e-09 .* cannot hold"):
        Trainer(
            _micro(micro, "train.activation_checkpointing=autoac", "train.ac_budget_gb=1e-9"),
            out_dir=tmp_path / "bad",
            progress=False,
        )
    with pytest.raises(ValueError, match="ac_budget_gb must be > 0 off a GPU"):
        Trainer(_micro(micro, "train.activation_checkpointing=autoac"), progress=False)


def test_autoac_and_ac_config_errors(micro):
    with pytest.raises(ValueError, match="one entry per sequence layer"):
        override(micro, ["train.ac_layer_budgets_gb=1,2"])
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        override(micro, ["train.ac_layer_budgets_gb=-1"])
    with pytest.raises(ValueError, match="ac_formats must hold names"):
        override(micro, ["train.ac_formats=fp16"])
    with pytest.raises(ValueError, match=r"only 'mxint8' is packed inside compiled .*'mxfp8'"):
        override(micro, ["train.ac_formats=mxint8,mxfp8", "train.compile=aot_eager"])
    assert override(micro, ["train.ac_formats=mxint8", "train.compile=aot_eager"])
    with pytest.raises(ValueError, match="TrainConfig.mesh must be one of"):
        override(micro, ["train.mesh=3d"])
    p = override(micro, ["train.ac_layer_budgets_gb=0.5", "train.ac_formats=mxfp8,fp8_e4m3"])
    assert p.train.ac_layer_budgets_gb == (0.5,) and p.train.ac_formats == ("mxfp8", "fp8_e4m3")


def test_autoac_pack_all_packs_every_save_it_may_and_cuts_the_step(micro, tmp_path):
    """``ac_strategy=pack_all``: no budget needed, no layer recomputed, every saved
    activation whose class passed the error bound packed (the profile says which), the
    probe step allocates less than without autoac, and training stays close to exact."""
    base = ["model.seq_layers=2", "data.max_seqlen=64", "model.dim=32"]
    off_t = Trainer(_micro(micro, *base), out_dir=tmp_path / "off", progress=False)
    off_mem = off_t.step_memory()
    off = _losses(off_t)
    ac = ["train.activation_checkpointing=autoac", "train.ac_strategy=pack_all",
          "train.ac_formats=mxint8"]  # fmt: skip
    t = Trainer(_micro(micro, *base, *ac), out_dir=tmp_path / "pack", progress=False)
    s = t.autoac_summary()
    assert s["solver"] == "pack_all" and s["budget_gb"] is None
    prof, plan = t.autoac.profile, t.autoac.plan
    n_packed = 0
    for pr, r in zip(prof.regions, plan.regions, strict=True):
        assert r.mode == "none"
        want = {
            o.key
            for o in pr.ops
            if o.needed and not o.collective and "mxint8" in o.formats
            and any(lv.nbytes >= prof.config.min_pack_bytes for lv in o.storages)
        }  # fmt: skip
        assert {k for k, d in r.saves.items() if d == "mxint8"} == want
        assert s["regions"][r.name]["packed"] == ({"mxint8": len(want)} if want else {})
        assert s["regions"][r.name]["held_gb"] <= s["regions"][r.name]["noac_held_gb"]
        n_packed += len(want)
    assert n_packed > 0
    mem = t.step_memory()
    assert mem["base_gb"] == pytest.approx(off_mem["base_gb"], rel=0.05)
    assert 0 < mem["step_gb"] < off_mem["step_gb"]
    assert mem["step_gb"] == pytest.approx(mem["peak_gb"] - mem["base_gb"])
    losses = _losses(t)
    assert losses != off
    np.testing.assert_allclose(losses, off, rtol=5e-3)


def test_autoac_all_regions_pack_more_and_recompute_exactly(micro, tmp_path):
    """``ac_regions=all``: the modules called once per step become regions too. With
    pack_all they pack saves the layers-only plan leaves alone and the step allocates
    less; with every region recomputed (dropout in the MLP replayed) the losses equal
    training without autoac bit for bit."""
    base = ["model.seq_layers=2", "data.max_seqlen=64", "model.dim=32", "model.dropout=0.1"]
    pack = ["train.activation_checkpointing=autoac", "train.ac_strategy=pack_all",
            "train.ac_formats=mxint8"]  # fmt: skip
    layers = Trainer(_micro(micro, *base, *pack), out_dir=tmp_path / "l", progress=False)
    layers_mem, layers_summary = layers.step_memory(), layers.autoac_summary()
    layers.close()
    t = Trainer(_micro(micro, *base, *pack, "train.ac_regions=all"), out_dir=tmp_path / "a",
                progress=False)  # fmt: skip
    s = t.autoac_summary()
    names = t.model.ac_regions("all")
    assert set(s["regions"]) == set(names) and names[:2] == ["seq_layers.0", "seq_layers.1"]
    assert {"pma", "cross_attention", "interaction", "mlp", "ctr_head"} <= set(names)
    extra = {n: r for n, r in s["regions"].items() if n not in layers_summary["regions"]}
    assert any(r["packed"] for r in extra.values())
    assert t.step_memory()["step_gb"] < layers_mem["step_gb"]
    t.close()
    off = _losses(Trainer(_micro(micro, *base), out_dir=tmp_path / "off", progress=False))
    ac = Trainer(
        _micro(micro, *base, "train.activation_checkpointing=autoac", "train.ac_regions=all",
               "train.ac_budget_gb=1"),
        out_dir=tmp_path / "ac",
        progress=False,
    )  # fmt: skip
    # Every region fully recomputed, set by hand: the planner leaves the modules after
    # the layers un-checkpointed on this model (their saves are freed before its peak).
    plan = ac.autoac.plan
    regions = tuple(dataclasses.replace(r, mode="sac", saves={}) for r in plan.regions)
    ac.autoac.set_plan(dataclasses.replace(plan, regions=regions))
    assert {r.name for r in regions} == set(names)
    assert _losses(ac) == off


def test_ac_strategy_config_errors(micro):
    with pytest.raises(ValueError, match="ac_strategy must be one of"):
        override(micro, ["train.ac_strategy=all"])
    with pytest.raises(ValueError, match="ac_strategy='pack_all' needs TrainConfig.ac_formats"):
        override(micro, ["train.ac_strategy=pack_all"])
    p = override(micro, ["train.ac_strategy=pack_all", "train.ac_formats=mxint8"])
    assert p.train.ac_strategy == "pack_all"
    with pytest.raises(ValueError, match="ac_regions must be one of"):
        override(micro, ["train.ac_regions=some"])
    with pytest.raises(ValueError, match="ac_regions='all' needs TrainConfig.compile='off'"):
        override(micro, ["train.ac_regions=all", "train.compile=aot_eager"])
    assert override(micro, ["train.ac_regions=all"]).train.ac_regions == "all"


def test_autoac_pack_inputs_packs_the_layers_inputs_and_can_be_turned_off(micro, tmp_path):
    """``ac_pack_inputs`` (autoac 0.1.18): with pack_all the second layer's input (the
    first layer's output, saved by its norm) is packed and the step allocates less than
    with the inputs kept; ``False`` keeps every input as before."""
    base = ["model.seq_layers=2", "data.max_seqlen=64", "model.dim=32",
            "train.activation_checkpointing=autoac", "train.ac_strategy=pack_all",
            "train.ac_formats=mxint8"]  # fmt: skip
    mem, inputs = {}, {}
    for flag in (True, False):
        t = Trainer(_micro(micro, *base, f"train.ac_pack_inputs={str(flag).lower()}"),
                    out_dir=tmp_path / str(flag), progress=False)  # fmt: skip
        try:
            mem[flag] = t.step_memory()["step_gb"]
            inputs[flag] = {
                r.name: [k for k, d in r.saves.items() if k[0] == "<input>" and d == "mxint8"]
                for r in t.autoac.plan.regions
            }
        finally:
            t.close()
    assert inputs[True]["seq_layers.1"] and not any(inputs[False].values())
    assert mem[True] < mem[False]
    with pytest.raises(ValueError, match="train.ac_pack_inputs: expected a bool"):
        override(micro, ["train.ac_pack_inputs=maybe"])
    with pytest.raises(TypeError, match="TrainConfig.ac_pack_inputs must be a bool"):
        dataclasses.replace(micro.train, ac_pack_inputs=1)


@pytest.mark.parametrize("scope", ["regions", "layers"])
def test_autoac_packs_mxint8_inside_the_compiled_layers(micro, scope, monkeypatch):
    """``ac_formats=mxint8`` with ``compile``: autoac compiles each layer with the packing
    traced into its graphs (no eager packed region runs). The plan is set by hand (the
    planner's choice on the CPU follows measured pack rates): layer 0 checkpointed and
    layer 1 not, each keeping its packable saves as MXINT8. The losses move by the
    quantization only."""
    from hyperrec.autoac import runtime

    eager = []
    orig = runtime._eager_region
    monkeypatch.setattr(
        runtime, "_eager_region", lambda *a, **k: (eager.append(1), orig(*a, **k))[1]
    )
    base = ["model.seq_layers=2", "train.compile=aot_eager", f"train.compile_scope={scope}"]
    off = _losses(Trainer(_micro(micro, *base), progress=False))
    ac = ["train.activation_checkpointing=autoac", "train.ac_budget_gb=1"]
    t = Trainer(_micro(micro, *base, *ac, "train.ac_formats=mxint8"), progress=False)
    prof, plan = t.autoac.profile, t.autoac.plan
    regions = []
    for i, (r, pr) in enumerate(zip(plan.regions, prof.regions, strict=True)):
        packable = [o.key for o in pr.ops if o.needed and "mxint8" in o.formats]
        assert len({op for op, _ in packable}) > 1, packable
        # layer 0 packs one op class, layer 1 all: different hooks, reported apart
        mode, packed = ("sac", packable[:1]) if i == 0 else ("none", packable)
        regions.append(dataclasses.replace(r, mode=mode, saves=dict.fromkeys(packed, "mxint8")))
    t.autoac.set_plan(dataclasses.replace(plan, regions=tuple(regions)))
    hooks = t.autoac._runner.hooks
    assert hooks[regions[0].name] is not hooks[regions[1].name]
    eager.clear()
    losses = _losses(t)
    assert eager == []
    assert all(t.autoac.packed_in_graph[r.name] for r in regions), t.autoac.packed_in_graph
    assert losses != off
    np.testing.assert_allclose(losses, off, rtol=2e-3)


def _two_rank_run(preset, out_dir):
    records, resumed = [], []
    t = Trainer(preset, out_dir=out_dir, progress=False, on_step=records.append)
    info = {
        "mesh": repr(t.mesh),
        "tables": t.tables,
        "local_rows": t.model.sharded.local_bytes() if t.model.sharded is not None else None,
        "autoac": t.autoac_summary(),
    }
    t.fit(plot=False)
    t.close()
    again = Trainer(
        preset, resume=checkpoint_dir(out_dir, 3), progress=False, on_step=resumed.append
    )
    again.fit(plot=False)
    again.close()
    return {
        **info,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "loss": [r.loss for r in records],
        "resumed": [r.loss for r in resumed],
    }


def test_two_ranks_sharded_tables_5d_mesh_and_autoac_match_one_process(micro, tmp_path):
    """Two gloo ranks with the defaults of a multi-rank run (5-D mesh, sharded tables with
    row-wise Adagrad) and autoac: the same losses as one process with the same config
    (sharded tables start from the same rows on any world size), each rank holding half
    the rows; exact resume on two ranks, and the same losses resumed on one process."""
    p = _micro(
        micro,
        "train.window_steps=1",
        "train.ckpt_every=3",
        "train.mesh=5d",
        "train.sparse=sharded",
        "train.activation_checkpointing=autoac",
        "train.ac_budget_gb=1",
    )
    one = _two_rank_run(p, tmp_path / "one")
    two = run_on_ranks(_two_rank_run, 2, p, tmp_path / "two", timeout_s=600)
    assert "world=2" in two[0]["mesh"] and "sparse_replicate=2" in two[0]["mesh"]
    assert two[0]["tables"] == "sharded" and two[0]["autoac"] is not None
    assert two[0]["local_rows"] + two[1]["local_rows"] == one["local_rows"]
    assert two[0]["loss"] == two[1]["loss"]
    np.testing.assert_allclose(two[0]["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    assert one["resumed"] == one["loss"][3:]
    assert two[0]["resumed"] == two[0]["loss"][3:]
    # One process resumes the two ranks' checkpoint: the sharded tables (rows and
    # row-wise Adagrad states) reshard, autoac plans afresh (each rank's batch changed).
    t = Trainer(p, resume=checkpoint_dir(tmp_path / "two", 3), progress=False)
    try:
        assert t.tables == "sharded" and t.autoac is not None
        assert "resharded from 2 to 1 ranks" in t.resume_notes[0]
        losses = t.fit(plot=False).metrics["history"]["loss"]
    finally:
        t.close()
    np.testing.assert_allclose(losses, one["loss"], rtol=1e-5, atol=1e-6)


def test_autoac_steps_start_without_pending_table_rows(micro, monkeypatch):
    """autoac profiles and verifies by running backward several times; the sharded
    tables append their row gradients per backward until their optimizer's zero_grad,
    so later steps started with earlier steps' rows alive (counted in a GPU's measured
    peak, not in the plan's). Every step autoac runs must start with none pending."""
    from hyperrec import autoac

    real = autoac.apply
    pending: list[int] = []

    def spy(model, *a, **kw):
        coll = model.sharded
        # what each forward autoac runs finds pending
        h = coll.register_forward_pre_hook(
            lambda m, args: pending.append(sum(len(p) for p in m._pending))
        )
        try:
            return real(model, *a, **kw)
        finally:
            h.remove()

    monkeypatch.setattr(autoac, "apply", spy)
    p = _micro(
        micro,
        "train.sparse=sharded",
        "train.activation_checkpointing=autoac",
        "train.ac_budget_gb=1",
    )
    t = Trainer(p, progress=False)
    try:
        assert t.model.sharded is not None
        assert len(pending) >= 2 and pending == [0] * len(pending)
    finally:
        t.close()
