"""MFU accounting: the analytic FLOP count against torch's FLOP counter and brute force.

``torch.utils.flop_counter.FlopCounterMode`` counts matrix multiplications (mm, addmm,
bmm, SDPA) and nothing else, the same rule as :mod:`hyperrec.integration.flops`. Two
differences are structural and are removed before the exact comparison: the jagged
attention reference is one opaque custom op (the counter sees none of its work; the
attention count is checked separately against dense per-sequence attention and the mask
algebra), and the heads' final ``[N, h] @ [h]`` is ``aten.mv``, which the counter has no
formula for (``2 h`` FLOPs per candidate and head).
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, Trainer, esmm_loss
from hyperrec.integration import flops as F
from hyperrec.jagged_attn import MaskSpec, mask_matrix


def _variant(micro, **model):
    base = dict(seq_layers=3, block_attention_layers=1, attn_block_size=4, cross_rank=4)
    base.update(model)
    return dataclasses.replace(micro, model=dataclasses.replace(micro.model, **base))


def _uncounted(preset, batch, fc):
    """Forward FLOPs the counter cannot see: attention (opaque op) and the heads' mv."""
    lens = np.diff(batch.history_offsets.numpy())
    cands = np.diff(batch.candidate_offsets.numpy())
    d = preset.model.dim
    attention = fc.forward["attention_block"] + fc.forward["attention_full"]
    attention += 4.0 * preset.model.pma_queries * lens.sum() * d
    attention += 4.0 * (lens * cands).sum() * d
    mv = 2 * 2.0 * cands.sum() * preset.model.head_dims[-1]
    return attention + mv


@pytest.mark.parametrize(
    ("model", "fused"), [({}, False), ({"embedding_dim": 8, "cross_rank": 0}, True)]
)
def test_analytic_count_equals_flop_counter_on_the_reference_path(micro, model, fused):
    preset = _variant(micro, **model)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(48))
    net = GEMModel(preset.model, preset.data, fused_embeddings=fused)
    fc = F.batch_flops(preset.model, preset.data, batch)
    hidden = _uncounted(preset, batch, fc)
    with FlopCounterMode(display=False) as fwd:
        net(batch)
    with FlopCounterMode(display=False) as both:
        ctr, cvr = net(batch)
        sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
    # Exact: the same GEMMs, and training = 3x forward except the dense-feature
    # projection, whose input (the batch) needs no gradient.
    assert fwd.get_total_flops() == fc.total_forward - hidden
    assert both.get_total_flops() == fc.total_training - 3 * hidden
    assert fc.training["dense_features"] == 2 * fc.forward["dense_features"]
    assert fc.training["mlp"] == 3 * fc.forward["mlp"]


def _dense_attention_flops(lq, lk, heads, dim, backward):
    """FlopCounterMode's count of plain per-sequence attention ``softmax(q k^T) v``."""
    with FlopCounterMode(display=False) as counter:
        for a, b in zip(lq, lk):
            q = torch.randn(heads, a, dim, requires_grad=True)
            k = torch.randn(heads, b, dim, requires_grad=True)
            v = torch.randn(heads, b, dim, requires_grad=True)
            out = torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v
            if backward:
                out.sum().backward()
    return counter.get_total_flops()


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    block=st.integers(1, 12),
)
def test_attention_pairs_equal_the_mask_algebra(lengths, block):
    causal = sum(int(mask_matrix(n, n, MaskSpec(causal=True)).sum()) for n in lengths)
    blocked = sum(
        int(mask_matrix(n, n, MaskSpec(causal=True, block_size=block)).sum()) for n in lengths
    )
    assert F.attention_pairs(lengths, causal=True) == causal
    assert F.attention_pairs(lengths, causal=True, block_size=block) == blocked
    assert F.attention_pairs(lengths, causal=False) == sum(n * n for n in lengths)


def test_attention_flops_per_pair_match_dense_attention():
    """4 head_dim FLOPs per pair and head forward, 3x that for forward + backward."""
    rng = np.random.default_rng(0)
    lq, lk = rng.integers(1, 20, 5).tolist(), rng.integers(1, 20, 5).tolist()
    heads, dim = 2, 8
    pairs = sum(a * b for a, b in zip(lq, lk))
    counter = F._Counter()
    counter.attention("x", pairs, heads * dim)
    assert counter.forward["x"] == _dense_attention_flops(lq, lk, heads, dim, False)
    assert counter.training["x"] == _dense_attention_flops(lq, lk, heads, dim, True)


def test_pma_and_cross_attention_pairs(micro):
    lens, cands = np.array([0, 3, 7]), np.array([2, 1, 4])
    m, d = micro.model, micro.model.dim
    fc = F.model_flops(m, micro.data, lens, cands)
    c, t, b, p = cands.sum(), lens.sum(), 3, m.pma_queries
    pma = 2 * t * d * 2 * d + 4 * p * t * d + 2 * b * p * d * d
    cross = 2 * c * d * d + 2 * t * d * 2 * d + 4 * (lens * cands).sum() * d + 2 * c * d * d
    assert fc.forward["pma"] == pma and fc.forward["cross_attention"] == cross
    assert fc.forward["attention_full"] == 4 * (0 + 6 + 28) * d  # L(L+1)/2 causal pairs


def test_model_flops_rejects_bad_shapes(micro):
    with pytest.raises(ValueError, match="one entry per request"):
        F.model_flops(micro.model, micro.data, [1, 2], [1])
    with pytest.raises(ValueError, match="non-negative"):
        F.model_flops(micro.model, micro.data, [-1], [1])
    batch = SyntheticRecsysData(micro.data).batch(TRAIN, [0, 1])
    with pytest.raises(ValueError, match="CPU copy"):
        F.StepShape.from_batch(batch.to("meta"))


def test_peak_table_lookup(monkeypatch):
    assert F.peak_tflops("cpu") == (None, None)
    assert F.measure_matmul_tflops("cpu") is None
    for name, want in (
        ("NVIDIA H200", 989.4),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GB200", 2500.0),
        ("Some Future GPU", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, n=name: n)
        assert F.peak_tflops("cuda")[0] == want, name


def test_every_step_records_its_flops_and_mfu(micro, tmp_path):
    preset = dataclasses.replace(micro, train=dataclasses.replace(micro.train, steps=5))
    records = []
    result = Trainer(preset, out_dir=tmp_path, progress=False, on_step=records.append).fit(
        plot=True
    )
    hist = result.metrics["history"]
    data = SyntheticRecsysData(preset.data)
    for rec, tflop, step_time, rate in zip(
        records, hist["step_tflop"], hist["step_time_s"], hist["tflops_per_gpu"]
    ):
        batch = data.batch(TRAIN, rec.sample_ids.numpy())
        want = F.batch_flops(preset.model, preset.data, batch).total_training
        assert math.isclose(tflop * 1e12, want, rel_tol=1e-12)
        assert math.isclose(rate, tflop / step_time, rel_tol=1e-9)
    # A CPU has no datasheet peak: MFU is null, the FLOP rate is still reported.
    assert hist["mfu"] == [None] * 5
    mfu = result.metrics["mfu"]
    assert mfu["peak_tflops"] is None and mfu["mfu"] is None
    assert mfu["model_tflop_total"] == pytest.approx(sum(hist["step_tflop"]))
    assert mfu["tflops_per_gpu"] > 0
