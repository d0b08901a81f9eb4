"""Bucketed row counts (``row_buckets``): padding rows change no real output or gradient."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrec.integration import TRAIN, GEMModel, SyntheticRecsysData, esmm_loss
from hyperrec.integration.config import TrainConfig
from hyperrec.integration.model import _pad_sequences, bucket_rows


@pytest.mark.parametrize("per_octave", [1, 2, 4, 64])
def test_bucket_rows_bounds_the_padding_and_is_idempotent(per_octave):
    seen = set()
    for n in range(0, 5000):
        r = bucket_rows(n, per_octave)
        assert n <= r <= n + max(0, n // per_octave) or n <= per_octave and r == n
        assert bucket_rows(r, per_octave) == r
        seen.add(r)
    # few distinct sizes: per_octave per power of two (plus the small exact ones)
    assert len(seen) <= per_octave * 13 + per_octave + 1


def test_bucket_rows_off_and_bad_arguments():
    assert bucket_rows(12345, 0) == 12345
    assert bucket_rows(100_000, 64) == 100_352  # steps of 1,024 between 65,536 and 131,072
    for bad in (3, -2, 1.0, True):
        with pytest.raises(ValueError, match="per_octave"):
            bucket_rows(10, bad)
    with pytest.raises(ValueError, match="n must"):
        bucket_rows(-1, 4)


def test_pad_sequences_covers_the_rows_with_short_sequences():
    off = torch.tensor([0, 3, 3, 10])
    out, longest = _pad_sequences(off, 10, 31, longest=7, cap=100)
    assert out.tolist() == [0, 3, 3, 10, 31] and longest == 21  # one padding sequence
    # capped at 5, but never below the longest real sequence (7): three of <= 7
    out, longest = _pad_sequences(off, 10, 31, longest=7, cap=5)
    assert out.tolist() == [0, 3, 3, 10, 17, 24, 31] and longest == 7
    out, longest = _pad_sequences(off, 10, 10, longest=7, cap=5)
    assert out is off and longest == 7
    out, longest = _pad_sequences(torch.tensor([0, 0]), 0, 3, longest=0, cap=1)
    assert out.tolist() == [0, 0, 1, 2, 3] and longest == 1


def _pair(preset, per_octave):
    torch.manual_seed(0)
    plain = GEMModel(preset.model, preset.data)
    torch.manual_seed(0)
    padded = GEMModel(preset.model, preset.data, row_buckets=per_octave)
    padded.load_state_dict(plain.state_dict())
    return plain, padded


def _run(model, batch):
    ctr, cvr = model(batch)
    a, b = esmm_loss(ctr, cvr, batch.click, batch.conversion)
    (a + b).backward()
    return ctr.detach(), cvr.detach(), {n: p.grad for n, p in model.named_parameters()}


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    per_octave=st.sampled_from([1, 2, 8]),
    ids=st.lists(st.integers(0, 255), min_size=1, max_size=40, unique=True),
)
def test_padded_model_equals_the_unpadded_one(micro, micro_data, per_octave, ids):
    plain, padded = _pair(micro, per_octave)
    batch = micro_data.batch(TRAIN, np.array(ids))
    want = _run(plain, batch)
    got = _run(padded, batch)
    assert got[0].shape == want[0].shape == (batch.num_candidates,)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_padding_with_empty_histories_and_block_layers(micro_empty_block):
    preset = micro_empty_block
    data = SyntheticRecsysData(preset.data)
    batch = data.batch(TRAIN, np.arange(48))
    assert (batch.history_offsets.diff() == 0).any()
    plain, padded = _pair(preset, 2)
    want, got = _run(plain, batch), _run(padded, batch)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_row_buckets_config_checks():
    with pytest.raises(ValueError, match="row_buckets"):
        TrainConfig(steps=1, global_batch_size=32, row_buckets=3)
    with pytest.raises(TypeError, match="row_buckets"):
        TrainConfig(steps=1, global_batch_size=32, row_buckets=1.5)
    with pytest.raises(ValueError, match="row_buckets"):
        TrainConfig(steps=1, global_batch_size=32, row_buckets=-4)
    assert (
        TrainConfig(steps=1, global_batch_size=32, row_buckets=64, impl="naive").row_buckets == 64
    )  # no effect there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_model_equals_the_unpadded_one_on_the_gpu():
    """The Triton kernels (kv_index past the real sequences, padding sequences in the
    tower) under bf16 autocast: what the trainer runs."""
    from hyperrec.integration import get_preset

    preset = get_preset("tiny")
    data = SyntheticRecsysData(preset.data)
    batch = data.batch(TRAIN, np.arange(100)).to("cuda")
    for per_octave in (1, 4, 64):
        torch.manual_seed(0)
        with torch.device("cuda"):
            plain = GEMModel(preset.model, preset.data, validate=False)
            padded = GEMModel(preset.model, preset.data, validate=False, row_buckets=per_octave)
        padded.load_state_dict(plain.state_dict())
        runs = []
        for model in (plain, padded):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctr, cvr = model(batch)
            a, b = esmm_loss(ctr.float(), cvr.float(), batch.click, batch.conversion)
            (a + b).backward()
            runs.append(
                (ctr.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()})
            )
        torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-2, atol=1e-2)
        for name, g in runs[0][1].items():
            scale = g.abs().max().clamp_min(1e-30)
            assert ((runs[1][1][name] - g).abs().max() / scale).item() < 1e-2, name


def test_training_with_row_buckets_follows_the_unpadded_run(micro, tmp_path):
    """Through the trainer (BBS, AdamW, evaluation): the same losses and parameters
    within float32 rounding after 12 steps, and a resume may change row_buckets."""
    import dataclasses

    from hyperrec.integration import Trainer
    from hyperrec.integration.checkpoint import checkpoint_dir

    def preset(per_octave, steps=12):
        train = dataclasses.replace(
            micro.train, steps=steps, row_buckets=per_octave, ckpt_every=6, eval_every=0
        )
        return dataclasses.replace(micro, train=train)

    runs = {}
    for per_octave in (0, 2):
        trainer = Trainer(preset(per_octave), out_dir=tmp_path / str(per_octave), progress=False)
        runs[per_octave] = (trainer, trainer.fit(plot=False).metrics["history"]["loss"])
    np.testing.assert_allclose(runs[2][1], runs[0][1], rtol=1e-4, atol=1e-6)
    plain, padded = runs[0][0].model.state_dict(), runs[2][0].model.state_dict()
    for name, value in plain.items():
        torch.testing.assert_close(padded[name], value, rtol=1e-3, atol=1e-5, msg=name)
    # a cadence field: resuming the unpadded run's step-6 checkpoint with buckets is allowed
    resumed = Trainer(preset(2, steps=12), resume=checkpoint_dir(tmp_path / "0", 6),
                      out_dir=tmp_path / "r", progress=False)  # fmt: skip
    assert resumed.step == 6
