"""FSDP2's public surface on hyperrec's fully_shard: every name exists, every argument is
validated, and the features a flat buffer cannot provide say so (structure only, on the
fake backend; training parity is in test_p5d_fsdp2_scenarios.py)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hyperrec.parallel5d as ours
from hyperrec.parallel5d import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    OffloadPolicy,
    UnshardHandle,
    dbuffers,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from hyperrec.parallel5d.fsdp import get_state
from hyperrec.testing import fake_mesh

FSDP2_NAMES = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_every_fsdp2_name_and_method_exists():
    for name in FSDP2_NAMES:
        if hasattr(torch_fsdp, name):  # DataParallelMeshDims is newer than torch 2.11
            assert hasattr(ours, name), name
    public = [n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")]
    assert len(public) >= 20
    assert [n for n in public if not hasattr(FSDPModule, n)] == []
    # Same argument names for fully_shard (ours adds granularity and alignment).
    theirs = set(inspect.signature(torch_fsdp.fully_shard).parameters)
    assert theirs <= set(inspect.signature(fully_shard).parameters)


def test_module_list_forms_one_group():
    with fake_mesh((2,)) as mesh:
        model = _mlp()
        out = fully_shard([model[0], model[2]], mesh=mesh)
        assert out[0] is model[0] and isinstance(model[2], FSDPModule)
        assert get_state(model[0]) is get_state(model[2])
        assert len(dbuffers(model)) == 1 and len(get_state(model[0]).group.slots) == 4
        with pytest.raises(ValueError, match="same module twice"):
            fully_shard([model[1], model[1]], mesh=mesh)
        with pytest.raises(TypeError, match=r"module\[1\]"):
            fully_shard([nn.Linear(2, 2), "x"], mesh=mesh)
        with pytest.raises(TypeError, match="non-empty list"):
            fully_shard([], mesh=mesh)


def test_reshard_after_forward_values():
    with fake_mesh((4,)) as mesh:
        lin = fully_shard(nn.Linear(4, 4), mesh=mesh)  # None: resolved at first forward
        assert get_state(lin).auto_reshard_after_forward
        lin = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=4)
        assert get_state(lin).group.reshard_after_forward  # the whole axis: True
        assert get_state(lin).group.post_forward_group is None
        with pytest.warns(UserWarning, match="same as False"):
            lin = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
        assert not get_state(lin).group.reshard_after_forward
        with pytest.raises(ValueError, match="divide the shard axis size 4, got 3"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
        with pytest.raises(TypeError, match="bool, an int or None"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2.0)
        with pytest.raises(TypeError, match="reshard_after_forward must be a bool"):
            lin.set_reshard_after_forward(2)


def test_offload_policies():
    with fake_mesh((2,)) as mesh:
        for policy, want in [
            (CPUOffloadPolicy(pin_memory=False), True),
            (torch_fsdp.CPUOffloadPolicy(pin_memory=False), True),
            (OffloadPolicy(), False),
            (torch_fsdp.OffloadPolicy(), False),
            (None, False),
        ]:
            lin = fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy=policy)
            buf = lin.dbuffers[0]
            assert buf.offload is want and buf.shard.device.type == "cpu"
            assert lin.weight.to_local().device.type == "cpu"
        with pytest.raises(TypeError, match="offload_policy"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy="cpu")


def test_shard_placement_fn_maps_to_blocks():
    with fake_mesh((2,)) as mesh:
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
        fully_shard(
            model, mesh=mesh, shard_placement_fn=lambda p: Shard(0) if p.dim() == 2 else None
        )
        buf = model.dbuffers[0]
        # Shard(0): whole rows of each weight; vectors: the default element granularity.
        assert buf.granularities == [4, 1, 6, 1]
        with pytest.raises(TypeError, match="None or Shard"):
            fully_shard(nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda p: Replicate())
        with pytest.raises(ValueError, match="Shard\\(3\\)"):
            fully_shard(nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda p: Shard(3))
        result = getattr(
            __import__("torch.distributed.fsdp._fully_shard._fsdp_common", fromlist=["x"]),
            "ShardPlacementResult",
            None,
        )
        if result is not None:

            class ShardPlacementResult:  # the name is what is checked, torch's or not
                pass

            with pytest.raises(NotImplementedError, match="mesh per parameter"):
                fully_shard(
                    nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult()
                )


def test_dp_mesh_dims_selects_named_dims():
    with fake_mesh((2, 2, 2), ("a", "b", "c"), rank=5) as mesh:
        lin = fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="c"))
        assert lin.dbuffers[0].mesh.mesh_dim_names == ("c",)
        lin = fully_shard(
            nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="c", replicate="a")
        )
        m = lin.dbuffers[0].mesh
        assert m.ndim == 2 and m.mesh_dim_names == ("a", "c")
        lin = fully_shard(
            nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("b", "c"))
        )
        assert lin.dbuffers[0].world_size == 4
        if hasattr(torch_fsdp, "DataParallelMeshDims"):
            dims = torch_fsdp.DataParallelMeshDims(shard="b")
            assert (
                fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims).dbuffers[0].world_size
                == 2
            )
        with pytest.raises(ValueError, match="'z', not a dim"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="z"))
        with pytest.raises(NotImplementedError, match="replicate only"):
            fully_shard(
                nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="a")
            )
        with pytest.raises(ValueError, match="shard or replicate"):
            DataParallelMeshDims()
        with pytest.raises(ValueError, match="1-D .* or 2-D"):
            fully_shard(nn.Linear(4, 4), mesh=mesh)


def test_dtensor_parameters():
    with fake_mesh((2,)) as mesh:
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Replicate()]))
        fully_shard(lin, mesh=mesh)  # replicated DTensors are plain values
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(NotImplementedError, match="FSDP x TP/EP"):
            fully_shard(lin, mesh=mesh)


def test_setters_validate_and_unsupported_features_say_why():
    with fake_mesh((2, 2), ("r", "s")) as mesh:
        model = fully_shard(_mlp(), mesh=mesh)
        group = get_state(model).group
        model.set_gradient_divide_factor(4)
        assert group.divide_factor == 4.0
        with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
            model.set_reduce_scatter_divide_factor(2.0)
        for bad, err in [(0, ValueError), (float("nan"), ValueError), ("2", TypeError)]:
            with pytest.raises(err, match="factor"):
                model.set_gradient_divide_factor(bad)
        model.set_force_sum_reduction_for_comms(True)
        model.set_requires_all_reduce(False)
        assert group.force_sum and not group.requires_all_reduce
        model.set_requires_gradient_sync(True)
        assert group.requires_all_reduce  # both switches, as in FSDP2
        model.set_unshard_in_backward(False)
        assert not group.unshard_in_backward
        model.set_all_reduce_hook(lambda t: None)
        with pytest.raises(TypeError, match="hook must be callable"):
            model.set_all_reduce_hook(3)
        with pytest.raises(ValueError, match="native HSDP"):
            model.set_all_reduce_hook(lambda t: None, stream=object())
        model.set_reduce_scatter_unused_params(True)
        model.set_reduce_scatter_max_input_buffers(2)
        with pytest.raises(ValueError, match=">= 1"):
            model.set_reduce_scatter_max_input_buffers(0)
        model.set_allocate_memory_from_process_group_for_comm(False)
        with pytest.raises(NotImplementedError, match="no staging buffers"):
            model.set_allocate_memory_from_process_group_for_comm(True)
        with pytest.raises(NotImplementedError, match="symmetric memory"):
            model.set_symm_mem_for_comm()
        with pytest.raises(TypeError, match="comm must be callable"):
            model.set_custom_all_gather(None)
        model.set_is_last_backward(False)
        assert not get_state(model).is_last_backward
        model.set_is_last_backward(True)
        event = torch.Event("cpu")  # a torch.Event: anything else is a TypeError
        model.set_post_optim_event(event)  # waited on by the next forward's gathers
        assert get_state(model).post_optim_event is event
        model(torch.randn(2, 4))
        assert get_state(model).post_optim_event is None
        with pytest.raises(NotImplementedError, match="deepcopy"):
            copy.deepcopy(model)


def test_unshard_handle_and_functions():
    with fake_mesh((2,)) as mesh:
        model = fully_shard(_mlp(), mesh=mesh)
        handle = model.unshard(async_op=True)
        assert isinstance(handle, UnshardHandle)
        handle.wait()
        assert not isinstance(model[0].weight, DTensor)  # registered once waited
        handle.wait()  # twice is harmless
        model.reshard()
        assert model.unshard() is None
        sd = model.state_dict()  # reshards first, as FSDP2: DTensors, never gathered views
        assert all(isinstance(v, DTensor) for v in sd.values())
        assert isinstance(model[0].weight, DTensor)
        model.unshard()
        model.load_state_dict(sd)
        assert isinstance(model[0].weight, DTensor)
        # assign=True replaces the parameters: the buffer is rebuilt around the new values.
        new = {k: v * 2 for k, v in sd.items()}
        want = [v.to_local().clone() for v in new.values()]
        model.load_state_dict(new, assign=True)
        buf = model.dbuffers[0]
        for p, w in zip(model.parameters(), want):
            assert torch.equal(p.to_local(), w)
            assert (
                p.to_local().untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
            )
        model.reshard()
        with pytest.raises(TypeError, match="async_op"):
            model.unshard(async_op="yes")
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not sharded: no-op
        with pytest.raises(ValueError, match="no method 'nope'"):
            register_fsdp_forward_method(model, "nope")
        with pytest.raises(ValueError, match=r"modules\[1\] is not a fully_shard module"):
            share_comm_ctx([model, nn.Linear(2, 2)])


def test_to_dtype_rebuilds_the_buffers_and_device_moves_are_refused():
    with fake_mesh((2,)) as mesh:
        model = _mlp()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        before = {n: p for n, p in model.named_parameters()}
        model.to(torch.float64)
        for name, p in model.named_parameters():
            assert p is before[name]  # the same parameter objects
            assert p.dtype == torch.float64 and p.to_local().dtype == torch.float64
        for buf in dbuffers(model):
            assert buf.dtype == torch.float64
            for s in range(len(buf)):
                assert buf.shard_view(s).untyped_storage().data_ptr() == (
                    buf.shard.untyped_storage().data_ptr()
                )
        model.half()
        assert all(b.dtype == torch.float16 for b in dbuffers(model))
        with pytest.raises(RuntimeError, match="not supported"):
            model.to("meta")
        # Refused without damage: the parameters are views of their buffers again.
        for p, buf in zip(model[0].parameters(), dbuffers(model[0]) * 2):
            assert p.to_local().device.type == "cpu"
            assert (
                p.to_local().untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
            )


# CPUOffloadPolicy on an accelerator mesh: the shards live on the host, the mesh (which
# runs the collectives) on the device. On the GPU that is a CUDA mesh; here a mesh of
# device type "meta" stands in for it (anything but "cpu" makes DTensor.from_local move
# local tensors). The benchmark's pattern: fully_shard per block and at the root, then the
# first forward's lazy init, which checks that every parameter still views its buffer.


def _offloaded_on(mesh) -> tuple[nn.Sequential, list[torch.Tensor]]:
    from hyperrec.parallel5d import MixedPrecisionPolicy

    model = _mlp()
    ref = [p.detach().clone() for p in model.parameters()]
    kw = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy(pin_memory=False),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    fully_shard(model[0], **kw)
    fully_shard(model, **kw)
    return model, ref


def _host_views(model: nn.Module) -> list[tuple[torch.Tensor, int, object]]:
    """(parameter, index in its buffer, buffer) for every parameter; each checked to be a
    host view of its buffer's shard."""
    out = []
    for module in (model[0], model):
        buf = module.dbuffers[0]
        state = get_state(module)
        for s in state.group.slots:
            p = s.registrations[0][0]._parameters[s.registrations[0][1]]
            assert p is s.sharded and isinstance(p, DTensor)
            local = p.to_local()
            assert local.device.type == "cpu" and buf.shard.device.type == "cpu"
            assert local.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
            assert torch.equal(local.reshape(-1), buf.shard_view(s.index))
            out.append((p, s.index, buf))
    return out


def test_offload_on_an_accelerator_mesh_keeps_host_views_through_lazy_init():
    with fake_mesh((2,), device_type="meta") as mesh:
        model, ref = _offloaded_on(mesh)
        views = _host_views(model)
        assert {buf.full.device.type for _, _, buf in views} == {"meta"}
        by_id = {id(p): r for p, r in zip(model.parameters(), ref)}
        for p, i, buf in views:
            lo, hi = buf.local_range(i)
            assert torch.equal(p.to_local().reshape(-1), by_id[id(p)].reshape(-1)[lo:hi])
        # Raised "fully_shard keeps these sharded parameters on the host
        # (CPUOffloadPolicy); moving them to ['meta'] is not supported" (['cuda:0'] on
        # the GPU) when the views were device copies.
        get_state(model).lazy_init()
        assert [p for p, _, _ in _host_views(model)] == [p for p, _, _ in views]
        # Reduced gradients are exposed as host views of grad_shard too.
        for module in (model[0], model):
            group = get_state(module).group
            buf = module.dbuffers[0]
            buf.set_grad_(torch.randn(buf.shard_numel))
            group._reduced = True
            group.finalize_backward()
            for s in group.slots:
                g = s.sharded.grad.to_local()
                assert g.device.type == "cpu"
                assert g.untyped_storage().data_ptr() == buf.grad_shard.untyped_storage().data_ptr()


def test_offloaded_parameters_moved_to_the_mesh_device_go_back_to_the_host():
    # FSDP2 (pin_memory=True) copies offloaded parameters that model.cuda() /
    # to_empty(device="cuda") moved back to pinned host memory; so do we.
    with fake_mesh((2,), device_type="meta") as mesh:
        model, ref = _offloaded_on(mesh)
        before = [p for p, _, _ in _host_views(model)]
        model.to(torch.float64)  # values kept, on the host
        views = _host_views(model)
        assert [p for p, _, _ in views] == before
        by_id = {id(p): r for p, r in zip(model.parameters(), ref)}
        for p, i, buf in views:
            lo, hi = buf.local_range(i)
            assert p.dtype == torch.float64 and buf.dtype == torch.float64
            assert torch.equal(p.to_local().reshape(-1), by_id[id(p)].double().reshape(-1)[lo:hi])
        model.to("meta")  # the mesh's device ("cuda" in training): accepted
        assert [p for p, _, _ in _host_views(model)] == before
        model.to_empty(device="meta")
        assert [p for p, _, _ in _host_views(model)] == before
        get_state(model).lazy_init()
    with fake_mesh((2,)) as mesh:  # a CPU mesh: "meta" is another device, refused
        model, _ = _offloaded_on(mesh)
        with pytest.raises(RuntimeError, match="on the host \\(CPUOffloadPolicy\\).*not supported"):
            model.to("meta")
        _host_views(model)


def test_optimizer_states_of_offloaded_parameters_stay_on_the_host():
    from hyperrec.parallel5d.optim._local import state_tensor

    with fake_mesh((2,), device_type="meta") as mesh:
        model, _ = _offloaded_on(mesh)
        for p in model.parameters():
            st = state_tensor(p, torch.float32)
            assert isinstance(st, DTensor) and st.placements == p.placements
            assert st.shape == p.shape and st.to_local().shape == p.to_local().shape
            assert st.to_local().device.type == "cpu" and not st.to_local().any()
