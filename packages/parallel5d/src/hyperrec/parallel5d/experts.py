"""Expert parallelism: a top-k routed-experts layer with experts sharded over ``ep`` ranks.

Token flow of :class:`RoutedExperts` on one rank (``T`` tokens, ``E`` experts, ``ep``
ranks each holding ``E / ep`` consecutive experts):

1. the router scores every token against every expert and keeps the top ``k``;
2. the ``T * k`` (token, expert) pairs are sorted by expert (stable), so the rows bound
   for each rank and, inside it, for each of its experts are contiguous;
3. **counts first**: one ``all_to_all_single`` of the per-expert counts tells every rank
   how many rows it receives from each peer for each of its experts;
4. dispatch: ``all_to_all_single`` of the rows with those jagged split sizes (any count,
   zero included, per peer and per expert);
5. the received rows are regrouped by local expert and run through the experts' SwiGLU
   MLPs (grouped GEMMs; here a loop over experts, one GEMM each -- a fused grouped GEMM
   kernel is not part of this release);
6. combine: the inverse ``all_to_all_single``, then each token sums its ``k`` expert
   outputs weighted by the router.

Backward runs the two all-to-alls in reverse. The split sizes are read on the host
(``all_to_all_single`` takes Python lists), one synchronisation per layer and pass.

Composition with ``fully_shard``: shard ``layer.experts`` on the expert mesh
(``ParallelMesh.expert_mesh``: ``replicate x efsdp``) and the rest of the model, the
router included, on the dense mesh. Each rank's expert gradient then holds the sum over
the ``ep`` ranks whose tokens it served, and ``fully_shard`` averages it over the
``world / ep`` ranks holding the same experts, which leaves it ``ep`` times the
data-parallel mean; the layer scales expert gradients by ``1 / ep`` (``expert_grad_scale``)
so they equal single-process training, like torchtitan's gradient divide factor for
experts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hyperrec.parallel5d._validate import check_bool, check_float, check_int, check_tensor

__all__ = ["GroupedExperts", "RoutedExperts", "TopKRouter", "routed_experts_reference"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with jagged splits; backward = the reverse."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            back,
            grad.contiguous(),
            output_split_sizes=in_splits,
            input_split_sizes=out_splits,
            group=ctx.group,
        )
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class TopKRouter(nn.Module):
    """Linear scores, softmax over experts, top ``k`` (a dense, data-parallel module).

    Args:
        dim: token width.
        num_experts: experts scored.
        top_k: experts per token (1 <= top_k <= num_experts).
        normalize: rescale the kept probabilities to sum to 1 per token (default True).

    Raises:
        ValueError/TypeError: bad sizes.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        *,
        top_k: int = 2,
        normalize: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dim = check_int("dim", dim, minimum=1)
        num_experts = check_int("num_experts", num_experts, minimum=1)
        top_k = check_int("top_k", top_k, minimum=1)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.normalize = check_bool("normalize", normalize)
        self.gate = nn.Linear(dim, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(T, dim)`` -> weights ``(T, k)`` (x's dtype) and expert ids ``(T, k)`` int64.

        Softmax and selection run in ``float32``, or in ``x``'s dtype if wider (float64).
        Ties in the scores go to the lower expert id (ids are in descending-score order).
        A token whose row of ``x`` holds a NaN or an Inf gets NaN weights (its ids are
        then arbitrary but valid); nothing is raised.
        """
        weights, ids = _route(self.gate(x), self.top_k, self.normalize)
        return weights.to(x.dtype), ids  # (under autocast the logits may be narrower)


def _route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weights ``(T, k)`` (float32, or float64 for float64 logits) and expert ids
    ``(T, k)`` from ``logits``."""
    # At least float32, never narrower than the logits: a bare ``.float()`` silently cut a
    # float64 layer's routing to float32 precision (weights off by ~1e-8 relative, and
    # experts whose float64 scores differ by less than a float32 ulp became "ties").
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    # A stable descending sort, not ``topk``: topk's choice among equal scores is
    # unspecified (on CPU it kept e.g. expert 2 of 5 equal ones, and it differs between
    # devices), so tied tokens went to arbitrary experts. Lower expert id wins a tie.
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class GroupedExperts(nn.Module):
    """``num_local`` SwiGLU expert MLPs as three 3-D parameters.

    ``w1``, ``w3``: ``(num_local, dim, hidden)``; ``w2``: ``(num_local, hidden, dim)``.
    Expert ``e`` maps rows ``x`` to ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``.
    """

    def __init__(
        self,
        num_local: int,
        dim: int,
        hidden: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_local = check_int("num_local", num_local, minimum=1)
        dim = check_int("dim", dim, minimum=1)
        hidden = check_int("hidden", hidden, minimum=1)
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_local, dim, hidden, **kw))  # type: ignore[arg-type]
        self.w3 = nn.Parameter(torch.empty(num_local, dim, hidden, **kw))  # type: ignore[arg-type]
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, dim, **kw))  # type: ignore[arg-type]
        self.grad_scale = 1.0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) per expert, like ``nn.Linear``."""
        for w in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows ``x`` ``(sum(counts), dim)`` grouped by expert (``counts[e]`` rows each)."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        if self.grad_scale != 1.0:
            w1, w3, w2 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w3, w2))
        outs = []
        # Every expert runs, empty ones included: their weights then get (zero) gradients
        # like every other parameter, whatever the routing.
        for e, chunk in enumerate(x.split(counts)):
            h = F.silu(chunk @ w1[e]) * (chunk @ w3[e])
            outs.append(h @ w2[e])
        return torch.cat(outs) if outs else x.new_empty((0, w2.shape[-1]))


class RoutedExperts(nn.Module):
    """Top-k routed SwiGLU experts, sharded over an expert-parallel mesh.

    Args:
        dim: token width.
        hidden: hidden width of each expert.
        num_experts: experts in total (over all ``ep`` ranks).
        top_k: experts per token. Default 2.
        ep_mesh: 1-D mesh of the expert-parallel ranks (``ParallelMesh.ep_mesh``); rank
            ``i`` of it holds experts ``[i * E / ep, (i + 1) * E / ep)``. ``None``: every
            expert here (no communication).
        normalize: renormalise the top-k router weights per token. Default True.
        expert_grad_scale: factor on expert gradients; default ``1 / ep``, right when
            ``fully_shard`` (or any mean-reduction) averages the experts over the
            ``world / ep`` ranks holding them (see the module docstring). Use ``1.0`` if
            your reduction divides by the whole data-parallel world instead.

    Submodules: ``router`` (:class:`TopKRouter`, dense) and ``experts``
    (:class:`GroupedExperts` with ``E / ep`` local experts).

    Raises:
        ValueError: ``num_experts`` not divisible by the ``ep`` size; bad sizes.
        TypeError: ``ep_mesh`` not a 1-D ``DeviceMesh``.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        ep_mesh: DeviceMesh | None = None,
        normalize: bool = True,
        expert_grad_scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_experts = check_int("num_experts", num_experts, minimum=1)
        if ep_mesh is not None and (not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1):
            raise TypeError(f"ep_mesh must be a 1-D DeviceMesh or None, got {ep_mesh!r}")
        self.ep = 1 if ep_mesh is None else ep_mesh.size()
        if num_experts % self.ep:
            raise ValueError(
                f"num_experts must be divisible by the ep size {self.ep}, got {num_experts}"
            )
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        self.ep_rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
        self._group = None if ep_mesh is None else ep_mesh.get_group()
        self.router = TopKRouter(
            dim, num_experts, top_k=top_k, normalize=normalize, device=device, dtype=dtype
        )
        self.experts = GroupedExperts(self.num_local, dim, hidden, device=device, dtype=dtype)
        scale = 1.0 / self.ep if expert_grad_scale is None else expert_grad_scale
        self.experts.grad_scale = check_float("expert_grad_scale", scale, minimum=0.0)
        self.last_counts: list[int] = []
        """Rows each local expert received in the last forward (load-balance metrics)."""

    @property
    def local_experts(self) -> range:
        """Global ids of the experts on this rank."""
        start = self.ep_rank * self.num_local
        return range(start, start + self.num_local)

    @torch.no_grad()
    def load_full_experts_(
        self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, router: torch.Tensor
    ) -> None:
        """Copy this rank's slice of full (all-expert) weights and the router weight in.

        Shapes: ``w1``/``w3`` ``(E, dim, hidden)``, ``w2`` ``(E, hidden, dim)``, ``router``
        ``(E, dim)``.

        Raises:
            ValueError: shapes that do not match this layer.
        """
        sl = slice(self.local_experts.start, self.local_experts.stop)
        pairs = (
            ("w1", w1, self.experts.w1),
            ("w3", w3, self.experts.w3),
            ("w2", w2, self.experts.w2),
        )
        # every shape first: a bad one must leave the layer as it was
        for name, full, mine in pairs:
            want = (self.num_experts, *mine.shape[1:])
            if tuple(full.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(full.shape)}")
        if tuple(router.shape) != tuple(self.router.gate.weight.shape):
            raise ValueError(
                f"router must have shape {tuple(self.router.gate.weight.shape)}, "
                f"got {tuple(router.shape)}"
            )
        for _, full, mine in pairs:
            mine.copy_(full[sl])
        self.router.gate.weight.copy_(router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(T, dim)`` (``T`` may be 0) -> ``(T, dim)``.

        Non-finite inputs are not checked (that would cost a host synchronisation): a
        token whose row holds a NaN or an Inf gets an all-NaN output row, and the rows
        of every other token are unaffected; in backward the NaN reaches the router
        gradient and the gradients of the experts that token was sent to.

        Raises:
            ValueError/TypeError: ``x`` not a 2-D floating tensor of width ``dim``.
        """
        check_tensor("x", x, ndim=2)
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating tensor, got {x.dtype}")
        dim = self.router.gate.in_features
        if x.shape[1] != dim:
            raise ValueError(f"x must have {dim} columns, got shape {tuple(x.shape)}")
        k = self.router.top_k
        weights, ids = self.router(x)  # (T, k)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k  # source token of each sorted (token, expert) pair
        rows = x[token]  # (T * k, dim), grouped by global expert
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)

        if self.ep == 1:
            self.last_counts = counts.tolist()
            out = self.experts(rows, self.last_counts)
        else:
            ep, nl = self.ep, self.num_local
            # Counts first: recv[src, e] = rows rank `src` sends to my local expert e.
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self._group)
            send_splits = counts.view(ep, nl).sum(1).tolist()
            recv_mat = recv.view(ep, nl)
            recv_splits = recv_mat.sum(1).tolist()
            got = _AllToAll.apply(rows, recv_splits, send_splits, self._group)
            # Received rows are ordered (source, expert); the experts want (expert, source).
            seg = recv_mat.reshape(-1)
            seg_start = torch.cumsum(seg, 0) - seg
            by_expert = seg_start.view(ep, nl).t().reshape(-1)
            by_expert_len = recv_mat.t().reshape(-1)
            perm = _segments_to_index(by_expert, by_expert_len)
            self.last_counts = recv_mat.sum(0).tolist()
            out_e = self.experts(got[perm], self.last_counts)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
            out = _AllToAll.apply(out_e[inv], send_splits, recv_splits, self._group)

        y = x.new_zeros(x.shape)
        w = weights.reshape(-1)[order].unsqueeze(1)
        return y.index_add(0, token, out * w)


def _segments_to_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for each (start, length) pair."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    rep_start = torch.repeat_interleave(starts, lengths)
    seg_first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return rep_start + torch.arange(total, device=starts.device) - seg_first


def routed_experts_reference(
    x: torch.Tensor,
    router: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    normalize: bool = True,
) -> torch.Tensor:
    """Dense reference of :class:`RoutedExperts` (no sorting, no communication).

    Every expert runs on every token; a ``(T, E)`` mask of router weights selects and
    weights the outputs (routed as in :class:`TopKRouter`: same precision, ties to the
    lower expert id). ``router`` ``(E, dim)``; ``w1``/``w3`` ``(E, dim, hidden)``;
    ``w2`` ``(E, hidden, dim)``; ``x`` ``(T, dim)``.
    """
    weights, ids = _route(x @ router.t(), top_k, normalize)
    gate = x.new_zeros((x.shape[0], router.shape[0])).scatter(1, ids, weights.to(x.dtype))
    h = F.silu(torch.einsum("td,edh->eth", x, w1)) * torch.einsum("td,edh->eth", x, w3)
    outs = torch.einsum("eth,ehd->etd", h, w2)  # (E, T, dim)
    return torch.einsum("te,etd->td", gate, outs)
