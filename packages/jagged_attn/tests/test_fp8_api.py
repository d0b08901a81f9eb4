"""The ``precision=`` option and :class:`FP8Config`: bad input, encoding, the optional
hyperrec-mxfp8 dependency."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.jagged_attn import (
    FP8Config,
    block_attention,
    gdpa,
    jagged_attention,
    quantize_qkv,
)
from hyperrec.jagged_attn.fp8 import resolve_precision
from hyperrec.testing.bad_inputs import case, check_case, documented_exceptions

T, V = TypeError, ValueError
H = 2
Q, K, VV = (torch.randn(6, H, 32) for _ in range(3))
OFF = torch.tensor([0, 2, 6])


def ja(**kw):
    return jagged_attention, dict(q=Q, k=K, v=VV, offsets=OFF, max_seqlen=4, backend="torch") | kw


def gd(**kw):
    args = dict(q=Q, k=K, v=VV, q_offsets=OFF, kv_offsets=OFF, max_seqlen_q=4, max_seqlen_kv=4,
                backend="torch")  # fmt: skip
    return gdpa, args | kw


def ba(**kw):
    return block_attention, dict(q=Q, k=K, v=VV, offsets=OFF, max_seqlen=4, backend="torch") | kw


def c(exc, match, built):
    fn, args = built
    return case(exc, match, fn, **args)


CASES = [
    c(V, "precision", ja(precision="fp16")),
    c(T, "precision", ja(precision=8)),
    c(T, "precision", gd(precision=None)),
    c(V, "precision", ba(precision="int8")),
    c(
        V,
        "FP8 kernels need q/k head_dim in [16, 256], got 8",
        ja(
            q=Q[..., :8].bfloat16(),
            k=K[..., :8].bfloat16(),
            v=VV.bfloat16(),
            precision="fp8",
            backend="triton",
        ),
    ),
    c(
        V,
        "v head_dim",
        gd(
            q=Q.bfloat16(),
            k=K.bfloat16(),
            v=torch.randn(6, H, 300).bfloat16(),
            precision="fp8",
            backend="triton",
        ),
    ),
    c(
        V, "multiple of 32", ja(q=torch.randn(6, H, 48), k=torch.randn(6, H, 48), precision="mxfp8")
    ),  # fmt: skip
    c(
        V,
        "power-of-two q/k head_dim",
        ja(q=torch.randn(6, H, 48), k=torch.randn(6, H, 48), precision=FP8Config(hadamard=True)),
    ),  # fmt: skip
    c(
        V,
        "backend='triton'",
        gd(q=Q.float(), k=K.float(), v=VV.float(), backend="triton", precision="fp8"),
    ),  # fmt: skip
    c(V, "precision", (quantize_qkv, dict(q=Q, k=K, v=VV, q_offsets=OFF, precision="bf16"))),
    c(V, "backend", (quantize_qkv, dict(q=Q, k=K, v=VV, q_offsets=OFF, backend="gpu"))),
    c(T, "q", (quantize_qkv, dict(q=[1.0], k=K, v=VV, q_offsets=OFF))),
    # FP8Config
    case(V, "format", FP8Config, format="fp4"),
    case(V, "block_q", FP8Config, block_q=3),
    case(T, "block_q", FP8Config, block_q=16.0),
    case(V, "block_kv", FP8Config, block_kv=16),
    case(V, "p_block", FP8Config, p_block=256),
    case(V, "block_kv must be a multiple of p_block", FP8Config, block_kv=64, p_block=128),
    case(V, "scale", FP8Config, scale="e8m0"),
    case(T, "hadamard", FP8Config, hadamard=1),
    case(V, "hadamard_seed", FP8Config, hadamard_seed=-1),
    case(V, "backward", FP8Config, backward="int8"),
    case(V, "backward", FP8Config, format="mxfp8", backward="e5m2"),
    case(V, "block_q applies to format='fp8' only", FP8Config, format="mxfp8", block_q=32),
    case(V, "scale applies", FP8Config, format="mxfp8", scale="pow2"),
]


@pytest.mark.parametrize("c", CASES, ids=[x.test_id for x in CASES])
def test_bad_input(c):
    err = check_case(c)
    assert type(err).__name__ in documented_exceptions(c.documented_by), c.test_id


def test_fp8_without_hyperrec_mxfp8(monkeypatch):
    """ "mxfp8" names the missing extra; "fp8" needs nothing beyond the base package."""
    monkeypatch.setitem(sys.modules, "hyperrec.mxfp8", None)
    with pytest.raises(ModuleNotFoundError, match=r"hyperrec-jagged-attn\[fp8\]"):
        jagged_attention(Q, K, VV, OFF, 4, backend="torch", precision="mxfp8")
    out = jagged_attention(Q, K, VV, OFF, 4, backend="torch", precision="fp8")
    assert out.shape == (6, H, 32) and torch.isfinite(out).all()
    assert "ModuleNotFoundError" in documented_exceptions(jagged_attention)


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(["fp8", "mxfp8"]),
    block_q=st.sampled_from([None, 1, 8, 128]),
    p_block=st.sampled_from([None, 32, 64]),
    scale=st.sampled_from([None, "pow2", "fp32"]),
    hadamard=st.sampled_from([None, False, True]),
    seed=st.integers(0, 2**31),
    backward=st.sampled_from(["bf16", "fp8"]),
)
def test_encode_round_trip(fmt, block_q, p_block, scale, hadamard, seed, backward):
    fp8 = fmt == "fp8"
    config = FP8Config(
        format=fmt,
        block_q=block_q if fp8 else None,
        p_block=p_block if fp8 else None,
        scale=scale if fp8 else None,
        hadamard=hadamard,
        hadamard_seed=seed,
        backward=backward,
    )
    assert FP8Config.decode(config.encode()) == config


def test_small_head_dims_run_the_emulation_under_auto():
    """Head dims below the kernels' 16 (the integration's tiny presets) are valid: "auto"
    takes the pure-PyTorch emulation."""
    q, k, v = (t[..., :8].clone() for t in (Q, K, VV))
    out = jagged_attention(q, k, v, OFF, 4, precision="fp8")
    assert out.shape == (6, H, 8) and torch.isfinite(out).all()


def test_resolved_defaults():
    assert resolve_precision("bf16") is None
    c = resolve_precision("fp8")
    assert (c.q_block, c.kv_block, c.tile_n, c.scale_rule) == (128, 128, 128, "pow2")
    assert c.rotates(128) and not c.rotates(96)
    m = resolve_precision("mxfp8")
    assert (m.q_block, m.kv_block, m.tile_n, m.scale_rule) == (1, 32, 32, "pow2")
    assert resolve_precision(FP8Config(hadamard=False)).rotates(128) is False
