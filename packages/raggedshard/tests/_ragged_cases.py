"""Random placements and tensors shared by the multi-rank tests (same on every rank)."""

from __future__ import annotations

import math
import random

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hyperrec.raggedshard import RaggedShard
from hyperrec.raggedshard.reference import local_tensor


def random_units(rng: random.Random, rows: int, world: int) -> list[int]:
    """Units for ``rows`` rows over ``world`` ranks: zeros, one-hot and uneven splits."""
    if rows == 0:
        return [1] + [0] * (world - 1)
    total = rng.choice([d for d in range(1, rows + 1) if rows % d == 0])
    if rng.random() < 0.25:
        units = [0] * world
        units[rng.randrange(world)] = total
        return units
    cuts = sorted(rng.randint(0, total) for _ in range(world - 1))
    units = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    return units if sum(units) else [total] + [0] * (world - 1)


def random_ragged(rng: random.Random, shape: tuple[int, ...], world: int, k: int | None = None):
    k = rng.randint(0, len(shape)) if k is None else k
    return RaggedShard(tuple(range(k)), random_units(rng, math.prod(shape[:k]), world))


def full_tensor_for(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Integer-valued, so every sum and comparison below is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def local_for(full, mesh_shape, coord, placements, seed: int) -> torch.Tensor:
    """This rank's local tensor; a Partial axis gets integer parts that reduce to ``full``."""
    t = full
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            n, c = mesh_shape[axis], coord[axis]
            g = torch.Generator().manual_seed(seed + 7919 * axis)
            parts = [torch.randint(-9, 9, t.shape, generator=g).to(t.dtype) for _ in range(n)]
            if p.reduce_op == "sum":
                parts[-1] = t - sum(parts[:-1])
                t = parts[c]
            elif p.reduce_op == "max":
                lows = [t - part.abs() for part in parts]
                lows[int(seed) % n] = t
                t = lows[c]
            else:  # avg
                t = t.clone()
        else:
            t = local_tensor(t, mesh_shape, coord, [Replicate()] * axis + [p])
    return t.clone()


def expected_local(full, mesh_shape, coord, placements) -> torch.Tensor:
    return local_tensor(
        full, mesh_shape, coord, [Replicate() if p.is_partial() else p for p in placements]
    )


def pool_1d(rng: random.Random, shape, world):
    ragged = [random_ragged(rng, shape, world) for _ in range(3)]
    shards = [Shard(d) for d in range(len(shape))]
    return ragged + shards + [Replicate(), Partial()]
