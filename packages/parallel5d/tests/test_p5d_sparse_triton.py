"""The fused Triton row updates against the PyTorch rules and a float64 reference (CPU,
``TRITON_INTERPRET=1``), and the backend resolution."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from _p5d_sparse_cases import FEATURES, make_inputs, rank_loss, tables

from hyperrec.parallel5d.sparse import (
    LazyAdagrad,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
)
from hyperrec.parallel5d.sparse._dispatch import resolve_backend
from hyperrec.parallel5d.sparse._triton import interpreting
from hyperrec.parallel5d.sparse.optim import (
    adagrad_rows_,
    adam_rows_,
    rowwise_adagrad_rows_,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _case(dim: int, dtype: torch.dtype, n_rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    total = 13
    weight = torch.randn(total, dim, generator=g).to(dtype)
    state1 = torch.rand(total, generator=g) + 0.1
    state_el = torch.rand(total, dim, generator=g) * 0.2
    state_el2 = torch.rand(total, dim, generator=g) * 0.01 + 1e-4
    rows = torch.randperm(total, generator=g)[:n_rows].sort().values
    grad = torch.randn(n_rows, dim, generator=g)
    return weight, state1, state_el, state_el2, rows, grad


def _to(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.clone().to(device=DEVICE, dtype=dtype or t.dtype)


def _check(kernel_out, torch_out, ref64, untouched_before, rows):
    for k, t, r in zip(kernel_out, torch_out, ref64, strict=True):
        k, t, r = k.cpu().double(), t.cpu().double(), r.cpu()
        err_k = (k - r).abs().max().item() if k.numel() else 0.0
        err_t = (t - r).abs().max().item() if t.numel() else 0.0
        assert err_k <= 2 * err_t + 1e-6, (err_k, err_t)
    # rows outside ``rows`` are not written
    keep = torch.ones(untouched_before.shape[0], dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(kernel_out[0].cpu()[keep], untouched_before[keep])


@pytest.mark.parametrize("dim", [1, 5, 128, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "l2", "decoupled"])
def test_rowwise_adagrad_kernel(dim, dtype, mode):
    from hyperrec.parallel5d.sparse._triton.update import rowwise_adagrad_rows

    w, m, _, _, rows, grad = _case(dim, dtype, 6, dim)
    hp = {
        "lr": 0.3,
        "eps": 1e-8,
        "weight_decay": 0.0 if mode == "none" else 0.05,
        "weight_decay_mode": "l2" if mode == "none" else mode,
    }
    kw, km = _to(w), _to(m)
    rowwise_adagrad_rows(kw, km, _to(rows), _to(grad), **hp)
    tw, tm = w.clone(), m.clone()
    rowwise_adagrad_rows_(tw, tm, rows, grad, **hp)
    rw, rm = w.double(), m.double()
    rowwise_adagrad_rows_(rw, rm, rows, grad.double(), **hp)
    _check((kw, km), (tw, tm), (rw, rm), w, rows)


@pytest.mark.parametrize("dim", [3, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adagrad_and_adam_kernels(dim, dtype):
    from hyperrec.parallel5d.sparse._triton.update import adagrad_rows, adam_rows

    w, _, s, v, rows, grad = _case(dim, dtype, 5, 7 + dim)
    kw, ks = _to(w), _to(s)
    adagrad_rows(kw, ks, _to(rows), _to(grad), lr=0.2, eps=1e-10)
    tw, ts = w.clone(), s.clone()
    adagrad_rows_(tw, ts, rows, grad, lr=0.2, eps=1e-10)
    rw, rs = w.double(), s.double()
    adagrad_rows_(rw, rs, rows, grad.double(), lr=0.2, eps=1e-10)
    _check((kw, ks), (tw, ts), (rw, rs), w, rows)

    m = s * 0.1
    step, lr, b1, b2, wd = 3, 0.05, 0.8, 0.95, 0.01
    step_size = lr * (1 - b2**step) ** 0.5 / (1 - b1**step)
    kw, km, kv = _to(w), _to(m), _to(v)
    adam_rows(kw, km, kv, _to(rows), _to(grad), beta1=b1, beta2=b2, eps=1e-8,
              decay=1 - lr * wd, step_size=step_size)  # fmt: skip
    hp = {"lr": lr, "beta1": b1, "beta2": b2, "eps": 1e-8, "weight_decay": wd, "step": step}
    tw, tm, tv = w.clone(), m.clone(), v.clone()
    adam_rows_(tw, tm, tv, rows, grad, **hp)
    rw, rm, rv = w.double(), m.double(), v.double()
    adam_rows_(rw, rm, rv, rows, grad.double(), **hp)
    _check((kw, km, kv), (tw, tm, tv), (rw, rm, rv), w, rows)


def test_empty_rows_are_a_no_op():
    from hyperrec.parallel5d.sparse._triton.update import rowwise_adagrad_rows

    w, m, _, _, _, _ = _case(4, torch.float32, 0, 1)
    kw = _to(w)
    rowwise_adagrad_rows(kw, _to(m), _to(torch.empty(0, dtype=torch.long)),
                         _to(torch.empty(0, 4)), lr=1.0, eps=1e-8, weight_decay=0.0,
                         weight_decay_mode="l2")  # fmt: skip
    assert torch.equal(kw.cpu(), w)


@pytest.mark.parametrize("cls", [RowWiseAdagrad, LazyAdagrad, LazyAdam])
def test_optimizers_with_the_triton_backend_match_torch(cls):
    colls = [ShardedEmbeddingCollection(tables(), FEATURES, device=DEVICE) for _ in range(2)]
    opts = [cls(colls[0], backend="triton"), cls(colls[1], backend="torch")]
    assert opts[0].backend == "triton" and opts[1].backend == "torch"
    for step in range(2):
        for c, o in zip(colls, opts, strict=True):
            inputs = {
                k: tuple(x.to(DEVICE) for x in v) if isinstance(v, tuple) else v.to(DEVICE)
                for k, v in make_inputs(step, 0).items()
            }
            rank_loss({k: v.cpu() for k, v in c(inputs).items()}, step, 0).backward()
            o.step()
    a, b = colls[0].full_weights(), colls[1].full_weights()
    for name in a:
        assert torch.allclose(a[name].cpu(), b[name].cpu(), rtol=1e-5, atol=1e-6), name


def test_backend_resolution(monkeypatch):
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match=r"backend must be one of"):
        resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors"):
        resolve_backend("triton", torch.device("cpu"))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hyperrec.parallel5d.sparse._triton.update import _cast_out  # noqa: E402


@triton.jit
def _store_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    d = tl.arange(0, BLOCK)
    m = d < n
    x = tl.load(x_ptr + d, mask=m)
    tl.store(y_ptr + d, _cast_out(x, True).to(tl.bfloat16), mask=m)


def test_bf16_store_rounds_like_torch():
    """The kernels' bf16 stores round to nearest even, as ``Tensor.to(bfloat16)`` does
    (the interpreter alone would truncate), including signs, extremes and infinities."""
    g = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-30, 30, (2000,), generator=g).float()
    special = torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0, -0.0])
    x = torch.cat([torch.randn(2000, generator=g) * scale, special]).to(DEVICE)
    y = torch.empty_like(x, dtype=torch.bfloat16)
    _store_bf16[(1,)](x, y, x.numel(), BLOCK=4096)
    assert torch.equal(y.float(), x.to(torch.bfloat16).float())
