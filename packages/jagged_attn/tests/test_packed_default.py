"""The packed-rows forward as the Hopper default for batches of short sequences
(``_configs.PACKED``, ``PACK_ROWS_MAX_LEN``): which calls take it, and that they compute
what the reference does. The interpreter stands in for an sm90 GPU (the table is keyed by
architecture), so the decision and the kernel both run on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from hyperrec.jagged_attn import gdpa, jagged_attention
from hyperrec.jagged_attn._triton import _configs, _launch

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture
def as_sm90(monkeypatch):
    """Plans built as on an H200; counts packed launches."""
    monkeypatch.setattr(_launch, "_arch", lambda device: "sm90")
    monkeypatch.setattr(_launch, "_FWD_PLANS", {})
    monkeypatch.setattr(_launch, "_BWD_PLANS", {})
    calls = []
    real = _launch._forward_packed

    def spy(call, cfg, *rest):
        calls.append(cfg)
        return real(call, cfg, *rest)

    monkeypatch.setattr(_launch, "_forward_packed", spy)
    return calls


def _batch(lens, heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    t = int(off[-1])
    q, k, v = (torch.randn(t, heads, dim, generator=g).to(torch.bfloat16) for _ in range(3))
    return q, k, v, off


def _reference(q, k, v, off, max_len, **kw):
    return jagged_attention(q.double(), k.double(), v.double(), off, max_len, backend="torch",
                            validate=False, **kw)  # fmt: skip


def test_packed_config_selection():
    assert _configs.packed_config("sm90", 128, 64).pack_rows
    assert _configs.packed_config("sm90", 64, 1).pack_rows
    assert _configs.packed_config("sm90", 100, 64).pack_rows  # padded to 128
    assert _configs.packed_config("sm90", 128, 65) is None  # longer sequences
    assert _configs.packed_config("sm90", 256, 64) is None  # no entry
    assert _configs.packed_config("default", 128, 64) is None  # only measured on Hopper
    assert _configs.packed_config("interpreter", 128, 64) is None


@pytest.mark.parametrize("causal", [False, True])
def test_short_self_attention_takes_the_packed_forward(as_sm90, causal):
    lens = [5, 0, 64, 1, 33, 17, 64, 2]
    q, k, v, off = _batch(lens)
    for t in (q, k, v):
        t.requires_grad_()
    out = jagged_attention(q, k, v, off, 64, causal=causal, backend="triton")
    assert len(as_sm90) == 1 and as_sm90[0].pack_rows and as_sm90[0].block_m == 64
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _reference(qd, kd, vd, off, 64, causal=causal)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    do = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), do.to(out.dtype))
    ref = torch.autograd.grad(want, (qd, kd, vd), do)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, atol=3e-2, rtol=3e-2)


def test_hstu_activation_is_packed_too(as_sm90):
    q, k, v, off = _batch([9, 30, 0, 12])
    out = gdpa(q, k, v, off, off, 30, 30, causal=True, activation="silu",
               normalization="max_seqlen", backend="triton")  # fmt: skip
    want = gdpa(q.double(), k.double(), v.double(), off, off, 30, 30, causal=True,
                activation="silu", normalization="max_seqlen", backend="torch",
                validate=False)  # fmt: skip
    assert len(as_sm90) == 1
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "case",
    ["longer", "cross", "window", "targets"],
)
def test_other_calls_keep_the_tile_per_sequence_forward(as_sm90, case):
    lens = [5, 20, 9]
    q, k, v, off = _batch(lens)
    if case == "longer":  # a cap above PACK_ROWS_MAX_LEN, even though the batch is short
        out = jagged_attention(q, k, v, off, 65, backend="triton")
        want = _reference(q, k, v, off, 65)
    elif case == "cross":  # keys of other lengths
        kv_off = torch.tensor([0, 3, 20, 34])
        kk, vv = k[:34], v[:34]
        out = jagged_attention(q, kk, vv, off, 20, kv_offsets=kv_off, max_seqlen_kv=17,
                               backend="triton")  # fmt: skip
        want = jagged_attention(q.double(), kk.double(), vv.double(), off, 20,
                                kv_offsets=kv_off, max_seqlen_kv=17, backend="torch",
                                validate=False)  # fmt: skip
    elif case == "window":
        out = jagged_attention(q, k, v, off, 20, window_size=(4, 0), backend="triton")
        want = _reference(q, k, v, off, 20, window_size=(4, 0))
    else:
        nt = torch.tensor([1, 3, 0])
        out = gdpa(q, k, v, off, off, 20, 20, causal=True, num_targets=nt, backend="triton")
        want = gdpa(q.double(), k.double(), v.double(), off, off, 20, 20, causal=True,
                    num_targets=nt, backend="torch", validate=False)  # fmt: skip
    assert as_sm90 == []
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_gpu_check_script_runs_as_sm90(tmp_path):
    """``bench/check_packed_default.py`` (the H200 check of this default) in its smoke
    mode: a subprocess, because it patches the launcher module for the whole run."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "check_packed_default.py"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "packed_default_check_smoke.json").read_text())
    assert result["cases"] == 8 and result["fails"] == 0
    assert all(row["packed_taken"] for row in result["rows"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_non_finite_value_stays_in_its_sequence(as_sm90, bad, activation, causal):
    """A non-finite V row of one sequence reached every sequence of its 64-row span
    (0 * NaN in the P V product over the span's keys; an audit found it). Outputs and
    gradients of the other sequences must stay finite and equal the reference."""
    lens = [5, 7, 3, 9]
    q, k, v, off = _batch(lens)
    v[8, 1] = bad  # sequence 1, head 1
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=causal, activation=activation, backend="triton")
    out = gdpa(*leaves, off, off, 9, 9, **kw)
    assert len(as_sm90) == 1 and as_sm90[0].pack_rows
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = gdpa(*ref_leaves, off, off, 9, 9, causal=causal, activation=activation,
                backend="torch", validate=False)  # fmt: skip
    ref_grads = torch.autograd.grad(want, ref_leaves, torch.ones_like(want))
    other = torch.ones(off[-1], dtype=torch.bool)
    other[off[1] : off[2]] = False
    for got, ref in zip((out, *grads), (want, *ref_grads)):
        assert torch.isfinite(got[other]).all()
        torch.testing.assert_close(got[other].double(), ref[other], atol=3e-2, rtol=3e-2)
    # in its own sequence the value shows, as in the reference
    assert not torch.isfinite(out[off[1] : off[2], 1]).all()


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_non_finite_value_changes_no_bit_of_other_sequences(as_sm90, activation, causal):
    """The packed forward runs each tile's plain loop and redoes the guarded one only when
    the tile's result is not finite (0.2.25; 0.2.23 reduced V before the launch): the
    other sequences' outputs must equal, bit for bit, those of the same batch with the bad
    value replaced by zero, in the bad value's span and in the spans without it."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 12, (40,), generator=g).tolist()  # several 64-row spans
    lens[3] = 6
    q, k, v, off = _batch(lens)
    row = int(off[3]) + 2
    kw = dict(causal=causal, activation=activation, backend="triton")
    clean = v.clone()
    clean[row, 1] = 0.0
    v[row, 1] = float("nan")
    max_len = max(lens)
    got = gdpa(q, k, v, off, off, max_len, max_len, **kw)
    want = gdpa(q, k, clean, off, off, max_len, max_len, **kw)
    assert all(c.pack_rows for c in as_sm90)
    other = torch.ones(int(off[-1]), dtype=torch.bool)
    other[off[3] : off[4]] = False
    assert torch.equal(got[other], want[other])
    assert not torch.isfinite(got[off[3] : off[4], 1]).all()
    assert torch.isfinite(got[off[3] : off[4], 0]).all()  # other heads untouched
