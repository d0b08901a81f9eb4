"""Adversarial cases: results must equal the same computation done with plain torch on the
full tensors, or raise by name.

Every reference here is computed from the full tensors (``torch.linalg.vector_norm``,
``torch.nn.utils.clip_grad_norm_``, sums of the per-rank gradients in fp64), never with
the package's own helpers. Each spawned rank checks its own piece and returns the
failures it saw (no collective after a possible error, so a wrong path cannot hang).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyperrec.dbuffer import DBuffer, ReduceOptions, clip_grad_norm_, grad_norm, zero_grad_
from hyperrec.testing import fake_mesh, run_on_ranks

# ------------------------------------------------------------------------ one process


def _zero_after_release() -> float:
    buf = DBuffer.from_tensors([torch.randn(4), torch.randn(1000)])
    buf.begin_grad()
    buf.grad_full.fill_(3.0)
    buf.reduce_grad()
    buf.drop_grad_(release=True)
    zero_grad_([buf])  # wrote through the released (empty) storage: a segfault
    buf.zero_grad_()
    return float(buf.grad_shard.abs().max())


def test_zero_grad_after_release_keeps_the_gradient_released():
    # zero_grad(set_to_none=True) then zero_grad(): the second call zeroed a tensor whose
    # storage had been resized to nothing. Run in a process of its own (it crashed).
    (result,) = run_on_ranks(_zero_after_release, 1)
    assert result == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grad_norm_and_clip_of_every_float_dtype(dtype):
    # An fp64 buffer (allowed, and reduced in fp64) raised in grad_norm: torch refuses a
    # narrowing vector_norm(fp64, dtype=fp32).
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, 3, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)]
    grads = [torch.randn(t.shape, generator=g).to(dtype) * 10 for t in ts]
    buf = DBuffer.from_tensors(ts)
    buf.begin_grad()
    for i, gr in enumerate(grads):
        buf.grad_full_view(i).copy_(gr)
    buf.reduce_grad()
    want = torch.linalg.vector_norm(torch.cat([gr.double().reshape(-1) for gr in grads]))
    got = grad_norm([buf])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    ref = [t.clone().requires_grad_() for t in ts]
    for r, gr in zip(ref, grads):
        r.grad = gr.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)  # in bf16 for bf16 gradients
    norm = clip_grad_norm_([buf], 1.0)
    torch.testing.assert_close(norm.double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm.double(), ref_norm.double(), rtol=1e-2, atol=0)
    for i, r in enumerate(ref):
        torch.testing.assert_close(buf.grad_full_view(i), r.grad, rtol=1e-2, atol=1e-6)


def test_reshard_keep_of_a_buffer_of_only_empty_tensors():
    # Nothing to gather, so the full storage never holds memory: reshard(keep=...) right
    # after an unshard raised "needs the full storage (call unshard first)".
    with fake_mesh((2,)) as mesh:
        buf = DBuffer([(0,), (0, 3)], mesh=mesh, param_dtype=torch.bfloat16)
        assert buf.shard_numel == 0
        for _ in range(2):
            buf.unshard()
            buf.wait_unshard()
            buf.reshard(keep=mesh.get_group())
        assert [tuple(buf.full_view(i).shape) for i in range(2)] == [(0,), (0, 3)]


@pytest.mark.parametrize("force_sum", [False, True])
@pytest.mark.parametrize("factor", [0.0, -2.0, float("nan"), float("inf")])
def test_reduce_options_refuse_a_divide_factor_that_is_not_positive_and_finite(factor, force_sum):
    # 0 divided by zero (ZeroDivisionError) or, with force_sum, gave inf gradients; -2
    # flipped every gradient's sign; NaN/inf gave NaN/zero gradients. All silently.
    with pytest.raises(ValueError, match="divide_factor"):
        ReduceOptions(divide_factor=factor, force_sum=force_sum)


def test_int_divide_factor_still_divides():
    buf = DBuffer.from_tensors([torch.ones(3)], reduce_dtype=torch.float32)
    buf.unalias_grad_()
    buf.begin_grad()
    buf.grad_full.fill_(6.0)
    buf.reduce_grad(options=ReduceOptions(divide_factor=3))
    assert torch.equal(buf.grad_shard, torch.full((3,), 2.0))


def test_huge_counts_on_meta_are_cut_exactly():
    # Counts beyond int32 (nothing allocated): every rank's piece of every tensor is the
    # intersection of the tensor's flat range with the rank's, and the views sit there.
    big = 2**31 + 7
    numels = [big, 3, 2**31 - 1, 0]
    shapes = [(big,), (3,), (2**31 - 1,), (0, 5)]
    with fake_mesh((8,), rank=5) as mesh:
        buf = DBuffer(shapes, mesh=mesh, device="meta")
    S = buf.shard_numel
    assert sum(numels) <= 8 * S and buf.padding == 8 * S - sum(numels)
    starts = [buf.full_view(i).storage_offset() for i in range(len(numels))]
    for i, n in enumerate(numels):
        assert buf.full_view(i).numel() == n
        for r in range(8):
            lo, hi = max(starts[i], r * S), min(starts[i] + n, (r + 1) * S)
            a, b = buf.local_range(i, r)
            if hi > lo:
                assert (a, b) == (lo - starts[i], hi - starts[i]), (i, r)
            else:
                assert a == b, (i, r)
        a, b = buf.local_range(i)  # this rank's (5) piece and its view in the shard
        assert buf.shard_view(i).numel() == b - a
        if b > a:
            assert buf.shard_view(i).storage_offset() == starts[i] + a - 5 * S


def test_one_rank_mesh_views_of_empty_tensors_have_the_global_shape():
    """An empty tensor on a mesh of one rank (raggedshard 0.2.3: (1, 0, 3) before)."""
    ts = [torch.zeros(0, 3), torch.zeros(3, 0), torch.zeros(0), torch.randn(4)]
    with fake_mesh((1,)) as mesh:
        buf = DBuffer.from_tensors(ts, mesh=mesh)
        for v, t in zip(buf.state_dict().values(), ts):
            assert v.to_local().shape == t.shape
            assert v.full_tensor().shape == t.shape


@pytest.mark.xfail(
    strict=True,
    reason="raggedshard's RaggedShard.from_numels gives a 0-d tensor dims=() on an axis "
    "of one rank: local shape (1,), not the global ()",
)
def test_one_rank_mesh_views_of_scalars_have_the_global_shape():
    ts = [torch.tensor(2.5), torch.randn(4)]
    with fake_mesh((1,)) as mesh:
        buf = DBuffer.from_tensors(ts, mesh=mesh)
        for v, t in zip(buf.state_dict().values(), ts):
            assert v.to_local().shape == t.shape
            assert v.full_tensor().shape == t.shape


# --------------------------------------------------------------------------- gloo ranks


def _case(seed: int):
    """Seeded shapes (empty, scalar, uneven), granularities, dtypes and alignment."""
    rng = random.Random(seed)
    shapes, grans = [], []
    for _ in range(rng.randint(0, 5)):
        kind = rng.random()
        if kind < 0.2:
            s: tuple[int, ...] = (0, rng.randint(1, 3))
        elif kind < 0.3:
            s = ()
        else:
            s = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        shapes.append(s)
        numel = torch.Size(s).numel()
        row = torch.Size(s[1:]).numel() if s else 1
        grans.append(rng.choice([1, max(numel, 1), max(row, 1)]))
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.float16])
    param = rng.choice([None, torch.bfloat16, torch.float32])
    reduce = rng.choice([None, torch.float32, torch.bfloat16])
    return shapes, grans, dtype, param, reduce, rng.choice([1, 4, 16])


def _grads(seed: int, rank: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


def _sweep(mesh: DeviceMesh, seed: int, tag: str) -> list[str]:
    """Unshard / reduce / norm / clip / gather / state-dict cycles against full-tensor
    references; returns the failures."""
    R = mesh.size(0) if mesh.ndim == 2 else 1
    W = mesh.size(mesh.ndim - 1)
    me = (mesh.get_local_rank(0) * W if mesh.ndim == 2 else 0) + mesh.get_local_rank(mesh.ndim - 1)
    shapes, grans, dtype, param, reduce, align = _case(seed)
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    kw = dict(mesh=mesh, granularities=grans, alignment=align, dtype=dtype)
    buf = DBuffer(shapes, param_dtype=param, reduce_dtype=reduce, **kw)
    buf.copy_from_full_(ts)
    errs = []
    for step in range(2):
        buf.unshard()
        buf.wait_unshard()
        for i, t in enumerate(ts):
            if not torch.equal(buf.full_view(i), t.to(buf.param_dtype)):
                errs.append(f"unshard {step} tensor {i}")
        buf.reshard()
    per_rank = [_grads(seed, r, shapes) for r in range(R * W)]
    mean = [sum(x[i].double() for x in per_rank) / (R * W) for i in range(len(shapes))]
    for rounds in (1, 2):  # the second reduction accumulates
        buf.begin_grad()
        for i, gr in enumerate(per_rank[me]):
            buf.grad_full_view(i).add_(gr)
        buf.reduce_grad()
        buf.wait_reduce()
        for i, m in enumerate(mean):
            a, b = buf.local_range(i)
            got = buf.grad_shard_view(i).double()
            if not torch.allclose(got, rounds * m.reshape(-1)[a:b], rtol=3e-2, atol=3e-2):
                errs.append(f"reduce {rounds} tensor {i}")
    # Norm and clipping of the held gradient (2 * mean) by torch on the full tensors.
    held = [2 * m for m in mean]
    flat = [torch.zeros(0, dtype=torch.float64)] + [h.reshape(-1) for h in held]
    want = torch.linalg.vector_norm(torch.cat(flat))
    if not torch.allclose(grad_norm([buf]).double(), want, rtol=2e-2, atol=1e-6):
        errs.append("grad_norm")
    ref = [h.clone().requires_grad_() for h in held]
    for r, h in zip(ref, held):
        r.grad = h.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5).double() if ref else want
    if not torch.allclose(clip_grad_norm_([buf], 0.5).double(), ref_norm, rtol=2e-2, atol=1e-6):
        errs.append("clip norm")
    for i, r in enumerate(ref):
        a, b = buf.local_range(i)
        want_i = r.grad.reshape(-1)[a:b]
        if not torch.allclose(buf.grad_shard_view(i).double(), want_i, rtol=3e-2, atol=1e-3):
            errs.append(f"clipped tensor {i}")
    for i, t in enumerate(buf.gather_full()):
        if not torch.equal(t, ts[i]):
            errs.append(f"gather_full tensor {i}")
    # A state dict loaded into a buffer of another layout (element-wise blocks).
    other = DBuffer(shapes, mesh=mesh, dtype=dtype)
    other.load_state_dict(buf.state_dict())
    for i, t in enumerate(ts):
        a, b = other.local_range(i)
        if not torch.equal(other.shard_view(i), t.reshape(-1)[a:b]):
            errs.append(f"load_state_dict tensor {i}")
    return [
        f"{tag} seed {seed} {shapes} {grans} {dtype} {param} {reduce} {align}: {e}" for e in errs
    ]


def _partial_after_release(mesh: DeviceMesh) -> list[str]:
    """HSDP: a reduction that only reduce-scatters (``all_reduce=False``) into a gradient
    released by ``drop_grad_(release=True)`` left ``grad_shard`` uninitialised."""
    R, W = mesh.size(0), mesh.size(1)
    me = mesh.get_local_rank(0) * W + mesh.get_local_rank(1)
    errs = []
    buf = DBuffer([(1000,), (7, 3)], mesh=mesh)
    full = [torch.full((1000,), 7.0), torch.full((7, 3), -5.0)]
    for step in range(2):
        buf.begin_grad()
        for i, f in enumerate(full):
            buf.grad_full_view(i).copy_(f)
        buf.reduce_grad()
        buf.wait_reduce()
        buf.drop_grad_(release=True)
        grads = [_grads(100 + k, r, [(1000,), (7, 3)]) for k in range(2) for r in range(R * W)]
        for k, opts in enumerate((ReduceOptions(all_reduce=False), ReduceOptions())):
            buf.begin_grad()
            for i, gr in enumerate(grads[k * R * W + me]):
                buf.grad_full_view(i).copy_(gr)
            buf.reduce_grad(options=opts)
            buf.wait_reduce()
            if k == 0:
                if buf.has_grad or bool(buf.grad_shard.any()):
                    errs.append(f"step {step}: partial reduction exposed values")
                if float(grad_norm([buf])) != 0.0:
                    errs.append(f"step {step}: norm of a partial reduction")
        for i in range(2):
            total = sum(grads[k * R * W + r][i].double() for k in range(2) for r in range(R * W))
            a, b = buf.local_range(i)
            want = (total / (R * W)).reshape(-1)[a:b]
            if not torch.allclose(buf.grad_shard_view(i).double(), want, atol=1e-5):
                errs.append(f"step {step}: partial + full reduction of tensor {i}")
    return errs


def _nan_and_inf(mesh: DeviceMesh) -> list[str]:
    """A NaN or inf on one rank reaches the owner's reduced piece and every rank's norm."""
    W = mesh.size()
    me = mesh.get_local_rank()
    errs = []
    for bad in (float("nan"), float("inf")):
        buf = DBuffer([(5, 4), (3,)], mesh=mesh, granularities=[4, 1])
        buf.begin_grad()
        buf.grad_full_view(0).fill_(1.0)
        buf.grad_full_view(1).fill_(2.0)
        if me == W - 1:
            buf.grad_full_view(0)[2, 1] = bad
        buf.reduce_grad()
        buf.wait_reduce()
        a, b = buf.local_range(0)
        want = torch.ones(20)
        want[9] = bad
        if not torch.allclose(buf.grad_shard_view(0), want[a:b], 0, 0, equal_nan=True):
            errs.append(f"{bad}: reduced piece")
        norm = grad_norm([buf])
        if not (torch.isnan(norm) if bad != bad else torch.isinf(norm)):
            errs.append(f"{bad}: norm {float(norm)}")
    return errs


def _on_8_ranks() -> list[str]:
    rank = dist.get_rank()
    errs = []
    for w in range(1, 9):  # every world size, from subgroups of the 8 ranks
        group = dist.new_group(list(range(w)))
        if rank < w:
            mesh = DeviceMesh.from_group(group, "cpu")
            for seed in range(2):
                errs += _sweep(mesh, 10 * w + seed, f"fsdp{w}")
            if w in (3, 8):
                errs += [f"fsdp{w} {e}" for e in _nan_and_inf(mesh)]
        dist.barrier()
    hsdp = init_device_mesh("cpu", (2, 4))
    errs += _sweep(hsdp, 99, "hsdp2x4")
    errs += [f"hsdp2x4 {e}" for e in _partial_after_release(hsdp)]
    return errs


def test_world_sizes_1_to_8_hsdp_and_leftover_state_on_gloo():
    failures = sorted({e for per_rank in run_on_ranks(_on_8_ranks, 8) for e in per_rank})
    assert not failures, "\n".join(failures)
