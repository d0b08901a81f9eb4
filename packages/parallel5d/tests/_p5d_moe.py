"""A small MoE network and a parity run: EP + fully_shard on gloo ranks vs one process.

Used by test_p5d_experts.py (2 and 4 ranks) and test_p5d_mesh.py (8 ranks, in the same
spawn as the mesh membership checks: spawning 8 ranks costs ~30 s on 2 cores).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperrec.parallel5d import full_state_dict, fully_shard
from hyperrec.parallel5d.experts import RoutedExperts
from hyperrec.parallel5d.mesh import MeshSpec, ParallelMesh
from hyperrec.parallel5d.topology import Topology

DIM, HIDDEN, EXPERTS, TOP_K, FEATURES = 8, 12, 8, 2, 5


class MoEBlock(nn.Module):
    def __init__(self, ep_mesh=None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=torch.float64)
        self.moe = RoutedExperts(
            DIM, HIDDEN, EXPERTS, top_k=TOP_K, ep_mesh=ep_mesh, dtype=torch.float64
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoENet(nn.Module):
    def __init__(self, ep_mesh=None) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, DIM, dtype=torch.float64)
        self.blocks = nn.ModuleList([MoEBlock(ep_mesh) for _ in range(2)])
        self.head = nn.Linear(DIM, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


def _data(step: int, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    total = sum(counts)
    return (
        torch.randn(total, FEATURES, generator=g, dtype=torch.float64),
        torch.randn(total, generator=g, dtype=torch.float64),
    )


def moe_parity(topology: Topology, spec: MeshSpec, token_counts: list[int], steps: int = 3) -> dict:
    """On every rank: train the EP + fully_shard net and the single-process reference on
    the same global batches; return losses and the worst parameter difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MoENet()
    init = copy.deepcopy(ref.state_dict())
    pm = ParallelMesh(topology, spec)
    net = MoENet(ep_mesh=pm.ep_mesh)
    with torch.no_grad():
        sd = ref.state_dict()
        net.load_state_dict({k: v for k, v in sd.items() if ".moe.experts." not in k}, strict=False)
        for b_net, b_ref in zip(net.blocks, ref.blocks):
            e = b_ref.moe.experts
            b_net.moe.load_full_experts_(e.w1, e.w3, e.w2, b_ref.moe.router.gate.weight)
    for b in net.blocks:
        fully_shard(b.moe.experts, mesh=pm.expert_mesh)
        fully_shard(b, mesh=pm.dense_mesh)
    fully_shard(net, mesh=pm.dense_mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    start = sum(token_counts[:rank])
    mine = slice(start, start + token_counts[rank])
    total = sum(token_counts)
    losses, ref_losses, zero_expert_seen = [], [], False
    for step in range(steps):
        x, y = _data(step, token_counts)
        # Each rank's loss is its share of the global mean, times the world size because
        # fully_shard averages gradients over ranks.
        out = net(x[mine])
        loss = (out - y[mine]).pow(2).sum() * (world / total)
        loss.backward()
        opt.step()
        opt.zero_grad()
        zero_expert_seen |= any(c == 0 for b in net.blocks for c in b.moe.last_counts)
        reported = loss.detach() / world
        dist.all_reduce(reported)
        losses.append(float(reported))
        ref_loss = (ref(x) - y).pow(2).sum() / total
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss))
    full = full_state_dict(net)
    ref_sd = ref.state_dict()
    worst = 0.0
    for key, value in full.items():
        want = ref_sd[key]
        if ".moe.experts." in key:
            b = net.blocks[int(key.split(".")[1])]
            want = want[b.moe.local_experts.start : b.moe.local_experts.stop]
        worst = max(worst, float((value - want).abs().max()))
    # How far training moved the parameters: the scale the differences compare against.
    moved = max(float((ref_sd[k] - v).abs().max()) for k, v in init.items())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "max_param_diff": worst,
        "zero_expert_seen": zero_expert_seen,
        "moved": moved,
    }


def check_parity(results: list[dict]) -> None:
    for r in results:
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-10, atol=1e-12)
        assert r["max_param_diff"] < 1e-10, r["max_param_diff"]
        assert r["moved"] > 1e-3  # training did move the weights the comparison checks
    assert any(r["zero_expert_seen"] for r in results)  # some expert got no tokens
