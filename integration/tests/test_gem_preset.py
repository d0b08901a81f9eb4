"""The GEM-scale preset, the memory estimate behind its fit, and the speed switches' config."""

import dataclasses

import numpy as np
import pytest
import torch

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, get_preset, override
from hyperrec.integration.config import TrainConfig
from hyperrec.integration.model import activation_bytes_per_token, estimate_memory

H200_BYTES = 141e9


def test_gem_preset_is_production_shaped():
    p = get_preset("gem")
    m = p.model
    assert (m.dim, m.heads, m.head_dim) == (1024, 8, 128)
    assert m.seq_layers >= 12 and 4096 <= p.data.max_seqlen <= 8192
    assert GEMModel.interaction_width(m) >= 4096 and m.mlp_dims[0] >= 4096
    t = p.train
    assert (t.impl, t.fused_embeddings, t.compile, t.mlp_precision, t.optimizer_impl) == (
        "hyperrec",
        True,
        "inductor",
        "mxfp8",
        "fused",
    )
    assert t.data_workers > 0
    lengths = SyntheticRecsysData(p.data).history_lengths(TRAIN, np.arange(100_000))
    assert 600 < lengths.mean() < 1200 and lengths.max() == p.data.max_seqlen  # power law


def test_gem_fits_one_h200_with_its_batch():
    p = get_preset("gem")
    est = estimate_memory(p)
    assert est.embedding_parameters > 2e9 and est.optimizer_temporaries == 0  # fused AdamW
    # The mean step, with room for the allocator, the CUDA context and compile workspaces.
    assert est.total < 0.85 * H200_BYTES, est.total / 1e9
    # The heaviest of 300 steps of the length law still fits.
    data = SyntheticRecsysData(p.data)
    b = p.train.global_batch_size
    tokens = data.history_lengths(TRAIN, np.arange(300 * b)).reshape(300, b).sum(axis=1)
    worst = est.weights_grads_optimizer + tokens.max() * est.activation_bytes_per_token
    assert worst < 0.95 * H200_BYTES, worst / 1e9


def test_sharded_tables_shrink_the_state_estimate():
    """Sharded tables keep fp32 rows and one float of row-wise state per row: 4 bytes
    per element instead of AdamW's 16 (weights, gradients, two moments)."""
    p = get_preset("gem")
    dense, sharded = estimate_memory(p), estimate_memory(p, tables="sharded")
    m, d = p.model, p.data
    rows = d.num_items + d.num_topics + m.user_hash_size + d.num_topics
    elements = rows * m.table_dim
    assert sharded.parameters == dense.parameters
    want = dense.weights_grads_optimizer - 16 * elements + 4 * elements + 4 * rows
    assert sharded.weights_grads_optimizer == want
    assert sharded.weights_grads_optimizer < 0.3 * dense.weights_grads_optimizer
    assert sharded.activations == dense.activations
    half = estimate_memory(p, tables="sharded", world_size=2)
    assert half.weights_grads_optimizer == want // 2
    with pytest.raises(ValueError, match="tables must be one of"):
        estimate_memory(p, tables="hashed")


def _saved_bytes(model, batch):
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(storages.values())


@pytest.mark.parametrize(
    ("embedding_dim", "pma", "fused"), [(0, 2, False), (8, 2, True), (8, 0, False), (0, 0, True)]
)
def test_activation_estimate_equals_the_saved_tensors(micro, embedding_dim, pma, fused):
    """Bytes saved for backward per history token, measured with saved-tensor hooks (the
    slope between two history lengths, so parameters and the candidate side cancel), equal
    the estimate's formula. Measured without autocast (element_bytes=4; CPU autocast runs
    norms in bf16, unlike CUDA's, so the bf16 branch is the GPU run's to confirm)."""
    cfg = dataclasses.replace(
        micro.model,
        dim=32,
        heads=2,
        seq_layers=3,
        block_attention_layers=1,
        attn_block_size=8,
        embedding_dim=embedding_dim,
        pma_queries=pma,
    )
    points = []
    for length in (24, 48):
        data = dataclasses.replace(micro.data, min_seqlen=length, max_seqlen=64, seqlen_scale=0.0)
        torch.manual_seed(0)
        model = GEMModel(cfg, data, fused_embeddings=fused)
        batch = SyntheticRecsysData(data).batch(TRAIN, np.arange(32))
        points.append((batch.num_history_events, _saved_bytes(model, batch)))
    slope = (points[1][1] - points[0][1]) / (points[1][0] - points[0][0])
    assert slope == activation_bytes_per_token(cfg, element_bytes=4, fused_embeddings=fused)


def test_speed_switches_validate_and_unavailable_ones_say_so(micro):
    p = override(micro, ["train.impl=naive", "train.compile=aot_eager", "train.data_workers=2"])
    assert (p.train.impl, p.train.compile, p.train.data_workers) == ("naive", "aot_eager", 2)
    assert TrainConfig(steps=1, global_batch_size=32, attention_precision="fp8")
    with pytest.raises(ValueError, match="attention_precision='fp8' needs impl='hyperrec'"):
        TrainConfig(steps=1, global_batch_size=32, attention_precision="fp8", impl="naive")
    with pytest.raises(ValueError, match="TrainConfig.impl must be one of"):
        TrainConfig(steps=1, global_batch_size=32, impl="fast")
    with pytest.raises(ValueError, match="TrainConfig.mlp_precision must be one of"):
        TrainConfig(steps=1, global_batch_size=32, mlp_precision="fp4")
    with pytest.raises(TypeError, match="fused_embeddings must be a bool"):
        TrainConfig(steps=1, global_batch_size=32, fused_embeddings=1)
    with pytest.raises(ValueError, match="data_workers must be >= 0"):
        TrainConfig(steps=1, global_batch_size=32, data_workers=-1)
    with pytest.raises(ValueError, match="element_bytes"):
        activation_bytes_per_token(micro.model, element_bytes=3)
    with pytest.raises(ValueError, match="impl must be one of"):
        GEMModel(micro.model, micro.data, impl="padded")
