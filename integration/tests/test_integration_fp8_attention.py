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


def test_fused_projection_equals_fp8_on_the_cpu(micro):
    """``fp8_fused``: the GDPA layers take Q/K/V quantized by their projection. On the CPU
    the projection is PyTorch's linear + SiLU and the attention's emulation quantizes the
    same Q/K/V, so outputs and gradients equal ``fp8``'s bit for bit; block (softmax)
    layers do not fuse."""
    preset = _preset(micro)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(32))
    torch.manual_seed(0)
    models = {p: GEMModel(preset.model, preset.data, attention_precision=p)
              for p in ("fp8", "fp8_fused")}  # fmt: skip
    models["fp8_fused"].load_state_dict(models["fp8"].state_dict())
    fused = [b.fuses_projection for b in models["fp8_fused"].seq_layers]
    assert fused == [b.block_size == 0 for b in models["fp8_fused"].seq_layers]
    assert any(fused) and not all(fused)
    assert not any(b.fuses_projection for b in models["fp8"].seq_layers)
    outs, grads = {}, {}
    for name, m in models.items():
        ctr, cvr = m(batch)
        outs[name] = ctr.detach()
        sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in m.seq_layers.parameters()])
    assert torch.equal(outs["fp8"], outs["fp8_fused"])
    assert torch.equal(grads["fp8"], grads["fp8_fused"])


def test_fused_projection_kernel_in_the_model(micro, monkeypatch):
    """The fused Triton projection (interpreter) inside the model: close to the unfused
    FP8 model (its GEMM sums in another order), finite gradients everywhere."""
    import functools

    from hyperrec.integration import model as model_module
    from hyperrec.jagged_attn import linear_quantize_qkv
    from hyperrec.jagged_attn._fp8.quantize import fp8_kernels_supported

    if not fp8_kernels_supported(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 (the Triton interpreter on the CPU)")
    calls = []

    def kernel(*args, **kw):
        calls.append(1)
        return functools.partial(linear_quantize_qkv, backend="triton")(*args, **kw)

    monkeypatch.setattr(model_module, "linear_quantize_qkv", kernel)
    preset = _preset(micro)
    batch = SyntheticRecsysData(preset.data).batch(TRAIN, np.arange(16))
    torch.manual_seed(0)
    ref = GEMModel(preset.model, preset.data, attention_precision="fp8")
    fused = GEMModel(preset.model, preset.data, attention_precision="fp8_fused")
    fused.load_state_dict(ref.state_dict())
    ctr_ref, _ = ref(batch)
    ctr, cvr = fused(batch)
    assert calls
    assert (ctr - ctr_ref).norm() / ctr_ref.norm() < 0.05
    sum(esmm_loss(ctr, cvr, batch.click, batch.conversion)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in fused.seq_layers.parameters())  # fmt: skip


def test_fused_projection_needs_regions_and_bf16_linears(micro):
    from hyperrec.integration.config import TrainConfig

    with pytest.raises(ValueError, match="fp8_fused' needs compile_scope='regions'"):
        TrainConfig(steps=1, global_batch_size=32, attention_precision="fp8_fused",
                    compile_scope="layers")  # fmt: skip
    with pytest.raises(ValueError, match="seq_linear_precision='bf16'"):
        TrainConfig(steps=1, global_batch_size=32, attention_precision="fp8_fused",
                    seq_linear_precision="fp8")  # fmt: skip
    preset = _preset(micro)
    with pytest.raises(ValueError, match="fp8_fused' needs compile_scope='regions'"):
        GEMModel(preset.model, preset.data, attention_precision="fp8_fused",
                 seq_linear_precision="fp8")  # fmt: skip
