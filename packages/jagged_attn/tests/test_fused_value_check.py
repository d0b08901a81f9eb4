"""The default (``validate=True``) device check fused into the forward's tile-schedule
kernel (``_triton/_tiles.py``, ``check=``): the same verdicts as the separate check kernel
and the PyTorch-op condition, the same schedule when the values are valid, an empty one
when they are not; and through the public call, the check runs exactly once per new
offsets object, inside the schedule build when there is one and on its own otherwise.

Runs in the Triton interpreter on CPU tensors, where ``torch._assert_async`` raises at
once (on a GPU it is a device-side assert)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.jagged_attn import _validate, jagged_attention
from hyperrec.jagged_attn._triton import _launch
from hyperrec.jagged_attn._triton._configs import KernelConfig

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from hyperrec.jagged_attn._triton._checks import values_ok
from hyperrec.jagged_attn._triton._schedule import work_upper_bound
from hyperrec.jagged_attn._triton._tiles import tile_schedule


def _off(lens, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()],
                        dtype=dtype)  # fmt: skip


def _fused(qo, ko, tq, tk, max_q, max_kv, kv_index=None, num_targets=None, block=16,
           causal=False, valid=True):  # fmt: skip
    ki32 = None if kv_index is None else kv_index.to(torch.int32)
    upper = work_upper_bound(max(tq, 0), qo.numel() - 1, block)
    args = (tq, tk, qo, ko, max_q, max_kv, kv_index, num_targets)
    plain = None  # the unchecked kernel on invalid values could read out of bounds
    if valid:
        plain = tile_schedule(qo, ko, ki32, block, causal, upper, max_kv, kv_tiles=False)
    fused = tile_schedule(qo, ko, ki32, block, causal, upper, max_kv, kv_tiles=False,
                          check=args)  # fmt: skip
    return args, plain, fused


GOOD = [3, 0, 4, 1]


CASES = [  # (q lens or offsets, kv lens or offsets, overrides) -> valid?
    (dict(), True),
    (dict(max_q=3), False),  # a sequence longer than max_seqlen_q
    (dict(max_kv=3, kv=[3, 0, 4, 1]), False),
    (dict(q_off=torch.tensor([0, 3, 2, 7, 8])), False),  # decreasing
    (dict(q_off=torch.tensor([1, 3, 3, 7, 8])), False),  # not starting at 0
    (dict(tq=9), False),  # not ending at the token count
    (dict(kv=[5, 5], kv_index=torch.tensor([0, 1, 1, 0])), True),
    (dict(kv=[5, 5], kv_index=torch.tensor([0, 2, 1, 0])), False),  # out of [0, Bk)
    (dict(kv=[5, 5], kv_index=torch.tensor([0, 1, -1, 0])), False),
    (dict(num_targets=torch.tensor([1, 0, 4, 0])), True),
    (dict(num_targets=torch.tensor([1, 1, 0, 0])), False),  # more targets than keys
    (dict(num_targets=torch.tensor([0, 0, -1, 0])), False),
]


@pytest.mark.parametrize(("over", "valid"), CASES)
def test_fused_flag_equals_the_check_kernel(over, valid):
    over = dict(over)
    qo = over.pop("q_off", _off(GOOD))
    kv = over.pop("kv", None)
    ko = qo if kv is None else _off(kv)
    tq = over.pop("tq", int(qo[-1]))
    tk = int(ko[-1])
    max_q, max_kv = over.pop("max_q", 4), over.pop("max_kv", 5 if kv is not None else 4)
    args, plain, fused = _fused(qo, ko, tq, tk, max_q, max_kv, **over, valid=valid)
    ok = bool(fused[-1])
    assert ok == valid == bool(values_ok(*args)) == bool(_validate._device_condition(*args))
    if valid:  # the check changes nothing else
        for a, b in zip(plain, fused[:-1]):
            assert torch.equal(a, b)
    else:  # an empty schedule: nothing for the attention kernel, nothing out of bounds
        assert int(fused[4]) == 0


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    shrink=st.integers(0, 3),
    block=st.sampled_from([16, 32]),
    causal=st.booleans(),
    int32=st.booleans(),
    targets=st.booleans(),
)
def test_fused_check_on_random_batches(lens, shrink, block, causal, int32, targets):
    dtype = torch.int32 if int32 else torch.int64
    qo = _off(lens, dtype)
    longest = max(lens)
    max_len = max(longest - shrink, 0)  # shrink > 0 may make the batch invalid
    nt = None
    if targets:
        nt = torch.tensor([min(n, 2) for n in lens])
    tq = int(qo[-1])
    valid = longest <= max_len
    args, plain, fused = _fused(qo, qo, tq, tq, max_len, max_len, num_targets=nt, block=block,
                                causal=causal, valid=valid)  # fmt: skip
    assert bool(fused[-1]) == valid == bool(_validate._device_condition(*args))
    if valid:
        for a, b in zip(plain, fused[:-1]):
            assert torch.equal(a, b)


# --- the public call: where the check runs -----------------------------------------------


@pytest.fixture
def device_mode(monkeypatch):
    """``validate=True`` on CPU tensors as on CUDA ones (``"device"`` mode), counting the
    separate check launches (the flag computed on its own) and the fused ones."""
    counts = {"separate": 0, "fused": 0}
    monkeypatch.setattr(
        "hyperrec.jagged_attn.interface.value_check_mode",
        lambda validate, device: "device" if validate is True else "none",
    )
    real_condition = _validate._fused_condition
    real_flag = _validate.DeviceCheck.assert_flag

    def condition(*args):
        counts["separate"] += 1
        return real_condition(*args)

    def flag(self, ok):
        counts["fused"] += 1
        real_flag(self, ok)

    def in_kernel(self):
        counts["fused"] += 1

    monkeypatch.setattr(_validate, "_fused_condition", condition)
    monkeypatch.setattr(_validate.DeviceCheck, "assert_flag", flag)
    monkeypatch.setattr(_validate.DeviceCheck, "asserted_in_kernel", in_kernel)
    _validate._checked.clear()
    yield counts
    assert _validate.take_pending_check() is None  # nothing left pending on the thread


def _qkv(total, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=g).to(torch.bfloat16) for _ in range(3)]


def test_new_offsets_object_is_checked_inside_the_schedule_build(device_mode):
    off = _off([5, 0, 17, 9])
    q, k, v = _qkv(int(off[-1]))
    out = jagged_attention(q, k, v, off, 17, causal=True, backend="triton")
    want = jagged_attention(q.double(), k.double(), v.double(), off, 17, causal=True,
                            backend="torch", validate=False)  # fmt: skip
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert device_mode == {"separate": 0, "fused": 1}
    jagged_attention(q, k, v, off, 17, causal=True, backend="triton")  # cached: no check
    assert device_mode == {"separate": 0, "fused": 1}


def test_new_scalars_on_a_cached_schedule_check_separately(device_mode):
    off = _off([5, 0, 17, 9])
    q, k, v = _qkv(int(off[-1]))
    jagged_attention(q, k, v, off, 17, backend="triton")
    jagged_attention(q, k, v, off, 32, backend="triton")  # same schedule, new max_seqlen
    assert device_mode == {"separate": 1, "fused": 1}


def test_a_schedule_built_unchecked_is_checked_once_on_its_own(device_mode):
    # validate=False builds the schedule without the check; the next default calls hit
    # that schedule, so the check runs on its own, once per object and version
    off = _off([5, 0, 17, 9])
    q, k, v = _qkv(int(off[-1]))
    jagged_attention(q, k, v, off, 17, backend="triton", validate=False)
    jagged_attention(q, k, v, off, 17, backend="triton")
    jagged_attention(q, k, v, off, 17, backend="triton")
    assert device_mode == {"separate": 1, "fused": 0}
    off[1] = 4  # modified in place (still valid): a new schedule, built with the check
    jagged_attention(q, k, v, off, 17, backend="triton")
    jagged_attention(q, k, v, off, 17, backend="triton")
    assert device_mode == {"separate": 1, "fused": 1}


def test_a_check_vouches_only_for_its_own_objects(device_mode):
    # checks and schedules are cached per offsets object: an equal copy is a new object
    # (checked again), and invalid values in a new object still raise
    off = _off([5, 0, 17, 9])
    q, k, v = _qkv(int(off[-1]))
    jagged_attention(q, k, v, off, 17, backend="triton")
    jagged_attention(q, k, v, off.clone(), 17, backend="triton")
    assert device_mode == {"separate": 0, "fused": 2}
    bad = off.clone()
    bad[2] = 40  # decreasing after
    with pytest.raises(RuntimeError, match="validate='full'"):
        jagged_attention(q, k, v, bad, 17, backend="triton")


def test_invalid_values_raise_through_the_fused_check(device_mode):
    off = _off([5, 0, 17, 9])
    q, k, v = _qkv(int(off[-1]))
    with pytest.raises(RuntimeError, match="validate='full'"):
        jagged_attention(q, k, v, off, 16, backend="triton")  # 17 > max_seqlen
    assert device_mode == {"separate": 0, "fused": 1}
    bad = torch.tensor([0, 5, 3, 22, 31])  # decreasing
    with pytest.raises(RuntimeError, match="validate='full'"):
        jagged_attention(q, k, v, bad, 17, backend="triton")


def test_in_kernel_assert_only_off_the_interpreter(monkeypatch):
    from hyperrec.jagged_attn._triton import _tiles

    assert _tiles._assert_options() is None  # the interpreter: the caller asserts the flag
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    opts = _tiles._assert_options()
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:
        assert opts is None
        return
    fields = CUDAOptions.__dataclass_fields__
    if "debug" in fields and "sanitize_overflow" in fields:
        assert opts == {"num_warps": 8, "debug": True, "sanitize_overflow": False}
    else:
        assert opts is None


def test_in_kernel_assert_variant_writes_no_flag(monkeypatch):
    """The variant a GPU runs (``C_ASSERT``: the schedule kernel asserts the check itself)
    allocates no flag and writes none: it passes ``total`` as the flag's pointer, so a
    stray flag store would clobber the tile count. Run in the interpreter with the
    launch options forced: the same schedule as without the check on valid values, an
    empty one on invalid values."""
    from hyperrec.jagged_attn._triton import _tiles

    monkeypatch.setattr(_tiles, "_assert_options", lambda: {"num_warps": 8})
    qo = _off([5, 0, 17, 9, 1])
    tq = int(qo[-1])
    for causal in (False, True):
        args, plain, fused = _fused(qo, qo, tq, tq, 17, 17, causal=causal)
        assert fused[-1] is None  # asserted in the kernel: no flag for the caller
        for a, b in zip(plain, fused[:-1]):
            assert torch.equal(a, b)
        assert int(fused[4]) == int(plain[4]) > 1
    # invalid values (17 > max_seqlen): an empty schedule; the assert itself needs the
    # debug compile of a GPU (the interpreter skips ``tl.device_assert`` without it)
    _, _, fused = _fused(qo, qo, tq, tq, 16, 16, valid=False)
    assert fused[-1] is None and int(fused[4]) == 0


def test_paths_without_a_schedule_build_check_on_their_own(device_mode):
    q, k, v = _qkv(0)
    jagged_attention(q, k, v, _off([0, 0]), 1, backend="triton")  # no kernel at all
    assert device_mode == {"separate": 1, "fused": 0}
    off = _off([7, 9])
    q, k, v = _qkv(16)
    packed = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, pack_rows=True)
    from hyperrec.jagged_attn._opschema import AttentionCall, make_spec

    spec = make_spec(activation="softmax", scale=0.25, max_seqlen_q=9, max_seqlen_kv=9)
    call = AttentionCall(q=q, k=k, v=v, q_offsets=off, kv_offsets=off, kv_index=None,
                         num_targets=None, spec=spec)  # fmt: skip
    check = _validate.run_value_checks("device", q, k, off, off, 9, 9, kv_index=None,
                                       num_targets=None, names=_validate.Names(),
                                       defer=True)  # fmt: skip
    assert check is not None
    _validate.set_pending_check(check)
    _launch.attention_forward(call, config=packed)
    assert device_mode == {"separate": 2, "fused": 0}


def test_other_backends_check_before_they_run(device_mode):
    off = _off([4, 6])
    q, k, v = _qkv(10)
    with pytest.raises(RuntimeError, match="validate='full'"):
        jagged_attention(q, k, v, off, 5, backend="torch")
    assert device_mode == {"separate": 1, "fused": 0}


def test_the_gluon_path_checks_inside_its_schedule_build(device_mode, monkeypatch):
    # The Gluon forward walks the same schedule; its build runs the fused check too.
    seen = []

    def gluon_stub(call, schedule, *buffers):
        seen.append(int(schedule[-1]))  # the number of real tiles
        out = torch.zeros_like(call.q)
        return out, torch.zeros(call.q.shape[1], call.q.shape[0], dtype=torch.float32)

    monkeypatch.setattr(_launch, "gluon_eligible", lambda call: True)
    monkeypatch.setattr(_launch, "_gluon_forward", gluon_stub)
    monkeypatch.setattr(_launch, "_FWD_PLANS", {})
    monkeypatch.setenv(_launch.GLUON_ENV, "1")
    off = _off([5, 0, 17, 9])
    q, k, v = _qkv(int(off[-1]))
    jagged_attention(q, k, v, off, 17, backend="triton")
    assert seen == [3] and device_mode == {"separate": 0, "fused": 1}  # 128-row tiles
    with pytest.raises(RuntimeError, match="validate='full'"):
        jagged_attention(q, k, v, _off([5, 0, 17, 9]), 16, backend="triton")  # 17 > 16
    assert device_mode == {"separate": 0, "fused": 2} and seen == [3]
