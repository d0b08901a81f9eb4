"""Shared cases of the sparse tests: tables, jagged inputs, losses and the single-process
reference training (full dense tables, every rank's batch, torch / reference optimizers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperrec.parallel5d.sparse import (
    FeatureConfig,
    LazyAdagrad,
    LazyAdam,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)
from hyperrec.parallel5d.sparse.reference import lookup_reference, rowwise_adagrad_reference_

HP = {
    "rowwise_adagrad": {"lr": 0.3, "eps": 1e-8, "weight_decay": 0.01},
    "adagrad": {"lr": 0.2, "lr_decay": 0.1, "eps": 1e-10},
    "adam": {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-8},
}
STATES = {
    "rowwise_adagrad": ("momentum",),
    "adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
}


def tables(dtype: torch.dtype = torch.float32) -> tuple[TableConfig, ...]:
    """A GEM-like mix: a big row-wise item table (hashed row order) read by two sequence
    features, a small
    category table (table-wise under ``auto``) read by a sequence and a pooled feature,
    a 3-row table sharded row-wise (zero-row shards from 4 ranks up) and a table of
    another width (a second collective group)."""
    return (
        TableConfig(
            name="item", num_rows=61, dim=8, dtype=dtype, sharding="row", row_order="hashed"
        ),
        TableConfig(name="cat", num_rows=13, dim=8, dtype=dtype),
        TableConfig(name="action", num_rows=3, dim=8, dtype=dtype, sharding="row"),
        TableConfig(name="user", num_rows=29, dim=4, dtype=dtype, sharding="row"),
    )


FEATURES = (
    FeatureConfig(name="history", table="item"),
    FeatureConfig(name="candidates", table="item"),
    FeatureConfig(name="history_cat", table="cat"),
    FeatureConfig(name="actions", table="action"),
    FeatureConfig(name="user", table="user", pooling="sum"),
    FeatureConfig(name="tags", table="cat", pooling="mean"),
)


def _skewed(g: torch.Generator, n: int, rows: int) -> torch.Tensor:
    # ids ~ rows * u^3: low ids are hot, so batches repeat ids (duplicates to merge).
    return (torch.rand(n, generator=g) ** 3 * rows).long().clamp_max(rows - 1)


def make_inputs(step: int, rank: int, *, seed: int = 0) -> dict:
    """One rank's batch: jagged history (some ranks empty), 0-3 candidates, 0-3 requests
    with a user id each and 0-4 tags each (empty bags included)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 1_009 + rank)
    t = 0 if (step + rank) % 5 == 3 else int(torch.randint(1, 25, (1,), generator=g))
    b = int(torch.randint(0, 4, (1,), generator=g))
    tag_lens = torch.randint(0, 5, (b,), generator=g)
    tag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), tag_lens.cumsum(0)])
    return {
        "history": _skewed(g, t, 61),
        "candidates": _skewed(g, int(torch.randint(0, 4, (1,), generator=g)), 61).int(),
        "history_cat": _skewed(g, t, 13),
        "actions": torch.randint(0, 3, (t,), generator=g),
        "user": (_skewed(g, b, 29), torch.arange(b + 1)),
        "tags": (_skewed(g, int(tag_offsets[-1]), 13), tag_offsets.int()),
    }


def rank_loss(outputs: dict, step: int, rank: int) -> torch.Tensor:
    """A loss whose gradient depends on the rows: ``sum(out * P) + 0.5 * sum(out^2)``."""
    g = torch.Generator().manual_seed(7 + step * 31 + rank)
    loss = torch.zeros((), dtype=torch.float32)
    for name in sorted(outputs):
        out = outputs[name].float()
        proj = torch.randn(out.shape, generator=g)
        loss = loss + (out * proj).sum() + 0.5 * out.square().sum()
    return loss


def make_optimizer(kind: str, collection: ShardedEmbeddingCollection):
    cls = {"rowwise_adagrad": RowWiseAdagrad, "adagrad": LazyAdagrad, "adam": LazyAdam}[kind]
    return cls(collection, **HP[kind])


def touched_rows(inputs_per_rank: list[dict]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for inputs in inputs_per_rank:
        for f in FEATURES:
            v = inputs[f.name]
            ids = v[0] if isinstance(v, tuple) else v
            out.setdefault(f.table, set()).update(ids.tolist())
    return out


class Reference:
    """Single-process training of full tables on the union of every rank's batch."""

    def __init__(self, kind: str, weights: dict[str, torch.Tensor]):
        self.kind = kind
        self.w = {k: v.detach().clone().requires_grad_(True) for k, v in weights.items()}
        hp = HP[kind]
        if kind == "adagrad":
            self.opt = torch.optim.Adagrad(list(self.w.values()), **hp)
        elif kind == "adam":
            self.opt = torch.optim.SparseAdam(list(self.w.values()), **hp)
        else:
            self.momentum = {k: torch.zeros(v.shape[0]) for k, v in weights.items()}

    def outputs(self, inputs: dict) -> dict[str, torch.Tensor]:
        if self.kind == "adam":  # SparseAdam needs sparse gradients
            out = {}
            for f in FEATURES:
                v, w = inputs[f.name], self.w[f.table]
                if f.pooling == "none":
                    out[f.name] = F.embedding(v.long(), w, sparse=True)
                else:
                    out[f.name] = F.embedding_bag(
                        v[0], w, v[1].long(), mode=f.pooling, sparse=True, include_last_offset=True
                    )
            return out
        return lookup_reference(self.w, FEATURES, inputs)

    def step(self, step: int, world: int) -> list[dict[str, torch.Tensor]]:
        """One step on the batches of ranks ``0 .. world - 1``; returns each rank's
        outputs (before the update)."""
        batches = [make_inputs(step, r) for r in range(world)]
        outs = [self.outputs(b) for b in batches]
        loss = sum(rank_loss(o, step, r) for r, o in enumerate(outs)) / world
        loss.backward()
        with torch.no_grad():
            if self.kind == "rowwise_adagrad":
                touched = touched_rows(batches)
                for name, w in self.w.items():
                    grad = w.grad if w.grad is not None else torch.zeros_like(w)
                    rowwise_adagrad_reference_(
                        w, self.momentum[name], grad, touched.get(name, ()), **HP[self.kind]
                    )
                    w.grad = None
            else:
                self.opt.step()
                self.opt.zero_grad()
        return [{k: v.detach() for k, v in o.items()} for o in outs]

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.kind == "rowwise_adagrad":
            return {k: {"momentum": m} for k, m in self.momentum.items()}
        out = {}
        for name, w in self.w.items():
            st = self.opt.state[w]
            out[name] = {s: st[s].to_dense() for s in STATES[self.kind]}
        return out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, relative to the larger of 1 and ``max |b|``."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel():
        scale = max(1.0, float(b.detach().double().abs().max()))
        return float((a.detach().double() - b.detach().double()).abs().max()) / scale
    return 0.0
