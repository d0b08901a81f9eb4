"""The speed switches compute the same function, and the step reads no device values."""

import dataclasses

import numpy as np
import pytest
import torch

import hyperrec.integration.model as model_module
from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, esmm_loss, get_preset
from hyperrec.integration.loader import StepLoader, validate_batch
from hyperrec.integration.model import fuse_tables_state_dict, split_tables_state_dict
from hyperrec.integration.pipeline import TrainStream
from hyperrec.integration.trainer import backward_and_update, build_optimizer


def _preset(micro, **model):
    base = dict(seq_layers=2, block_attention_layers=1, attn_block_size=4, embedding_dim=8)
    base.update(model)
    return dataclasses.replace(micro, model=dataclasses.replace(micro.model, **base))


def _grads(model, batch):
    ctr, cvr = model(batch)
    sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
    return ctr.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_fused_lookup_equals_separate_tables(micro, micro_data):
    preset = _preset(micro)
    batch = micro_data.batch(TRAIN, np.arange(64))
    torch.manual_seed(0)
    sep = GEMModel(preset.model, preset.data)
    fused = GEMModel(preset.model, preset.data, fused_embeddings=True)
    fused.load_state_dict(fuse_tables_state_dict(sep.state_dict()))
    (a, ga), (b, gb) = _grads(sep, batch), _grads(fused, batch)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    split = split_tables_state_dict(
        {"tables.weight": gb["tables.weight"]}, preset.model, preset.data
    )
    for name, grad in split.items():
        torch.testing.assert_close(ga[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    for name in ga:
        if name in gb:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)
    assert fused.embedding_parameters() == [fused.tables.weight]
    back = split_tables_state_dict(fused.state_dict(), preset.model, preset.data)
    assert all(torch.equal(back[k], v) for k, v in sep.state_dict().items())
    with pytest.raises(ValueError, match="tables.weight has"):
        split_tables_state_dict({"tables.weight": torch.zeros(3, 8)}, preset.model, preset.data)


def test_compiled_regions_equal_eager(micro, micro_data):
    """torch.compile of the small-op regions (aot_eager: the graph capture and AOT
    autograd the inductor build also goes through, without its code generation, which
    takes minutes on a CPU) gives the eager outputs and gradients, over two batch sizes
    (one dynamic-shape graph serves both)."""
    preset = _preset(micro, cross_rank=4)
    torch.manual_seed(0)
    eager = GEMModel(preset.model, preset.data)
    compiled = GEMModel(preset.model, preset.data, compile="aot_eager")
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    for n in (32, 48):
        batch = micro_data.batch(TRAIN, np.arange(n))
        eager.zero_grad()
        compiled.zero_grad()
        (a, ga), (b, gb) = _grads(eager, batch), _grads(compiled, batch)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for name in ga:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


def test_mxfp8_mlp_switch(micro, micro_data, monkeypatch):
    from hyperrec.mxfp8 import MXLinear, PrecisionPolicy, plan_conversion

    preset = _preset(micro, mlp_dims=(64, 32))
    # The real policy keeps layers under 4,096 features in bf16 (all of micro's): check the
    # decision, then force small layers through MXFP8 to check the wiring numerically.
    gem_like = GEMModel.interaction_width(get_preset("gem").model)
    plan = plan_conversion(
        torch.nn.Sequential(torch.nn.Linear(gem_like, 4096), torch.nn.Linear(4096, 1024)),
        model_module.mlp_policy(),
    )
    assert list(plan.values())[0] == "mx" and list(plan.values())[1] != "mx"
    monkeypatch.setattr(
        model_module,
        "mlp_policy",
        lambda: PrecisionPolicy(block_size=32, keep_first=False, keep_last=False, min_features=1),
    )
    torch.manual_seed(0)
    ref = GEMModel(preset.model, preset.data)
    mx = GEMModel(preset.model, preset.data, mlp_precision="mxfp8")
    mx.load_state_dict(ref.state_dict())  # MXLinear keeps nn.Linear's parameters
    assert sum(isinstance(m, MXLinear) for m in mx.mlp) == 2
    batch = micro_data.batch(TRAIN, np.arange(64))
    (a, ga), (b, gb) = _grads(ref, batch), _grads(mx, batch)
    # FP8 rounding: ~29 dB per GEMM (mxfp8's README); outputs and gradients stay close.
    assert float((a - b).norm() / a.norm()) < 0.1
    w = "mlp.0.weight"
    assert float((ga[w] - gb[w]).norm() / ga[w].norm()) < 0.2


@pytest.mark.parametrize(("impl", "fused"), [("hyperrec", True), ("naive", False)])
def test_the_device_step_reads_no_device_values(micro, micro_data, impl, fused):
    """Forward, loss, backward, clipping and AdamW on the meta device: any ``.item()``,
    ``.tolist()``, ``bool()`` or data-dependent shape on a device tensor raises there, so
    passing means the steady-state step needs no host synchronisation."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        bool(torch.ones(2, device="meta").sum() > 0)  # the detector works
    preset = _preset(micro, dropout=0.1)
    with torch.device("meta"):
        model = GEMModel(
            preset.model, preset.data, validate=False, impl=impl, fused_embeddings=fused
        )
    optimizer = build_optimizer(model, preset.train)
    batch = micro_data.batch(TRAIN, np.arange(32)).to("meta")
    for _ in range(2):
        ctr, cvr = model(batch)
        ctr_sum, ctcvr_sum = esmm_loss(ctr, cvr, batch.click, batch.conversion)
        loss = (ctr_sum + ctcvr_sum) / float(batch.num_candidates)
        norm = backward_and_update(loss, model, optimizer, grad_clip=1.0)
        assert norm.device.type == "meta"


@pytest.mark.slow  # loader worker processes (own internals): not in `nox -s lowest`
def test_loader_workers_deliver_the_inline_batches_and_states(micro, micro_data):
    def stream():
        return TrainStream(micro_data, sub_batch_size=16, sub_batches_per_step=2, window_steps=2)

    inline = StepLoader(stream(), torch.device("cpu"), workers=0)
    pooled = StepLoader(stream(), torch.device("cpu"), workers=1, prefetch=2)
    reference = stream()
    try:
        for _ in range(3):
            a, b = inline.next(), pooled.next()
            ref = reference.next()
            assert a.plan.sub_batches == b.plan.sub_batches == ref.sub_batches
            for name in ("history_items", "candidate_items", "click", "dense"):
                assert torch.equal(getattr(a.batch, name), getattr(b.batch, name))
                assert torch.equal(getattr(a.batch, name), getattr(ref.batch, name))
            # The worker pool reads ahead; the checkpointable state is the consumed one.
            assert pooled.state_dict() == inline.state_dict() == reference.state_dict()
    finally:
        pooled.close()
        inline.close()


def test_worker_batches_travel_by_value_not_as_shared_tensors(micro_data):
    """A batch leaves a worker as numpy arrays in the pickle: receiving shared-memory
    tensors costs the trainer's thread a round trip to the busy worker per tensor."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers the tensor reducers

    from hyperrec.integration.loader import _Built

    batch = micro_data.batch(TRAIN, np.arange(12))
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(_Built(4, "plan", batch))
    assert b"rebuild_storage" not in buf.getvalue() and b"rebuild_tensor" not in buf.getvalue()
    back = pickle.loads(buf.getvalue())
    assert back.seq == 4 and back.plan == "plan"
    for f in dataclasses.fields(batch):
        a, b = getattr(batch, f.name), getattr(back.batch, f.name)
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
            b.add_(0)  # writable, owned memory
        else:
            assert a == b, f.name


def test_batches_are_validated_at_loading(micro, micro_data, monkeypatch):
    real = SyntheticRecsysData.batch

    def corrupt(self, split, ids):
        b = real(self, split, ids)
        items = b.candidate_items.clone()
        items[0] = self.config.num_items + 7
        return dataclasses.replace(b, candidate_items=items)

    monkeypatch.setattr(SyntheticRecsysData, "batch", corrupt)
    s = TrainStream(micro_data, sub_batch_size=16, sub_batches_per_step=1, window_steps=1)
    with pytest.raises(ValueError, match="Batch.candidate_items"):
        StepLoader(s, torch.device("cpu"), validate=True).next()
    StepLoader(s, torch.device("cpu"), validate=False).next()  # opting out skips the check
    longer = dataclasses.replace(micro.data, max_seqlen=4)
    with pytest.raises(ValueError, match="exceeds DataConfig.max_seqlen"):
        validate_batch(real(micro_data, TRAIN, np.arange(64)), longer)
    with pytest.raises(ValueError, match="workers"):
        StepLoader(s, torch.device("cpu"), workers=-1)


def test_fused_adamw_equals_foreach(micro, micro_data):
    preset = _preset(micro)
    batch = micro_data.batch(TRAIN, np.arange(32))
    params = {}
    for impl in ("foreach", "fused"):
        torch.manual_seed(0)
        model = GEMModel(preset.model, preset.data)
        train = dataclasses.replace(preset.train, optimizer_impl=impl)
        optimizer = build_optimizer(model, train)
        assert bool(optimizer.defaults["fused"]) == (impl == "fused")
        for _ in range(3):
            ctr, cvr = model(batch)
            loss = sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)) / batch.num_candidates
            backward_and_update(loss, model, optimizer, grad_clip=1.0)
        params[impl] = dict(model.named_parameters())
    # Same update up to float32 rounding (the kernels order the arithmetic differently; a
    # few elements with tiny gradients differ by ~1% of one learning-rate step).
    for name, p in params["foreach"].items():
        torch.testing.assert_close(p, params["fused"][name], rtol=1e-4, atol=5e-5, msg=name)


def test_both_table_layouts_start_from_the_same_values(micro):
    preset = _preset(micro)
    torch.manual_seed(3)
    sep = GEMModel(preset.model, preset.data)
    torch.manual_seed(3)
    fused = GEMModel(preset.model, preset.data, fused_embeddings=True)
    want = fuse_tables_state_dict(sep.state_dict())
    got = fused.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    std = preset.model.table_dim**-0.5
    assert abs(float(sep.item_embedding.weight.detach().std()) - std) < 0.1 * std


@pytest.mark.slow  # loader worker processes (own internals): not in `nox -s lowest`
def test_resume_is_exact_with_data_workers_reading_ahead(micro, tmp_path):
    from hyperrec.integration import Trainer

    train = dataclasses.replace(
        micro.train, steps=8, ckpt_every=4, window_steps=3, data_workers=1, prefetch_batches=2
    )
    preset = dataclasses.replace(micro, train=train)
    full, first, second = [], [], []
    Trainer(preset, out_dir=tmp_path / "a", progress=False, on_step=full.append).fit(plot=False)
    b = Trainer(preset, out_dir=tmp_path / "b", progress=False, on_step=first.append)
    b.fit(stop_after=6, plot=False)
    b.close()
    c = Trainer(preset, resume=tmp_path / "b", progress=False, on_step=second.append)
    c.fit(plot=False)
    c.close()
    assert [r.step for r in second] == [5, 6, 7, 8]
    assert [r.loss for r in second] == [r.loss for r in full[4:]]
    for x, y in zip(second, full[4:]):
        assert torch.equal(x.sample_ids, y.sample_ids)


def test_the_pipelined_loop_trains_what_the_stepwise_loop_does(micro, tmp_path):
    """``fit`` overlaps steps when no ``on_step`` callback is set and finishes each step
    first when one is: the same losses, metrics and parameters either way."""
    from hyperrec.integration import Trainer

    train = dataclasses.replace(micro.train, steps=6, ckpt_every=3, eval_every=3)
    preset = dataclasses.replace(micro, train=train)
    records = []
    a = Trainer(preset, out_dir=tmp_path / "a", progress=False)
    b = Trainer(preset, out_dir=tmp_path / "b", progress=False, on_step=records.append)
    ma, mb = a.fit(plot=False).metrics, b.fit(plot=False).metrics
    assert ma["history"]["loss"] == mb["history"]["loss"] == [r.loss for r in records]
    assert ma["history"]["skipped"] == [0.0] * 6
    assert ma["final"] == mb["final"] and ma["eval"] == mb["eval"]
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), name


def test_a_naive_model_of_a_ctr_only_schema_counts_one_head(micro):
    """The merged model: a schema without conversions (no CVR head) on the naive path,
    and the FLOP count follows it."""
    from hyperrec.integration.flops import model_flops

    schema = dataclasses.replace(micro.data.schema, tasks=("ctr",))
    torch.manual_seed(0)
    model = GEMModel(micro.model, schema, impl="naive")
    assert model.cvr_head is None
    batch = SyntheticRecsysData(micro.data).batch(TRAIN, np.arange(16))
    ctr, cvr = model(batch)
    assert cvr is None and ctr.shape == (batch.num_candidates,)
    lens, cands = batch.history_offsets.diff().numpy(), batch.candidate_offsets.diff().numpy()
    both = model_flops(micro.model, micro.data, lens, cands)
    one = model_flops(micro.model, schema, lens, cands)
    assert one.forward["heads"] == both.forward["heads"] / 2
    assert {k: v for k, v in one.forward.items() if k != "heads"} == {
        k: v for k, v in both.forward.items() if k != "heads"
    }
    narrow = dataclasses.replace(schema, max_candidates=1)
    with pytest.raises(ValueError, match="DataSchema.max_candidates = 1"):
        validate_batch(batch, narrow)
