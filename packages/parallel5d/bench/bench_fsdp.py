"""hyperrec fully_shard vs PyTorch FSDP2: same run, same model, same batch.

Launch on any number of GPUs (or CPU processes with gloo)::

    torchrun --nproc_per_node 8 packages/parallel5d/bench/bench_fsdp.py --model llama gem
    torchrun --nproc_per_node 4 packages/parallel5d/bench/bench_fsdp.py --device cpu --preset tiny

Without torchrun it runs as one process. For each model and each variant it builds the
model from the same seed, applies ``fully_shard`` per block and at the root (both
libraries, same mixed-precision policy and ``reshard_after_forward``), and measures:

* step time (median of the timed steps, forward + backward + optimizer step);
* peak allocated / reserved memory over the timed steps (CUDA), or the peak of live
  tensor bytes over one step from ``MemTracker`` (CPU);
* collectives per step (c10d ops seen by a dispatch mode) and their bytes;
* bytes written by copy kernels per step (same-dtype layout copies and dtype casts
  reported apart; copy-in/copy-out of FSDP2 shows as the former).

Rank 0 prints a table and writes JSON (``--out``) with the machine description.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

# ----------------------------------------------------------------------------- models


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int = 128) -> None:
        super().__init__()
        self.heads = dim // head_dim
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """A block whose ``_forward`` is optionally recomputed in backward (``checkpoint``).

    Checkpointing sits inside the block, as torchtitan composes it: the sharding hooks
    of the block run outside the recomputed region."""

    checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class LlamaBlock(Block):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Llama-like decoder stack (no RoPE: it does not change the sharding work)."""

    def __init__(self, layers: int, dim: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim, ffn) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, target = batch
        h = self.tok(ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.out(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class GEMBlock(Block):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class GEMTower(nn.Module):
    """GEM-like dense tower: many small per-feature projections feeding an MLP stack and
    several task heads — many uneven tensors, the case FSDP2 pads and copies the most."""

    def __init__(self, layers: int, dim: int, features: int, feat_dim: int, tasks: int) -> None:
        super().__init__()
        self.feat_dim = feat_dim
        self.features = nn.ModuleList([nn.Linear(feat_dim, 48) for _ in range(features)])
        self.proj = nn.Linear(48 * features, dim)
        self.layers = nn.ModuleList([GEMBlock(dim, 4 * dim) for _ in range(layers)])
        self.heads = nn.ModuleList(
            [nn.Sequential(nn.Linear(dim, 500), nn.ReLU(), nn.Linear(500, 1)) for _ in range(tasks)]
        )

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        parts = x.split(self.feat_dim, dim=1)
        h = self.proj(torch.cat([f(p) for f, p in zip(self.features, parts)], dim=1))
        for layer in self.layers:
            h = layer(h)
        logits = torch.cat([head(h) for head in self.heads], dim=1)
        return F.binary_cross_entropy_with_logits(logits.float(), y)


class MoEBlock(Block):
    """GPT-OSS-like block: attention + ``experts`` stacked expert MLPs, one expert per token.

    The experts live in two 3-D parameters ``(experts, dim, ffn)`` / ``(experts, ffn,
    dim)``: with more ranks than experts, sharding dim 0 (FSDP2's default) pads.
    Tokens go to experts round-robin (token ``t`` to expert ``t % experts``), weighted by
    the router's probability for that expert: the work per step then does not depend on
    the weights' values. It must not: on the fake process group gathered weights hold
    whatever the allocator left there, different for each library, and learned top-1
    routing over such weights sent the tokens to different numbers of experts (a kernel
    launch per non-empty expert), which made the step times incomparable."""

    def __init__(self, dim: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, ffn) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, dim) * ffn**-0.5)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x).flatten(0, 1)
        n_experts = self.w_in.shape[0]
        probs = self.router(h).softmax(-1)
        out = torch.zeros_like(h)
        for e in range(n_experts):
            idx = torch.arange(e, h.shape[0], n_experts, device=h.device)
            y = F.silu(h[idx] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, idx, y * probs[idx, e, None])
        return x + out.view_as(x)


class MoE(Llama):
    def __init__(self, layers: int, dim: int, ffn: int, vocab: int, experts: int) -> None:
        super().__init__(0, dim, ffn, vocab)
        self.layers = nn.ModuleList([MoEBlock(dim, ffn, experts) for _ in range(layers)])


PRESETS = {
    # name: (constructor kwargs, batch maker)
    "llama": dict(kind="llama", layers=8, dim=4096, ffn=11008, vocab=32000, batch=2, seq=2048),
    "gem": dict(kind="gem", layers=8, dim=2048, features=64, feat_dim=16, tasks=3, batch=8192),
    "moe": dict(
        kind="moe", layers=12, dim=2048, ffn=2048, experts=32, vocab=32000, batch=1, seq=2048
    ),
}
TINY = {
    "llama": dict(kind="llama", layers=4, dim=256, ffn=688, vocab=1000, batch=2, seq=64),
    "gem": dict(kind="gem", layers=4, dim=128, features=16, feat_dim=8, tasks=3, batch=256),
    "moe": dict(kind="moe", layers=2, dim=256, ffn=128, experts=4, vocab=1000, batch=2, seq=64),
}


def build(cfg: dict, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        if cfg["kind"] == "llama":
            model = Llama(cfg["layers"], cfg["dim"], cfg["ffn"], cfg["vocab"])
        elif cfg["kind"] == "moe":
            model = MoE(cfg["layers"], cfg["dim"], cfg["ffn"], cfg["vocab"], cfg["experts"])
        else:
            model = GEMTower(
                cfg["layers"], cfg["dim"], cfg["features"], cfg["feat_dim"], cfg["tasks"]
            )
    for block in model.blocks():
        block.checkpoint = bool(cfg.get("checkpoint", False))
    return model


def make_batch(cfg: dict, device: torch.device, step: int, rank: int) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(1000 * step + rank)
    if cfg["kind"] in ("llama", "moe"):
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)
    x = torch.randn(cfg["batch"], cfg["features"] * cfg["feat_dim"], generator=g)
    y = (torch.rand(cfg["batch"], cfg["tasks"], generator=g) < 0.3).float()
    return x.to(device), y.to(device)


# ---------------------------------------------------------------------------- sharding


def shard(model: nn.Module, impl: str, mesh, mp: bool) -> None:
    kw = {}
    if impl == "fsdp2-dim1":
        # FSDP2 tuned by hand for 3-D expert weights: shard dim 1 (no padding when the
        # ranks outnumber the experts; FSDP2 then copies with a chunk-cat instead).
        from torch.distributed.tensor import Shard

        kw["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 3 else Shard(0)
        impl = "fsdp2"
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from hyperrec.parallel5d import MixedPrecisionPolicy, fully_shard
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=True, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, **kw)


def make_optimizer(model: nn.Module, impl: str, optim: str) -> torch.optim.Optimizer:
    lr = 1e-4
    if impl == "hyperrec" and optim == "flat":  # (fsdp2-dim1 falls through below)
        from hyperrec.dbuffer import flat_params
        from hyperrec.parallel5d import dbuffers

        # One fused AdamW kernel per flat buffer.
        return torch.optim.AdamW(flat_params(dbuffers(model)), lr=lr, fused=True)
    if optim in ("fused", "flat"):
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


# ----------------------------------------------------------------------------- counting

_COPY_OPS = {
    "aten::copy_",
    "aten::_to_copy",
    "aten::cat",
    "aten::_chunk_cat",
    "aten::split_with_sizes_copy",
    "aten::_foreach_copy_",
    "aten::clone",
    "fsdp::all_gather_copy_in",
    "fsdp::split_with_sizes_copy",
    "fsdp::chunk_cat",
}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class OpCounter(TorchDispatchMode):
    """Counts collectives and the bytes written by copy-like ops during one step.

    Copies that a backend makes inside ``Work.wait()`` (gloo stages results through
    aten copies; NCCL does not) belong to the collective, not to the FSDP
    implementation, and are reported apart as ``backend_copy_bytes``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.backend_copy_bytes = 0
        self._in_wait = 0
        self._orig_wait = None
        self.collectives: dict[str, int] = {}
        self.collective_bytes = 0
        self.copy_bytes = 0
        self.cast_bytes = 0
        self.copy_ops: dict[str, int] = {}

    def __enter__(self):
        work = torch._C._distributed_c10d.Work
        self._orig_wait = work.wait
        counter = self

        def wait(w, *a, **k):
            counter._in_wait += 1
            try:
                return counter._orig_wait(w, *a, **k)
            finally:
                counter._in_wait -= 1

        work.wait = wait
        return super().__enter__()

    def __exit__(self, *exc):
        torch._C._distributed_c10d.Work.wait = self._orig_wait
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if self._in_wait and name in _COPY_OPS:
            self.backend_copy_bytes += _nbytes(_tensors(args[0]) if args else [])
            return out
        ns = name.split("::")[0]
        if ns in ("c10d", "_c10d_functional"):
            if not name.endswith(("wait", "wait_tensor", "barrier")):
                self.collectives[name] = self.collectives.get(name, 0) + 1
                self.collective_bytes += _nbytes(_tensors(args[0]) if args else [])
        elif name in _COPY_OPS:
            if name == "fsdp::all_gather_copy_in":
                written, src = _tensors(out)[:1], _tensors(args[0])
            elif "out" in kwargs:
                written, src = _tensors(kwargs["out"]), _tensors(args[0])
            elif name in ("aten::copy_", "aten::_foreach_copy_"):
                written, src = _tensors(args[0]), _tensors(args[1])
            else:
                written, src = _tensors(out), _tensors(args[0])
            nbytes = _nbytes(written)
            cast = bool(src) and bool(written) and src[0].dtype != written[0].dtype
            if cast:
                self.cast_bytes += nbytes
            else:
                self.copy_bytes += nbytes
            self.copy_ops[name] = self.copy_ops.get(name, 0) + 1
        return out


# ------------------------------------------------------------------------------- runs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(model, opt, batch, marks: list | None = None) -> torch.Tensor:
    loss = model(batch)
    if marks is not None:  # the host's clock when the forward (and loss) is issued
        marks.append(time.perf_counter())
    loss.backward()
    if marks is not None:  # ... and when the backward is
        marks.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _GCLog:
    """Time spent in Python's garbage collector (``gc.callbacks``) since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def timed_step(model, opt, batch, device, marks: list | None = None):
    """One training step from a synchronised device: ``(loss, host_s, step_s)``, the
    seconds until ``train_step`` returned (the host's enqueue time) and until the device
    finished. ``marks``: gets ``(forward, backward)``, the host's seconds issuing the
    forward (and loss) and then the backward; the rest of ``host_s`` issued the
    optimizer."""
    t0 = time.perf_counter()
    clock: list[float] = []
    loss = train_step(model, opt, batch, clock)
    host_s = time.perf_counter() - t0
    sync(device)
    if marks is not None:
        marks.append((clock[0] - t0, clock[1] - clock[0]))
    return loss, host_s, time.perf_counter() - t0


def _phase_medians(marks: list[tuple[float, float]]) -> dict:
    fwd, bwd = [m[0] for m in marks], [m[1] for m in marks]
    return {
        "host_forward_s": statistics.median(fwd),
        "host_forward_s_all": fwd,
        "host_backward_s": statistics.median(bwd),
        "host_backward_s_all": bwd,
    }


def run_variant(cfg, impl, optim, mp, mesh, device, args) -> dict:
    rank = dist.get_rank()
    model = build(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    shard(model, impl, mesh, mp)
    opt = make_optimizer(model, impl, optim)
    for s in range(args.warmup):
        train_step(model, opt, make_batch(cfg, device, s, rank))
    sync(device)
    result = {"impl": impl, "optimizer": optim, "params": n_params}

    # Counting step (not timed).
    counter = OpCounter()
    with counter:
        train_step(model, opt, make_batch(cfg, device, args.warmup, rank))
    sync(device)
    result["collectives"] = dict(sorted(counter.collectives.items()))
    result["collectives_per_step"] = sum(counter.collectives.values())
    result["collective_bytes"] = counter.collective_bytes
    result["copy_bytes"] = counter.copy_bytes
    result["cast_bytes"] = counter.cast_bytes
    result["backend_copy_bytes"] = counter.backend_copy_bytes
    result["copy_ops"] = dict(sorted(counter.copy_ops.items()))

    # Memory. Cached blocks left from building the full model before sharding (and from
    # the warm-up) would otherwise dominate the reserved peak: release them so that peak
    # measures the training steps alone.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        result.update(cpu_memory(model, opt, cfg, device, rank, args))

    if args.gc_freeze:
        # move everything alive now (the model, the shards, the optimizer) out of the
        # cyclic collector's reach: its full collections then scan only the step's objects
        gc.collect()
        gc.freeze()
    gc_log = _GCLog()
    times, host, phases, losses, gc_s, gc_full = [], [], [], [], [], []
    for s in range(args.steps):
        batch = make_batch(cfg, device, args.warmup + 1 + s, rank)
        sync(device)
        gc_log.reset()
        loss, host_s, step_s = timed_step(model, opt, batch, device, phases)
        losses.append(loss)
        host.append(host_s)
        times.append(step_s)
        gc_s.append(gc_log.seconds)
        gc_full.append(gc_log.full)
    gc_log.close()
    if args.gc_freeze:
        gc.unfreeze()
    # Python's cyclic garbage collector inside the timed steps: seconds and full
    # (generation-2) collections per step; a full collection walks every tracked object.
    result["gc_s_per_step"] = gc_s
    result["gc_full_collections_per_step"] = gc_full
    result["gc_frozen"] = bool(args.gc_freeze)
    # Seconds until train_step returned, before the device sync: on a GPU the host's time
    # to enqueue the step (plus any wait inside it). Close to step_s means the host, not
    # the GPU, set the step time; the cost model has no host term.
    result["host_s"] = statistics.median(host)
    result["host_s_all"] = host
    # ... of which the forward (and loss), then the backward: the cost model's
    # host_forward_s / host_backward_s
    result.update(_phase_medians(phases))
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        stats = torch.cuda.memory_stats()
        result["alloc_retries"] = stats.get("num_alloc_retries", 0)
        result["device_mallocs"] = stats.get("num_device_alloc", 0)
    if args.profile:
        # Where the time goes: two more steps under the profiler, table to a text file.
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for s in range(2):
                train_step(model, opt, make_batch(cfg, device, 50_000 + s, rank))
            sync(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        path = Path(args.profile) / f"profile_{cfg['kind']}_{impl}_{optim}_r{rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40)
            + "\n\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        )
    result["step_s"] = statistics.median(times)
    result["step_s_all"] = times
    result["final_loss"] = float(losses[-1])
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_interleaved(cfgs, impl, optim, mp, mesh, device, args) -> list[dict]:
    """Time several models step by step in turn (model 0's step, model 1's, ..., then
    model 0's next one): each model's steps sample the same stretch of the host's speed,
    where :func:`run_variant` times one model's steps after the other's. Per model:
    ``step_s``/``host_s`` medians and ``step_s_all``/``host_s_all`` (step ``i`` of every
    model taken back to back). No counting, memory or profile step."""
    rank = dist.get_rank()
    runs = []
    for cfg in cfgs:
        model = build(cfg, device)
        shard(model, impl, mesh, mp)
        runs.append((cfg, model, make_optimizer(model, impl, optim)))
    for s in range(args.warmup):
        for cfg, model, opt in runs:
            train_step(model, opt, make_batch(cfg, device, s, rank))
    sync(device)
    times: list[list[float]] = [[] for _ in runs]
    host: list[list[float]] = [[] for _ in runs]
    phases: list[list[tuple[float, float]]] = [[] for _ in runs]
    for s in range(args.steps):
        for i, (cfg, model, opt) in enumerate(runs):
            batch = make_batch(cfg, device, args.warmup + s, rank)
            sync(device)
            _, host_s, step_s = timed_step(model, opt, batch, device, phases[i])
            host[i].append(host_s)
            times[i].append(step_s)
    out = [
        {
            "step_s": statistics.median(t),
            "step_s_all": t,
            "host_s": statistics.median(h),
            "host_s_all": h,
            **_phase_medians(f),
        }
        for t, h, f in zip(times, host, phases)
    ]
    del runs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _live_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of every distinct storage reachable from parameters, gradients, optimizer
    states and (hyperrec) the DBuffers: what a step starts with."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            if st.nbytes():
                storages[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    for group in opt.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
    try:
        from hyperrec.parallel5d import dbuffers

        for buf in dbuffers(model):
            for t in (buf.shard, buf.full, buf._grad_shard, buf._grad_full):
                add(t)
    except (ImportError, TypeError, ValueError):
        pass
    return sum(storages.values())


def cpu_memory(model, opt, cfg, device, rank, args) -> dict:
    """Peak CPU bytes over one step: the state live at its start plus the largest net
    growth within it, from the profiler's allocator events.

    Every allocation, free and storage resize goes through the allocator, so this sees
    what a tracker of live tensors cannot (DBuffer frees and re-grows storages in place).
    """
    from torch.profiler import ProfilerActivity, profile

    # hyperrec returns the memory of gradients the optimizer set to None at the next
    # forward (FSDP2 at zero_grad). The profiler cannot see the free of a block allocated
    # before it started, so that release is done here, before the count starts, exactly
    # as the forward would do it; the peak (in backward) does not depend on when.
    state = model.__dict__.get("_hyperrec_fsdp_state")
    if state is not None:
        for st in state.all_states:
            if st.group is not None:
                st.group.release_dropped_grads()
    before = _live_state_bytes(model, opt)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, opt, make_batch(cfg, device, 10_000, rank))
    deltas = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    live = growth = 0
    for _, n in deltas:
        live += n
        growth = max(growth, live)
    return {"peak_live_bytes": int(before + growth), "start_live_bytes": int(before)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", nargs="+", default=["llama", "gem"], choices=sorted(PRESETS))
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["fsdp2:fused", "hyperrec:flat", "fsdp2:foreach", "hyperrec:foreach"],
        help="impl:optimizer pairs; impl in fsdp2 | fsdp2-dim1 (3-D weights sharded on dim 1) | hyperrec; optimizer in foreach | fused | flat (hyperrec only)",
    )
    ap.add_argument("--no-mp", action="store_true", help="fp32 compute (no mixed precision)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--out", default=None, help="JSON path (rank 0 writes)")
    ap.add_argument(
        "--fake-world-size",
        type=int,
        default=None,
        help="run ONE process as rank 0 of this many ranks on the fake backend: "
        "collectives move no data but allocate their real outputs, so per-rank memory "
        "is that of an N-rank job (step times then exclude all communication)",
    )
    ap.add_argument("--profile", default=None, help="folder for per-variant profiler tables")
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() after the warm-up (the timed steps' full garbage collections then "
        "skip the model's objects); per-step collector time is recorded either way",
    )
    ap.add_argument(
        "--checkpoint",
        action="store_true",
        help="activation checkpointing of every block (torch.utils.checkpoint)",
    )
    args = ap.parse_args()

    if args.fake_world_size is not None:
        if args.fake_world_size < 1:
            ap.error("--fake-world-size must be >= 1")
        os.environ.update(RANK="0", WORLD_SIZE=str(args.fake_world_size), LOCAL_RANK="0")
    elif "RANK" not in os.environ:  # plain `python bench_fsdp.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    elif args.fake_world_size is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
    if args.fake_world_size is not None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    presets = PRESETS if args.preset == "full" else TINY
    rows = []
    for name in args.model:
        cfg = dict(presets[name])
        if args.layers:
            cfg["layers"] = args.layers
        cfg["checkpoint"] = args.checkpoint
        for variant in args.variants:
            impl, optim = variant.split(":")
            try:
                r = run_variant(cfg, impl, optim, not args.no_mp, mesh, device, args)
                r["error"] = None
            except Exception as e:  # keep the other rows
                r = {"impl": impl, "optimizer": optim, "error": repr(e)[:500]}
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            r.update(model=name, config=cfg)
            rows.append(r)
            if dist.get_rank() == 0:
                print(json.dumps({k: v for k, v in r.items() if k != "step_s_all"}), flush=True)
    if dist.get_rank() == 0:
        print_table(rows, device)
        if args.out:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "testing" / "src"))
            from hyperrec.testing import write_result

            write_result(
                args.out,
                {
                    "benchmark": "fully_shard vs FSDP2",
                    "world_size": world,
                    "fake_backend": args.fake_world_size is not None,
                    "activation_checkpointing": args.checkpoint,
                    "device": device.type,
                    "mixed_precision": None if args.no_mp else "bf16 params, fp32 reduce",
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "rows": rows,
                },
            )
    dist.destroy_process_group()


def print_table(rows: list[dict], device: torch.device) -> None:
    mem = "peak_alloc_GiB peak_resv_GiB" if device.type == "cuda" else "peak_live_MiB"
    print(
        f"\n{'model':6} {'variant':18} {'step_ms':>8} {'host_ms':>8} {mem:>28} {'colls':>6} "
        f"{'copy_MiB':>9} {'cast_MiB':>9}"
    )
    for r in rows:
        variant = f"{r['impl']}:{r['optimizer']}"
        if r.get("error"):
            print(f"{r['model']:6} {variant:18} ERROR {r['error'][:80]}")
            continue
        if device.type == "cuda":
            m = f"{r['peak_allocated_gib']:14.2f} {r['peak_reserved_gib']:13.2f}"
        else:
            live = r.get("peak_live_bytes")
            m = f"{(live or math.nan) / 2**20:28.1f}"
        print(
            f"{r['model']:6} {variant:18} {r['step_s'] * 1e3:8.1f} {r['host_s'] * 1e3:8.1f} {m:>28} "
            f"{r['collectives_per_step']:6d} {r['copy_bytes'] / 2**20:9.1f} {r['cast_bytes'] / 2**20:9.1f}"
        )


if __name__ == "__main__":
    main()
