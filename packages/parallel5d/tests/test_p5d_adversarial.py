"""Adversarial inputs checked against independent plain-PyTorch / arithmetic references."""

from __future__ import annotations

import pytest

from hyperrec.parallel5d.cost import GroupShape, collective_time
from hyperrec.parallel5d.topology import Topology


@pytest.mark.parametrize(
    ("topology", "shape", "explicit"),
    [
        # one host: GroupShape's default ranks_per_host / ranks_per_zone (1) must not
        # send the all-to-all through the NICs or across zones
        (
            Topology(gpus_per_host=8, hosts=1),
            GroupShape(size=8),
            GroupShape(size=8, ranks_per_host=8, ranks_per_zone=8),
        ),
        # two hosts in one zone: the default ranks_per_zone must not price cross-zone links
        (
            Topology(gpus_per_host=8, hosts=2),
            GroupShape(size=16, ranks_per_host=8, hosts=2),
            GroupShape(size=16, ranks_per_host=8, ranks_per_zone=16, hosts=2),
        ),
    ],
    ids=["one_host", "two_hosts_one_zone"],
)
def test_all_to_all_in_one_zone_is_not_priced_across_zones(topology, shape, explicit):
    got, _ = collective_time(topology, shape, "all_to_all", 1e9)
    want, _ = collective_time(topology, explicit, "all_to_all", 1e9)
    assert got == pytest.approx(want, rel=1e-12)
    # and the ring collectives agree on the tier (they read hosts / zones)
    ag, _ = collective_time(topology, shape, "all_gather", 1e9)
    assert ag == pytest.approx(collective_time(topology, explicit, "all_gather", 1e9)[0])


def _frozen_flat_adamw() -> bool:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrec.dbuffer import flat_params
    from hyperrec.parallel5d import dbuffers, full_state_dict, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref.load_state_dict(model.state_dict())
    ref[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(flat_params(dbuffers(model)), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                                weight_decay=0.5)  # fmt: skip
    torch.manual_seed(1)  # the same batch on every rank: the reference sees it once
    for _ in range(3):
        x = torch.randn(3, 4)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = full_state_dict(model)
    return torch.equal(got["0.weight"], frozen) and all(
        torch.allclose(got[k], v, atol=1e-6) for k, v in ref.state_dict().items()
    )


def test_frozen_parameter_unchanged_by_recommended_flat_adamw():
    """README's fused path, ``AdamW(flat_params(dbuffers(model)))``, with a frozen weight
    in the same fully_shard group as trainable ones: the frozen weight stays bit for bit
    (it used to share a flat shard that got a zero gradient, so weight decay moved it)
    and everything else follows plain AdamW over the trainable parameters."""
    from hyperrec.testing import run_on_ranks

    assert all(run_on_ranks(_frozen_flat_adamw, 2))


def _lazy_adam_against_sparse_adam(c_dim: int, backend: str = "auto") -> None:
    """Three steps of LazyAdam on tables ``a`` (dim 4) and ``c`` (dim ``c_dim``) against
    ``nn.Embedding(sparse=True)``-style gradients + ``SparseAdam``. Step 1 looks ``fc`` up
    but does not use it; step 2 uses it again, so ``c``'s step count (Adam's bias
    correction) must not have advanced at step 1."""
    import torch
    import torch.nn.functional as F

    from hyperrec.parallel5d.sparse import (
        FeatureConfig,
        LazyAdam,
        ShardedEmbeddingCollection,
        TableConfig,
    )

    tabs = [TableConfig(name="a", num_rows=5, dim=4), TableConfig(name="c", num_rows=3, dim=c_dim)]
    feats = [FeatureConfig(name="fa", table="a"), FeatureConfig(name="fc", table="c")]
    coll = ShardedEmbeddingCollection(tabs, feats)
    assert len(coll.plan.groups) == (1 if c_dim == 4 else 2)
    opt = LazyAdam(coll, lr=0.1, backend=backend)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in coll.full_weights().items()}
    ref_opt = torch.optim.SparseAdam(list(ref.values()), lr=0.1)
    batch = {"fa": torch.tensor([0, 1]), "fc": torch.tensor([2])}
    for step in range(3):
        use_c = step != 1
        out = coll(batch)
        (out["fa"].square().sum() + (out["fc"].sum() if use_c else 0)).backward()
        loss = F.embedding(batch["fa"], ref["a"]).square().sum()
        if use_c:
            loss = loss + F.embedding(batch["fc"], ref["c"]).sum()
        loss.backward()
        for p in ref.values():
            if p.grad is not None:
                p.grad = p.grad.to_sparse()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    got = coll.full_weights()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k].detach(), rtol=0, atol=1e-6)


def test_lazy_adam_leaves_rows_of_an_unused_output_alone():
    # A looked-up feature whose output does not reach the loss: autograd materialises
    # zero row gradients for it, and LazyAdam used to move its rows by momentum;
    # SparseAdam + nn.Embedding(sparse=True) leaves them (grad None).
    _lazy_adam_against_sparse_adam(c_dim=2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lazy_adam_step_count_of_an_unused_table_in_a_shared_group(backend):
    # Two tables merged into one group (same dim): a step where only one was used
    # advances only that table's step count (Adam's bias correction), as SparseAdam.
    if backend == "triton" and not _triton_runs():
        pytest.skip("the Triton row kernels need a GPU or TRITON_INTERPRET=1")
    _lazy_adam_against_sparse_adam(c_dim=4, backend=backend)


def _triton_runs() -> bool:
    import os

    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
