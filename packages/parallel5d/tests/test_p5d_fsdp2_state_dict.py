"""Loading a PyTorch FSDP2 ``state_dict()`` into our ``fully_shard`` model in memory.

FSDP2's entries are DTensors sharded ``Shard(0)`` (padded to equal chunks); ours are
``RaggedShard`` views of the flat buffer. ``load_state_dict`` (``assign=False``) copies
each entry into the parameter; a copy between those placements raised "in-place
operations that require placement changes are not supported" (while FSDP2 loads its own
state dict, and ours loaded it with ``assign=True``). On 3 ranks (uneven: a bias of 3,
a one-element parameter) and on a 2x2 HSDP mesh, the loaded parameters must equal
FSDP2's, and both models must then train identically (AdamW, 2 steps). Our own state
dict on the 2x2 mesh also loads into our model on a 1-D mesh of 4 (it raised too).

Caught: every test here failed before the fix (0.2.12).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperrec.testing import run_on_ranks

D = 5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(D, 3)
        self.v = nn.Parameter(torch.randn(3))
        self.one = nn.Parameter(torch.tensor([0.5]))
        self.m = nn.Parameter(torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w(x) * self.v * self.one) @ self.m.t()


def _model() -> nn.Module:
    return nn.Sequential(Tiny(), nn.Linear(2, D), Tiny())


def _shard(api, model: nn.Module, mesh) -> None:
    for m in (model[0], model[2], model):
        api.fully_shard(m, mesh=mesh)


def _x(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randn(4, D, generator=g)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(_x(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _load_fsdp2_state_dict(mesh_shape: tuple[int, ...]) -> dict:
    import torch.distributed.fsdp as fsdp2

    import hyperrec.parallel5d as ours

    names = ("r", "s")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(1)
    ref = _model()
    _shard(fsdp2, ref, mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, range(2))  # moved away from any fresh initialisation
    torch.manual_seed(2)  # other initial values
    model = _model()
    _shard(ours, model, mesh)
    try:
        model.load_state_dict(ref.state_dict())
    except RuntimeError as e:
        return {"error": str(e)[:300]}
    loaded = {
        n: float((_full(p) - _full(q)).abs().max())
        for (n, p), q in zip(model.named_parameters(), ref.parameters())
    }
    # Both continue from the same values with fresh AdamW states.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_losses = _train(ref, ref_opt, range(2, 4))
    losses = _train(model, opt, range(2, 4))
    trained = {
        n: float((_full(p) - _full(q)).abs().max())
        for (n, p), q in zip(model.named_parameters(), ref.parameters())
    }
    cross = 0.0
    if len(mesh_shape) == 2:  # ours on the 2x2 HSDP mesh into ours on a 1-D mesh of 4
        torch.manual_seed(3)
        flat = _model()
        _shard(ours, flat, init_device_mesh("cpu", (4,)))
        flat.load_state_dict(model.state_dict())
        cross = max(
            float((_full(p) - _full(q)).abs().max())
            for p, q in zip(flat.parameters(), model.parameters())
        )
    return {
        "cross_mesh": cross,
        "loaded": loaded,
        "loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "trained": trained,
        "ours_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def _check(per_rank: list[dict]) -> None:
    for rank, r in enumerate(per_rank):
        assert "error" not in r, (rank, r)
        assert r["ours_sharded"], rank
        assert r["cross_mesh"] == 0.0, (rank, r["cross_mesh"])
        assert max(r["loaded"].values()) == 0.0, (rank, r["loaded"])
        assert r["loss_err"] <= 1e-5, (rank, r)
        assert max(r["trained"].values()) <= 2e-6, (rank, r["trained"])


@pytest.mark.parametrize(
    "mesh_shape",
    # HSDP on 4 ranks repeats the uneven 3-rank load (HSDP parity: test_p5d_parity): not
    # in `nox -s lowest`
    [(3,), pytest.param((2, 2), marks=pytest.mark.slow)],
    ids=["3-ranks", "hsdp-2x2"],
)
def test_load_state_dict_of_fsdp2_in_memory(mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    _check(run_on_ranks(_load_fsdp2_state_dict, world, mesh_shape, timeout_s=120))
