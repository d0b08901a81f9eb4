import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, esmm_loss, get_preset


def _model(preset, seed=0):
    torch.manual_seed(seed)
    return GEMModel(preset.model, preset.data)


def test_forward_shapes_and_gradients_reach_every_parameter(micro, micro_data):
    model = _model(micro)
    batch = micro_data.batch(TRAIN, np.arange(64))
    model.check_batch(batch)
    ctr, cvr = model(batch)
    assert ctr.shape == cvr.shape == (batch.num_candidates,)
    assert ctr.dtype == cvr.dtype == torch.float32
    assert torch.isfinite(ctr).all() and torch.isfinite(cvr).all()
    a, b = esmm_loss(ctr, cvr, batch.click, batch.conversion)
    (a + b).backward()
    missing = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert not missing, missing


def test_one_feature_groups_scale_leaves_the_others_alone(micro, micro_data):
    """Each feature group is normalized on its own before the cross layers: the PMA
    output grown 100x (Adam grows it fastest in a wide model) changes none of the other
    groups' normalized features. Under one LayerNorm over the concatenation it set every
    group's scale and squashed the candidate's own features (the 1,024-wide gem stopped
    learning)."""
    model = _model(micro).eval()
    assert model.pma is not None
    seen = []
    model.interaction.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    batch = micro_data.batch(TRAIN, np.arange(16))
    with torch.no_grad():
        model(batch)
        model.pma.out.weight.mul_(100.0)
        model.pma.out.bias.mul_(100.0)
        model(batch)
    before, after = seen
    d = micro.model.dim
    others = slice(0, before.shape[-1] - d)  # PMA's group is the last
    torch.testing.assert_close(after[:, others], before[:, others], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after[:, -d:], before[:, -d:])
    # the grown group is itself normalized: unit scale per row (default affine)
    assert torch.allclose(after[:, -d:].pow(2).mean(-1), torch.ones(len(after)), atol=1e-3)


def test_a_request_does_not_depend_on_its_batch(micro, micro_data):
    """Jagged ops must not leak across requests, and HSTU's 1/N uses the fixed cap."""
    model = _model(micro).eval()
    ids = np.array([3, 17, 40, 41, 99, 120])
    with torch.no_grad():
        together = model(micro_data.batch(TRAIN, ids))[0]
        alone = torch.cat([model(micro_data.batch(TRAIN, [i]))[0] for i in ids])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_empty_histories_and_block_attention(micro_empty_block):
    preset = micro_empty_block
    data = SyntheticRecsysData(preset.data)
    batch = data.batch(TRAIN, np.arange(48))
    assert (batch.history_offsets.diff() == 0).any()
    model = _model(preset)
    assert model.seq_layers[0].block_size == 4 and model.seq_layers[1].block_size == 0
    ctr, cvr = model(batch)
    a, b = esmm_loss(ctr, cvr, batch.click, batch.conversion)
    (a + b).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_minimal_model_without_sequence_tower_or_pma(micro, micro_data):
    preset = dataclasses.replace(
        micro, model=dataclasses.replace(micro.model, seq_layers=0, pma_queries=0, cross_layers=0)
    )
    model = _model(preset)
    assert model.pma is None and len(model.seq_layers) == 0
    ctr, _ = model(micro_data.batch(TRAIN, np.arange(8)))
    assert torch.isfinite(ctr).all()


def test_esmm_loss_matches_the_probability_formula():
    g = torch.Generator().manual_seed(0)
    ctr_logit, cvr_logit = torch.randn(200, generator=g) * 3, torch.randn(200, generator=g) * 3
    click = (torch.rand(200, generator=g) < 0.4).float()
    conv = click * (torch.rand(200, generator=g) < 0.5).float()
    a, b = esmm_loss(ctr_logit.double(), cvr_logit.double(), click.double(), conv.double())
    p_ctr, p_cvr = torch.sigmoid(ctr_logit.double()), torch.sigmoid(cvr_logit.double())
    torch.testing.assert_close(a, F.binary_cross_entropy(p_ctr, click.double(), reduction="sum"))
    torch.testing.assert_close(
        b, F.binary_cross_entropy(p_ctr * p_cvr, conv.double(), reduction="sum")
    )
    # Saturated logits stay finite.
    big = torch.tensor([40.0, -40.0])
    a, b = esmm_loss(big, big, torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert torch.isfinite(a) and torch.isfinite(b)


def test_check_batch_rejects_bad_data(micro, micro_data):
    model = _model(micro)
    batch = micro_data.batch(TRAIN, np.arange(8))
    items = batch.candidate_items.clone()
    items[0] = micro.data.num_items + 5
    with pytest.raises(ValueError, match="Batch.candidate_items"):
        model.check_batch(dataclasses.replace(batch, candidate_items=items))
    longer = dataclasses.replace(micro.data, max_seqlen=64)
    long_batch = SyntheticRecsysData(longer).batch(TRAIN, np.arange(400))
    with pytest.raises(ValueError, match="exceeds the model's DataSchema.max_seqlen"):
        model.check_batch(long_batch)
    with pytest.raises(TypeError, match="expected a Batch"):
        model.check_batch({"items": items})  # type: ignore[arg-type]


def test_model_rejects_wrong_config_types(micro):
    with pytest.raises(TypeError, match="ModelConfig"):
        GEMModel(micro.data, micro.model)  # type: ignore[arg-type]


def test_tiny_preset_uses_block_attention_then_gdpa():
    tiny = get_preset("tiny")
    with torch.device("meta"):
        model = GEMModel(tiny.model, tiny.data)
    sizes = [layer.block_size for layer in model.seq_layers]
    assert sizes == [tiny.model.attn_block_size] + [0] * (tiny.model.seq_layers - 1)


def test_forward_under_bf16_autocast(micro, micro_data):
    """The trainer runs CUDA models under bf16 autocast; the same mix on the CPU must work:
    learned PMA queries (fp32 parameters) meet bf16 keys from an autocast projection."""
    model = _model(micro)
    batch = micro_data.batch(TRAIN, np.arange(32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctr, cvr = model(batch)
    a, b = esmm_loss(ctr.float(), cvr.float(), batch.click, batch.conversion)
    (a + b).backward()
    assert torch.isfinite(ctr.float()).all() and torch.isfinite(cvr.float()).all()
    assert model.pma.queries.grad is not None and model.pma.queries.grad.abs().sum() > 0
