"""CPU tests of the Gluon forward's host side: argument checks, configuration, tile table.

The kernel itself needs an sm_90 GPU (``test_gluon_forward.py``); everything here runs
without one and without importing the kernel.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hyperrec.jagged_attn._gluon import (
    GluonConfig,
    default_config,
    gluon_supported,
    jagged_attention_fwd_gluon,
    shared_memory_bytes,
    unsupported_reason,
)
from hyperrec.jagged_attn._gluon import _launch as gluon_launch


def _inputs(lens=(5, 0, 9), heads=2, dim=64, dtype=torch.bfloat16):
    t = sum(lens)
    q, k, v = (torch.randn(t, heads, dim).to(dtype) for _ in range(3))
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, offsets, max(lens)


def test_cpu_tensors_are_rejected_with_the_reason():
    q, k, v, offsets, max_len = _inputs()
    assert not gluon_supported("cpu")
    assert "not a CUDA device" in unsupported_reason("cpu")
    with pytest.raises(ValueError, match="sm_90"):
        jagged_attention_fwd_gluon(q, k, v, offsets, max_len)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: {**a, "q": a["q"].float()}, TypeError, "q must be bfloat16 or float16"),
        (lambda a: {**a, "k": a["k"].half()}, TypeError, "k must have q's dtype"),
        (lambda a: {**a, "q": "q"}, TypeError, "q must be a torch.Tensor"),
        (lambda a: {**a, "v": a["v"][:, :, :32]}, ValueError, "k and v must be"),
        (lambda a: {**a, "q": a["q"][:, 0]}, ValueError, "q must be"),
        (lambda a: {**a, "max_seqlen": -1}, ValueError, "max_seqlen must be >= 0"),
        (lambda a: {**a, "max_seqlen": 9.0}, TypeError, "max_seqlen must be an int"),
        (lambda a: {**a, "offsets": a["offsets"].float()}, TypeError, "offsets must be int32"),
        (lambda a: {**a, "offsets": a["offsets"][None]}, ValueError, "offsets must be 1-D"),
        (lambda a: {**a, "causal": 1}, TypeError, "causal must be a bool"),
        (lambda a: {**a, "scale": math.nan}, ValueError, "scale must be finite"),
        (lambda a: {**a, "activation": "gelu"}, ValueError, "activation must be one of"),
        (
            lambda a: {**a, "normalization": "max_seqlen"},
            ValueError,
            "normalization must be 'none'",
        ),
        (
            lambda a: {**a, "max_seqlen_kv": 9},
            ValueError,
            "only meaningful together with kv_offsets",
        ),
        (lambda a: {**a, "kv_offsets": a["offsets"]}, ValueError, "max_seqlen_kv is required"),
        (
            lambda a: {**a, "kv_offsets": a["offsets"][:2], "max_seqlen_kv": 5},
            ValueError,
            "kv_offsets must have 4 entries",
        ),
        (lambda a: {**a, "config": {"block_n": 64}}, TypeError, "config must be a GluonConfig"),
        (
            lambda a: {**a, "q": a["q"][:-1]},
            ValueError,
            "without kv_offsets, k.shape\\[0\\] must equal q.shape\\[0\\]",
        ),
    ],
)
def test_bad_arguments_name_the_argument(change, error, match):
    q, k, v, offsets, max_len = _inputs()
    args = change(dict(q=q, k=k, v=v, offsets=offsets, max_seqlen=max_len))
    with pytest.raises(error, match=match):
        jagged_attention_fwd_gluon(**args)


def test_unsupported_head_dim():
    q, k, v, offsets, max_len = _inputs(dim=96)
    with pytest.raises(ValueError, match="head_dim\\) must be one of"):
        jagged_attention_fwd_gluon(q, k, v, offsets, max_len)


def test_config_checks_and_shared_memory():
    with pytest.raises(ValueError, match="block_n must be 64 or 128"):
        GluonConfig(block_n=96)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        GluonConfig(num_stages=0)
    with pytest.raises(TypeError, match="pingpong must be a bool"):
        GluonConfig(pingpong="yes")
    with pytest.raises(TypeError, match="num_stages must be an int"):
        GluonConfig(num_stages=2.0)
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        GluonConfig(dynamic=1)
    with pytest.raises(TypeError, match="overlap_pv must be a bool"):
        GluonConfig(overlap_pv=0)
    # the defaults fit Hopper's 227 KiB; three 128x128 stages at head dim 128 do not
    for d in (64, 128):
        assert shared_memory_bytes(d, default_config(d)) <= 232448 - 1024
    q, k, v, offsets, max_len = _inputs(dim=128)
    with pytest.raises(ValueError, match="shared memory"):
        jagged_attention_fwd_gluon(q, k, v, offsets, max_len, config=GluonConfig(num_stages=3))


def _table(lens, kv_lens=None, causal=False):
    qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ko = qo if kv_lens is None else torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    kv_max = max(kv_lens if kv_lens is not None else lens, default=0)
    schedule = gluon_launch._schedule(qo, ko, causal, int(qo[-1]), kv_max)
    return qo, ko, schedule


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the schedule is a Triton kernel"
)


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_lists_every_tile_once(causal):
    # the Gluon forward walks the package forward's 128-row query-tile schedule
    lens, kv_lens = [300, 0, 1, 128, 129, 700], [10, 5, 300, 128, 1000, 700]
    qo, ko, (q32, kv32, tile_seq, tile_idx, total) = _table(lens, kv_lens, causal)
    total = int(total)
    assert q32.tolist() == qo.tolist() and kv32.tolist() == ko.tolist()
    assert total == sum(math.ceil(x / 128) for x in lens)
    assert tile_seq.shape == (sum(lens) // 128 + len(lens),)
    got = sorted(zip(tile_seq[:total].tolist(), tile_idx[:total].tolist()))
    assert got == sorted((b, t) for b, n in enumerate(lens) for t in range(math.ceil(n / 128)))
    # the longest key range first
    assert kv_lens[int(tile_seq[0])] == 1000


@needs_interpreter
def test_schedule_cache_follows_the_offsets_object():
    qo = torch.tensor([0, 200, 300])
    a = gluon_launch._schedule(qo, qo, False, 300, 200)
    assert gluon_launch._schedule(qo, qo, False, 300, 200) is a
    assert gluon_launch._schedule(qo.clone(), qo, False, 300, 200) is not a
    qo[1] = 100  # in place: a new version, a new table
    b = gluon_launch._schedule(qo, qo, False, 300, 200)
    assert b is not a and not torch.equal(b[0], a[0])


@needs_interpreter
def test_schedule_empty_sequences_only():
    qo, ko, schedule = _table([0, 0, 0])
    assert int(schedule[-1]) == 0 and schedule[2].shape[0] >= 1


def test_dynamic_switch(monkeypatch):
    """``JAGGED_ATTN_GLUON_DYNAMIC``: unset or 1 keeps the configured order, 0 forces the
    fixed one, anything else names the variable."""
    monkeypatch.delenv(gluon_launch.DYNAMIC_ENV, raising=False)
    assert gluon_launch.dynamic_allowed()
    monkeypatch.setenv(gluon_launch.DYNAMIC_ENV, "0")
    assert not gluon_launch.dynamic_allowed()
    monkeypatch.setenv(gluon_launch.DYNAMIC_ENV, "yes")
    with pytest.raises(ValueError, match=gluon_launch.DYNAMIC_ENV):
        gluon_launch.dynamic_allowed()


def test_persistent_grid_and_work_buffer(monkeypatch):
    """One CTA per SM at most; the dynamic schedule's buffer is zeroed, sized for the item
    counter and four ring slots per CTA, and new at every launch; the switch at 0 passes
    the unused argument through."""
    monkeypatch.setattr(gluon_launch, "_num_sms", lambda device: 4)
    monkeypatch.delenv(gluon_launch.DYNAMIC_ENV, raising=False)
    unused = torch.empty(1, dtype=torch.int32)
    grid, work, dynamic = gluon_launch._persistent_grid(10, torch.device("cpu"), True, unused)
    assert grid == (4,) and dynamic and work.dtype == torch.int32
    assert work.shape == (1 + 4 * 4,) and not bool(work.any())
    assert gluon_launch._persistent_grid(10, torch.device("cpu"), True, unused)[1] is not work
    assert gluon_launch._persistent_grid(0, torch.device("cpu"), False, unused) == (
        (1,),
        unused,
        False,
    )
    monkeypatch.setenv(gluon_launch.DYNAMIC_ENV, "0")
    assert gluon_launch._persistent_grid(3, torch.device("cpu"), True, unused) == (
        (3,),
        unused,
        False,
    )
