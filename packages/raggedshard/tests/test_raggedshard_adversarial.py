"""Adversarial cases: results must equal the same computation on the full tensors, or raise.

Each spawned rank compares its own local result with the slice of the full-tensor answer
it should hold (no collective after a possible error, so a wrong path cannot hang).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from hyperrec.raggedshard import RaggedShard, distribute_tensor, local_ops, total_norm
from hyperrec.testing import run_on_ranks


def _outcome(fn) -> object:
    """``fn()``'s value, or ``"raised"`` (an error is an acceptable answer here)."""
    try:
        return fn()
    except Exception:
        return "raised"


def _mixed_layouts_2_ranks() -> dict:
    mesh = init_device_mesh("cpu", (2,))
    p = RaggedShard((0,), (1, 1))
    a, b = torch.tensor([3.0, 5.0]), torch.tensor([10.0, 20.0])
    out = {}
    with local_ops():
        # Position 0 of the two lists: a Replicate DTensor and a ragged one. Combining the
        # local tensors broadcasts rank r's single element over the whole replica.
        y = distribute_tensor(b.clone(), mesh, [Replicate()], src_data_rank=None)
        x = distribute_tensor(a, mesh, [p], src_data_rank=None)

        def step() -> list:
            torch._foreach_mul_([y], [x])
            return y.to_local().tolist()

        out["foreach_replicate_times_ragged"] = (_outcome(step), (a * b).tolist())
    return out


def _mixed_meshes_4_ranks() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    p = RaggedShard((0,), (1, 1))
    a, b = torch.arange(4.0), torch.arange(4.0) * 10
    want = a + b
    out = {}
    with local_ops():
        # Same placements and shape, but on the two different axes of a 2-D mesh: rank
        # (i, j) holds half i of x and half j of y.
        x = distribute_tensor(a, mesh["a"], [p], src_data_rank=None)
        y = distribute_tensor(b, mesh["b"], [p], src_data_rank=None)
        mine = want[2 * mesh.get_local_rank(0) :][:2].tolist()
        out["pointwise_two_meshes"] = (_outcome(lambda: (x + y).to_local().tolist()), mine)
        # HSDP-like placements swapped between the lists of a foreach op.
        u = distribute_tensor(a, mesh, [Replicate(), p], src_data_rank=None)
        v = distribute_tensor(b, mesh, [p, Replicate()], src_data_rank=None)

        def step() -> list:
            torch._foreach_add_([u], [v])
            return u.to_local().tolist()

        mine = want[2 * mesh.get_local_rank(1) :][:2].tolist()
        out["foreach_swapped_axes"] = (_outcome(step), mine)
    return out


def _assert_right_or_raised(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for name, (got, want) in res.items():
            assert got == "raised" or got == want, (rank, name, got, want)


def test_foreach_local_ops_reject_mismatched_layouts_per_position():
    _assert_right_or_raised(run_on_ranks(_mixed_layouts_2_ranks, 2, timeout_s=120))


def test_local_ops_reject_operands_on_different_meshes():
    _assert_right_or_raised(run_on_ranks(_mixed_meshes_4_ranks, 4, timeout_s=120))


def _inf_norm_with_nan_2_ranks() -> list:
    mesh = init_device_mesh("cpu", (2,))
    p = RaggedShard((0,), (1, 3))
    full = torch.tensor([1.0, 2.0, 3.0, float("nan")])  # the NaN is on rank 1 only
    x = distribute_tensor(full, mesh, [p], src_data_rank=None)
    return [total_norm([x], norm_type).item() for norm_type in (math.inf, 2.0)]


def test_total_norm_inf_propagates_nan_from_any_rank():
    # torch.linalg.vector_norm(full, inf) is NaN; an all-reduce MAX silently dropped it
    # (returned 1.0, rank 0's max), so clipping never saw the non-finite gradient.
    for got in run_on_ranks(_inf_norm_with_nan_2_ranks, 2, timeout_s=120):
        assert all(math.isnan(v) for v in got), got


def _int_partial_avg_2_ranks() -> object:
    from torch.distributed.tensor import DTensor, Partial

    from hyperrec.raggedshard import redistribute

    mesh = init_device_mesh("cpu", (2,))
    rank = mesh.get_local_rank()
    part = DTensor.from_local(torch.tensor([1, 2, 3, 4]) + rank, mesh, [Partial("avg")])
    try:
        out = redistribute(part, [RaggedShard((0,), (1, 3))])
    except ValueError:
        return "raised"
    return (out.dtype, out.to_local().dtype)


def test_int_partial_avg_to_ragged_keeps_dtype_or_raises():
    # The average of int64 partials is not an int64 tensor: the result used to come back
    # as float32 (local and DTensor dtype), silently changing the tensor's dtype.
    for got in run_on_ranks(_int_partial_avg_2_ranks, 2, timeout_s=120):
        assert got == "raised" or got == (torch.int64, torch.int64), got
