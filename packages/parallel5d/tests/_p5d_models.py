"""Tiny models and a single-process reference trainer shared by the parallel5d tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hyperrec.parallel5d import fully_shard


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """Input projection, a stack of residual blocks, an awkwardly shaped head."""

    def __init__(self, d: int = 12, layers: int = 3, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) * self.scale


class MixedNet(nn.Module):
    """A float64 sub-module inside a float32 model: two DBuffers per group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 9)
        self.b = nn.Linear(9, 9).double()
        self.c = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.tanh(self.a(x)).double()).float())


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mixed":
        return MixedNet()
    if kind == "wide":
        return Net(d=40, layers=2)
    return Net()


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def shard_model(model: nn.Module, mesh: DeviceMesh, **kw) -> nn.Module:
    """fully_shard every block, then the root (as users do).

    ``ignored_params`` goes to each call restricted to that module's own parameters
    (fully_shard rejects parameters a module does not have).
    """
    ignored = kw.pop("ignored_params", None)
    for m in getattr(model, "blocks", []):
        own = (
            None if ignored is None else {p for p in ignored if any(p is q for q in m.parameters())}
        )
        fully_shard(m, mesh=mesh, ignored_params=own, **kw)
    return fully_shard(model, mesh=mesh, ignored_params=ignored, **kw)


def local_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """Data-parallel coordinate of this rank over every mesh axis."""
    rank, size = 0, 1
    for axis in range(mesh.ndim):
        rank = rank * mesh.size(axis) + mesh.get_local_rank(axis)
        size *= mesh.size(axis)
    return rank, size


def mean_over_ranks(x: torch.Tensor) -> float:
    t = x.detach().clone().float()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
