"""The naive baseline (padded PyTorch attention) computes the model's function exactly."""

import dataclasses

import numpy as np
import pytest
import torch

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, Trainer, esmm_loss, naive


def _preset(micro, **model):
    base = dict(seq_layers=3, block_attention_layers=1, attn_block_size=4, embedding_dim=8)
    base.update(model)
    return dataclasses.replace(
        micro,
        # Empty histories (min 0) and a few long ones: padding and empty rows both matter.
        data=dataclasses.replace(micro.data, min_seqlen=0, seqlen_scale=3.0),
        model=dataclasses.replace(micro.model, **base),
    )


def _double(batch):
    return dataclasses.replace(
        batch,
        dense=batch.dense.double(),
        click=batch.click.double(),
        conversion=batch.conversion.double(),
    )


def _run(model, batch):
    ctr, cvr = model(batch)
    sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return ctr.detach(), cvr.detach(), grads


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_naive_and_hyperrec_are_the_same_function(micro, activation, monkeypatch):
    preset = _preset(micro, activation=activation)
    batch = _double(SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(48)))
    lengths = batch.history_offsets.diff()
    assert (lengths == 0).any() and int(lengths.max()) > 2 * preset.model.attn_block_size
    torch.manual_seed(0)
    fast = GEMModel(preset.model, preset.data).double()
    slow = GEMModel(preset.model, preset.data, impl="naive").double()
    slow.load_state_dict(fast.state_dict())
    # Several query chunks, each recomputed in backward, as at GEM scale.
    monkeypatch.setattr(naive, "SCORE_CHUNK_ELEMENTS", 2 * 48 * batch.max_history_len)
    a, b = _run(fast, batch), _run(slow, batch)
    torch.testing.assert_close(a[0], b[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a[1], b[1], rtol=1e-10, atol=1e-12)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=1e-9, atol=1e-12, msg=name)


def test_hstu_chunks_and_recompute_do_not_change_the_result():
    torch.manual_seed(1)
    lengths = torch.tensor([5, 0, 9, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    t = int(lengths.sum())
    q, k, v = (torch.randn(t, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    layout = naive.JaggedLayout.from_offsets(offsets, 9, t)
    results = []
    for chunk, recompute in ((1 << 20, False), (8, True), (1, True)):
        out = naive.hstu_attention(
            q, k, v, layout, activation="silu", scale=0.5, output_scale=0.1,
            recompute=recompute, chunk_elements=chunk,
        )  # fmt: skip
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, *grads))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="activation must be one of"):
        naive.hstu_attention(q, k, v, layout, activation="tanh", scale=1.0, output_scale=1.0)


def test_naive_training_follows_the_same_loss_curve(micro, tmp_path):
    """Same data, same initial parameters: the two paths train the same model (float32
    rounding aside), so speed can be compared at equal quality."""
    preset = dataclasses.replace(
        _preset(micro), train=dataclasses.replace(micro.train, steps=30, eval_every=0)
    )
    runs = {}
    for impl in ("hyperrec", "naive"):
        p = dataclasses.replace(preset, train=dataclasses.replace(preset.train, impl=impl))
        runs[impl] = Trainer(p, out_dir=tmp_path / impl, progress=False).fit(plot=False).metrics
    fast, slow = runs["hyperrec"], runs["naive"]
    np.testing.assert_allclose(fast["history"]["loss"], slow["history"]["loss"], atol=1e-4)
    assert abs(fast["final"]["ctr_auc"] - slow["final"]["ctr_auc"]) < 2e-3
    assert fast["mfu"]["model_tflop_total"] == slow["mfu"]["model_tflop_total"]


@pytest.mark.parametrize("chunk", [1 << 20, 40, 7])
def test_padded_attention_work_counts_what_the_naive_kernels_compute(chunk):
    """The naive row's work estimate against FlopCounterMode on the padded HSTU attention:
    forward 4 x head_dim per computed score element, training (forward, the recomputed
    score GEMM, backward) 14 x head_dim; the padded count exceeds the jagged one."""
    from torch.utils.flop_counter import FlopCounterMode

    lengths = np.array([5, 0, 9, 1, 3])
    heads, head_dim = 2, 4
    offsets = torch.from_numpy(np.concatenate([[0], lengths.cumsum()]))
    t = int(lengths.sum())
    q, k, v = (torch.randn(t, heads, head_dim, requires_grad=True) for _ in range(3))
    layout = naive.JaggedLayout.from_offsets(offsets, int(lengths.max()), t)
    work = naive.padded_attention_work(
        lengths, heads=heads, head_dim=head_dim, full_layers=1, block_layers=0,
        block_size=4, pma_queries=0, max_candidates=0, chunk_elements=chunk,
    )  # fmt: skip
    kwargs = dict(activation="silu", scale=0.5, output_scale=0.1, chunk_elements=chunk)
    with FlopCounterMode(display=False) as fwd_only, torch.no_grad():
        naive.hstu_attention(q, k, v, layout, **kwargs)
    assert fwd_only.get_total_flops() == work["hstu"] * 4 / 14
    with FlopCounterMode(display=False) as counter:
        naive.hstu_attention(q, k, v, layout, **kwargs).sum().backward()
    assert counter.get_total_flops() == work["hstu"]
    assert work["max_len"] == 9
    jagged_pairs = int((lengths * (lengths + 1) // 2).sum()) * heads
    assert work["hstu_score_elements"] >= 5 * 9 * 9 * heads / 2 > jagged_pairs
    with pytest.raises(ValueError, match="history_lengths must be non-negative"):
        naive.padded_attention_work(
            [-1], heads=1, head_dim=1, full_layers=1, block_layers=0, block_size=1,
            pma_queries=0, max_candidates=0,
        )  # fmt: skip
