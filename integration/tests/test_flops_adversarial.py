"""Adversarial checks of the MFU accounting (:mod:`hyperrec.integration.flops`).

The analytic count is compared, component by component, with
``torch.utils.flop_counter.FlopCounterMode`` on the reference path over random small
models and batches (block sizes that do not divide the lengths, empty and one-token
histories, narrow tables, low-rank and full DCN, no PMA, softmax and SiLU, CTR-only
schemas, one-request batches). The attention ops are opaque to the counter; their work
is counted here independently, as the allowed (query, key) pairs of
:func:`hyperrec.jagged_attn.mask_matrix` (brute force over each sequence's mask), and
the heads' final ``aten.mv`` (no counter formula) as ``2 h`` per candidate and head.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch.utils.flop_counter import FlopCounterMode

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, Trainer, esmm_loss
from hyperrec.integration import flops as F
from hyperrec.integration.config import DataSchema, ModelConfig
from hyperrec.integration.data import Batch
from hyperrec.integration.model import bucket_rows
from hyperrec.jagged_attn import MaskSpec, mask_matrix

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")


def _batch(schema, lens, cands, rng):
    """A valid batch with exactly these history lengths and candidate counts."""
    b, t, c = len(lens), int(sum(lens)), int(sum(cands))

    def offsets(n):
        return torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int64)

    def ids(n, high):
        return torch.tensor(rng.integers(0, high, n), dtype=torch.int64)

    n_tags = rng.integers(1, 3, b)
    click = torch.tensor(rng.integers(0, 2, c), dtype=torch.float32)
    return Batch(
        sample_ids=torch.arange(b),
        user_ids=ids(b, 1000),
        request_time=torch.full((b,), 10**9),
        dense=torch.randn(b, schema.num_dense),
        tag_offsets=offsets(n_tags),
        tags=ids(int(n_tags.sum()), schema.num_tags),
        history_offsets=offsets(lens),
        history_items=ids(t, schema.num_items),
        history_categories=ids(t, schema.num_categories),
        history_actions=ids(t, schema.num_actions),
        history_time=torch.full((t,), 10**9 - 60),
        candidate_offsets=offsets(cands),
        candidate_items=ids(c, schema.num_items),
        candidate_categories=ids(c, schema.num_categories),
        click=click,
        conversion=click * torch.tensor(rng.integers(0, 2, c), dtype=torch.float32),
        max_history_len=int(max(lens)),
    )


def _mask_pairs(lq, lk, spec):
    return int(mask_matrix(int(lq), int(lk), spec).sum())


def _attention_by_brute_force(m, lens, cands):
    """Forward attention FLOPs from the masks: 4 * dim per allowed pair (all heads)."""
    out = {"attention_block": 0, "attention_full": 0, "pma": 0, "cross_attention": 0}
    for i in range(m.seq_layers):
        block = i < m.block_attention_layers
        spec = MaskSpec(causal=True, block_size=m.attn_block_size if block else 0)
        key = "attention_block" if block else "attention_full"
        out[key] += 4 * m.dim * sum(_mask_pairs(n, n, spec) for n in lens)
    every = MaskSpec()  # PMA queries and candidates see their whole history
    out["pma"] = 4 * m.dim * sum(_mask_pairs(m.pma_queries, n, every) for n in lens)
    out["cross_attention"] = (
        4 * m.dim * sum(c * _mask_pairs(1, n, every) for n, c in zip(lens, cands))
    )
    return out


def _forward_by_component(counter, m, schema, cands):
    """The counter's forward FLOPs per flops.py component (module attribution)."""
    per = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    top = per.get("GEMModel", 0)
    # direct children; the sequence layers sit one level lower, under a ModuleList
    children = {k: v for k, v in per.items() if k.count(".") == 1 and k.startswith("GEMModel.")}
    seq = sum(v for k, v in per.items() if k.count(".") == 2 and ".seq_layers." in k)
    mv = 2 * len(schema.tasks) * int(sum(cands)) * m.head_dims[-1]  # aten.mv: uncounted
    return {
        # the token projection runs as F.linear in GEMModel.forward itself
        "embedding_projection": per.get("GEMModel.candidate_proj", 0)
        + top
        - sum(children.values())
        - seq,
        "sequence_linear": seq,
        "pma": per.get("GEMModel.pma", 0),
        "cross_attention": per.get("GEMModel.cross_attention", 0),
        "dense_features": per.get("GEMModel.dense_proj", 0),
        "dcn": per.get("GEMModel.interaction", 0),
        "mlp": per.get("GEMModel.mlp", 0),
        "heads": per.get("GEMModel.ctr_head", 0) + per.get("GEMModel.cvr_head", 0) + mv,
    }


def _random_case(rng):
    heads = int(rng.choice([1, 2, 4]))
    seq = int(rng.integers(0, 4))
    model = ModelConfig(
        dim=heads * int(rng.choice([2, 4])),
        heads=heads,
        seq_layers=seq,
        block_attention_layers=int(rng.integers(0, seq + 1)),
        attn_block_size=int(rng.integers(1, 7)),  # rarely divides the lengths
        activation=str(rng.choice(["silu", "softmax", "relu"])),
        pma_queries=int(rng.integers(0, 3)),
        time_buckets=4,
        user_hash_size=32,
        cross_layers=int(rng.integers(0, 3)),
        cross_rank=int(rng.choice([0, 1, 3, 1000])),  # 1000 >= width: full rank
        mlp_dims=tuple(int(x) for x in rng.integers(1, 9, int(rng.integers(1, 3)))),
        head_dims=tuple(int(x) for x in rng.integers(1, 9, int(rng.integers(1, 3)))),
        embedding_dim=int(rng.choice([0, 0, 3, 8])),
    )
    most = int(rng.integers(1, 5))
    schema = DataSchema(
        num_items=50,
        num_categories=5,
        num_tags=7,
        actions=("view", "click"),
        dense_features=tuple(f"f{i}" for i in range(int(rng.integers(0, 4)))),
        max_seqlen=20,
        tasks=("ctr",) if rng.random() < 0.4 else ("ctr", "cvr"),
        max_candidates=most,
    )
    b = int(rng.integers(1, 5))
    lens = rng.choice([0, 1, 1, 2, 5, 7, 13, 20], b).astype(np.int64)
    cands = rng.integers(1, most + 1, b).astype(np.int64)
    return model, schema, lens, cands


def _check(model, schema, lens, cands, rng, fused=False):
    torch.manual_seed(0)
    net = GEMModel(model, schema, fused_embeddings=fused)
    batch = _batch(schema, lens, cands, rng)
    fc = F.model_flops(model, schema, lens, cands)
    attention = _attention_by_brute_force(model, lens, cands)
    with FlopCounterMode(display=False) as fwd:
        net(batch)
    with FlopCounterMode(display=False) as both:
        ctr, cvr = net(batch)
        if cvr is None:
            loss = TF.binary_cross_entropy_with_logits(ctr, batch.click, reduction="sum")
        else:
            loss = sum(esmm_loss(ctr, cvr, batch.click, batch.conversion))
        loss.backward()
    want = _forward_by_component(fwd, model, schema, cands)
    for key, value in attention.items():
        want[key] = want.get(key, 0) + value
    got = {k: v for k, v in fc.forward.items()}
    keys = set(want) | set(got)
    assert {k: got.get(k, 0.0) for k in keys} == {k: float(want.get(k, 0)) for k in keys}
    # Training: the same GEMMs forward and backward (the dense projection's input needs
    # no gradient: 2x); attention and the mv (invisible to the counter) at 3x.
    hidden = (
        sum(attention.values()) + 2 * len(schema.tasks) * int(sum(cands)) * (model.head_dims[-1])
    )
    assert fc.total_training == both.get_total_flops() + 3 * hidden
    assert fc.total_forward == fwd.get_total_flops() + hidden


@pytest.mark.parametrize("seed", range(6))
def test_random_models_match_the_flop_counter_component_by_component(seed):
    rng = np.random.default_rng(1000 + seed)
    for _ in range(5):
        model, schema, lens, cands = _random_case(rng)
        _check(model, schema, lens, cands, rng, fused=bool(rng.random() < 0.3))


@pytest.mark.parametrize(
    ("lens", "cands", "model", "tasks"),
    [
        ([0], [1], {}, ("ctr", "cvr")),  # one request, empty history
        ([1, 1, 1], [3, 1, 2], {"attn_block_size": 1}, ("ctr",)),  # one-token histories
        ([0, 0], [2, 2], {"pma_queries": 0, "embedding_dim": 6}, ("ctr",)),
        ([7, 11, 0, 1], [1, 4, 2, 3], {"activation": "softmax", "cross_rank": 0}, ("ctr",)),
        ([20], [4], {"block_attention_layers": 3, "attn_block_size": 6}, ("ctr", "cvr")),
        ([3, 2], [1, 2], {"cross_rank": 40}, ("ctr", "cvr")),  # rank == width: full
    ],
)
def test_edge_batches_match_the_flop_counter(lens, cands, model, tasks):
    base = dict(
        dim=8,
        heads=2,
        seq_layers=3,
        block_attention_layers=2,
        attn_block_size=3,
        pma_queries=2,
        time_buckets=4,
        user_hash_size=32,
        cross_layers=2,
        cross_rank=5,
        mlp_dims=(6, 4),
        head_dims=(5,),
        embedding_dim=4,
    )
    base.update(model)
    schema = DataSchema(
        num_items=50,
        num_categories=5,
        num_tags=7,
        actions=("view",),
        dense_features=("a", "b", "c"),
        max_seqlen=20,
        tasks=tasks,
        max_candidates=4,
    )
    lens, cands = np.array(lens), np.array(cands)
    _check(ModelConfig(**base), schema, lens, cands, np.random.default_rng(7))


def test_attention_pairs_equal_a_brute_force_count_of_the_mask():
    rng = np.random.default_rng(3)
    for _ in range(40):
        lengths = rng.integers(0, 30, int(rng.integers(1, 5))).tolist()
        block = int(rng.integers(1, 11))
        for causal in (True, False):
            full = MaskSpec(causal=causal)
            blocked = MaskSpec(causal=causal, block_size=block)
            assert F.attention_pairs(lengths, causal=causal) == sum(
                _mask_pairs(n, n, full) for n in lengths
            )
            assert F.attention_pairs(lengths, causal=causal, block_size=block) == sum(
                _mask_pairs(n, n, blocked) for n in lengths
            )


def test_fractional_candidate_counts_give_the_expected_flops(micro):
    """A mean candidate count (the ablation bench passes ``(1 + max_candidates) / 2``)
    is the exact expectation, not truncated to an integer."""
    m, data = micro.model, micro.data
    lens = np.array([3, 9])
    half = F.model_flops(m, data, lens, [2.5, 2.5])
    low = F.model_flops(m, data, lens, [2, 2]).total_training
    high = F.model_flops(m, data, lens, [3, 3]).total_training
    assert half.total_training == pytest.approx((low + high) / 2, rel=1e-12)
    assert half.total_training > low


def test_fractional_history_lengths_raise_instead_of_truncating(micro):
    with pytest.raises(ValueError, match="whole numbers"):
        F.model_flops(micro.model, micro.data, [2.5, 3], [1, 1])
    with pytest.raises(ValueError, match="whole numbers"):
        F.attention_pairs([4.7], causal=True)
    with pytest.raises(ValueError, match="block_size"):
        F.attention_pairs([4], causal=True, block_size=-2)
    with pytest.raises(ValueError, match="non-negative"):
        F.model_flops(micro.model, micro.data, [2], [math.nan])
    # whole numbers in a float array are fine
    assert F.model_flops(micro.model, micro.data, np.array([2.0, 3.0]), [1, 2]) == (
        F.model_flops(micro.model, micro.data, [2, 3], [1, 2])
    )


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("NVIDIA L40", 181.05),  # was L4's 121: MFU overstated 1.5x
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA H200 NVL", 835.5),  # was the SXM 989.4
        ("NVIDIA H200", 989.4),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA H20", 148.0),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA RTX A1000 Laptop GPU", None),  # was the A100's 312
        ("AMD Instinct MI300X", 1307.4),
    ],
)
def test_peak_lookup_matches_whole_model_names(monkeypatch, name, want):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    assert F.peak_tflops("cuda")[0] == want


def test_step_records_and_mfu_follow_each_steps_batch_with_row_buckets(micro, tmp_path):
    """Pipelined (no callback) with row_buckets: each step's FLOPs are those of its own
    unpadded batch, the same as an unpipelined run without buckets; MFU divides the
    recorded rate by the peak, per step and over the run."""
    steps = 4

    def run(row_buckets, on_step, name):
        train = dataclasses.replace(micro.train, steps=steps, row_buckets=row_buckets)
        trainer = Trainer(
            dataclasses.replace(micro, train=train),
            out_dir=tmp_path / name,
            progress=False,
            on_step=on_step,
        )
        trainer.peak_tflops = 1e-3  # a CPU has none; any positive peak exercises MFU
        return trainer.fit(plot=False).metrics

    records = []
    plain = run(0, records.append, "plain")
    bucketed = run(4, None, "bucketed")
    data = SyntheticRecsysData(micro.data)
    batches = [data.batch(TRAIN, r.sample_ids.numpy()) for r in records]
    want = [F.batch_flops(micro.model, micro.data, b).total_training / 1e12 for b in batches]
    assert len(set(want)) == steps  # distinct per step: a shifted record would show
    assert any(bucket_rows(b.num_history_events, 4) > b.num_history_events for b in batches)
    for metrics in (plain, bucketed):
        hist = metrics["history"]
        assert hist["step_tflop"] == pytest.approx(want, rel=1e-12)
        for rate, mfu in zip(hist["tflops_per_gpu"], hist["mfu"]):
            assert mfu == pytest.approx(rate / 1e-3, rel=1e-12)
        summary = metrics["mfu"]
        assert summary["model_tflop_total"] == pytest.approx(sum(want), rel=1e-12)
        assert summary["mfu"] == pytest.approx(summary["tflops_per_gpu"] / 1e-3, rel=1e-12)
        assert summary["tflops_per_gpu"] == pytest.approx(
            sum(want) / metrics["train_time_s"], rel=1e-9
        )
