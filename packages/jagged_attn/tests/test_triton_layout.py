"""Inputs the kernels read in place and inputs they copy first (misaligned views), and the
eager path that skips the custom op's dispatch: same results and gradients either way."""

from __future__ import annotations

import os

import pytest
import torch

from hyperrec.jagged_attn import jagged_attention
from hyperrec.jagged_attn._triton import _launch
from hyperrec.jagged_attn._triton.ops import ALIGNMENT, _eager, needs_copy

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _at_offset(shape, offset_bytes: int, dtype=torch.bfloat16, row_pad: int = 0):
    """A (T, H, D) tensor whose data starts ``offset_bytes`` into a fresh buffer, with rows
    ``row_pad`` elements longer than H * D (a view, as q sliced out of a packed buffer)."""
    t, h, d = shape
    item = torch.empty((), dtype=dtype).element_size()
    row = h * d + row_pad
    buf = torch.zeros(t * row * item + offset_bytes + 64, dtype=torch.uint8)
    base = buf[offset_bytes : offset_bytes + t * row * item].view(dtype).view(t, row)
    out = base[:, : h * d].view(t, h, d) if row_pad == 0 else base[:, : h * d].unflatten(1, (h, d))
    out.copy_(torch.randn(shape).to(dtype))
    return out


def test_needs_copy_decision():
    shape = (6, 2, 32)
    assert not needs_copy(torch.randn(shape).to(torch.bfloat16))  # fresh: aligned, in place
    assert torch.randn(8).data_ptr() % ALIGNMENT == 0  # (the test's premise on this host)
    assert needs_copy(_at_offset(shape, 8))  # base 8 bytes off: copy
    assert needs_copy(_at_offset(shape, 2))
    assert not needs_copy(_at_offset(shape, 16))  # 16-byte aligned: read in place
    assert not needs_copy(_at_offset(shape, 128))
    assert needs_copy(_at_offset(shape, 0, row_pad=4))  # rows of 68 bf16 = 136 bytes
    assert not needs_copy(_at_offset(shape, 0, row_pad=8))  # rows of 144 bytes: fine
    assert needs_copy(torch.randn(6, 32, 2).to(torch.bfloat16).transpose(1, 2))  # last dim
    # head dim of 20 bf16 (40 bytes): a contiguous copy's rows are no better aligned, so a
    # padded-row view is read in place (only a misaligned base is worth a copy)
    assert not needs_copy(_at_offset((6, 2, 20), 0, row_pad=2))
    assert needs_copy(_at_offset((6, 2, 20), 8))
    assert not needs_copy(_at_offset((0, 2, 32), 8))  # empty: nothing to read
    # strides of dims of size 1 never matter
    one = torch.randn(1, 2, 32).to(torch.bfloat16).as_strided((1, 2, 32), (3, 32, 1))
    assert not needs_copy(one)


needs_kernels = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


@needs_kernels
@pytest.mark.parametrize("grad", [False, True])
def test_misaligned_inputs_are_copied_and_exact(grad, monkeypatch):
    lens = (5, 0, 11)
    shape = (sum(lens), 2, 32)
    off = torch.tensor([0, 5, 5, 16])
    q, k, v = (_at_offset(shape, 8) for _ in range(3))
    aligned = [t.clone() for t in (q, k, v)]
    seen = []
    real = _launch._launch_persistent

    def spy(kernel, work, device, cfg, key, args, kw):
        seen.extend(a.data_ptr() % ALIGNMENT for a in args[:3])
        return real(kernel, work, device, cfg, key, args, kw)

    monkeypatch.setattr(_launch, "_launch_persistent", spy)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        aligned = [t.requires_grad_() for t in aligned]
    got = jagged_attention(q, k, v, off, 11, causal=True, backend="triton")
    want = jagged_attention(*aligned, off, 11, causal=True, backend="triton")
    assert seen and not any(seen)  # the kernels read aligned copies
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if grad:
        do = torch.randn_like(got)
        g_got = torch.autograd.grad(got, (q, k, v), do)
        g_want = torch.autograd.grad(want, aligned, do)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_kernels
def test_eager_path_equals_custom_op():
    # The eager path (no custom op dispatch) and the op give the same outputs and
    # gradients; a dispatch mode (here the FLOP counter) routes calls through the op.
    from torch.utils.flop_counter import FlopCounterMode

    off = torch.tensor([0, 7, 7, 20])
    q, k, v = (torch.randn(20, 2, 32).to(torch.bfloat16).requires_grad_() for _ in range(3))
    assert _eager(q, k, v)
    out = jagged_attention(q, k, v, off, 13, causal=True, backend="triton")
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    with FlopCounterMode(display=False) as counter:
        assert not _eager(q, k, v)
        out_op = jagged_attention(q, k, v, off, 13, causal=True, backend="triton")
        grads_op = torch.autograd.grad(out_op.float().square().sum(), (q, k, v))
    assert counter.get_total_flops() > 0  # the op was seen
    torch.testing.assert_close(out, out_op, rtol=0, atol=0)
    for a, b in zip(grads, grads_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(
            jagged_attention(q, k, v, off, 13, causal=True, backend="triton"), out, rtol=0, atol=0
        )


# ----------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------

GPU = torch.cuda.is_available() and not INTERPRET


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (not the interpreter)")
@pytest.mark.parametrize("shift", [2, 8])
def test_gpu_misaligned_inputs(shift):
    # Shipped configurations (tensor descriptors): misaligned views are copied, the result
    # and the gradients equal those of aligned inputs bit for bit.
    lens = [300, 0, 1, 129, 64, 513]
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    shape = (sum(lens), 4, 128)
    aligned = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3)]
    moved = []
    for t in aligned:
        buf = torch.empty(t.numel() * 2 + shift + 64, dtype=torch.uint8, device="cuda")
        moved.append(buf[shift : shift + t.numel() * 2].view(torch.bfloat16).view(shape))
        moved[-1].copy_(t)
    assert all(needs_copy(t) for t in moved)
    leaves_a = [t.clone().requires_grad_() for t in aligned]
    leaves_m = [t.requires_grad_() for t in moved]
    out_a = jagged_attention(*leaves_a, off, 513, causal=True)
    out_m = jagged_attention(*leaves_m, off, 513, causal=True)
    assert torch.equal(out_a, out_m)
    do = torch.randn_like(out_a)
    for a, m in zip(torch.autograd.grad(out_a, leaves_a, do),
                    torch.autograd.grad(out_m, leaves_m, do)):  # fmt: skip
        assert torch.equal(a, m)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (not the interpreter)")
def test_gpu_eager_path_equals_custom_op():
    from torch.utils.flop_counter import FlopCounterMode

    lens = [300, 0, 1, 129, 64, 513]
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    q, k, v = (torch.randn(sum(lens), 4, 128, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    do = torch.randn(sum(lens), 4, 128, device="cuda").to(torch.bfloat16)
    out = jagged_attention(q, k, v, off, 513, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    with FlopCounterMode(display=False):
        out_op = jagged_attention(q, k, v, off, 513, causal=True)
        grads_op = torch.autograd.grad(out_op, (q, k, v), do)
    assert torch.equal(out, out_op)
    for a, b in zip(grads, grads_op):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------
# Direct relaunch (``_triton/_direct.py``, on by default): its bookkeeping, on stand-ins for a
# Triton kernel and its compiled launcher (the real replay is a GPU test)
# ----------------------------------------------------------------------------------------


class _Param:
    def __init__(self, name, do_not_specialize=False):
        self.name, self.do_not_specialize = name, do_not_specialize


class _FakeKernel:
    """Parameters (X, n, stride, BLOCK); its binder returns them in that order."""

    def __init__(self, reorder=False):
        self.params = [_Param("X"), _Param("n", True), _Param("stride"), _Param("BLOCK")]

        def binder(X, n, stride, BLOCK=64, **options):
            params = dict(X=X, n=n, stride=stride, BLOCK=BLOCK)
            if reorder:
                params = dict(n=n, X=X, stride=stride, BLOCK=BLOCK)
            return params, [], options

        self.device_caches = {0: (None, None, None, None, binder)}


class _FakeCompiled:
    function, packed_metadata = "fn", "md"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *values):
        return None

    def run(self, *launch):
        self.runs.append(launch)


@pytest.fixture
def fake_triton(monkeypatch):
    from hyperrec.jagged_attn._triton import _direct

    monkeypatch.setattr(_direct, "_current_device", lambda: 0)
    monkeypatch.setattr(_direct, "_current_stream", lambda device: "stream")
    monkeypatch.setattr(_direct, "_hooks", lambda: (None, None))
    monkeypatch.setattr(_direct, "_CONVENTION", [True])
    return _direct


def test_relauncher_replays_and_falls_back(fake_triton):
    x = torch.zeros(64)
    compiled = _FakeCompiled()
    r = fake_triton.Relauncher(_FakeKernel(), compiled, (x, 7, 32), dict(BLOCK=128), {})
    assert r.ok
    y = torch.zeros(32)
    assert r((5,), (y, 2**20, 32))  # new tensor and unspecialised int: replayed
    assert compiled.runs == [(5, 1, 1, "stream", "fn", "md", None, None, None, y, 2**20, 32, 128)]
    assert r((5, 3), (y, 2**20, 32))  # a 2-D grid
    assert compiled.runs[-1][:3] == (5, 3, 1)
    z = torch.zeros(33)[1:]  # 4 bytes off: Triton would compile another variant
    assert not r((5,), (z, 7, 32))
    assert not r((5,), (y, 7, 48))  # a specialised int changed
    assert not r((5,), (y, 2**31, 32))  # beyond int32: another signature
    fake_triton._current_device = lambda: 1  # another current device
    assert not r((5,), (y, 2**20, 32))
    assert len(compiled.runs) == 2


def test_launch_records_then_replays(fake_triton, monkeypatch):
    calls = []
    compiled = _FakeCompiled()

    class Kernel(_FakeKernel):
        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append((grid, args, kw))
                return compiled

            return run

    monkeypatch.setattr(fake_triton, "RELAUNCH", {})
    monkeypatch.setattr(fake_triton, "direct_requested", lambda: True)
    k, x = Kernel(), torch.zeros(64)
    assert fake_triton.launch(k, (2,), ("k",), (x, 7, 32), dict(BLOCK=128), {}) is compiled
    assert fake_triton.launch(k, (3,), ("k",), (x, 9, 32), dict(BLOCK=128), {}) is None
    assert len(calls) == 1 and compiled.runs[0][:3] == (3, 1, 1)  # the second was replayed
    assert fake_triton.launch(k, (3,), ("k",), (x, 9, 48), dict(BLOCK=128), {}) is compiled
    assert len(calls) == 2  # a specialised int changed: Triton's path
    monkeypatch.setattr(fake_triton, "direct_requested", lambda: False)
    fake_triton.launch(k, (3,), ("k",), (x, 9, 32), dict(BLOCK=128), {})
    assert len(calls) == 3  # switched off: always Triton's path


def test_direct_launch_switch(monkeypatch):
    from hyperrec.jagged_attn._triton import _direct

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(_direct.DIRECT_ENV, raising=False)
    assert _direct.direct_requested()  # on by default
    monkeypatch.setenv(_direct.DIRECT_ENV, "0")
    assert not _direct.direct_requested()
    monkeypatch.setenv(_direct.DIRECT_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _direct.direct_requested()  # the interpreter has no compiled launcher


def test_relauncher_refuses_what_it_cannot_replay(fake_triton, monkeypatch):
    x = torch.zeros(64)
    misaligned = torch.zeros(33)[1:]
    assert not fake_triton.Relauncher(_FakeKernel(), _FakeCompiled(), (misaligned, 7, 32),
                                      dict(BLOCK=128), {}).ok  # fmt: skip
    assert not fake_triton.Relauncher(_FakeKernel(reorder=True), _FakeCompiled(), (x, 7, 32),
                                      dict(BLOCK=128), {}).ok  # fmt: skip
    monkeypatch.setattr(fake_triton, "_CONVENTION", [False])
    assert not fake_triton.Relauncher(_FakeKernel(), _FakeCompiled(), (x, 7, 32),
                                      dict(BLOCK=128), {}).ok  # fmt: skip


def test_run_convention_of_this_triton():
    # The replayed call is the one this Triton's JITFunction.run makes (read from its
    # source); a Triton that changed it turns the opt-in off instead of misusing it.
    import triton

    from hyperrec.jagged_attn._triton._direct import _convention_ok

    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if not (3, 6) <= version <= (3, 9):
        pytest.skip(f"convention only known for Triton 3.6-3.9, got {triton.__version__}")
    assert _convention_ok()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (not the interpreter)")
def test_gpu_direct_relaunch_equals_triton_launch(monkeypatch):
    from hyperrec.jagged_attn._triton import _direct
    from hyperrec.jagged_attn._triton._direct import DIRECT_ENV

    lens = [300, 0, 1, 129, 64, 513]
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    q, k, v = (torch.randn(sum(lens), 4, 128, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    do = torch.randn(sum(lens), 4, 128, device="cuda").to(torch.bfloat16)

    def run(offsets, max_len=513):
        out = jagged_attention(q, k, v, offsets, max_len, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    monkeypatch.setenv(DIRECT_ENV, "0")
    want = run(off.clone())
    monkeypatch.setenv(DIRECT_ENV, "1")
    monkeypatch.setattr(_direct, "RELAUNCH", {})
    replays = []
    real = _direct.Relauncher.__call__

    def counted(self, grid, args):
        done = real(self, grid, args)
        replays.append(done)
        return done

    monkeypatch.setattr(_direct.Relauncher, "__call__", counted)
    # new offsets objects: schedules (with the fused check) built; then the same offsets
    # with another max_seqlen: cached schedules, the separate check kernel
    o1 = off.clone()
    first = run(o1)  # Triton's launches; relaunchers recorded
    run(o1, 600)  # (replays the attention kernels; records the check kernel's)
    assert {key[0] for key in _direct.RELAUNCH} >= {"tiles", "checks", "delta"}
    assert _direct.RELAUNCH and all(r.ok for r in _direct.RELAUNCH.values()), (
        "this Triton's launch convention is not replayable"
    )
    o2 = off.clone()
    again = run(o2)  # replayed
    again_600 = run(o2, 600)
    assert sum(replays) >= 6, replays  # tiles x2, attention x3, delta (at least)
    for a, b, c, d in zip(want, first, again, again_600):
        assert torch.equal(a, d)
        assert torch.equal(a, b) and torch.equal(a, c)
