"""Adversarial inputs the public functions accept: each test pins a bug that was found by
feeding valid but unusual input (strided index tensors, empty batches in the backward,
create_graph=True) and compares with a float64 formula written here from the README."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hyperrec.jagged_attn import block_attention, gdpa, jagged_attention
from hyperrec.jagged_attn._triton import interpreting, supports

_TRITON = pytest.mark.skipif(
    not (interpreting() and supports(torch.device("cpu"), torch.bfloat16)),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1) for the kernels on CPU tensors",
)
BACKENDS = ["torch", pytest.param("triton", marks=_TRITON)]
H, D = 2, 16


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)


def _strided(t: torch.Tensor, junk: int) -> torch.Tensor:
    """The values of ``t`` as a non-contiguous view (every other element of a buffer whose
    other elements are ``junk``)."""
    out = torch.stack([t, torch.full_like(t, junk)], 1).reshape(-1)[::2]
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def _expected(q, k, v, q_off, kv_off, *, act, causal, targets=None, kv_index=None):
    """float64, per pair, straight from the README: bottom-right causal, HSTU targets."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    rows = []
    for b in range(q_off.numel() - 1):
        m = b if kv_index is None else int(kv_index[b])
        qs, qe, ks, ke = int(q_off[b]), int(q_off[b + 1]), int(kv_off[m]), int(kv_off[m + 1])
        lq, lk = qe - qs, ke - ks
        t0 = lk - (0 if targets is None else int(targets[b]))
        allowed = torch.zeros(lq, lk, dtype=torch.bool)
        for i in range(lq):
            p = i + lk - lq
            for j in range(lk):
                allowed[i, j] = (j == p) if j >= t0 else (not causal or j <= min(p, t0))
        s = torch.einsum("ihd,jhd->hij", q[qs:qe], k[ks:ke]) / math.sqrt(q.shape[2])
        if act == "softmax":
            w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num() * allowed
        else:
            w = torch.where(allowed, F.silu(s), 0.0)
        rows.append((qs, qe, torch.einsum("hij,jhd->ihd", w, v[ks:ke])))
    for qs, qe, o in rows:
        out = torch.cat([out[:qs], o, out[qe:]])
    return out


def _check(fn, ref, tensors, tol=3e-2):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves64 = [t.detach().double().requires_grad_() for t in tensors]
    expected = ref(*leaves64)
    expected.backward(grad.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=tol, rtol=0)
    for got, want in zip(leaves, leaves64):
        scale = max(1.0, want.grad.abs().max().item())
        torch.testing.assert_close(got.grad.double(), want.grad, atol=tol * scale, rtol=0)


# --- strided offsets / kv_index / num_targets --------------------------------------------
# Before the fix the Triton kernels (and the one-launch schedule builder) indexed these as
# dense arrays: a strided view such as offsets[::2] was read as other values, giving
# garbage outputs, NaN, or heap corruption ("munmap_chunk(): invalid pointer").


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_offsets(backend, index_dtype):
    torch.manual_seed(0)
    offsets = _offsets([3, 0, 5, 4])
    strided = _strided(offsets.to(index_dtype), 3)
    q, k, v = (torch.randn(12, H, D, dtype=torch.bfloat16) for _ in range(3))
    _check(
        lambda q, k, v: jagged_attention(q, k, v, strided, 5, causal=True, backend=backend),
        lambda q, k, v: _expected(q, k, v, offsets, offsets, act="softmax", causal=True),
        [q, k, v],
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_kv_index_and_targets(backend):
    torch.manual_seed(0)
    q_off, kv_off = _offsets([3, 0, 6, 2]), _offsets([5, 2, 4, 1])
    kv_index, targets = torch.tensor([2, 2, 0, 1]), torch.tensor([1, 0, 2, 0])
    q = torch.randn(11, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(12, H, D, dtype=torch.bfloat16) for _ in range(2))
    args = (_strided(q_off, 7), _strided(kv_off, 7), 6, 5)
    _check(
        lambda q, k, v: gdpa(
            q,
            k,
            v,
            *args,
            causal=True,
            kv_index=_strided(kv_index, 5),
            num_targets=_strided(targets, 9),
            backend=backend,
        ),  # fmt: skip
        lambda q, k, v: _expected(
            q, k, v, q_off, kv_off, act="silu", causal=True, targets=targets, kv_index=kv_index
        ),  # fmt: skip
        [q, k, v],
    )


# --- the backward of an empty batch ------------------------------------------------------
# B = 0 and batches of only empty sequences are valid "so a rank that receives no sequences
# can still run its step"; the Triton backward raised AssertionError("grad_out/out: last dim
# contiguous") on the stride-0 gradient autograd passes for a sum.


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_of_empty_batch(backend, lengths):
    offsets = _offsets(lengths) if lengths else torch.zeros(1, dtype=torch.long)
    q, k, v = (torch.randn(0, H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = jagged_attention(q, k, v, offsets, 0, causal=True, backend=backend)
    out.float().sum().backward()
    assert out.shape == (0, H, D)
    assert q.grad.shape == k.grad.shape == v.grad.shape == (0, H, D)


# --- double backward ---------------------------------------------------------------------
# "First-order gradients only": the reference backend raises when its gradients are
# differentiated. The Triton eager path (once_differentiable) returned detached gradients
# when the loss was linear in the output, so a gradient penalty was dropped silently.


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises(backend):
    torch.manual_seed(0)
    offsets = _offsets([3, 5])
    q = torch.randn(8, 1, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(8, 1, D, dtype=torch.bfloat16) for _ in range(2))
    out = jagged_attention(q, k, v, offsets, 5, backend=backend)
    (grad_q,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    assert grad_q.requires_grad
    loss = out.float().sum() + grad_q.float().square().sum()  # a gradient penalty
    with pytest.raises(RuntimeError):
        loss.backward()


# --- offsets refilled behind PyTorch's version counter ----------------------------------
# The Triton backend caches tile schedules per offsets object and version counter. A
# buffer refilled through NumPy (torch.from_numpy shares memory) or through ``.data`` keeps
# its version, so the next call silently reuses the old lengths' schedule. Not fixed: a
# fix needs the offsets' values on the host (a sync per call on CUDA), which the design
# avoids; the reference backend reads them at every call and is right.


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=[
                _TRITON,
                pytest.mark.xfail(
                    strict=True,
                    reason="schedule cache keyed on the version counter: stale after an "
                    "untracked refill of the offsets buffer",
                ),
            ],
        ),
    ],
)
def test_offsets_buffer_refilled_through_numpy(backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(12, 1, D, dtype=torch.bfloat16) for _ in range(3))
    buffer = torch.tensor([0, 3, 12]).numpy()
    offsets = torch.from_numpy(buffer)  # shares memory with buffer
    jagged_attention(q, k, v, offsets, 12, causal=True, backend=backend)
    buffer[1] = 9  # the next batch's lengths, written into the same buffer
    out = jagged_attention(q, k, v, offsets, 12, causal=True, backend=backend)
    new = torch.tensor([0, 9, 12])
    expected = _expected(q, k, v, new, new, act="softmax", causal=True)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=0)


# --- windows and blocks wider than any sequence ------------------------------------------
# window_size and block_size take any int >= -1 / >= 1, and one wider than every sequence
# must act like an unbounded one. The Triton kernels did their position arithmetic in
# int32: window (2**31 - 1, -1) dropped every dK/dV contribution (the outputs were right),
# (-1, 2**31 - 5) hid every key, and block_size > 2**30 with previous_block zeroed dK/dV;
# the reference wrapped around in int64 at 2**63 - 1 and hid every key.


@pytest.mark.parametrize(
    "window", [(2**31 - 1, -1), (-1, 2**31 - 5), (2**31 - 1, 2**31 - 1), (2**63 - 1, 2**63 - 1)]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_wider_than_int32(backend, window):
    torch.manual_seed(0)
    q_off, kv_off = _offsets([5, 0, 37, 3]), _offsets([8, 4, 40, 0])
    q = torch.randn(45, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(52, H, D, dtype=torch.bfloat16) for _ in range(2))
    _check(
        lambda q, k, v: jagged_attention(
            q,
            k,
            v,
            q_off,
            37,
            kv_offsets=kv_off,
            max_seqlen_kv=40,
            causal=True,
            window_size=window,
            backend=backend,
        ),
        lambda q, k, v: _expected(q, k, v, q_off, kv_off, act="softmax", causal=True),
        [q, k, v],
    )


@pytest.mark.parametrize("block_size", [2**30 + 7, 2**31 - 1, 2**63 - 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_wider_than_int32(backend, block_size):
    torch.manual_seed(0)
    offsets = _offsets([7, 40, 0, 3])
    q, k, v = (torch.randn(50, H, D, dtype=torch.bfloat16) for _ in range(3))
    _check(
        lambda q, k, v: block_attention(
            q, k, v, offsets, 40, block_size=block_size, previous_block=True, backend=backend
        ),
        lambda q, k, v: _expected(q, k, v, offsets, offsets, act="softmax", causal=False),
        [q, k, v],
    )
