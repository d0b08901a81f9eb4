"""Single-process DBuffer checks: layout arithmetic, views, group ops, errors."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.dbuffer import DBuffer, clip_grad_norm_, flat_params, grad_norm, zero_grad_
from hyperrec.raggedshard import plan_layout
from hyperrec.testing import fake_mesh


def _inside(view: torch.Tensor, base: torch.Tensor) -> bool:
    lo = base.untyped_storage().data_ptr()
    hi = lo + base.untyped_storage().nbytes()
    if view.untyped_storage().data_ptr() != lo:
        return False
    if view.numel() == 0:
        return True
    start = view.data_ptr()
    return lo <= start and (start + view.numel() * view.element_size() <= hi)


@settings(deadline=None, max_examples=40)
@given(
    numels=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    world=st.integers(1, 9),
    block=st.sampled_from([1, 2, 7, 32]),
)
def test_layout_geometry_partitions_every_tensor(numels, world, block):
    # The layout is the one geometry DBuffer and fully_shard read: rank ranges tile each
    # tensor on block edges, shard ranges sit inside the shard, and the RaggedShard
    # placement of every tensor names the same elements.
    grans = [min(block, max(n, 1)) for n in numels]
    layout = plan_layout(numels, grans, world)
    S = int(layout.shard_numel)
    held = 0
    for i, (n, g) in enumerate(zip(numels, grans)):
        ranges = [layout.rank_range(i, r) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        for (a, b), (c, d) in zip(ranges, ranges[1:]):
            assert b == c and a <= b and c <= d
        for a, b in ranges:
            assert (a % g == 0 or a == n) and (b % g == 0 or b == n)
        assert tuple(layout.placement(i, (n,)).element_bounds((n,))) == tuple(ranges)
        for r in range(world):
            lo, hi = layout.shard_range(i, r)
            assert hi - lo == ranges[r][1] - ranges[r][0]
            if hi > lo:  # (an empty piece may sit anywhere: DBuffer slices it empty)
                assert 0 <= lo < hi <= S
                assert int(layout.offsets[i]) + ranges[r][0] == r * S + lo
            held += hi - lo
    assert held == sum(numels)


def test_one_rank_mesh_dtensors_have_the_global_shape():
    # On an axis of one rank upstream DTensor takes the local tensor for the global one,
    # so each view's local shape must be the tensor's own shape.
    ts = [torch.randn(6, 4), torch.randn(5), torch.randn(2, 3, 2)]
    with fake_mesh((1,)) as mesh:
        buf = DBuffer.from_tensors(ts, mesh=mesh, granularities=[4, 1, 12])
        for v, t in zip(buf.state_dict().values(), ts):
            assert v.to_local().shape == t.shape
            assert torch.equal(v.full_tensor(), t)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_offloaded_views_stay_on_the_host_of_a_mesh_of_another_device(mesh_shape):
    # An offloaded shard lives on the host while the mesh is the accelerator's (CUDA in
    # training; "meta" stands in for it here). DTensor.from_local moves local tensors to
    # the mesh's device type: the views were copies there, not views of the host shard.
    ts = [torch.randn(6, 4), torch.randn(5), torch.randn(3, 3)]
    with fake_mesh(mesh_shape, device_type="meta") as mesh:
        buf = DBuffer(
            [t.shape for t in ts], mesh=mesh, offload=True, pin_memory=False, device="meta"
        )
        assert buf.shard.device.type == "cpu" and buf.full.device.type == "meta"
        buf.shard.copy_(torch.randn(buf.shard_numel))
        for flat in (None, torch.randn(buf.shard_numel)):
            base = buf.shard if flat is None else flat
            for i, v in enumerate(buf.as_dtensors(flat)):
                assert v.device_mesh is mesh and v.shape == ts[i].shape
                assert v.placements[-1] == buf.placement(i)
                local = v.to_local()
                assert local.device.type == "cpu" and _inside(local, base)
                assert torch.equal(local.reshape(-1), buf.flat_view(base, i))
        for v in buf.state_dict().values():
            assert _inside(v.to_local(), buf.shard)


def test_given_layout_is_wrapped_and_checked():
    shapes = [(6, 4), (5,), (3, 3)]
    layout = plan_layout([24, 5, 9], [4, 1, 9], 1, alignment=4)
    buf = DBuffer(shapes, layout=layout)
    assert buf.layout is layout and buf.granularities == [4, 1, 9]
    assert buf.shard_numel == layout.shard_numel
    with pytest.raises(ValueError, match="numels"):
        DBuffer([(6, 4), (5,)], layout=layout)
    with pytest.raises(ValueError, match="world_size"):
        DBuffer(shapes, layout=plan_layout([24, 5, 9], 1, 2))
    with pytest.raises(ValueError, match="not both"):
        DBuffer(shapes, layout=layout, granularities=[1, 1, 1])
    with pytest.raises(TypeError, match="layout"):
        DBuffer(shapes, layout="planned")
    broken = dataclasses.replace(layout, offsets=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="contract"):
        DBuffer(shapes, layout=broken)


def test_views_alias_the_flat_storage_single_rank():
    torch.manual_seed(0)
    ts = [torch.randn(3, 4), torch.randn(5), torch.randn(0, 3), torch.randn(2, 2, 2)]
    buf = DBuffer.from_tensors(ts, granularities=[4, 1, 1, 8])
    assert buf.full is buf.shard  # one rank, no cast: nothing to gather or allocate
    for i, t in enumerate(ts):
        assert _inside(buf.shard_view(i), buf.shard)
        assert _inside(buf.full_view(i), buf.shard)
        assert torch.equal(buf.full_view(i), t)
    buf.unshard()
    buf.wait_unshard()
    buf.reshard()
    assert buf.is_unsharded  # aliasing storage is never freed


def test_cast_unshard_and_free_single_rank():
    ts = [torch.randn(4, 4), torch.randn(3)]
    buf = DBuffer.from_tensors(ts, param_dtype=torch.bfloat16)
    assert not buf.is_unsharded
    buf.unshard()
    buf.wait_unshard()
    for i, t in enumerate(ts):
        assert buf.full_view(i).dtype == torch.bfloat16
        assert torch.equal(buf.full_view(i), t.to(torch.bfloat16))
        assert _inside(buf.full_view(i), buf.full)
    ptr = buf.full.untyped_storage()
    buf.reshard()
    assert not buf.is_unsharded and buf.full.untyped_storage().size() == 0
    buf.unshard()
    buf.wait_unshard()
    assert buf.full.untyped_storage() is not None and ptr.size() > 0  # same storage, regrown
    assert torch.equal(buf.full_view(0), ts[0].to(torch.bfloat16))


@pytest.mark.parametrize("chunk", [1, 5, 7, 1 << 24])
def test_offloaded_cast_unshard_in_chunks(monkeypatch, chunk):
    """An offloaded shard reaches the device and its cast in chunks (no whole fp32 copy
    beside the gather buffer); every chunk size gives the same gathered values."""
    import hyperrec.dbuffer.buffer as buffer_module

    monkeypatch.setattr(buffer_module, "_OFFLOAD_CHUNK", chunk)
    ts = [torch.randn(4, 4), torch.randn(3), torch.randn(2, 5)]
    buf = DBuffer.from_tensors(ts, param_dtype=torch.bfloat16, offload=True, pin_memory=False)
    for _ in range(2):  # the second unshard regrows the freed storage
        buf.unshard()
        buf.wait_unshard()
        for i, t in enumerate(ts):
            assert torch.equal(buf.full_view(i), t.to(torch.bfloat16))
        buf.reshard()


def test_placements_are_built_once():
    """Gradient DTensors are rebuilt every step from these: a RaggedShard validates one
    count per rank, so they are built on first use and reused (same object after)."""
    ts = [torch.randn(4, 4), torch.randn(3)]
    buf = DBuffer.from_tensors(ts)
    first = [buf.placement(i) for i in range(2)]
    assert all(buf.placement(i) is first[i] for i in range(2))
    assert buf.placement(-1) is first[1]
    assert first == [buf.layout.placement(i, t.shape) for i, t in enumerate(ts)]


def test_grad_accumulates_in_place_single_rank():
    ts = [torch.randn(3, 4), torch.randn(5)]
    buf = DBuffer.from_tensors(ts)
    g = buf.begin_grad()
    assert g is buf.grad_shard  # one rank: unreduced gradient == reduced gradient
    buf.grad_full_view(0).add_(1.0)
    buf.reduce_grad()
    buf.wait_reduce()
    assert buf.has_grad and torch.equal(buf.grad_shard_view(0), torch.ones(12))
    buf.begin_grad()
    buf.grad_full_view(0).add_(2.0)
    buf.reduce_grad()
    assert torch.equal(buf.grad_shard_view(0), torch.full((12,), 3.0))  # accumulated
    assert torch.equal(buf.grad_shard_view(1), torch.zeros(5))
    buf.drop_grad_(release=True)
    assert buf._grad_shard.untyped_storage().size() == 0
    buf.begin_grad()
    assert torch.equal(buf.grad_shard, torch.zeros(buf.shard_numel))  # fresh window
    with pytest.raises(RuntimeError, match="begin_grad"):
        DBuffer.from_tensors(ts).reduce_grad()


def test_release_keeps_unresizable_host_grad_memory(monkeypatch):
    """Pinned host memory (an offloaded buffer's gradient on a GPU machine) cannot be
    resized: releasing keeps it, and the next window still starts empty (the reduce
    overwrites it). numpy-backed storage stands in for pinned memory on the CPU."""
    import numpy as np

    def unresizable_zeros(self, numel, dtype):
        return torch.from_numpy(np.zeros(numel, dtype=np.float32)).to(dtype)

    monkeypatch.setattr(DBuffer, "_host_zeros", unresizable_zeros)
    ts = [torch.randn(3, 4), torch.randn(5)]
    buf = DBuffer.from_tensors(ts, offload=True)
    assert not buf.grad_shard.untyped_storage().resizable()
    for value in (1.0, 2.0):
        buf.begin_grad()
        buf.grad_full_view(0).fill_(value)
        buf.reduce_grad()
        buf.wait_reduce()
        assert torch.equal(buf.grad_shard_view(0), torch.full((12,), value))  # not 1 + 2
        buf.drop_grad_(release=True)
        assert buf._grad_shard.untyped_storage().size() == 17 * 4 and not buf.has_grad


def test_reduce_casts_into_master_dtype():
    ts = [torch.randn(3, 4)]
    buf = DBuffer.from_tensors(ts, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    buf.begin_grad()
    assert buf.grad_full.dtype == torch.bfloat16
    buf.grad_full_view(0).copy_(torch.full((3, 4), 0.5))
    buf.reduce_grad()
    buf.wait_reduce()
    assert buf.grad_shard.dtype == torch.float32
    assert torch.equal(buf.grad_shard_view(0), torch.full((12,), 0.5))
    assert buf.grad_full.untyped_storage().size() == 0  # released after the reduction


def test_group_ops_match_torch():
    torch.manual_seed(1)
    ts = [torch.randn(7, 3), torch.randn(11), torch.randn(2, 5)]
    grads = [torch.randn_like(t) for t in ts]
    bufs = [DBuffer.from_tensors(ts[:2]), DBuffer.from_tensors(ts[2:])]
    for b, gs in zip(bufs, (grads[:2], grads[2:])):
        b.begin_grad()
        for i, gr in enumerate(gs):
            b.grad_full_view(i).copy_(gr)
        b.reduce_grad()
    ref = [t.clone().requires_grad_() for t in ts]
    for r, gr in zip(ref, grads):
        r.grad = gr.clone()
    torch.testing.assert_close(
        grad_norm(bufs), torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    )
    n_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    n = clip_grad_norm_(bufs, 0.5)
    torch.testing.assert_close(n, n_ref)
    got = [bufs[0].grad_full_view(0), bufs[0].grad_full_view(1), bufs[1].grad_full_view(0)]
    for gv, r in zip(got, ref):
        torch.testing.assert_close(gv, r.grad)
    # Fused AdamW over the flat storages == per-tensor AdamW.
    opt = torch.optim.AdamW(flat_params(bufs), lr=0.1, fused=True)
    opt_ref = torch.optim.AdamW(ref, lr=0.1, fused=True)
    opt.step()
    opt_ref.step()
    for v, r in zip([bufs[0].full_view(0), bufs[0].full_view(1), bufs[1].full_view(0)], ref):
        torch.testing.assert_close(v, r.detach(), rtol=0, atol=0)
    bufs[0].scale_grad_(2.0)
    bufs[0].add_(bufs[0], alpha=-0.5)
    torch.testing.assert_close(bufs[0].full_view(1), ref[1].detach() * 0.5)
    zero_grad_(bufs)
    assert all(not b.has_grad and not b.grad_shard.any() for b in bufs)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(bufs, 0.0)
    with pytest.raises(TypeError, match="DBuffer"):
        grad_norm([torch.zeros(2)])
    with pytest.raises(ValueError, match="same shapes"):
        bufs[0].add_(bufs[1])


def test_flat_params_leave_non_trainable_buffers_out():
    """A frozen buffer (``trainable=False``) is not handed to the optimizer: with weight
    decay, a zero gradient would still move it."""
    frozen = DBuffer([(3,)], trainable=False)
    frozen.copy_from_full_([torch.ones(3)])
    live = DBuffer([(2,)])
    live.copy_from_full_([torch.ones(2)])
    live.begin_grad()
    live.grad_full_view(0).copy_(torch.full((2,), 0.5))
    live.reduce_grad()
    params = flat_params([frozen, live])
    assert len(params) == 1 and params[0] is live.shard
    assert frozen.trainable is False and live.trainable is True
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    opt.step()
    assert torch.equal(frozen.full_view(0), torch.ones(3))
    assert not torch.equal(live.full_view(0), torch.ones(2))


def test_state_dict_round_trip_single_rank():
    ts = [torch.randn(3, 4), torch.randn(5)]
    buf = DBuffer.from_tensors(ts, names=["w", "b"])
    sd = buf.state_dict()
    assert set(sd) == {"w", "b"} and _inside(sd["w"], buf.shard)
    other = DBuffer([t.shape for t in ts], names=["w", "b"])
    other.load_state_dict({k: v.clone() for k, v in sd.items()})
    assert torch.equal(other.shard, buf.shard)
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({"w": ts[0]})
    with pytest.raises(KeyError, match="unexpected"):
        other.load_state_dict({"w": ts[0], "b": ts[1], "c": ts[1]})
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict({"w": ts[1], "b": ts[1]})


def test_gather_full_of_flat_state():
    ts = [torch.randn(3, 4), torch.randn(5)]
    buf = DBuffer.from_tensors(ts)
    state = torch.arange(buf.shard_numel, dtype=torch.float32)
    full = buf.gather_full(state)
    assert torch.equal(full[0].reshape(-1), state[: ts[0].numel()])
    with pytest.raises(ValueError, match="flat"):
        buf.gather_full(torch.zeros(3))


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"shapes": torch.zeros(3)}, TypeError, "shapes"),
        ({"shapes": [(2,)], "dtype": torch.int32}, TypeError, "dtype"),
        ({"shapes": [(2,)], "reduce_dtype": "fp32"}, TypeError, "reduce_dtype"),
        ({"shapes": [(2,)], "granularities": [1, 2]}, ValueError, "granularities"),
        ({"shapes": [(2,)], "granularities": [0]}, ValueError, "granularities"),
        ({"shapes": [(2,)], "alignment": 0}, ValueError, "alignment"),
        ({"shapes": [(2,), (3,)], "names": ["a", "a"]}, ValueError, "names"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    shapes = kwargs.pop("shapes")
    with pytest.raises(err, match=match):
        DBuffer(shapes, **kwargs)


def test_from_tensors_errors():
    with pytest.raises(TypeError, match="tensors"):
        DBuffer.from_tensors([])
    buf = DBuffer([(2, 2)])
    with pytest.raises(ValueError, match="shape"):
        buf.copy_from_full_([torch.zeros(3)])
    with pytest.raises(ValueError, match="expected 1"):
        buf.copy_from_full_([])


@settings(deadline=None, max_examples=25)
@given(
    numels=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    alignment=st.sampled_from([1, 4, 16]),
)
def test_zero_grad_padding_clears_exactly_the_gaps_across_reallocations(numels, alignment):
    # grad_full's storage is freed after each reduction and re-grown by the next
    # begin_grad, holding whatever the allocator left: the gaps between tensors (which
    # reach the reduced shard, and a flat optimizer's or grad norm's view of it) must be
    # zeroed every time, and the tensors' own gradients left alone.
    buf = DBuffer([(n,) for n in numels], reduce_dtype=torch.float64, alignment=alignment)
    for _window in range(2):  # the second one runs on re-grown storage
        g = buf.begin_grad(zero=False)
        assert g is not buf.grad_shard  # a separate reduce-dtype buffer
        g.fill_(float("nan"))
        for i in range(len(numels)):
            buf.grad_full_view(i).fill_(float(i + 1))
        buf.zero_grad_padding_()
        inside = torch.zeros(g.numel(), dtype=torch.bool)
        for i, n in enumerate(numels):
            view = buf.grad_full_view(i)
            assert torch.equal(view, torch.full((n,), float(i + 1), dtype=torch.float64))
            if n:
                start = (view.data_ptr() - g.data_ptr()) // g.element_size()
                inside[start : start + n] = True
        assert torch.equal(g[~inside], torch.zeros(int((~inside).sum()), dtype=torch.float64))
        buf.reduce_grad()
        buf.wait_reduce()
        expect = torch.cat([torch.full((n,), float(i + 1)) for i, n in enumerate(numels)])
        got = torch.cat([buf.grad_shard_view(i) for i in range(len(numels))])
        assert torch.equal(got, expect) and bool(torch.isfinite(buf.grad_shard).all())
        buf.drop_grad_(release=True)
