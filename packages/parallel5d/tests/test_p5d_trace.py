"""One training step's trace: collectives per group, and no copy-in/copy-out at all.

The fake backend stands in for NCCL (a structure-only process group in one process);
its own staging shows up under the collective op and is excluded. Every hook of an
FSDP implementation runs under a profiler scope (``hyperrec::*`` here, ``FSDP::*`` in
PyTorch FSDP2): a copy inside those scopes is a copy-in or copy-out.
"""

from __future__ import annotations

import pytest
import torch
from _p5d_models import batch, loss_fn, make, shard_model

from hyperrec.parallel5d import MixedPrecisionPolicy
from hyperrec.testing import fake_mesh

COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::clone", "split_with_sizes_copy")


def _scopes(event) -> list[str]:
    names, p = [], event.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    return names


def _fsdp_copies(prof, prefix: str) -> list[str]:
    """Copy ops inside the implementation's hooks and outside any collective."""
    out = []
    for e in prof.events():
        scopes = _scopes(e)
        if (
            e.name.endswith(COPY_OPS)
            and any(s.startswith(prefix) for s in scopes)
            and not any(s.startswith("c10d::") for s in scopes)
        ):
            out.append(e.name)
    return out


def _step_trace(model, opt, prefix: str = "hyperrec::") -> tuple[list[str], dict[str, int]]:
    """Trace forward + backward (where FSDP2 copies in and out); then step outside it."""
    x, y = batch(0, n=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return _fsdp_copies(prof, prefix), counts


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 4)], ids=["fsdp4", "hsdp2x4"])
def test_fp32_step_has_no_copies_and_one_collective_per_group(mesh_shape):
    with fake_mesh(mesh_shape, rank=1) as mesh:
        # Every group (the root too, unlike the default) reshards after forward.
        model = shard_model(make("net"), mesh, reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # the second step runs with prefetching and reused storage
            copies, counts = _step_trace(model, opt)
        groups = 4  # three blocks + the root
        # Gathers: every group in forward, again in backward (resharded after forward).
        want = {"c10d::_allgather_base_": 2 * groups, "c10d::_reduce_scatter_base_": groups}
        if len(mesh_shape) == 2:
            want["c10d::allreduce_"] = groups  # HSDP: across replicas, shard-sized
        assert copies == [] and counts == want


def test_mixed_precision_step_copies_are_only_the_policy_casts():
    with fake_mesh((4,), rank=2) as mesh:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard_model(make("net"), mesh, mp_policy=mp, reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            copies, counts = _step_trace(model, opt)
        params = sum(1 for _ in model.parameters())
        # The casts the policy asks for and nothing else: fp32 -> bf16 once per gather
        # (8), bf16 -> fp32 once per parameter gradient, and the root's fp32 input (the
        # blocks already receive bf16).
        assert counts == {"c10d::_allgather_base_": 8, "c10d::_reduce_scatter_base_": 4}
        assert copies.count("aten::copy_") == 8 + params + 1
        assert set(copies) <= {"aten::copy_", "aten::_to_copy"}


def test_the_same_check_catches_fsdp2_copies():
    # The check is not vacuous: PyTorch FSDP2's copy-in/copy-out shows up in its scopes.
    from torch.distributed.fsdp import fully_shard

    with fake_mesh((4,), rank=1) as mesh:
        model = make("net")
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            copies, _ = _step_trace(model, opt, prefix="FSDP::")
        assert len(copies) >= 8


def test_mixed_precision_grad_buffer_lives_only_from_post_backward():
    """bf16 compute / fp32 reduction on several ranks: the fp32 gradient buffer of a
    group must not exist while that group's backward is still computing (FSDP2 holds
    only autograd's bf16 gradients there), and the previous group's buffer is released
    before the next one is allocated."""
    from hyperrec.parallel5d import dbuffers

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_mesh((4,), rank=0) as mesh:
        model = shard_model(make("net"), mesh, mp_policy=mp)
        seen: list[tuple[int, int]] = []

        def live_grad_buffers() -> int:
            return sum(
                1
                for b in dbuffers(model)
                if b._grad_full is not None and b._grad_full.untyped_storage().size() > 0
            )

        def probe(block_index: int):
            def hook(grad):
                # Runs inside block `block_index`'s backward, after its `down` layer's
                # gradients were produced.
                own = dbuffers(model.blocks[block_index])[0]
                own_live = own._grad_full is not None and own._grad_full.untyped_storage().size()
                seen.append((int(bool(own_live)), live_grad_buffers()))
                return grad

            return hook

        def watch(k: int):
            def forward_hook(module, inputs, output) -> None:
                output.register_hook(probe(k))

            return forward_hook

        handles = [blk.up.register_forward_hook(watch(k)) for k, blk in enumerate(model.blocks)]
        x, y = batch(0, n=4)
        loss_fn(model(x), y).backward()
        for h in handles:
            h.remove()
    assert len(seen) == len(model.blocks)
    for own_live, total in seen:
        assert own_live == 0, seen
        assert total <= 1, seen
