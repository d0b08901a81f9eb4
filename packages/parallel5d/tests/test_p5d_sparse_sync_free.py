"""The sync-free lookup of one rank (``sync_free=True``): the padded unique against
``torch.unique``, training equal to the exact-size path bit for bit with every optimizer
and backend, padding rows skipped by the fused updates, errors; on a GPU, no host sync
in a whole training step."""

from __future__ import annotations

import pytest
import torch
from _p5d_sparse_cases import FEATURES, STATES, make_inputs, make_optimizer, rank_loss, tables
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.parallel5d.sparse import ShardedEmbeddingCollection, collection
from hyperrec.parallel5d.sparse._triton import interpreting
from hyperrec.parallel5d.sparse.collection import unique_padded
from hyperrec.testing import fake_mesh

BACKENDS = ["torch"] + (["triton"] if interpreting() or torch.cuda.is_available() else [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=64))
def test_unique_padded_matches_torch_unique(values):
    keys = torch.tensor(values, dtype=torch.long)
    unique, inverse = unique_padded(keys, pad=41)
    ref_u, ref_inv = torch.unique(keys, sorted=True, return_inverse=True)
    n = ref_u.numel()
    assert unique.shape == keys.shape and inverse.shape == keys.shape
    assert torch.equal(unique[:n], ref_u)
    assert torch.equal(unique[n:], torch.full((keys.numel() - n,), 41))
    assert torch.equal(inverse, ref_inv)
    assert torch.equal(unique[inverse], keys)


def _pair(dtype=torch.float32):
    return [
        ShardedEmbeddingCollection(tables(dtype), FEATURES, sync_free=flag, validate=False)
        for flag in (True, False)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad", "adam"])
def test_training_equals_the_exact_size_lookup(kind, backend):
    padded, exact = _pair()
    assert padded.sync_free and not exact.sync_free
    opts = [make_optimizer(kind, c) for c in (padded, exact)]
    for opt in opts:
        opt.backend = backend
    for step in range(4):
        inputs = make_inputs(step, 0)
        outs = [c(inputs) for c in (padded, exact)]
        for name in outs[1]:
            assert torch.equal(outs[0][name], outs[1][name]), (step, name)
        for out, opt in zip(outs, opts, strict=True):
            rank_loss(out, step, 0).backward()
            opt.step()
    for name, w in exact.full_weights().items():
        assert torch.equal(padded.full_weights()[name], w), name
        for s in STATES[kind]:
            assert torch.equal(opts[0].full_state(name, s), opts[1].full_state(name, s)), s


def test_gradient_accumulation_and_empty_batches():
    padded, exact = _pair()
    opts = [make_optimizer("rowwise_adagrad", c) for c in (padded, exact)]
    empty = {
        name: torch.empty(0, dtype=torch.long)
        if not isinstance(v, tuple)
        else (torch.empty(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        for name, v in make_inputs(0, 0).items()
    }
    for c, opt in zip((padded, exact), opts, strict=True):
        for step, inputs in enumerate([make_inputs(0, 0), empty, make_inputs(1, 0)]):
            rank_loss(c(inputs), step, 0).backward()
        opt.step()
    for name, w in exact.full_weights().items():
        assert torch.equal(padded.full_weights()[name], w), name


def test_the_sync_free_path_never_calls_torch_unique(monkeypatch):
    padded, _ = _pair()
    opt = make_optimizer("adam", padded)

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.unique called on the sync-free path")

    monkeypatch.setattr(collection.torch, "unique", forbidden)
    rank_loss(padded(make_inputs(2, 0)), 2, 0).backward()
    opt.step()


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_updates_skip_padding_rows():
    from hyperrec.parallel5d.sparse._triton.update import (
        adagrad_rows,
        adam_rows,
        rowwise_adagrad_rows,
    )

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(6, 8, generator=g).to(dev)
    rows = torch.tensor([1, 4, 6, 6, 6], device=dev)  # 6 == len(w0): padding
    grad = torch.randn(5, 8, generator=g).to(dev)
    grad[2:] = 0.0
    for fn, states in (
        (rowwise_adagrad_rows, [torch.rand(6, device=dev) + 0.1]),
        (adagrad_rows, [torch.rand(6, 8, device=dev) + 0.1]),
        (adam_rows, [torch.rand(6, 8, device=dev), torch.rand(6, 8, device=dev) + 0.1]),
    ):
        w, before = w0.clone(), [s.clone() for s in states]
        kw = {"lr": 0.1, "eps": 1e-8}
        if fn is rowwise_adagrad_rows:
            kw |= {"weight_decay": 0.0, "weight_decay_mode": "l2"}
        if fn is adam_rows:
            kw = {"beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "decay": 1.0, "step_size": 0.1}
        fn(w, *states, rows, grad, **kw)
        untouched = torch.tensor([0, 2, 3, 5], device=dev)
        assert torch.equal(w[untouched], w0[untouched]), fn.__name__
        assert not torch.equal(w[rows[:2]], w0[rows[:2]]), fn.__name__
        for s, b in zip(states, before, strict=True):
            assert torch.equal(s[untouched], b[untouched]), fn.__name__


def test_sync_free_errors():
    with pytest.raises(TypeError, match="sync_free"):
        ShardedEmbeddingCollection(tables(), FEATURES, sync_free="yes")
    with fake_mesh((2,), mesh_dim_names=("shard",)) as mesh:
        with pytest.raises(ValueError, match=r"sync_free=True needs a job of one rank, got 2"):
            ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh, sync_free=True)
        assert not ShardedEmbeddingCollection(tables(), FEATURES, mesh=mesh).sync_free
    # default: on for one rank on CUDA only
    assert not ShardedEmbeddingCollection(tables(), FEATURES).sync_free


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_training_step_has_no_host_sync():
    coll = ShardedEmbeddingCollection(tables(), FEATURES, device="cuda", validate=False)
    assert coll.sync_free
    opt = make_optimizer("rowwise_adagrad", coll)
    inputs = [
        {
            k: tuple(t.cuda() for t in v) if isinstance(v, tuple) else v.cuda()
            for k, v in make_inputs(s, 0).items()
        }
        for s in range(3)
    ]
    projections = [torch.randn(64, 8, device="cuda") for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            out = coll(inputs[step])
            loss = sum(
                (o.float().sum(0) * projections[step][0, : o.shape[1]]).sum() for o in out.values()
            )
            loss.backward()
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
