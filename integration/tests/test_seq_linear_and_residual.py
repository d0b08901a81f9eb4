"""``train.seq_linear_precision`` (row-wise FP8 projections in the sequence layers; CPU:
FP8 GEMMs emulated from the same quantized operands) and ``train.residual_dtype``
(the residual stream in autocast's dtype)."""

import dataclasses

import numpy as np
import pytest
import torch

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, TrainConfig, esmm_loss


def _preset(micro):
    model = dict(seq_layers=2, block_attention_layers=1, attn_block_size=4, embedding_dim=8)
    return dataclasses.replace(micro, model=dataclasses.replace(micro.model, **model))


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.seq_layers.parameters()])


def _pair(preset, n, **kw):
    """A batch of ``n`` requests, a default model and one built with ``kw`` holding the
    same parameters."""
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(n))
    torch.manual_seed(0)
    ref = GEMModel(preset.model, preset.data)
    other = GEMModel(preset.model, preset.data, **kw)
    other.load_state_dict(ref.state_dict())
    return batch, ref, other


def _outputs_after_backward(models, batch):
    """Each model's CTR logits (detached) after one backward of the ESMM loss."""
    outs = {}
    for name, m in models.items():
        ctr, cvr = m(batch)
        outs[name] = ctr.detach()
        sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
    return outs


@pytest.mark.parametrize("compile_mode", ["off", "aot_eager"])
def test_fp8_linears_are_close_to_bf16_and_train(micro, compile_mode):
    preset = _preset(micro)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(32))
    torch.manual_seed(0)
    ref = GEMModel(preset.model, preset.data, compile=compile_mode)
    low = GEMModel(preset.model, preset.data, compile=compile_mode, seq_linear_precision="fp8")
    low.load_state_dict(ref.state_dict())
    assert all(b.linear_precision == "fp8" for b in low.seq_layers)
    outs = _outputs_after_backward({"ref": ref, "low": low}, batch)
    # The quantization changes the result (the path is really taken) but only a little.
    assert not torch.equal(outs["low"], outs["ref"])
    assert (outs["low"] - outs["ref"]).norm() / outs["ref"].norm() < 0.05
    g, g_ref = _grads(low), _grads(ref)
    assert torch.isfinite(g).all()
    assert (g - g_ref).norm() / g_ref.norm() < 0.1


def test_fp8_projection_keeps_its_dgrad_in_high_precision(micro, monkeypatch):
    """The input projection asks for an FP8 forward only; the output projection for both."""
    import hyperrec.integration.model as model_mod

    calls = []
    real = model_mod.rowwise_linear

    def spy(x, w, b=None, *, fp8_dgrad=True):
        calls.append((tuple(w.shape), fp8_dgrad))
        return real(x, w, b, fp8_dgrad=fp8_dgrad)

    monkeypatch.setattr(model_mod, "rowwise_linear", spy)
    preset = _preset(micro)
    d = preset.model.dim
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(8))
    GEMModel(preset.model, preset.data, seq_linear_precision="fp8")(batch)
    assert calls == [((4 * d, d), False), ((d, d), True)] * preset.model.seq_layers


def test_seq_linear_precision_checks(micro):
    preset = _preset(micro)
    with pytest.raises(ValueError, match="seq_linear_precision='fp8' needs impl='hyperrec'"):
        GEMModel(preset.model, preset.data, impl="naive", seq_linear_precision="fp8")
    model = GEMModel(preset.model, preset.data, seq_linear_precision="fp8")
    with pytest.raises(ValueError, match="runs its linears in bf16"):
        model.set_impl("naive")
    with pytest.raises(ValueError, match="seq_linear_precision must be one of"):
        GEMModel(preset.model, preset.data, seq_linear_precision="fp4")
    with pytest.raises(ValueError, match="TrainConfig.seq_linear_precision"):
        TrainConfig(steps=1, global_batch_size=8, impl="naive", seq_linear_precision="fp8")
    with pytest.raises(ValueError, match="TrainConfig.seq_linear_precision must be one of"):
        TrainConfig(steps=1, global_batch_size=8, seq_linear_precision="int8")
    odd = dataclasses.replace(preset.model, dim=24, heads=2)
    with pytest.raises(ValueError, match="needs dim divisible by 16"):
        GEMModel(odd, preset.data, seq_linear_precision="fp8")


def _tower_dtypes(model, batch, device_type="cpu"):
    seen = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        for layer in model.seq_layers
    ]
    with torch.autocast(device_type, dtype=torch.bfloat16):
        ctr, cvr = model(batch)
    for h in hooks:
        h.remove()
    return seen, ctr, cvr


def test_autocast_residual_is_bf16_and_close(micro):
    preset = _preset(micro)
    batch, ref, low = _pair(preset, 32, residual_dtype="autocast")
    ctr_ref, _ = ref(batch)  # float32 throughout, no autocast
    dt, ctr, cvr = _tower_dtypes(low, batch)
    assert dt == [torch.bfloat16] * preset.model.seq_layers
    # The default keeps it float32 under autocast on a CPU too (where autocast's layer
    # norms would return bf16).
    dt_ref, _, _ = _tower_dtypes(ref, batch)
    assert dt_ref == [torch.float32] * preset.model.seq_layers
    assert (ctr.float() - ctr_ref).norm() / ctr_ref.norm() < 0.05
    sum(esmm_loss(ctr.float(), cvr.float(), batch.click, batch.conversion)).backward()
    assert torch.isfinite(_grads(low)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_residual_float32_by_default_bf16_when_asked(micro):
    """CUDA autocast runs layer norms in float32, so the default residual is float32."""
    preset = _preset(micro)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(32)).to("cuda")
    torch.manual_seed(0)
    ref = GEMModel(preset.model, preset.data).cuda()
    low = GEMModel(preset.model, preset.data, residual_dtype="autocast").cuda()
    low.load_state_dict(ref.state_dict())
    dt_ref, ctr_ref, _ = _tower_dtypes(ref, batch, "cuda")
    dt, ctr, _ = _tower_dtypes(low, batch, "cuda")
    assert dt_ref == [torch.float32] * preset.model.seq_layers
    assert dt == [torch.bfloat16] * preset.model.seq_layers
    assert (ctr.float() - ctr_ref.float()).norm() / ctr_ref.float().norm() < 0.05


def test_residual_dtype_without_autocast_changes_nothing(micro):
    preset = _preset(micro)
    batch, ref, other = _pair(preset, 16, residual_dtype="autocast")
    assert torch.equal(ref(batch)[0], other(batch)[0])
    with pytest.raises(ValueError, match="residual_dtype must be one of"):
        GEMModel(preset.model, preset.data, residual_dtype="bf16")
    with pytest.raises(ValueError, match="TrainConfig.residual_dtype must be one of"):
        TrainConfig(steps=1, global_batch_size=8, residual_dtype="half")


@pytest.mark.parametrize("fp8", [False, True])
def test_layer_scope_compiles_the_same_function(micro, fp8):
    """compile_scope="layers": one graph per layer around the attention op; the same
    outputs and gradients as the two regions (aot_eager: no code generation)."""
    preset = _preset(micro)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(32))
    torch.manual_seed(0)
    kw = dict(compile="aot_eager", seq_linear_precision="fp8" if fp8 else "bf16")
    ref = GEMModel(preset.model, preset.data, **kw)
    whole = GEMModel(preset.model, preset.data, compile_scope="layers", **kw)
    whole.load_state_dict(ref.state_dict())
    assert all(b.compile_scope == "layers" for b in whole.seq_layers)
    outs = _outputs_after_backward({"ref": ref, "whole": whole}, batch)
    assert torch.allclose(outs["whole"], outs["ref"], rtol=1e-5, atol=1e-6)
    assert torch.allclose(_grads(whole), _grads(ref), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="compile_scope must be one of"):
        GEMModel(preset.model, preset.data, compile_scope="model")
