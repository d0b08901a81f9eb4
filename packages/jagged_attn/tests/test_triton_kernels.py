"""The Triton kernels against the float64 reference (the accuracy rule of DESIGN.md).

On the CPU the real kernels run under ``TRITON_INTERPRET=1`` at small shapes chosen to hit
the hard cases: lengths that are not a multiple of the block, zero- and one-length
sequences, several tiles per sequence with a grid smaller than the work (the persistent
loop), causal and not, asymmetric query/key lengths, the query -> kv map, every activation,
normalisation and mask rule. The ``gpu`` tests sweep larger shapes on CUDA.

For each case: ``exact`` is the package's reference in float64, ``baseline`` is the same
math written naively in the input dtype (what plain PyTorch gives in bf16/fp16), and the
kernel must satisfy ``err(kernel) <= 2 * err(baseline) + atol`` for the output and for
dq, dk, dv, with every output element written (allocations are poisoned with NaN).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_check import (
    DKDV,
    DQ,
    SMALL,
    Case,
    build,
    call_of,
    check,
    kernels_available,
    poison_allocations,
    run_backward,
    run_forward,
)

from hyperrec.jagged_attn import reference
from hyperrec.jagged_attn._triton import KernelConfig

triton = pytest.importorskip("triton")

if not kernels_available():
    pytest.skip(
        "the Triton kernels need CUDA or TRITON_INTERPRET=1 on the CPU", allow_module_level=True
    )

pytestmark = pytest.mark.usefixtures(poison_allocations.__name__)


# ----------------------------------------------------------------------------------------
# CPU (interpreter) cases: tiny, but each one reaches a distinct code path.
# ----------------------------------------------------------------------------------------

# 0- and 1-length sequences, lengths around and not a multiple of the 16/32 blocks.
LENS = (17, 0, 1, 40, 5, 33)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_fwd_bwd(causal):
    check(Case(LENS, mask=dict(causal=causal)))


def test_softmax_fp16_head_dim_64_single_sequence():
    # B = 1, a length that is not a multiple of any block, fp16, another head dim.
    check(Case((45,), heads=1, head_dim=64, dtype=torch.float16, mask=dict(causal=True)))


def test_non_power_of_two_head_dims():
    # D = 48 and Dv = 24 are padded to 64 / 32 inside the kernel and masked on load/store.
    check(Case((19, 7), head_dim=48, head_dim_v=24))


@pytest.mark.parametrize(
    ("activation", "normalization", "causal"),
    [
        ("silu", "max_seqlen", True),  # HSTU
        ("gelu", "none", False),
        ("gelu_tanh", "length", True),
        ("gelu_poly", "none", False),
        ("relu", "length", False),
        ("sigmoid", "max_seqlen", False),
        ("identity", "none", True),
    ],
)
def test_gdpa_activations(activation, normalization, causal):
    spec = dict(activation=activation, normalization=normalization, output_scale=0.5)
    check(Case((21, 0, 3, 34), spec=spec, mask=dict(causal=causal)))


def test_softmax_output_scale_and_length_normalisation():
    check(Case((9, 20), spec=dict(output_scale=1.5, normalization="length")))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_index_and_asymmetric_lengths(causal):
    # Three candidate sequences read history 0, one reads history 2, history 1 is unused
    # (its dk/dv must be written as zeros); Lq > Lk and Lq < Lk both occur (bottom-right
    # causal alignment leaves the first Lq - Lk queries without keys: zeros, not NaN).
    case = Case(
        q_lens=(5, 1, 0, 30, 12),
        kv_lens=(23, 9, 4),
        kv_index=(0, 0, 2, 0, 2),
        spec=dict(activation="softmax"),
        mask=dict(causal=causal),
    )
    check(case)
    check(replace(case, spec=dict(activation="silu", normalization="length")), seed=1)


@pytest.mark.parametrize(
    ("mask", "targets"),
    [
        (dict(causal=True, window_left=5, window_right=0), None),  # sliding window
        (dict(window_left=3, window_right=7), None),  # two-sided window
        (dict(block_size=8, block_previous=True), None),  # block attention
        (dict(causal=True, contextual_len=3), (4, 0, 1, 2)),  # HSTU contextual + targets
    ],
    ids=["causal_window", "window", "block", "hstu"],
)
def test_generic_masks(mask, targets):
    case = Case((26, 0, 5, 37), targets=targets, mask=mask, spec=dict(activation="softmax"))
    check(case)
    check(replace(case, spec=dict(activation="silu", normalization="max_seqlen")), seed=1)


def test_many_short_sequences():
    # B = 40 tiny sequences, some empty: the cost-sorted tile table at scale.
    lens = tuple((7 * i) % 11 for i in range(40))
    check(Case(lens, heads=1, mask=dict(causal=True)))


def test_default_configs():
    # The shipped (interpreter) configuration, not the pinned small tiles.
    check(Case((70, 3)), configs=(None, None, None))


def test_empty_inputs():
    for lens in [(), (0, 0)]:
        q, k, v, do, qo, ko, kvi, nt, spec = build(Case(lens), 0)
        out, lse = run_forward(q, k, v, qo, ko, kvi, nt, spec)
        assert out.shape == (0, 2, 32) and lse.shape == (2, 0)
        grads = run_backward(do, q, k, v, out, lse, qo, ko, kvi, nt, spec)
        assert [g.shape for g in grads] == [(0, 2, 32)] * 3
    # Queries whose kv sequences are all empty: outputs are zeros, gradients too.
    case = Case((3, 4), kv_lens=(0, 0), spec=dict(activation="silu"))
    q, k, v, do, qo, ko, kvi, nt, spec = build(case, 0)
    out, lse = run_forward(q, k, v, qo, ko, kvi, nt, spec)
    assert torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = run_backward(do, q, k, v, out, lse, qo, ko, kvi, nt, spec)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == dv.numel() == 0


# ----------------------------------------------------------------------------------------
# Forward variants (KernelConfig flags): each against the reference, backward included (it
# reads the variant's LSE). Under the interpreter the warp-specialisation flag only checks
# the plumbing (the interpreter runs the plain loop).
# ----------------------------------------------------------------------------------------

ALL_FLAGS = dict(prefetch=True, tma=True, softmax_fma=True, lazy_rescale=True,
                 warp_specialize=True)  # fmt: skip
FWD_VARIANTS = {
    "prefetch": dict(prefetch=True),
    "tma": dict(tma=True),
    "tma_in_kernel": dict(tma=True, tma_in_kernel=True),
    "fma": dict(softmax_fma=True),
    "lazy": dict(lazy_rescale=True),
    "ws": dict(warp_specialize=True),
    "dynamic": dict(dynamic_schedule=True),
    "sequence_order": dict(work_order="sequence"),
    "dynamic_sequence_tma": dict(dynamic_schedule=True, work_order="sequence", tma=True),
    "all": ALL_FLAGS,
}


def _variant(flags: dict, base: KernelConfig = SMALL) -> KernelConfig:
    return replace(base, **flags)


@pytest.mark.parametrize("flags", list(FWD_VARIANTS.values()), ids=list(FWD_VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_variants_softmax(flags, causal):
    # 0- and 1-length sequences, partial tiles, several tiles per sequence, a small grid.
    check(Case(LENS, mask=dict(causal=causal)), configs=(_variant(flags), DKDV, DQ))


@pytest.mark.parametrize("flags", list(FWD_VARIANTS.values()), ids=list(FWD_VARIANTS))
def test_forward_variants_hstu(flags):
    # GDPA with HSTU semantics, targets and contextual tokens (the targets column of the
    # prefetched tile table), one head dim that is not a power of two (no descriptors).
    spec = dict(activation="silu", normalization="max_seqlen")
    case = Case((26, 0, 1, 37), targets=(4, 0, 1, 2), spec=spec,
                mask=dict(causal=True, contextual_len=3))  # fmt: skip
    check(case, configs=(_variant(flags), DKDV, DQ), backward=False)
    check(replace(case, head_dim=48), seed=1, configs=(_variant(flags), DKDV, DQ),
           backward=False)  # fmt: skip


def test_forward_variants_kv_index():
    # The query -> kv map through the prefetched tile table and the descriptors: Lq > Lk
    # and Lq < Lk, an empty kv sequence, an unused one.
    case = Case(q_lens=(5, 1, 0, 30, 12), kv_lens=(23, 9, 0), kv_index=(0, 0, 2, 0, 2),
                mask=dict(causal=True))  # fmt: skip
    check(case, configs=(_variant(ALL_FLAGS), DKDV, DQ))


def test_lazy_rescale_large_scores():
    # Large scores: running maxima jump by far more than the 2**8 threshold between tiles,
    # so both branches of the lazy rescale run (small scores above take the lazy one).
    for flags in (dict(lazy_rescale=True), dict(lazy_rescale=True, softmax_fma=True)):
        check(Case(LENS, spec=dict(scale=2.0), mask=dict(causal=True)),
               configs=(_variant(flags), DKDV, DQ))  # fmt: skip


def test_fma_needs_positive_scale():
    # softmax_fma takes the row max before scaling: with scale <= 0 the launcher drops it.
    from hyperrec.jagged_attn._triton import _launch

    q = torch.zeros(4, 1, 16, dtype=torch.bfloat16)
    flags = _launch._forward_variants(_variant(ALL_FLAGS), "softmax", -0.5, (q, q, q, q),
                                      (16, 16))  # fmt: skip
    assert not flags["FMA"] and flags["LAZY"] and flags["PREFETCH"] and flags["TMA"]
    check(Case((9, 20, 0), spec=dict(scale=-0.4)), configs=(_variant(ALL_FLAGS), DKDV, DQ))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_shipped_hopper_forward_configs(head_dim):
    # The shipped sm90 forward entries read Q and K/V and write O through in-kernel
    # descriptors; run each (its real tile shape) in the interpreter against the float64
    # reference: sequences shorter than, equal to and longer than a tile, and empty.
    from hyperrec.jagged_attn._triton._configs import TMA_KV, TMA_O, TMA_Q, TUNED

    for bucket in ("short", "long"):
        cfg = TUNED[("fwd", "sm90", head_dim, bucket)]
        assert cfg.tma == TMA_Q | TMA_KV | TMA_O and cfg.tma_in_kernel, (bucket, cfg)
        case = Case((cfg.block_m + 3, 0, cfg.block_n, 5), heads=1, head_dim=head_dim,
                    mask=dict(causal=bucket == "long"))  # fmt: skip
        check(case, configs=(cfg, DKDV, DQ), backward=False)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_shipped_hopper_backward_configs(activation):
    # The shipped sm90 backward entries of the long bucket (descriptor reads; SiLU's own
    # dK/dV tile), run at their real tile shapes in the interpreter against the float64
    # reference: sequences shorter than, equal to and longer than a tile, and empty.
    from hyperrec.jagged_attn._triton._configs import config_key, select_config

    softmax = activation == "softmax"
    dkdv = select_config(config_key("dkdv", "sm90", 64, softmax, True, 4096))
    dq = select_config(config_key("dq", "sm90", 64, softmax, True, 4096))
    assert dkdv.bwd_tma and dq.bwd_tma
    assert (dkdv.block_m, dkdv.block_n) == ((64, 64) if softmax else (32, 64))
    spec = dict(activation=activation)
    if not softmax:
        spec["normalization"] = "max_seqlen"
    case = Case((dkdv.block_n + 3, 0, dq.block_m * 2, 5, 1), heads=1, head_dim=64, spec=spec,
                mask=dict(causal=True))  # fmt: skip
    check(case, configs=(SMALL, dkdv, dq))


def test_tma_dropped_where_descriptors_cannot_read():
    # Head dims that are not powers of two, heads not packed in their rows, and empty
    # tensors take the pointer path; packed aligned heads keep the descriptors.
    from hyperrec.jagged_attn._triton import _launch
    from hyperrec.jagged_attn._triton._configs import TUNED

    cfg = TUNED[("fwd", "sm90", 128, "long")]

    def tma(t, dims):
        return _launch._forward_variants(cfg, "softmax", 0.1, (t, t, t, t), dims)["TMA"]

    packed = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    assert tma(packed, (64, 64)) == cfg.tma
    assert tma(torch.zeros(8, 2, 96, dtype=torch.bfloat16), (96, 96)) == 0
    # A row stride of its own is fine (heads 0-1 of 3); a head dim sliced out of a wider
    # one is not (the heads' columns are not adjacent).
    assert tma(torch.zeros(8, 3, 64, dtype=torch.bfloat16)[:, :2], (64, 64)) == cfg.tma
    assert tma(torch.zeros(8, 2, 128, dtype=torch.bfloat16)[:, :, :64], (64, 64)) == 0
    assert tma(torch.zeros(0, 2, 64, dtype=torch.bfloat16), (64, 64)) == 0


def test_forward_variants_nan_stays_inside_its_sequence():
    # Descriptors read whole blocks: rows past a sequence's end belong to the next one. A
    # NaN there must not reach this sequence's output (K is replaced by the mask, V is read
    # through masked loads in tiles that cross the end, Q's extra rows are never stored).
    case = Case((17, 40, 5, 33))
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 0)
    q[17:57], k[17:57], v[17:57] = (float("nan"),) * 3  # sequence 1
    args = (qo, ko, kvi, nt, spec)
    want, _ = run_forward(q, k, v, *args, config=SMALL)
    for flags in (dict(tma=True), dict(tma=True, tma_in_kernel=True), ALL_FLAGS):
        for cfg in (_variant(flags), _variant(flags, KernelConfig(block_m=32, block_n=32))):
            out, lse = run_forward(q, k, v, *args, config=cfg)
            others = torch.cat([out[:17], out[57:]])
            assert torch.isfinite(others).all(), flags
            assert torch.isnan(out[17:57]).all()
            torch.testing.assert_close(others, torch.cat([want[:17], want[57:]]), atol=1e-2,
                                       rtol=0)  # fmt: skip


# ----------------------------------------------------------------------------------------
# Backward descriptor reads (KernelConfig.bwd_tma): whole mask-free tiles of Q/dO (dK/dV)
# and K/V (dQ) through tensor descriptors, partial and masked tiles through pointers. The
# bulk dQ reduce runs on the GPU only (the interpreter keeps per-element atomics).
# ----------------------------------------------------------------------------------------

BWD_TMA = (replace(DKDV, bwd_tma=True), replace(DQ, bwd_tma=True))


@pytest.mark.parametrize("dq_atomic", [False, True], ids=["dq_kernel", "dq_atomic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_descriptor_reads_softmax(causal, dq_atomic):
    dkdv, dq = BWD_TMA
    configs = (SMALL, replace(dkdv, dq_atomic=dq_atomic), dq)
    # several whole tiles per sequence plus partial ones, 0- and 1-length sequences
    check(Case((70, 0, 1, 33, 16), heads=2, mask=dict(causal=causal)), configs=configs)


@pytest.mark.parametrize("regime", ["lq<lk", "lq>lk"])
def test_backward_descriptor_reads_hstu(regime):
    # SiLU attention (the activation's gradient is not zero on rows past a sequence, so a
    # tile that read the next sequence's rows would show here), unequal lengths, a kv map
    short, long = (9, 40, 0, 17), (50, 64, 3, 33)
    q_lens, kv_lens = (short, long) if regime == "lq<lk" else (long, short)
    spec = dict(activation="silu", normalization="max_seqlen")
    dkdv, dq = BWD_TMA
    for atomic in (False, True):
        check(Case(q_lens, kv_lens=kv_lens, spec=spec, mask=dict(causal=True)),
              configs=(SMALL, replace(dkdv, dq_atomic=atomic), dq))  # fmt: skip
    case = Case(q_lens=(5, 1, 0, 30, 12), kv_lens=(23, 9, 0), kv_index=(0, 0, 2, 0, 2),
                spec=spec)  # fmt: skip
    check(case, configs=(SMALL, *BWD_TMA))


def test_backward_descriptor_reads_dropped_where_they_cannot_read():
    # a head dim that is not a power of two: the launcher takes the pointer path
    from hyperrec.jagged_attn._triton import _launch

    case = Case((19, 40), head_dim=48, mask=dict(causal=True))
    check(case, configs=(SMALL, *BWD_TMA))
    q, k, v, _, qo, ko, kvi, nt, spec = build(case, 0)
    assert not _launch._backward_descriptors_ok(call_of(q, k, v, qo, ko, kvi, nt, spec))
    q, k, v, _, qo, ko, kvi, nt, spec = build(replace(case, head_dim=32), 0)
    assert _launch._backward_descriptors_ok(call_of(q, k, v, qo, ko, kvi, nt, spec))
    # a gradient that is a view with heads not packed is copied, not misread
    q, k, v, do, qo, ko, kvi, nt, spec = build(replace(case, head_dim=32), 0)
    out, lse = run_forward(q, k, v, qo, ko, kvi, nt, spec, config=SMALL)
    wide = torch.zeros(do.shape[0], do.shape[1] + 1, do.shape[2], dtype=do.dtype,
                       device=do.device)  # fmt: skip
    wide[:, : do.shape[1]] = do
    view = wide[:, : do.shape[1]]
    assert not view.is_contiguous()
    want = run_backward(do, q, k, v, out, lse, qo, ko, kvi, nt, spec, *BWD_TMA)
    got = run_backward(view, q, k, v, out, lse, qo, ko, kvi, nt, spec, *BWD_TMA)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_backward_descriptor_reads_nan_stays_inside_its_sequence(activation):
    # NaN in one sequence's q, k, v and dO: every other sequence's gradients stay finite
    # and equal to the pointer path's (whole tiles read through descriptors never cross a
    # sequence's end).
    spec = dict(activation=activation)
    if activation != "softmax":
        spec["normalization"] = "max_seqlen"
    case = Case((17, 40, 5, 33), spec=spec, mask=dict(causal=True))
    q, k, v, do, qo, ko, kvi, nt, spec_ = build(case, 0)
    for t in (q, k, v, do):
        t[17:57] = float("nan")
    args = (qo, ko, kvi, nt, spec_)
    out, lse = run_forward(q, k, v, *args, config=SMALL)
    want = run_backward(do, q, k, v, out, lse, *args, DKDV, DQ)
    dkdv, dq = BWD_TMA
    for atomic in (False, True):
        got = run_backward(do, q, k, v, out, lse, *args, replace(dkdv, dq_atomic=atomic), dq)
        for w, g in zip(want, got):
            others = torch.cat([g[:17], g[57:]])
            assert torch.isfinite(others).all(), atomic
            torch.testing.assert_close(others, torch.cat([w[:17], w[57:]]), atol=1e-2, rtol=0)


def test_warp_specialize_build_failure_falls_back(monkeypatch):
    # A Triton that cannot warp-specialise the loop: the launcher builds the same kernel
    # without it, remembers the failure and does not try again.
    from hyperrec.jagged_attn._triton import _launch

    real = _launch._launch_persistent
    calls = []

    def fake(kernel, work, device, cfg, key, args, kw):
        calls.append(kw.get("WARP_SPEC"))
        if kw.get("WARP_SPEC"):
            raise RuntimeError("PassManager::run failed (simulated)")
        return real(kernel, work, device, cfg, key, args, kw)

    monkeypatch.setattr(_launch, "_launch_persistent", fake)
    monkeypatch.setattr(_launch, "_FAILED_BUILDS", {})
    cfg = _variant(dict(warp_specialize=True))
    check(Case((19, 0, 1)), configs=(cfg, DKDV, DQ), backward=False)
    check(Case((19, 0, 1)), seed=1, configs=(cfg, DKDV, DQ), backward=False)
    fwd_calls = [c for c in calls if c is not None]
    assert fwd_calls == [True, False, False]
    assert len(_launch.forward_build_failures()) == 1


def test_tile_meta_table():
    # The prefetched table resolves each scheduled tile to its geometry.
    from hyperrec.jagged_attn._triton._schedule import q_tile_meta, q_tile_schedule

    qo = torch.tensor([0, 5, 5, 6, 40], dtype=torch.int32)
    ko = torch.tensor([0, 23, 23, 30], dtype=torch.int32)
    kvi = torch.tensor([0, 1, 2, 0], dtype=torch.int32)
    nt = torch.tensor([1, 0, 0, 3], dtype=torch.int32)
    meta, total = q_tile_meta(qo, ko, kvi, nt, 16, True, 40)
    seq, idx, total2 = q_tile_schedule(qo, ko, kvi, 16, True, 40)
    assert int(total) == int(total2) == 1 + 0 + 1 + 3
    for row, b, t in zip(meta[: int(total)].tolist(), seq.tolist(), idx.tolist()):
        kb = int(kvi[b])
        want = [int(qo[b]), int(qo[b + 1] - qo[b]), int(ko[kb]), int(ko[kb + 1] - ko[kb]),
                t * 16, int(nt[b]), b, 0]  # fmt: skip
        assert row == want


# ----------------------------------------------------------------------------------------
# GPU sweeps
# ----------------------------------------------------------------------------------------


def _random_lens(n: int, max_len: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (n,), generator=g)
    lens[0] = max_len  # the longest sequence is always present
    return tuple(lens.tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_softmax_sweep(head_dim, causal, dtype):
    lens = _random_lens(24, 700, head_dim)
    case = Case(lens, heads=3, head_dim=head_dim, dtype=dtype, mask=dict(causal=causal))
    check(case, configs=(None, None, None), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "activation", ["silu", "gelu", "gelu_tanh", "gelu_poly", "relu", "sigmoid", "identity"]
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gdpa_sweep(activation, head_dim):
    lens = _random_lens(16, 600, 7)
    spec = dict(activation=activation, normalization="max_seqlen", scale=0.5)
    case = Case(lens, heads=2, head_dim=head_dim, spec=spec, mask=dict(causal=True))
    check(case, configs=(None, None, None), atol=1e-4)


@pytest.mark.gpu
def test_gpu_kv_index_and_masks():
    q_lens = _random_lens(64, 40, 3)
    kv_lens = _random_lens(8, 900, 4)
    kv_index = tuple(int(i) % 8 for i in range(64))
    case = Case(q_lens, kv_lens=kv_lens, kv_index=kv_index, head_dim=128,
                spec=dict(activation="silu", normalization="length"))  # fmt: skip
    check(case, configs=(None, None, None), atol=1e-4)
    lens = _random_lens(12, 500, 5)
    targets = tuple(min(n, 20) for n in lens)
    hstu = Case(lens, targets=targets, head_dim=64, mask=dict(causal=True, contextual_len=6),
                spec=dict(activation="silu", normalization="max_seqlen"))  # fmt: skip
    check(hstu, configs=(None, None, None), atol=1e-4)
    block = Case(lens, head_dim=64, mask=dict(block_size=64, block_previous=True))
    check(block, configs=(None, None, None), atol=1e-4)


@pytest.mark.gpu
def test_gpu_large_batch_no_sync_no_recompile():
    """B = 1,024 mixed lengths: correct, no host sync, and no compile for new lengths."""
    case = Case(_random_lens(1024, 300, 11), heads=4, head_dim=64, mask=dict(causal=True))
    q, k, v, do, qo, ko, kvi, nt, spec = build(case, 0)
    args = (qo, ko, kvi, nt, spec)
    run_backward(do, q, k, v, *run_forward(q, k, v, *args), *args)  # compile
    torch.cuda.synchronize()
    from hyperrec.jagged_attn._triton import _kernels

    def n_compiled():
        total = 0
        for fn in (_kernels._fwd_kernel, _kernels._bwd_dkdv_kernel, _kernels._bwd_dq_kernel):
            caches = getattr(fn, "device_caches", None) or getattr(fn, "cache", {})
            for c in caches.values():
                total += len(c[0] if isinstance(c, tuple) else c)
        return total

    before = n_compiled()
    assert before > 0, "could not count compiled kernels in this Triton version"
    case2 = replace(case, q_lens=_random_lens(777, 290, 12))  # new B, T and lengths
    q, k, v, do, qo, ko, kvi, nt, spec = build(case2, 1)
    spec = replace(spec, max_seqlen_q=300, max_seqlen_kv=300)  # same bucket
    args = (qo, ko, kvi, nt, spec)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = run_forward(q, k, v, *args)
        grads = run_backward(do, q, k, v, out, lse, *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert n_compiled() == before, "a new set of lengths triggered a compilation"
    exact = reference.attention_forward(q.double(), k.double(), v.double(), qo, ko, spec)
    assert (out.double() - exact).abs().max() < 2e-2
    assert all(torch.isfinite(g).all() for g in grads)


def test_sequence_work_order_keeps_sequences_together():
    # "sequence": sequences by total cost (heaviest first), each one's tiles contiguous and
    # heaviest first; "cost": every tile by its own cost. Both list every real tile once.
    from hyperrec.jagged_attn._triton._schedule import q_tile_schedule

    lens = [40, 0, 70, 5, 70, 33]
    qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total_q = sum(lens)
    for causal in (False, True):
        by_cost = q_tile_schedule(qo, qo, None, 16, causal, total_q, "cost")
        by_seq = q_tile_schedule(qo, qo, None, 16, causal, total_q, "sequence")
        n = int(by_cost[2])
        assert n == int(by_seq[2]) == sum(-(-x // 16) for x in lens)
        tiles = {(int(a), int(b)) for a, b in zip(by_cost[0][:n], by_cost[1][:n])}
        assert tiles == {(int(a), int(b)) for a, b in zip(by_seq[0][:n], by_seq[1][:n])}
        seqs = by_seq[0][:n].tolist()
        runs = [seqs[0]] + [b for a, b in zip(seqs, seqs[1:]) if a != b]
        assert len(runs) == len(set(runs)), "a sequence's tiles are split"
        assert runs[:2] in ([2, 4], [4, 2]) and runs[-1] == 3  # longest first, shortest last
        if causal:  # within a sequence, the tile that sees the most keys first
            idx = by_seq[1][: seqs.count(runs[0])].tolist()
            assert idx == sorted(idx, reverse=True)


def test_occupancy_estimate_counts_reserved_shared_memory_and_register_granularity():
    from hyperrec.jagged_attn._triton._launch import occupancy_estimate

    hopper = dict(regs=65536, smem=228 * 1024, threads=2048)
    # two blocks of 114 KiB do not fit: each also takes 1 KiB of reserved shared memory
    assert occupancy_estimate(64, 114 * 1024, 4, hopper) == 1
    assert occupancy_estimate(64, 112 * 1024, 4, hopper) == 2
    # 130 registers are allocated as 136 per thread (256 per warp): 3 blocks of 4 warps
    # would need 3 * 4 * 32 * 136 = 52,224 <= 65,536, but 4 would not
    assert occupancy_estimate(130, 1024, 4, hopper) == 3
    assert occupancy_estimate(255, 0, 8, hopper) == 1
    assert occupancy_estimate(32, 0, 1, hopper) == 8  # capped


PACKED = replace(SMALL, pack_rows=True)


@pytest.mark.parametrize(
    ("spec", "causal"),
    [
        (dict(), False),
        (dict(), True),
        (dict(activation="silu", normalization="max_seqlen"), True),
        (dict(output_scale=0.5, normalization="length"), False),
        (dict(activation="gelu", normalization="length"), True),
    ],
    ids=["softmax", "softmax_causal", "hstu", "softmax_length", "gelu_length"],
)
def test_packed_rows_forward(spec, causal, monkeypatch):
    # Many short sequences packed into 16-row spans (sequences cross span boundaries, one is
    # longer than a span, empty ones in between); the backward reads the packed LSE.
    calls = _count_packed(monkeypatch)
    lens = (5, 0, 9, 1, 3, 16, 0, 7, 40, 2, 11)
    check(Case(lens, heads=2, spec=spec, mask=dict(causal=causal)), configs=(PACKED, DKDV, DQ))
    assert calls == [1]


def _count_packed(monkeypatch) -> list[int]:
    from hyperrec.jagged_attn._triton import _launch

    calls: list[int] = []
    real = _launch._forward_packed

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_launch, "_forward_packed", counted)
    return calls


def test_packed_rows_ignored_where_it_does_not_apply(monkeypatch):
    # A window, targets or a query -> kv map take the per-sequence forward (still correct).
    calls = _count_packed(monkeypatch)
    check(Case((5, 9, 17), mask=dict(causal=True, window_left=3)), configs=(PACKED, DKDV, DQ))
    check(Case((5, 9, 17), targets=(1, 0, 2), mask=dict(causal=True)), configs=(PACKED, DKDV, DQ))
    check(Case((5, 9), kv_lens=(7, 3)), configs=(PACKED, DKDV, DQ), backward=False)
    assert calls == []


def test_row_sequence():
    from hyperrec.jagged_attn._triton._schedule import row_sequence

    off = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    assert row_sequence(off, 6).tolist() == [0, 0, 2, 2, 2, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(128, 64, 8, 2), (64, 64, 4, 2)], ids=["m128", "m64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_packed_rows_many_tiny_sequences(tiles, causal):
    bm, bn, warps, stages = tiles
    cfg = KernelConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                       pack_rows=True)  # fmt: skip
    lens = _random_lens(2000, 64, 21)
    check(Case(lens, heads=4, head_dim=128, mask=dict(causal=causal)), configs=(cfg, None, None),
          atol=1e-4)  # fmt: skip
