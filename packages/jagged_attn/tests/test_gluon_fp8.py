"""The Gluon FP8 forward (``_gluon/_fp8_kernel.py``) on an sm_90 GPU against the FP8
specification (``gpu`` tests), and its dispatch on the CPU.

GPU: every call goes through the package's FP8 launcher with ``JAGGED_ATTN_GLUON_FP8=1``
and a spy that fails the test unless the Gluon launcher ran. The checks are
``test_fp8_attention.check``'s (the same quantized operands, the specification in
float64; FP8 tensor-core bounds), over the mask x length matrix the kernel serves (causal
or not x Lq = Lk, Lq < Lk, Lq > Lk x jagged lengths with empty sequences and partial
tiles x softmax / SiLU x head dim 64 / 128), plus: a NaN or uninitialised padding in a
neighbouring sequence never reaches another sequence's output, and the Gluon and Triton
FP8 forwards agree with each other as closely as each agrees with the specification.

CPU: the quantizer's V layout in the kernel's token order (interpreter), which calls
the Gluon FP8 forward takes (``gluon_fp8_unsupported``) and that the
launcher calls it only when asked and eligible (the launcher replaced by a stub: Gluon
has no interpreter).
"""

from __future__ import annotations

import pytest
import torch
from kernel_check import Case, build, call_of, kernels_available

from hyperrec.jagged_attn import FP8Config, reference_fp8
from hyperrec.jagged_attn._triton import _fp8_launch
from hyperrec.jagged_attn._triton._fp8_launch import GLUON_FP8_ENV, gluon_fp8_unsupported

pytest.importorskip("hyperrec.mxfp8")


def _gpu_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from hyperrec.jagged_attn._gluon import gluon_supported

    return gluon_supported("cuda")


needs_gluon = pytest.mark.skipif(not _gpu_ok(), reason="needs sm_90 + Triton 3.6 (Gluon)")


@pytest.fixture
def gluon_runs(monkeypatch):
    """Force the Gluon FP8 forward and count its launches."""
    from hyperrec.jagged_attn._gluon import _fp8_launch as gluon_fp8

    monkeypatch.setenv(GLUON_FP8_ENV, "1")
    calls: list[int] = []
    real = gluon_fp8.run

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_fp8, "run", spy)
    return calls


def _lens(n: int, max_len: int, seed: int, zero: bool = True) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n,), generator=g)
    lens[0] = max_len
    if zero:
        lens[n // 2] = 0
    return tuple(lens.tolist())


CROSS = {
    "equal": (None, 0),
    "q_shorter": ("q", 1),  # Lq < Lk
    "q_longer": ("k", 2),  # Lq > Lk
}


def _case(cross: str, causal: bool, head_dim: int, act: str, dtype=torch.bfloat16) -> Case:
    q_lens = _lens(9, 700, 11)
    kv_lens = None
    shorter, seed = CROSS[cross]
    if shorter is not None:
        other = _lens(9, 700, 20 + seed, zero=False)
        # shorten one side per sequence (sequence 4 stays empty on the query side)
        pairs = [(min(a, b), max(a, b)) for a, b in zip(q_lens, other)]
        if shorter == "q":
            q_lens, kv_lens = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
        else:
            q_lens, kv_lens = tuple(p[1] for p in pairs), tuple(p[0] for p in pairs)
    spec = dict(activation="silu", normalization="max_seqlen") if act == "silu" else {}
    return Case(q_lens, kv_lens=kv_lens, heads=3, head_dim=head_dim, dtype=dtype, spec=spec,
                mask=dict(causal=causal))  # fmt: skip


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cross", list(CROSS))
def test_gluon_fp8_matrix(gluon_runs, cross, causal, head_dim, act):
    import test_fp8_attention as t8

    t8.check(_case(cross, causal, head_dim, act), FP8Config())
    assert gluon_runs, "the Gluon FP8 forward did not run"


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_fp8_schedule_variants_change_no_bit(gluon_runs, monkeypatch, causal, act):
    """``GluonFP8Config.overlap_pv`` moves only where ptxas waits for ``P V``, the row-max
    tree only the order of exact maxima: the same bytes with and without either."""
    import functools

    import test_fp8_attention as t8

    from hyperrec.jagged_attn._gluon import _fp8_launch as gluon_fp8
    from hyperrec.jagged_attn._gluon import _launch as gluon_launch

    case = _case("q_shorter", causal, 128, act)
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 0)
    real = gluon_fp8.GluonFP8Config
    runs = []
    for overlap, tree in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(gluon_fp8, "GluonFP8Config",
                            functools.partial(real, overlap_pv=overlap))  # fmt: skip
        monkeypatch.setattr(gluon_launch, "ROW_MAX_TREE", tree)
        runs.append(t8._forward(q, k, v, qo, ko, kvi, nt, spec, FP8Config()))
    assert len(gluon_runs) == 3
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0])
        if act == "softmax":
            assert torch.equal(lse, runs[0][1])


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize(
    "config",
    [FP8Config(hadamard=False, scale="fp32", block_q=1), FP8Config(smooth_k=False),
     FP8Config(block_kv=256)],
    ids=["fp32-scales-per-token-q", "no-smoothing", "kv-block-256"],
)  # fmt: skip
def test_gluon_fp8_configs(gluon_runs, config):
    import test_fp8_attention as t8

    t8.check(_case("equal", True, 128, "softmax", dtype=torch.float16), config)
    assert gluon_runs


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("where", ["k", "v"])
def test_gluon_fp8_nan_stays_in_its_sequence(gluon_runs, where):
    """A NaN in the middle sequence's K or V reaches only that sequence's outputs (the
    first sequence's last value tile reads the padding and the next sequence's columns)."""
    from test_fp8_attention import _forward

    q, k, v, _, qo, ko, kvi, nt, spec = build(Case((200, 300, 150), heads=2, head_dim=128), 0)
    clean, _ = _forward(q, k, v, qo, ko, kvi, nt, spec, FP8Config())
    (k if where == "k" else v)[200, 1, 3] = float("nan")
    out, _ = _forward(q, k, v, qo, ko, kvi, nt, spec, FP8Config())
    assert torch.isnan(out[200:500]).any()
    assert torch.equal(out[:200], clean[:200]) and torch.equal(out[500:], clean[500:])
    assert gluon_runs


@pytest.mark.gpu
@needs_gluon
def test_gluon_fp8_agrees_with_triton(monkeypatch):
    """The two FP8 forwards: their difference is within the FP8 tensor cores' accumulation
    noise (a small fraction of the specification's own error), and the LSEs agree."""
    from test_fp8_attention import _forward

    case = _case("q_shorter", True, 128, "softmax")
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 3)
    monkeypatch.setenv(GLUON_FP8_ENV, "0")
    tri, tri_lse = _forward(q, k, v, qo, ko, kvi, nt, spec, FP8Config())
    monkeypatch.setenv(GLUON_FP8_ENV, "1")
    glu, glu_lse = _forward(q, k, v, qo, ko, kvi, nt, spec, FP8Config())
    args = (q.double(), k.double(), v.double(), qo, ko, spec)
    spec_out = reference_fp8.attention_forward(*args, FP8Config())
    from hyperrec.jagged_attn import reference

    exact = reference.attention_forward(*args)
    quant = (spec_out - exact).pow(2).mean().sqrt().item()
    dev = (glu.double() - tri.double()).pow(2).mean().sqrt().item()
    assert dev <= 0.3 * quant, (dev, quant)
    fin = torch.isfinite(tri_lse)
    assert torch.equal(fin, torch.isfinite(glu_lse))
    assert torch.allclose(glu_lse[fin], tri_lse[fin], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@needs_gluon
def test_gpu_default_silu_takes_gluon(monkeypatch):
    """Non-causal HSTU SiLU through the public ``gdpa`` (the default's last addition,
    0.2.21): the default takes the Gluon FP8 forward, whose output agrees with the Triton
    FP8 forward's within a small fraction of the specification's own FP8 error."""
    import hyperrec.jagged_attn as ja
    from hyperrec.jagged_attn import reference

    monkeypatch.delenv(GLUON_FP8_ENV, raising=False)
    case = Case((700, 0, 333, 1024), heads=2, head_dim=128,
                spec=dict(activation="silu", normalization="max_seqlen"))  # fmt: skip
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 5)
    call = call_of(q, k, v, qo, ko, kvi, nt, spec)
    assert _fp8_launch._use_gluon_fp8(call, FP8Config(), None, spec.scale, True)

    def run():
        return ja.gdpa(q, k, v, qo, ko, 1024, 1024, activation="silu",
                       normalization="max_seqlen", precision="fp8")  # fmt: skip

    glu = run()
    monkeypatch.setenv(GLUON_FP8_ENV, "0")
    tri = run()
    args = (q.double(), k.double(), v.double(), qo, ko, spec)
    spec_out = reference_fp8.attention_forward(*args, FP8Config())
    quant = (spec_out - reference.attention_forward(*args)).pow(2).mean().sqrt().item()
    dev = (glu.double() - tri.double()).pow(2).mean().sqrt().item()
    assert dev <= 0.3 * quant, (dev, quant)
    assert torch.isfinite(glu).all()


# ----------------------------------------------------------------------------------------
# CPU: V in the Gluon kernel's token order, eligibility and dispatch
# ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not kernels_available(), reason="needs CUDA or the interpreter")
@pytest.mark.parametrize("head_dim", [32, 64])
def test_quantizer_mma_order(head_dim):
    """``v_mma_order=True`` stores the same E4M3 bytes at ``mma_column`` positions (tokens
    past a sequence's end in a partial group of 16 stay unwritten), Q/K/scales unchanged;
    the specification's dequantization reads either layout to the same values."""
    from hyperrec.jagged_attn._triton._fp8_launch import quantize_qkv
    from hyperrec.jagged_attn.fp8 import mma_column

    lens = (37, 0, 130, 16, 1, 200)
    q, k, v, _, qo, ko, _, _, _ = build(Case(lens, heads=2, head_dim=head_dim), 0)
    config = FP8Config(hadamard=False)
    plain = quantize_qkv(q, k, v, qo, ko, config)
    perm = quantize_qkv(q, k, v, qo, ko, config, v_mma_order=True)
    assert perm.v.mma_order and not plain.v.mma_order
    for name in "qk":
        a, b = getattr(plain, name), getattr(perm, name)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
    assert torch.equal(plain.v.scale, perm.v.scale)
    seq, pos = reference_fp8._positions(ko, k.shape[0])
    base = plain.v.pad_offsets.long()[seq]
    got = perm.v.data.view(torch.uint8)[:, :, base + mma_column(pos)]
    want = plain.v.data.view(torch.uint8)[:, :, base + pos]
    assert torch.equal(got, want)
    assert not torch.equal(mma_column(pos), pos)  # the order differs
    a = reference_fp8.dequantize(plain.v, config, ko, k.shape[0])
    b = reference_fp8.dequantize(perm.v, config, ko, k.shape[0])
    assert torch.equal(a, b)


def test_mma_column_is_a_permutation_of_each_group():
    from hyperrec.jagged_attn.fp8 import mma_column

    pos = torch.arange(64)
    col = mma_column(pos)
    assert torch.equal(col.sort().values, pos)
    assert torch.equal(col // 16, pos // 16)
    # thread t of a quad holds columns 2t, 2t+1, 8+2t, 9+2t of the scores: those tokens
    # land on the 4 consecutive columns 4t..4t+3 of its P V operand
    for t in range(4):
        held = [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]
        assert col[held].tolist() == list(range(4 * t, 4 * t + 4))


def _call(**kw):
    case = Case((5, 0, 9), heads=2, head_dim=kw.pop("head_dim", 64), **kw)
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 0, device="cpu")
    return call_of(q, k, v, qo, ko, kvi, nt, spec)


def test_eligibility():
    call = _call()
    assert gluon_fp8_unsupported(call, FP8Config(), None, 0.1, check_device=False) is None
    silu = _call(spec=dict(activation="silu"))
    assert gluon_fp8_unsupported(silu, FP8Config(), None, 0.1, check_device=False) is None
    why = gluon_fp8_unsupported(silu, FP8Config(), None, 0.1, False, check_device=False)
    assert "fast_math" in why
    for config, reason in (
        (FP8Config(format="mxfp8"), "mxfp8"),
        (FP8Config(p_block=64, block_kv=128), "P tiles"),
    ):
        assert reason in gluon_fp8_unsupported(call, config, None, 0.1, check_device=False)
    assert "scale" in gluon_fp8_unsupported(call, FP8Config(), None, -0.1, check_device=False)
    window = _call(mask=dict(window_left=4))
    assert "mask" in gluon_fp8_unsupported(window, FP8Config(), None, 0.1, check_device=False)
    # the unquantized inputs' layout does not matter (the kernel reads quantized copies)
    strided = call_of(*(t[:, :1] for t in (call.q, call.k, call.v)), call.q_offsets,
                      call.kv_offsets, None, None, call.spec)  # fmt: skip
    assert gluon_fp8_unsupported(strided, FP8Config(), None, 0.1, check_device=False) is None
    assert "device" in gluon_fp8_unsupported(call, FP8Config(), None, 0.1)  # CPU tensors


@pytest.mark.parametrize("env", [None, "auto", "0", "1", "yes"])
@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_dispatch(monkeypatch, env, default, long, causal, activation):
    """The launcher takes the Gluon FP8 forward iff asked (or by default for long calls,
    since 0.2.21 whatever the mask and activation) and eligible; an invalid switch value is
    a ValueError naming the variable."""
    from hyperrec.jagged_attn._gluon import _fp8_launch as gluon_fp8

    if env is None:
        monkeypatch.delenv(GLUON_FP8_ENV, raising=False)
    else:
        monkeypatch.setenv(GLUON_FP8_ENV, env)
    monkeypatch.setattr(_fp8_launch, "GLUON_FP8_DEFAULT", default)
    monkeypatch.setattr(_fp8_launch, "gluon_unsupported", lambda call, **kw: None)
    ran: list[dict] = []
    monkeypatch.setattr(
        gluon_fp8, "run", lambda qkv, **kw: ran.append(kw) or (kw["out"], kw["lse"])
    )
    monkeypatch.setattr("hyperrec.jagged_attn._gluon._launch._schedule", lambda *a: ("schedule",))
    n = 300 if long else 100
    spec = {} if activation == "softmax" else dict(activation="silu", normalization="none")
    case = Case((n, 0, 7), heads=2, head_dim=64, mask=dict(causal=causal), spec=spec)
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 0, device="cpu")
    call = call_of(q, k, v, qo, ko, kvi, nt, spec)
    qkv = reference_fp8.quantize_qkv(q, k, v, qo, ko, FP8Config())

    class TritonPath(Exception):
        pass

    def triton_path(*args, **kwargs):
        raise TritonPath

    # the Triton path starts by picking its tiles: stop there, only the choice matters
    monkeypatch.setattr(_fp8_launch, "select_fp8_config", triton_path)
    if env == "yes":
        with pytest.raises(ValueError, match=GLUON_FP8_ENV):
            _fp8_launch.attention_forward_fp8(call, FP8Config(), qkv=qkv)
        return
    took_triton = False
    try:
        _fp8_launch.attention_forward_fp8(call, FP8Config(), qkv=qkv)
    except TritonPath:
        took_triton = True
    by_default = default and long
    want = env == "1" or (env in (None, "auto") and by_default)
    assert bool(ran) == want and took_triton != want
    if ran:
        assert ran[0]["causal"] == causal and ran[0]["softmax"] == (activation == "softmax")
        assert ran[0]["schedule"] == ("schedule",)
        assert ran[0]["qk_scale"] > 0
