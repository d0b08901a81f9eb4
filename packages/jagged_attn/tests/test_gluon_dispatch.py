"""The opt-in dispatch of the experimental Gluon forward (``JAGGED_ATTN_GLUON=1``).

On the CPU: which calls it may serve, and that the launcher calls it only when asked and
eligible (its kernel is replaced by a stub there: Gluon has no interpreter). On an sm_90
GPU (``gpu``): the public API with the opt-in against the default Triton path, forward
and backward.
"""

from __future__ import annotations

import os

import pytest
import torch

from hyperrec.jagged_attn import AttentionSpec, MaskSpec, gdpa, jagged_attention
from hyperrec.jagged_attn._opschema import AttentionCall
from hyperrec.jagged_attn._triton import _launch
from hyperrec.jagged_attn._triton._launch import GLUON_ENV, gluon_unsupported

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _call(lens=(5, 0, 9), heads=2, dim=64, dim_v=None, dtype=torch.bfloat16, device="cpu",
          targets=None, kv_index=None, **spec):  # fmt: skip
    t = sum(lens)
    q, k = (torch.randn(t, heads, dim, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(t, heads, dim if dim_v is None else dim_v, dtype=dtype, device=device)
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    mask = spec.pop("mask", MaskSpec())
    s = AttentionSpec(scale=0.125, max_seqlen_q=max(lens), max_seqlen_kv=max(lens), mask=mask,
                      **spec)  # fmt: skip
    return AttentionCall(q=q, k=k, v=v, q_offsets=off, kv_offsets=off, kv_index=kv_index,
                         num_targets=targets, spec=s)  # fmt: skip


def test_eligible_calls():
    ok = (
        _call(),
        _call(dim=128, mask=MaskSpec(causal=True)),
        _call(dtype=torch.float16),
        _call(activation="silu", normalization="max_seqlen", mask=MaskSpec(causal=True)),
        _call(activation="silu"),
    )
    for call in ok:
        assert gluon_unsupported(call, check_device=False) is None


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(activation="gelu"), "activation"),
        (dict(activation="silu", normalization="length"), "normalization"),
        (dict(normalization="max_seqlen"), "normalization"),  # softmax
        (dict(mask=MaskSpec(causal=True, window_left=4)), "mask"),
        (dict(mask=MaskSpec(contextual_len=1)), "mask"),
        (dict(targets=torch.tensor([1, 0, 2])), "mask"),
        (dict(kv_index=torch.tensor([0, 1, 2])), "kv_index"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(dim=32), "head dims"),
        (dict(dim_v=128), "head dims"),
        (dict(lens=(0, 0)), "empty"),
    ],
)
def test_ineligible_calls(kwargs, reason):
    assert reason in gluon_unsupported(_call(**kwargs), check_device=False)


def test_ineligible_without_a_hopper_gpu():
    assert "device" in gluon_unsupported(_call())  # CPU tensors


needs_kernels = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


@needs_kernels
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("env", [None, "auto", "0", "1"])
def test_dispatch_follows_the_variable_and_the_default(env, default, packed, long, monkeypatch):
    # "1": every eligible call; "0": none; unset/"auto": GLUON_DEFAULT for calls longer
    # than GLUON_MIN_SEQLEN that the packed-rows forward does not take
    want = env == "1" or (env in (None, "auto") and default and not packed and long)
    calls = []

    def stub(call, schedule, *buffers):
        # the forward's 128-row query-tile schedule: lengths (5, 0, 9) make two tiles
        q32, kv32, tile_seq, tile_idx, total = schedule
        assert q32.dtype == torch.int32 and q32.tolist() == call.q_offsets.tolist()
        assert int(total) == 2 and sorted(tile_seq[:2].tolist()) == [0, 2]
        assert tile_idx[:2].tolist() == [0, 0]
        calls.append(call)
        return _launch.attention_forward(call, config=_launch._configs._heuristic(
            "fwd", "interpreter", call.q.shape[2]))  # fmt: skip

    monkeypatch.setattr(_launch, "gluon_eligible", lambda call: True)
    monkeypatch.setattr(_launch, "_gluon_forward", stub)
    monkeypatch.setattr(_launch, "_FWD_PLANS", {})
    monkeypatch.setattr(_launch, "GLUON_DEFAULT", default)
    monkeypatch.setattr(_launch, "GLUON_MIN_SEQLEN", 0 if long else 10**9)
    # the packed-rows forward has no interpreter entry in the shipped table: pin the sm_90
    # one, or none
    pinned = _launch._configs.packed_config("sm90", 64, 9) if packed else None
    assert pinned is not None or not packed
    monkeypatch.setattr(_launch._configs, "packed_config", lambda *a: pinned)
    if env is None:
        monkeypatch.delenv(GLUON_ENV, raising=False)
    else:
        monkeypatch.setenv(GLUON_ENV, env)
    call = _call()
    out, _ = _launch.attention_forward(call)
    assert len(calls) == int(want)
    # a pinned configuration (tests, tuning) always runs the Triton kernel
    _launch.attention_forward(call, config=_launch._configs._heuristic("fwd", "interpreter", 64))
    assert len(calls) == int(want)


# ----------------------------------------------------------------------------------------
# GPU: the public API with the opt-in, against the default path
# ----------------------------------------------------------------------------------------


def _gluon_gpu() -> bool:
    if not torch.cuda.is_available() or INTERPRET:
        return False
    from hyperrec.jagged_attn._gluon import gluon_supported

    return gluon_supported("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _gluon_gpu(), reason="needs sm_90 and the Triton of the Gluon API")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_public_api_with_gluon(causal, dim, monkeypatch):
    lens = [300, 0, 1, 129, 64, 513]
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, 4, dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    do = torch.randn(t, 4, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    results = {}
    for env in ("0", "1"):
        monkeypatch.setenv(GLUON_ENV, env)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = jagged_attention(*leaves, off, 513, causal=causal)
        grads = torch.autograd.grad(out, leaves, do)
        hstu = gdpa(q, k, v, off, off, 513, 513, causal=True, normalization="max_seqlen")
        results[env] = (out, *grads, hstu)
    for a, b in zip(results["0"], results["1"]):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_a_bad_variable_value_is_an_error(monkeypatch):
    monkeypatch.setenv(GLUON_ENV, "yes")
    with pytest.raises(ValueError, match="JAGGED_ATTN_GLUON must be 0, 1 or auto"):
        _launch.gluon_requested()
