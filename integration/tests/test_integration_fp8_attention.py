"""``train.attention_precision``: the sequence tower's attention through jagged_attn's FP8
path (CPU: its pure-PyTorch emulation of the same quantization)."""

import dataclasses

import numpy as np
import pytest
import torch

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, esmm_loss


def _preset(micro, head_dim=None):
    model = dict(seq_layers=2, block_attention_layers=1, attn_block_size=4, embedding_dim=8)
    if head_dim is not None:  # MX blocks are 32 wide along the head dim
        model["dim"] = micro.model.heads * head_dim
    return dataclasses.replace(micro, model=dataclasses.replace(micro.model, **model))


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "fp8_bwd"])
def test_fp8_attention_is_close_to_bf16_and_trains(micro, precision):
    preset = _preset(micro, head_dim=32 if precision == "mxfp8" else None)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(32))
    torch.manual_seed(0)
    ref = GEMModel(preset.model, preset.data)
    low = GEMModel(preset.model, preset.data, attention_precision=precision)
    low.load_state_dict(ref.state_dict())
    assert all(b.precision == precision for b in low.seq_layers)
    ctr_ref, _ = ref(batch)
    ctr, cvr = low(batch)
    # The quantization changes the result (the path is really taken) but only a little.
    assert not torch.equal(ctr, ctr_ref)
    err = (ctr - ctr_ref).norm() / ctr_ref.norm()
    assert err < 0.05, err
    sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
    grads = [p.grad for p in low.seq_layers.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_fp8_backward_changes_only_the_gradients(micro):
    """``fp8_bwd``: the same FP8 forward as ``fp8`` (equal outputs), FP8 operands in the
    attention backward (different, close gradients)."""
    preset = _preset(micro)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(32))
    torch.manual_seed(0)
    models = {p: GEMModel(preset.model, preset.data, attention_precision=p)
              for p in ("fp8", "fp8_bwd")}  # fmt: skip
    models["fp8_bwd"].load_state_dict(models["fp8"].state_dict())
    grads = {}
    outs = {}
    for name, m in models.items():
        ctr, cvr = m(batch)
        outs[name] = ctr.detach()
        sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in m.seq_layers.parameters()])
    assert torch.equal(outs["fp8"], outs["fp8_bwd"])
    a, b = grads["fp8_bwd"], grads["fp8"]
    assert not torch.equal(a, b)
    assert (a - b).norm() / b.norm() < 0.2


def test_low_precision_attention_needs_the_jagged_kernels(micro):
    preset = _preset(micro)
    with pytest.raises(ValueError, match="attention_precision='fp8' needs impl='hyperrec'"):
        GEMModel(preset.model, preset.data, impl="naive", attention_precision="fp8")
    model = GEMModel(preset.model, preset.data, attention_precision="fp8")
    with pytest.raises(ValueError, match="naive attention has no low-precision path"):
        model.set_impl("naive")
    with pytest.raises(ValueError, match="attention_precision must be one of"):
        GEMModel(preset.model, preset.data, attention_precision="fp4")
