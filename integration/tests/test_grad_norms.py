"""The trainer's gradient norm and clipping on DTensor gradients (local work + one
all-reduce per mesh axis) against PyTorch's own on the full tensors."""

import math

import pytest
import torch
import torch.distributed as dist

from hyperrec.integration.trainer import _clip_grads_, _grad_norms
from hyperrec.testing import run_on_ranks


def _params(seed: int, nan_in: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 3), (5,), (7, 2), (1, 4), (3, 3)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float64]
    out = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        p = torch.zeros(shape, dtype=dtype)
        p.grad = (torch.randn(shape, generator=g) * (i + 1)).to(dtype)
        if nan_in == i:
            p.grad.view(-1)[-1] = float("nan")
        out.append(p)
    return out


def _distributed_case(seed: int, nan_in: int | None) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from hyperrec.raggedshard import RaggedShard, distribute_tensor, full_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    plain = _params(seed, nan_in)
    layouts = [
        (Replicate(), Shard(0)),  # HSDP: uneven shards (6 rows over the shard axis)
        (Replicate(), Replicate()),
        (Shard(1), Shard(0)),
        (Replicate(), Shard(0)),  # fewer rows than ranks on the axis: empty shards
        (Replicate(), RaggedShard((0,), (2, 1))),
    ]
    dparams = []
    for p, pl in zip(plain, layouts):
        d = torch.zeros_like(p)
        dp = torch.nn.Parameter(distribute_tensor(d, mesh, pl), requires_grad=False)
        dp.grad = distribute_tensor(p.grad, mesh, pl)
        dparams.append(dp)
    total, bad = _grad_norms(dparams)
    want = torch.nn.utils.get_total_norm([p.grad for p in plain])
    _clip_grads_(dparams, 1.0, total)
    clipped = [full_tensor(dp.grad).double().tolist() for dp in dparams]
    return [float(total), bad.tolist(), float(want), clipped]


@pytest.mark.parametrize("nan_in", [None, 2])
def test_dtensor_grad_norms_and_clip_match_full_tensors(nan_in):
    results = run_on_ranks(_distributed_case, 4, 3, nan_in)
    plain = _params(3, nan_in)
    # Exact (float64) norm: get_total_norm rounds a bf16 gradient's norm to bf16 first.
    want_total = torch.cat([p.grad.double().flatten() for p in plain]).norm()
    torch.nn.utils.clip_grads_with_norm_(plain, 1.0, want_total)
    for total, bad, _, clipped in results:
        if nan_in is None:
            assert total == pytest.approx(float(want_total), rel=1e-6)
            assert not any(bad)
            for got, p in zip(clipped, plain):
                torch.testing.assert_close(
                    torch.tensor(got, dtype=torch.float64).to(p.dtype),
                    p.grad,
                    rtol=1e-2 if p.dtype == torch.bfloat16 else 1e-5,
                    atol=1e-6,
                )
        else:
            # Every rank flags the parameter whose shard on one rank holds the NaN.
            assert math.isnan(total) and bad == [i == nan_in for i in range(5)]
    assert nan_in is not None or len({r[0] for r in results}) == 1


def test_plain_grad_norms_one_process():
    plain = _params(5)
    total, bad = _grad_norms(plain)
    want = torch.cat([p.grad.double().flatten() for p in plain]).norm()
    assert float(total) == pytest.approx(float(want), rel=1e-6) and not bad.any()
    assert float(total) == pytest.approx(
        float(torch.nn.utils.get_total_norm([p.grad for p in plain])), rel=1e-2
    )
    ref = [p.grad.clone() for p in plain]
    torch.nn.utils.clip_grads_with_norm_([torch.nn.Parameter(r.clone()) for r in ref], 0.5, want)
    _clip_grads_(plain, 0.5, total)
    coef = min(0.5 / (float(want) + 1e-6), 1.0)
    for p, r in zip(plain, ref):
        torch.testing.assert_close(p.grad, (r.double() * coef).to(r.dtype), rtol=1e-2, atol=1e-6)
    with pytest.raises(ValueError, match="grad is None"):
        _grad_norms([torch.zeros(2, requires_grad=True)])
