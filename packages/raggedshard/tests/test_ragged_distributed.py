"""Real gloo ranks: every redistribution pair (forward and backward), upstream DTensor
integration, local-shard ops and DCP round trips, checked against the reference.

Spawning ranks dominates the cost on a small CI machine, so each world size is spawned
once (module-scoped fixtures) and runs every section; sub-meshes of 2 and 3 ranks live
inside the 4-rank world. Each test asserts its own section.
"""

import math
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ragged_cases import expected_local, full_tensor_for, local_for, pool_1d, random_ragged
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hyperrec.raggedshard import (
    RaggedLoadPlanner,
    RaggedSavePlanner,
    RaggedShard,
    check_placements,
    distribute_tensor,
    enable_local_ops,
    from_local,
    full_tensor,
    local_chunks,
    ragged_foreach,
    ragged_map,
    redistribute,
    to_local,
    total_norm,
)
from hyperrec.testing import run_on_ranks

SEEDS = {"a": 101, "b": 102, "c": 103}  # not hash(): spawned ranks must agree

# -- one pair, forward and backward --------------------------------------------------------


def _upstream_backward_fails(src, dst) -> bool:
    """Upstream's backward needs a pair it cannot route: Shard(d) -> RaggedShard, or
    (torch >= 2.13, whose backward only normalises its own shard types) RaggedShard ->
    Partial for the gradient of Partial -> RaggedShard."""
    return any(
        isinstance(p, RaggedShard)
        and isinstance(q, Shard)
        or isinstance(p, Partial)
        and isinstance(q, RaggedShard)
        for p, q in zip(src, dst)
    )


def _upstream_can(src, dst) -> bool:
    """Pairs whose forward upstream DTensor.redistribute routes through RaggedShard."""
    return all(
        (q == p if q.is_partial() else not (isinstance(p, Shard) and isinstance(q, RaggedShard)))
        for p, q in zip(src, dst)
    )


def _run_pair(mesh, shape, src, dst, seed, failures, label, upstream=False):
    """Redistribute ``src -> dst``; compare the local result and the input gradient."""
    mesh_shape, coord = tuple(mesh.shape), tuple(mesh.get_coordinate())
    full = full_tensor_for(shape, seed)
    local = local_for(full, mesh_shape, coord, src, seed).requires_grad_()
    x = from_local(local, mesh, src, shape=shape)
    y = x.redistribute(mesh, dst) if upstream else redistribute(x, dst)
    got = to_local(y)
    result = got.detach().clone()
    for axis, p in enumerate(dst):
        if p.is_partial():
            dist.all_reduce(result, group=mesh.get_group(axis))
    # Expectations are built on the CPU; results may live on the mesh's device (cuda).
    if not torch.equal(
        result.cpu(), expected_local(full, mesh_shape, coord, dst)
    ) or y.placements != tuple(dst):
        failures.append(f"{label} fwd {src} -> {dst} shape {shape}")
        return
    grad_full = full_tensor_for(shape, seed + 1)
    weight = expected_local(grad_full, mesh_shape, coord, dst).to(got.device)
    try:
        (got * weight).sum().backward()
    except (NotImplementedError, AssertionError) as e:
        if not (upstream and _upstream_backward_fails(src, dst)):
            failures.append(f"{label} bwd {src} -> {dst}: {type(e).__name__} {e}")
        elif isinstance(e, NotImplementedError) and "hyperrec" not in str(e):
            failures.append(f"{label} bwd {src} -> {dst}: unclear error {e}")
        return
    if upstream and _upstream_backward_fails(src, dst) and not any(p.is_partial() for p in src):
        failures.append(f"{label} bwd {src} -> {dst}: expected an error")
        return
    if local.grad is None or not torch.equal(
        local.grad, expected_local(grad_full, mesh_shape, coord, src)
    ):
        failures.append(f"{label} bwd {src} -> {dst} shape {shape}")


def _pairs_1d(mesh, seed, cases):
    """Every pair among 3 random RaggedShards, Shard(d) for every d, Replicate, Partial."""
    world = mesh.size(0)
    rng = random.Random(seed)
    failures, checked = [], 0
    for case in range(cases):
        shape = tuple(rng.randint(1, 6) for _ in range(1 + case % 3))  # 1-D, 2-D, 3-D
        if case == cases - 1:
            shape = (*shape[:-1], 0)  # an empty tensor
        pool = pool_1d(rng, shape, world)
        for src in pool:
            for dst in pool:
                ragged = isinstance(src, RaggedShard) or isinstance(dst, RaggedShard)
                if (
                    src == dst
                    or not ragged
                    or (dst.is_partial() and not isinstance(src, RaggedShard))
                ):
                    continue
                s = seed * 1000 + case
                _run_pair(mesh, shape, [src], [dst], s, failures, "ours")
                checked += 1
                if _upstream_can([src], [dst]):
                    _run_pair(mesh, shape, [src], [dst], s, failures, "upstream", upstream=True)
                    checked += 1
        # full_tensor(), upstream's and ours, with the gradient landing ragged.
        full = full_tensor_for(shape, seed)
        for fn in (lambda t: t.full_tensor(), full_tensor):
            local = local_for(
                full, (world,), (mesh.get_local_rank(0),), [pool[0]], seed
            ).requires_grad_()
            out = fn(from_local(local, mesh, [pool[0]], shape=shape))
            (out * 3).sum().backward()
            if not torch.equal(out.detach().cpu(), full) or not torch.equal(
                local.grad, torch.full_like(local, 3.0)
            ):
                failures.append(f"full_tensor {pool[0]} {shape}")
    for op in ("max", "avg"):  # the reduce-scatter with other reduce ops, upstream's path
        p = random_ragged(rng, (6, 4), world, k=1)
        _run_pair(mesh, (6, 4), [Partial(op)], [p], seed, failures, f"P({op})", upstream=True)
        _run_pair(mesh, (6, 4), [Partial(op)], [p], seed, failures, f"P({op})")
        checked += 2
    for dtype in (torch.float32, torch.int64, torch.bfloat16):  # non-float64 payloads
        full = full_tensor_for((5, 4), seed, dtype)
        a, b = random_ragged(rng, (5, 4), world, 1), random_ragged(rng, (5, 4), world, 2)
        x = from_local(
            expected_local(full, (world,), (mesh.get_local_rank(0),), [a]), mesh, [a], shape=(5, 4)
        )
        y = redistribute(redistribute(x, [b]), [Replicate()])
        if not torch.equal(y.to_local().cpu(), full) or y.dtype != dtype:
            failures.append(f"dtype {dtype}")
    return checked, failures


def _mesh_pool(rng, shape, mesh_shape):
    """Legal placement tuples on a 2-D mesh with a RaggedShard on either axis."""
    out = []
    for axis in (0, 1):
        for p in (
            random_ragged(rng, shape, mesh_shape[axis], 1),
            random_ragged(rng, shape, mesh_shape[axis]),
        ):
            for q in [Replicate(), Partial()] + ([Shard(1)] if p.dims == (0,) else []):
                pl = [q, q]
                pl[axis] = p
                out.append(tuple(pl))
    return out + [
        (Replicate(), Replicate()),
        (Shard(0), Replicate()),
        (Replicate(), Shard(1)),
        (Shard(1), Shard(0)),
    ]


def _legal_pair(src, dst, shape, mesh) -> bool:
    try:
        check_placements(src, shape, mesh)
        check_placements(dst, shape, mesh)
    except ValueError:
        return False
    for i, (p, q) in enumerate(zip(src, dst)):
        if q.is_partial() and p != q and not isinstance(p, RaggedShard):
            return False  # upstream refuses Partial targets; so do we
        if p != q and (isinstance(p, RaggedShard) or isinstance(q, RaggedShard)):
            dims = {t.dim for t in (p, q) if type(t) is Shard}
            if dims & {t.dim for t in (src[1 - i], dst[1 - i]) if type(t) is Shard}:
                return False  # Shard(d) <-> RaggedShard needs d unsharded elsewhere
    return any(isinstance(p, RaggedShard) for p in (*src, *dst))


def _pairs_2d(mesh, seed, cases, max_pairs):
    rng = random.Random(seed)
    failures, checked = [], 0
    for case in range(cases):
        shape = (rng.choice([6, 8, 12]), rng.randint(2, 5), *([3] if case % 2 else []))
        pool = _mesh_pool(rng, shape, tuple(mesh.shape))
        pairs = [(s, d) for s in pool for d in pool if s != d and _legal_pair(s, d, shape, mesh)]
        for src, dst in rng.sample(pairs, min(max_pairs, len(pairs))):
            _run_pair(mesh, shape, list(src), list(dst), seed * 100 + case, failures, "ours")
            checked += 1
    return checked, failures


# -- upstream integration, local ops, DCP --------------------------------------------------


def _upstream(mesh):
    """DTensor APIs used directly with a RaggedShard (3-rank mesh)."""
    rank = mesh.get_local_rank(0)
    out = {}
    full = full_tensor_for((6, 4), 3)
    p = RaggedShard((0,), (1, 0, 2))
    mine = expected_local(full, (3,), (rank,), [p])
    x = DTensor.from_local(mine, mesh, [p], shape=torch.Size((6, 4)), stride=(4, 1))
    out["from_local"] = (
        x.placements == (p,) and x.shape == (6, 4) and x.to_local().shape[0] == (2, 0, 4)[rank]
    )
    chunk = expected_local(full, (3,), (rank,), [Shard(0)])
    s = DTensor.from_local(chunk, mesh, [Shard(0)], shape=torch.Size((6, 4)), stride=(4, 1))
    try:  # the one pair upstream cannot route: a clear error naming the way out
        s.redistribute(mesh, [p])
        out["shard_to_ragged_error"] = False
    except NotImplementedError as e:
        out["shard_to_ragged_error"] = "hyperrec.raggedshard.redistribute" in str(e)
    out["ours_handles_it"] = torch.equal(redistribute(s, [p]).to_local(), mine)
    d = distribute_tensor(full if rank == 0 else torch.zeros_like(full), mesh, [p])
    out["distribute_tensor"] = torch.equal(d.to_local(), mine)
    # An ATen op through upstream dispatch: torch 2.13 all-gathers first (correct, and
    # the result is Replicate); torch 2.11's propagation raises. Never a wrong value.
    try:
        out["upstream_add_is_correct"] = torch.equal((x + x).full_tensor(), 2 * full)
    except RuntimeError as e:
        out["upstream_add_is_correct"] = "Sharding propagation failed" in str(e)
    try:
        from_local(torch.zeros(3, 4), mesh, [p], shape=(6, 4))
        out["from_local_checks_shape"] = False
    except ValueError as e:
        out["from_local_checks_shape"] = "holds" in str(e)
    return out


def _ops(mesh):
    """ragged_map / ragged_foreach / total_norm on a (2, 2) mesh with HSDP-style (R, RS)."""
    coord = tuple(mesh.get_coordinate())
    out = {}
    shapes = [(6, 3), (4,), (2, 2, 3)]
    places = [
        (Replicate(), RaggedShard((0,), (1, 2))),
        (Replicate(), RaggedShard((0,), (3, 1))),
        (RaggedShard((0, 1), (1, 1)), Replicate()),
    ]
    fulls = [full_tensor_for(s, 10 + i) for i, s in enumerate(shapes)]
    others = [full_tensor_for(s, 20 + i) for i, s in enumerate(shapes)]

    def dt(full, pl, grad=False):
        local = expected_local(full, (2, 2), coord, pl).requires_grad_(grad)
        return from_local(local, mesh, pl, shape=full.shape), local

    a, a_local = dt(fulls[0], places[0], grad=True)
    b, _ = dt(others[0], places[0])
    y = ragged_map(lambda u, v: torch.addcmul(u, u, v, value=0.5), a, b)
    out["map_value"] = torch.equal(
        full_tensor(y), torch.addcmul(fulls[0], fulls[0], others[0], value=0.5)
    )
    out["map_layout"] = y.placements == places[0]
    to_local(y).sum().backward()
    out["map_grad"] = torch.equal(
        a_local.grad, expected_local(1 + 0.5 * others[0], (2, 2), coord, places[0])
    )
    try:
        ragged_map(torch.add, a, dt(fulls[0], (Replicate(), RaggedShard((0,), (2, 1))))[0])
        out["map_rejects_layouts"] = False
    except ValueError:
        out["map_rejects_layouts"] = True
    params = [dt(f, p)[0] for f, p in zip(fulls, places)]
    grads = [dt(f, p)[0] for f, p in zip(others, places)]
    with torch.no_grad():
        ragged_foreach(torch._foreach_add_, params, grads, alpha=-2.0)
        ragged_foreach(torch._foreach_mul_, params, 0.5)
    out["foreach_inplace"] = all(
        torch.equal(full_tensor(p), (f - 2 * o) * 0.5) for p, f, o in zip(params, fulls, others)
    )
    sums = ragged_foreach(torch._foreach_add, params, grads)
    out["foreach_outplace"] = all(
        s.placements == p.placements and torch.equal(full_tensor(s), full_tensor(p) + o)
        for s, p, o in zip(sums, params, others)
    )
    # Opt-in hook: a stock torch.optim optimizer steps ragged DTensor parameters locally,
    # exactly as it steps the full tensors in one process.
    enable_local_ops()
    for kind in ("foreach", "fused", "single"):
        # "single": the per-tensor loop (flat argument lists, the handler's fast path).
        flags = {"foreach": False} if kind == "single" else {kind: True}
        leaves = [torch.nn.Parameter(dt(f, p)[0]) for f, p in zip(fulls, places)]
        refs = [torch.nn.Parameter(f.clone()) for f in fulls]
        opt = torch.optim.AdamW(leaves, lr=0.1, weight_decay=0.01, **flags)
        ref_opt = torch.optim.AdamW(refs, lr=0.1, weight_decay=0.01, **flags)
        for step in range(2):
            for leaf, ref, o, pl in zip(leaves, refs, others, places):
                leaf.grad = dt(o * (step + 1), pl)[0]
                ref.grad = o * (step + 1)
            opt.step()
            ref_opt.step()
        out[f"stock_adamw_{kind}"] = all(
            leaf.placements == pl and torch.equal(full_tensor(leaf.detach()), ref.detach())
            for leaf, ref, pl in zip(leaves, refs, places)
        )
    # Stock gradient clipping on ragged DTensor parameters: the shard-local norms are
    # partial norms that DTensor reduces; clipped gradients keep their layout.
    for foreach in (True, False):
        for norm_type in (2.0, 1.0, math.inf):
            leaves = [torch.nn.Parameter(dt(f, p)[0]) for f, p in zip(fulls, places)]
            refs = [torch.nn.Parameter(f.clone()) for f in fulls]
            for leaf, ref, o, pl in zip(leaves, refs, others, places):
                leaf.grad = dt(3 * o, pl)[0]
                ref.grad = 3 * o
            got = torch.nn.utils.clip_grad_norm_(leaves, 1.5, norm_type, foreach=foreach)
            want = torch.nn.utils.clip_grad_norm_(refs, 1.5, norm_type, foreach=foreach)
            got = got.full_tensor() if isinstance(got, DTensor) else got
            out[f"clip_{norm_type}_{foreach}_norm"] = torch.allclose(got, want, rtol=1e-5)
            out[f"clip_{norm_type}_{foreach}_grads"] = all(
                leaf.grad.placements == pl
                and torch.allclose(full_tensor(leaf.grad), ref.grad, rtol=1e-5)
                for leaf, ref, pl in zip(leaves, refs, places)
            )
    vn = torch.linalg.vector_norm(params[0], 3.0)
    out["vector_norm"] = torch.allclose(
        vn.full_tensor(), torch.linalg.vector_norm(full_tensor(params[0]), 3.0), rtol=1e-5
    )
    flat = torch.cat([full_tensor(p).reshape(-1) for p in params])
    for norm_type in (2.0, 1.0, math.inf):
        got = total_norm(params, norm_type)
        want = torch.linalg.vector_norm(flat.float(), norm_type)
        out[f"norm_{norm_type}"] = torch.allclose(got.float(), want, rtol=1e-6)
    try:
        total_norm([dt(fulls[0], (Partial(), RaggedShard((0,), (1, 2))))[0]])
        out["norm_rejects_partial"] = False
    except ValueError:
        out["norm_rejects_partial"] = True
    return out


def _checkpoint_state(world, mesh_1d, mesh_2d, layout_seed, zeros):
    """A state dict of ragged DTensors (1-D and HSDP meshes) plus plain values."""
    rng = random.Random(layout_seed)
    rank = dist.get_rank()
    sd = {"step": 0 if zeros else 11, "nested": {"lr": 0.0 if zeros else 0.5}}
    for name, shape in (("a", (6, 5, 4)), ("b", (10,)), ("c", (7, 3))):
        full = full_tensor_for(shape, SEEDS[name])
        p = random_ragged(rng, shape, world)
        local = expected_local(full, (world,), (rank,), [p])
        sd[name] = from_local(
            torch.zeros_like(local) if zeros else local, mesh_1d, [p], shape=shape
        )
    if mesh_2d is not None:
        full = full_tensor_for((8, 6), 5)
        pl = (Replicate(), random_ragged(rng, (8, 6), mesh_2d.size(1), 1))
        local = expected_local(full, tuple(mesh_2d.shape), tuple(mesh_2d.get_coordinate()), pl)
        sd["nested"]["hsdp"] = from_local(
            torch.zeros_like(local) if zeros else local, mesh_2d, pl, shape=(8, 6)
        )
    return sd


def _checkpoint_ok(sd) -> dict:
    out = {"step": sd["step"] == 11, "lr": sd["nested"]["lr"] == 0.5}
    for name, shape in (("a", (6, 5, 4)), ("b", (10,)), ("c", (7, 3))):
        out[name] = torch.equal(full_tensor(sd[name]), full_tensor_for(shape, SEEDS[name]))
    if "hsdp" in sd["nested"]:
        out["hsdp"] = torch.equal(full_tensor(sd["nested"]["hsdp"]), full_tensor_for((8, 6), 5))
    return out


def _save(path, mesh_1d, mesh_2d):
    sd = _checkpoint_state(dist.get_world_size(), mesh_1d, mesh_2d, 1, zeros=False)
    # What this rank writes is its own shard only: no full tensor is built.
    written = sum(v.numel() for t in (sd["a"], sd["b"], sd["c"]) for _, _, v in local_chunks(t))
    held = sum(t.to_local().numel() for t in (sd["a"], sd["b"], sd["c"]))
    dcp.save(sd, checkpoint_id=path, planner=RaggedSavePlanner())
    return {"writes_only_its_shard": written == held}


# -- the spawned suites ------------------------------------------------------------------


def _suite_4(seed, path):
    rank = dist.get_rank()
    out = {}
    for world in (2, 3):  # sub-meshes of the 4-rank world
        mesh = DeviceMesh("cpu", list(range(world)))
        out[f"pairs_1d_{world}"] = _pairs_1d(mesh, seed + world, 4) if rank < world else (0, [])
        if world == 3:
            out["upstream"] = _upstream(mesh) if rank < 3 else {}
    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2))
    out["pairs_1d_4"] = _pairs_1d(mesh4, seed + 4, 3)
    out["pairs_2d_2x2"] = _pairs_2d(mesh22, seed, 3, 40)
    out["ops"] = _ops(mesh22)
    out["save"] = _save(path, mesh4, mesh22)
    return out


def _suite_8(seed):
    rank = dist.get_rank()
    out = {}
    timed = time.perf_counter()
    out["pairs_1d_8"] = _pairs_1d(init_device_mesh("cpu", (8,)), seed, 1)
    out["pairs_2d_4x2"] = _pairs_2d(init_device_mesh("cpu", (4, 2)), seed + 1, 1, 12)
    out["pairs_2d_2x4"] = _pairs_2d(init_device_mesh("cpu", (2, 4)), seed + 2, 1, 12)
    mesh23 = DeviceMesh("cpu", torch.arange(6).reshape(2, 3))
    out["pairs_2d_2x3"] = _pairs_2d(mesh23, seed + 3, 1, 12) if rank < 6 else (0, [])
    out["seconds"] = time.perf_counter() - timed
    return out


def _suite_nccl(seed):
    torch.cuda.set_device(dist.get_rank())
    return {"pairs_1d": _pairs_1d(init_device_mesh("cuda", (dist.get_world_size(),)), seed, 3)}


def _load(ragged_path, plain_path):
    world = dist.get_world_size()
    mesh_1d = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (1, world))
    out = {}
    sd = _checkpoint_state(world, mesh_1d, mesh_2d, 2, zeros=True)
    dcp.load(sd, checkpoint_id=ragged_path, planner=RaggedLoadPlanner())
    out.update({f"ragged_{k}": v for k, v in _checkpoint_ok(sd).items()})
    sd = _checkpoint_state(world, mesh_1d, None, 9, zeros=True)
    dcp.load(sd, checkpoint_id=plain_path, planner=RaggedLoadPlanner())
    out.update({f"plain_{k}": v for k, v in _checkpoint_ok(sd).items()})
    # The ragged checkpoint into upstream Shard(0) DTensors, with the default planner.
    chunk = expected_local(torch.zeros(6, 5, 4), (world,), (dist.get_rank(),), [Shard(0)])
    a = DTensor.from_local(
        torch.zeros_like(chunk, dtype=torch.float64),
        mesh_1d,
        [Shard(0)],
        shape=torch.Size((6, 5, 4)),
        stride=(20, 4, 1),
    )
    dcp.load({"a": a}, checkpoint_id=ragged_path)
    out["into_upstream_shard"] = torch.equal(
        a.full_tensor(), full_tensor_for((6, 5, 4), SEEDS["a"])
    )
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def suite4(ckpt_dir):
    results = run_on_ranks(_suite_4, 4, 40, str(ckpt_dir / "ragged"), timeout_s=900)
    return results


@pytest.fixture(scope="module")
def suite8():
    return run_on_ranks(_suite_8, 8, 80, timeout_s=900)


def _assert_pairs(results, key, minimum):
    for rank, res in enumerate(results):
        checked, failures = res[key]
        assert not failures, (rank, failures[:8])
        assert checked >= minimum or checked == 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_pair_on_1d_meshes(suite4, world):
    _assert_pairs(suite4, f"pairs_1d_{world}", 150)


def test_pairs_on_a_2x2_mesh(suite4):
    _assert_pairs(suite4, "pairs_2d_2x2", 40)


@pytest.mark.parametrize("key", ["pairs_1d_8", "pairs_2d_4x2", "pairs_2d_2x4", "pairs_2d_2x3"])
def test_pairs_on_eight_ranks(suite8, key):
    _assert_pairs(suite8, key, 12)


def test_upstream_dtensor_apis(suite4):
    for res in suite4[:3]:
        assert res["upstream"] and all(res["upstream"].values()), res["upstream"]


def test_local_shard_ops(suite4):
    for res in suite4:
        assert all(res["ops"].values()), res["ops"]


def test_dcp_save_writes_only_local_boxes(suite4):
    for res in suite4:
        assert all(res["save"].values())


def test_dcp_round_trips_across_world_sizes(suite4, ckpt_dir):
    # Saved on 4 ranks (suite4); read as whole tensors in one process (no process group).
    f64 = torch.float64
    plain = {"a": torch.zeros(6, 5, 4, dtype=f64), "c": torch.zeros(7, 3, dtype=f64)}
    dcp.load(plain, checkpoint_id=str(ckpt_dir / "ragged"), no_dist=True)
    assert torch.equal(plain["a"], full_tensor_for((6, 5, 4), SEEDS["a"]))
    assert torch.equal(plain["c"], full_tensor_for((7, 3), SEEDS["c"]))
    # A checkpoint of plain tensors, written by one process.
    sd = {"step": 11, "nested": {"lr": 0.5}}
    for name, shape in (("a", (6, 5, 4)), ("b", (10,)), ("c", (7, 3))):
        sd[name] = full_tensor_for(shape, SEEDS[name])
    dcp.save(sd, checkpoint_id=str(ckpt_dir / "plain"), no_dist=True)
    # Both loaded on 3 ranks with other units (and into upstream Shard(0) DTensors).
    for res in run_on_ranks(_load, 3, str(ckpt_dir / "ragged"), str(ckpt_dir / "plain")):
        assert all(res.values()), res


@pytest.mark.gpu
@pytest.mark.multigpu
def test_every_pair_on_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for res in run_on_ranks(_suite_nccl, 2, 60, backend="nccl", timeout_s=600):
        checked, failures = res["pairs_1d"]
        assert not failures, failures[:8]
        assert checked >= 100
