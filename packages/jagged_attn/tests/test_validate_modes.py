"""``validate=``: where the value checks run (host ValueError, sync-free device assert,
none), the device-side condition itself (run on CPU tensors, where ``torch._assert_async``
raises at once), its per-tensor cache, and on a GPU that the default path never syncs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.jagged_attn import _validate, gdpa, jagged_attention
from hyperrec.jagged_attn._validate import Names, run_value_checks, value_check_mode

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")


def test_mode_dispatch():
    assert value_check_mode(True, CPU) == "host"  # free on the CPU: clear ValueErrors
    assert value_check_mode("full", CPU) == "host"
    assert value_check_mode(False, CPU) == "none"
    assert value_check_mode(True, CUDA) == "device"  # the sync-free default on a GPU
    assert value_check_mode("full", CUDA) == "host"  # opt-in: one host sync per call
    assert value_check_mode(False, CUDA) == "none"
    assert value_check_mode(True, META) == "none"  # meta tensors hold no values


def test_mode_is_none_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for validate in (True, "full", False):
        for device in (CPU, CUDA):
            assert value_check_mode(validate, device) == "none"


@pytest.mark.parametrize(
    ("value", "err"), [(1, TypeError), (None, TypeError), ("device", ValueError)]
)
def test_bad_validate(value, err):
    q = torch.randn(4, 1, 8)
    off = torch.tensor([0, 4])
    with pytest.raises(err, match="validate must be True, False or 'full'"):
        jagged_attention(q, q, q, off, 4, validate=value)


def test_full_raises_value_errors_on_cpu():
    q = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        jagged_attention(q, q, q, torch.tensor([0, 3, 2, 4]), 4, validate="full")
    with pytest.raises(ValueError, match="max_seqlen=2 is smaller"):
        jagged_attention(q, q, q, torch.tensor([0, 4]), 2, validate="full")


# The device-side condition, evaluated on CPU tensors: torch._assert_async raises at once
# there, so every rule of the host checks can be exercised without a GPU.
def _device_check(q_off, kv_off, max_q, max_kv, *, kv_index=None, num_targets=None, tq=None,
                  tk=None):  # fmt: skip
    q = torch.zeros(int(q_off[-1]) if tq is None else tq, 1, 1)
    k = torch.zeros(int(kv_off[-1]) if tk is None else tk, 1, 1)
    run_value_checks("device", q, k, q_off, kv_off, max_q, max_kv, kv_index=kv_index,
                     num_targets=num_targets, names=Names())  # fmt: skip


GOOD = torch.tensor([0, 3, 3, 7])


REJECT = [
    dict(q_off=torch.tensor([1, 3, 7]), tq=7),  # does not start at 0
    dict(q_off=torch.tensor([0, 5, 3, 7])),  # decreases
    dict(q_off=GOOD, tq=8),  # does not end at the token count
    dict(kv_off=torch.tensor([0, 4, 2, 7])),
    dict(kv_off=GOOD, tk=6),
    dict(max_q=3),  # a sequence longer than max_seqlen_q
    dict(max_kv=3),
    dict(kv_index=torch.tensor([0, 3, 1])),  # out of [0, Bk)
    dict(kv_index=torch.tensor([0, -1, 1])),
    dict(num_targets=torch.tensor([1, -1, 0])),  # negative
    dict(num_targets=torch.tensor([0, 1, 0])),  # more targets than keys
    dict(num_targets=torch.tensor([0, 0, 5]), kv_index=torch.tensor([0, 1, 0])),
]


@pytest.mark.parametrize("kwargs", REJECT)
def test_device_condition_rejects(kwargs):
    args = dict(q_off=GOOD, kv_off=GOOD, max_q=4, max_kv=4) | kwargs
    q_off, kv_off = args.pop("q_off"), args.pop("kv_off")
    with pytest.raises(RuntimeError, match="validate='full'"):
        _device_check(q_off, kv_off, args.pop("max_q"), args.pop("max_kv"), **args)


def test_device_condition_accepts_valid_input():
    _device_check(GOOD, GOOD.to(torch.int32), 4, 4)
    _device_check(GOOD, torch.tensor([0, 5, 5]), 4, 5, kv_index=torch.tensor([0, 0, 1]),
                  num_targets=torch.tensor([2, 5, 0]))  # fmt: skip
    _device_check(torch.tensor([0]), torch.tensor([0]), 0, 0)  # an empty batch
    _device_check(torch.tensor([0, 0]), torch.tensor([0, 0]), 0, 0,
                  num_targets=torch.tensor([0]))  # fmt: skip


# The one-kernel flag of CUDA calls (``_triton/_checks.py``), run by the interpreter on CPU
# tensors: the same verdicts as the PyTorch-op condition, rule by rule and on random input.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1"
)


def _kernel_verdict(q_off, kv_off, max_q, max_kv, *, kv_index=None, num_targets=None, tq=None,
                    tk=None) -> bool:  # fmt: skip
    from hyperrec.jagged_attn._triton._checks import values_ok

    tq = int(q_off[-1]) if tq is None else tq
    tk = int(kv_off[-1]) if tk is None else tk
    args = (tq, tk, q_off, kv_off, max_q, max_kv, kv_index, num_targets)
    got = bool(values_ok(*args))
    assert got == bool(_validate._device_condition(*args))
    return got


@needs_interpreter
@pytest.mark.parametrize("kwargs", REJECT)
def test_check_kernel_rejects(kwargs):
    args = dict(q_off=GOOD, kv_off=GOOD, max_q=4, max_kv=4) | kwargs
    q_off, kv_off = args.pop("q_off"), args.pop("kv_off")
    assert not _kernel_verdict(q_off, kv_off, args.pop("max_q"), args.pop("max_kv"), **args)


@needs_interpreter
def test_check_kernel_accepts_valid_input():
    assert _kernel_verdict(GOOD, GOOD, 4, 4)
    assert _kernel_verdict(GOOD, GOOD.to(torch.int32), 4, 4)
    assert _kernel_verdict(GOOD, torch.tensor([0, 5, 5]), 4, 5, kv_index=torch.tensor([0, 0, 1]),
                           num_targets=torch.tensor([2, 5, 0]))  # fmt: skip
    assert _kernel_verdict(torch.tensor([0]), torch.tensor([0]), 0, 0)  # an empty batch
    assert _kernel_verdict(torch.tensor([0, 0]), torch.tensor([0, 0]), 0, 0,
                           num_targets=torch.tensor([0]))  # fmt: skip


@needs_interpreter
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_check_kernel_matches_torch_condition(data):
    n = data.draw(st.integers(0, 6), label="B")
    lens = data.draw(st.lists(st.integers(-2, 6), min_size=n, max_size=n), label="lengths")
    q_off = torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()])
    q_off[0] = data.draw(st.sampled_from([0, 0, 0, 1]), label="first")
    same = data.draw(st.booleans(), label="self-attention")
    use_map = not same and data.draw(st.booleans(), label="map")
    n_kv = data.draw(st.integers(0, 4), label="Bk") if use_map else n
    k_lens = data.draw(st.lists(st.integers(-1, 6), min_size=n_kv, max_size=n_kv))
    kv_off = q_off if same else torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()])
    kv_index = None
    if use_map:
        kv_index = torch.tensor(data.draw(st.lists(st.integers(-1, n_kv), min_size=n,
                                                   max_size=n)), dtype=torch.long)  # fmt: skip
    targets = None
    if data.draw(st.booleans(), label="targets"):
        targets = torch.tensor(data.draw(st.lists(st.integers(-1, 7), min_size=n, max_size=n)),
                               dtype=torch.int32)  # fmt: skip
    tq = int(q_off[-1]) + data.draw(st.sampled_from([0, 0, 0, 1]), label="tq shift")
    tk = int(kv_off[-1])
    max_q = data.draw(st.integers(0, 7), label="max_q")
    max_kv = data.draw(st.integers(0, 7), label="max_kv")
    _kernel_verdict(q_off, kv_off, max_q, max_kv, kv_index=kv_index, num_targets=targets,
                    tq=tq, tk=tk)  # fmt: skip


def test_device_checks_run_once_per_tensor_version(monkeypatch):
    calls = []
    monkeypatch.setattr(_validate, "_assert_async", lambda cond, msg: calls.append(bool(cond)))
    monkeypatch.setattr(_validate, "_checked", type(_validate._checked)())
    off = torch.tensor([0, 3, 3, 7])
    _device_check(off, off, 4, 4)
    _device_check(off, off, 4, 4)  # same object, same version: cached
    assert calls == [True]
    _device_check(off, off, 5, 4)  # other scalars: checked again
    assert calls == [True, True]
    off[1] = 9  # modified in place: checked again, and now invalid
    _device_check(off, off, 4, 4)
    assert calls == [True, True, False]
    _device_check(off.clone(), off, 4, 4)  # another object
    assert len(calls) == 4


# ----------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1",
    reason="needs a CUDA GPU (not the interpreter)",
)


def _gpu_inputs(lens, heads=2, dim=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, v, off


@pytest.mark.gpu
@needs_cuda
def test_gpu_check_kernel_verdicts():
    # the one-launch check on the GPU against the PyTorch condition, rule by rule
    from hyperrec.jagged_attn._triton._checks import values_ok

    cases = [dict(q_off=GOOD, kv_off=GOOD, max_q=4, max_kv=4) | kw for kw in REJECT]
    cases.append(dict(q_off=GOOD, kv_off=GOOD, max_q=4, max_kv=4))
    cases.append(dict(q_off=GOOD, kv_off=torch.tensor([0, 5, 5]), max_q=4, max_kv=5,
                      kv_index=torch.tensor([0, 0, 1]),
                      num_targets=torch.tensor([2, 5, 0])))  # fmt: skip
    for c in cases:
        c = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
        q_off, kv_off = c["q_off"], c["kv_off"]
        args = (int(q_off[-1]) if c.get("tq") is None else c["tq"],
                int(kv_off[-1]) if c.get("tk") is None else c["tk"], q_off, kv_off,
                c["max_q"], c["max_kv"], c.get("kv_index"), c.get("num_targets"))  # fmt: skip
        assert bool(values_ok(*args)) == bool(_validate._device_condition(*args)), c


@pytest.mark.gpu
@needs_cuda
def test_gpu_default_path_never_syncs():
    lens = [300, 0, 17, 129, 64]
    q, k, v, off = _gpu_inputs(lens)
    targets = torch.tensor([3, 0, 1, 5, 0], device="cuda")
    jagged_attention(q, k, v, off, 300, causal=True)  # compile outside the check
    gdpa(q, k, v, off, off, 300, 300, causal=True, num_targets=targets)
    torch.cuda.synchronize()
    fresh = off.clone()  # offsets never seen: the device checks and schedules run
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = jagged_attention(q, k, v, fresh, 300, causal=True)
        out2 = gdpa(q, k, v, fresh, fresh.clone(), 300, 300, causal=True, num_targets=targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    want = jagged_attention(q, k, v, off, 300, causal=True, validate=False)
    assert torch.equal(out, want) and torch.isfinite(out2).all()
    # The opt-in full check reads the values on the host: a sync, and ValueErrors.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            jagged_attention(q, k, v, off, 300, validate="full")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="max_seqlen=200 is smaller"):
        jagged_attention(q, k, v, off, 200, validate="full")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("total", "first", "max_len"), [(10, 8, 4), (600, 400, 300)])
def test_gpu_default_check_is_a_device_assert(total, first, max_len):
    # A device-side assert poisons the CUDA context, so it runs in a child process.
    # (10, 8, 4): short sequences, a check of its own; (600, 400, 300): a call long enough
    # for the tile-schedule kernel, which asserts the check itself (the Gluon path on Hopper).
    code = textwrap.dedent(
        f"""
        import torch
        from hyperrec.jagged_attn import jagged_attention
        q = torch.randn({total}, 2, 64, device="cuda", dtype=torch.bfloat16)
        off = torch.tensor([0, {first}, {total}], device="cuda")
        jagged_attention(q, q, q, off, {max_len})  # max_seqlen below the longest sequence
        torch.cuda.synchronize()
        print("no error")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=os.environ.copy(), check=False)  # fmt: skip
    assert proc.returncode != 0 and "no error" not in proc.stdout
    assert "assert" in (proc.stderr + proc.stdout).lower()
