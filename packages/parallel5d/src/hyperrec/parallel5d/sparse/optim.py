"""Sparse optimizers for :class:`ShardedEmbeddingCollection`: lazy, owner-side, sharded.

The backward leaves on every owner the rows some rank looked up and their gradients
summed over all ranks (duplicates included). ``step()`` updates exactly those rows, on
the owner, with optimizer states that live next to the rows (same owner, same row
range), so they take ``O(T / world_size)`` memory per rank like the rows. Rows no rank
touched in the step are left as they are: their states neither decay nor count the step.

- :class:`RowWiseAdagrad` (1 float per row, ``momentum``): ``m += mean(g'^2)``;
  ``w -= lr / (sqrt(m) + eps) * g'`` with ``g' = g + wd * w`` for L2 decay: FBGEMM's
  ``EXACT_ROWWISE_ADAGRAD``.
- :class:`LazyAdagrad` (``dim`` floats per row, ``sum``): ``s += g^2``;
  ``w -= lr_t * g / (sqrt(s) + eps)``: ``torch.optim.Adagrad`` on the touched rows, which
  equals it on the dense gradient (a zero gradient leaves a row unchanged).
- :class:`LazyAdam` (``2 dim`` floats per row, ``exp_avg``, ``exp_avg_sq``):
  ``torch.optim.SparseAdam``: moments of touched rows only, bias correction by the
  table's step count.

States are float32 whatever the table dtype; bf16/fp16 rows are updated in float32 and
rounded to nearest (FBGEMM can round stochastically; not done here).

``backend="auto"`` runs each update as one fused Triton kernel on CUDA (one program per
touched row: the row, its gradient and its state are read once and written once) and
the PyTorch version (the ``*_rows_`` functions below, about ten kernels) elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d._validate import check_choice, check_float
from hyperrec.parallel5d.sparse._dispatch import Backend, resolve_backend
from hyperrec.parallel5d.sparse.collection import ShardedEmbeddingCollection

__all__ = [
    "LazyAdagrad",
    "LazyAdam",
    "RowWiseAdagrad",
    "adagrad_rows_",
    "adam_rows_",
    "rowwise_adagrad_rows_",
]


# --------------------------------------------------------------------------- update rules
def rowwise_adagrad_rows_(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    weight_decay_mode: str,
) -> None:
    """Row-wise Adagrad on ``weight[rows]`` (in place). ``rows`` unique int64 ``[U]``;
    ``grad`` float32 ``[U, dim]``; ``momentum`` float32 ``[rows_total]``."""
    w = weight.index_select(0, rows).float()
    g = grad
    if weight_decay and weight_decay_mode == "l2":
        g = g + weight_decay * w
    m = momentum.index_select(0, rows) + g.square().mean(dim=1)
    momentum.index_copy_(0, rows, m)
    mult = (lr / (m.sqrt() + eps)).unsqueeze(1)
    if weight_decay and weight_decay_mode == "decoupled":
        w = w * (1.0 - lr * weight_decay)
    weight.index_copy_(0, rows, (w - mult * g).to(weight.dtype))


def adagrad_rows_(
    weight: torch.Tensor,
    state_sum: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """Element-wise Adagrad on ``weight[rows]`` (in place), ``torch.optim.Adagrad``'s
    arithmetic. ``state_sum`` float32 ``[rows_total, dim]``."""
    s = state_sum.index_select(0, rows).addcmul_(grad, grad, value=1.0)
    state_sum.index_copy_(0, rows, s)
    w = weight.index_select(0, rows).float()
    w.addcdiv_(grad, s.sqrt_().add_(eps), value=-lr)
    weight.index_copy_(0, rows, w.to(weight.dtype))


def _adam_step_size(
    lr: float, beta1: float, beta2: float, step: int | torch.Tensor
) -> float | torch.Tensor:
    """``lr * sqrt(1 - beta2^t) / (1 - beta1^t)`` (SparseAdam's bias correction): a float
    for one step count, a float32 tensor for a float64 tensor of counts (one per row)."""
    if isinstance(step, torch.Tensor):
        return (lr * (1.0 - beta2**step).sqrt() / (1.0 - beta1**step)).float()
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def adam_rows_(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int | torch.Tensor,
) -> None:
    """Lazy Adam on ``weight[rows]`` (in place), ``torch.optim.SparseAdam``'s arithmetic
    (``eps`` added to ``sqrt(v)`` before bias correction) plus optional decoupled weight
    decay of the touched rows. ``step``: the step count, or a float64 tensor with one per
    row (rows of tables at different step counts)."""
    m_old = exp_avg.index_select(0, rows)
    v_old = exp_avg_sq.index_select(0, rows)
    m = (grad - m_old).mul_(1.0 - beta1).add_(m_old)
    v = (grad.square() - v_old).mul_(1.0 - beta2).add_(v_old)
    exp_avg.index_copy_(0, rows, m)
    exp_avg_sq.index_copy_(0, rows, v)
    w = weight.index_select(0, rows).float()
    if weight_decay:
        w.mul_(1.0 - lr * weight_decay)
    step_size = _adam_step_size(lr, beta1, beta2, step)
    if isinstance(step_size, torch.Tensor):
        w.sub_(m.div_(v.sqrt_().add_(eps)) * step_size[:, None])
    else:
        w.add_(m.div_(v.sqrt_().add_(eps)), alpha=-step_size)
    weight.index_copy_(0, rows, w.to(weight.dtype))


# --------------------------------------------------------------------------- base
class _RowOptimizer(torch.optim.Optimizer):
    """One param group per table (``group["table"]``: its name; ``group["params"]``: this
    rank's rows of it), so learning-rate schedulers work unchanged. States live in one
    float32 storage per ``(dim, dtype)`` group of the collection."""

    #: ``(state name, "row" or "element")``: one float per row, or ``dim`` floats.
    _STATES: tuple[tuple[str, str], ...] = ()
    #: Hyperparameters that must agree inside a collection group to update it in one go.
    _HYPER: tuple[str, ...] = ()
    #: Whether the update depends on the table's step count (Adam's bias correction)
    #: and takes a per-row step tensor for tables of one group at different counts.
    _USES_STEP = False

    def _step_dependent(self, hp: dict[str, Any]) -> bool:
        """Whether an update with hyperparameters ``hp`` depends on the step count."""
        return self._USES_STEP

    def __init__(
        self, collection: ShardedEmbeddingCollection, defaults: dict[str, Any], backend: str
    ):
        if not isinstance(collection, ShardedEmbeddingCollection):
            raise TypeError(
                f"collection must be a ShardedEmbeddingCollection, got {type(collection).__name__}"
            )
        self.collection = collection
        self.backend = resolve_backend(backend, collection.device)
        groups = [
            {"params": [collection._table_view(name, collection._storage)], "table": name}
            for name in collection.table_configs
        ]
        super().__init__(groups, defaults)
        dev = collection.device
        self._storages: list[dict[str, torch.Tensor]] = []
        for g, gp in enumerate(collection.plan.groups):
            n = collection._storage[g].shape[0]
            self._storages.append(
                {
                    s: torch.zeros(
                        (n,) if kind == "row" else (n, gp.dim), dtype=torch.float32, device=dev
                    )
                    for s, kind in self._STATES
                }
            )
        self._steps = {
            name: torch.zeros((), dtype=torch.int64) for name in collection.table_configs
        }
        self._init_states()
        self._views: dict[tuple[str, str], torch.Tensor] = {}
        self._table_starts: dict[int, torch.Tensor] = {}  # group -> its tables' first rows

    def _init_states(self) -> None:
        """Fill fresh states (zeros unless a subclass starts elsewhere)."""

    def _group_of_table(self, name: str) -> dict[str, Any]:
        for group in self.param_groups:
            if group["table"] == name:
                return group
        raise KeyError(name)

    def state_view(self, table: str, state: str) -> torch.Tensor:
        """State ``state`` of table ``table`` on this rank: a DTensor sharded like the rows
        (``[num_rows]`` or ``[num_rows, dim]``), a view of the storage."""
        key = (table, state)
        if key not in self._views:
            if state not in dict(self._STATES):
                raise KeyError(
                    f"unknown state {state!r}; states are {[s for s, _ in self._STATES]}"
                )
            g, _ = self.collection.plan.group_of(table)
            local = self.collection._table_view(table, [s[state] for s in self._storages])
            self._views[key] = self.collection._dtensor(table, local)
        return self._views[key]

    def full_state(self, table: str, state: str) -> torch.Tensor:
        """State ``state`` of ``table`` whole on every rank, in id order (collective,
        ``O(T)`` memory; for tests and export)."""
        return self.collection.gather(table, self.state_view(table, state))

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer states."""
        return sum(t.numel() * t.element_size() for s in self._storages for t in s.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the row gradients kept since the last step."""
        self.collection.zero_grad_rows()

    def _update(
        self,
        g: int,
        rows: torch.Tensor,
        grad: torch.Tensor,
        hp: dict[str, Any],
        step: int | torch.Tensor,
    ) -> None:
        """Update ``rows`` of group ``g``. ``step``: the tables' step count, or (only for
        ``_USES_STEP`` optimizers) a float64 tensor with each row's table's count."""
        raise NotImplementedError

    def _row_steps(self, g: int, rows: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """Each row's table's step count (float64, on the rows' device, no host read):
        ``steps[i]`` for the rows of the group's ``i``-th table."""
        coll = self.collection
        starts = self._table_starts.get(g)
        if starts is None:  # constant per group; a pageable host-to-device copy would wait
            starts = self._to_device(coll.plan.groups[g].table_local_start[coll.owner_index], rows)
            self._table_starts[g] = starts
        table = (torch.searchsorted(starts, rows, right=True) - 1).clamp_(min=0)
        return self._to_device(steps, rows, torch.float64).index_select(0, table)

    @staticmethod
    def _to_device(
        values: list[int], like: torch.Tensor, dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        """A small host list on ``like``'s device without a host synchronisation."""
        t = torch.tensor(values, dtype=dtype)
        if like.is_cuda:
            return t.pin_memory().to(like.device, non_blocking=True)
        return t.to(like.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update the rows the last backward(s) touched, on their owners; no
        communication. Tables whose group had no backward since the last step are left
        alone (their step count does not advance)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coll = self.collection
        me = coll.owner_index
        for g, gp in enumerate(coll.plan.groups):
            if not coll._backward_count[g]:
                continue
            pending = coll._pending[g]
            if len(pending) == 1:
                rows, grad = pending[0]
            else:
                # Several backwards (gradient accumulation): merge the duplicates.
                cat_rows = torch.cat([p[0] for p in pending])
                rows, inv = torch.unique(cat_rows, sorted=True, return_inverse=True)
                grad = torch.zeros(
                    (rows.numel(), gp.dim), dtype=torch.float32, device=cat_rows.device
                )
                grad.index_add_(0, inv, torch.cat([p[1] for p in pending]))
            rows, grad = rows.contiguous(), grad.contiguous()
            if coll.sync_free and self.backend == "torch":
                # the padding rows (one past the end) are masked inside the fused
                # kernels; the PyTorch rules index with them, so drop them (a host sync)
                keep = rows < coll._storage[g].shape[0]
                rows, grad = rows[keep], grad[keep]
            hps = [self._group_of_table(name) for name in gp.tables]
            # A table steps when one of its features reached the loss on some rank (as
            # SparseAdam steps a parameter with a gradient); rows of the others are not
            # among ``rows``.
            used = [name for name in gp.tables if name in coll._used_tables]
            for name in used:
                self._steps[name] += 1
            steps = [int(self._steps[name]) for name in gp.tables]
            used_steps = {int(self._steps[name]) for name in used}
            same = all(all(h[k] == hps[0][k] for k in self._HYPER) for h in hps)
            if same and (not self._step_dependent(hps[0]) or len(used_steps) <= 1):
                step = used_steps.pop() if used_steps else steps[0]
                self._update(g, rows, grad, hps[0], step)
            elif same and self._USES_STEP:
                # tables of one group at different step counts: one per row, on the device
                self._update(g, rows, grad, hps[0], self._row_steps(g, rows, steps))
            else:
                # one update per table. The sync-free rows hold padding (one past the
                # end) between the sorted real rows: drop it, the split below needs order
                keep = rows < coll._storage[g].shape[0]
                rows, grad = rows[keep], grad[keep]
                starts = torch.as_tensor(gp.table_local_start[me], device=rows.device)
                bounds = torch.searchsorted(rows, starts).tolist() + [rows.numel()]
                for i in range(len(gp.tables)):
                    lo, hi = bounds[i], bounds[i + 1]
                    if hi > lo:
                        self._update(g, rows[lo:hi], grad[lo:hi], hps[i], steps[i])
        coll.zero_grad_rows()
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"state": {table: {"step": int64 tensor, <state>: DTensor}}, "param_groups":
        [{"table": name, <hyperparameters>}]}``: the live state tensors (DTensors sharded
        like the rows), so ``torch.distributed.checkpoint`` saves each rank's rows and
        loads in place on any world size (with raggedshard's planners)."""
        state = {
            name: {
                "step": self._steps[name],
                **{s: self.state_view(name, s) for s, _ in self._STATES},
            }
            for name in self.collection.table_configs
        }
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict` (filled by ``dcp.load``, or in memory: DTensors of
        any layout are redistributed, full tensors sliced). Everything is checked before
        anything changes.

        Raises:
            TypeError / ValueError: another set of tables or states, shapes or dtypes, or
                a missing entry (naming it).
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("state_dict must have exactly the keys 'state' and 'param_groups'")
        state, groups = state_dict["state"], list(state_dict["param_groups"])
        tables = list(self.collection.table_configs)
        if set(state) != set(tables):
            raise ValueError(
                f"state_dict['state'] must hold the tables {tables}, got {sorted(state)}"
            )
        names = [grp.get("table") for grp in groups]
        if sorted(names, key=str) != sorted(tables):
            raise ValueError(
                f"state_dict['param_groups'] must hold the tables {tables}, got {names}"
            )
        for name in tables:
            want = {"step", *(s for s, _ in self._STATES)}
            if set(state[name]) != want:
                raise ValueError(
                    f"state_dict['state'][{name!r}] must hold {sorted(want)} (a state of "
                    f"{type(self).__name__}), got {sorted(state[name])}"
                )
            for s, _ in self._STATES:
                live, saved = self.state_view(name, s), state[name][s]
                where = f"state_dict['state'][{name!r}][{s!r}]"
                if not isinstance(saved, torch.Tensor):
                    raise TypeError(f"{where} must be a tensor, got {type(saved).__name__}")
                if tuple(saved.shape) != tuple(live.shape) or saved.dtype != live.dtype:
                    raise ValueError(
                        f"{where} must be {live.dtype} {tuple(live.shape)}, got {saved.dtype} "
                        f"{tuple(saved.shape)}"
                    )
            step = state[name]["step"]
            if isinstance(step, DTensor) or not isinstance(step, torch.Tensor | int):
                raise TypeError(f"state_dict['state'][{name!r}]['step'] must be an int tensor")
        for name in tables:
            for s, _ in self._STATES:
                self.collection._copy_into(self.state_view(name, s), state[name][s], f"{name}.{s}")
            step = state[name]["step"]
            if step is not self._steps[name]:
                self._steps[name].fill_(int(step))
        by_name = {grp["table"]: grp for grp in groups}
        for group in self.param_groups:
            for k, v in by_name[group["table"]].items():
                if k not in ("params", "table"):
                    group[k] = v


class RowWiseAdagrad(_RowOptimizer):
    """Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one float32 accumulator
    per row, the mean over the row of the squared gradient.

    On a touched row with summed gradient ``g`` (``dim`` entries):
    ``g' = g + weight_decay * w`` for ``weight_decay_mode="l2"`` (else ``g' = g``);
    ``m += mean(g'^2)``; ``w *= 1 - lr * weight_decay`` for ``"decoupled"``;
    ``w -= lr / (sqrt(m) + eps) * g'``. Not ``torch.optim.Adagrad`` (whose accumulator is
    per element; see :class:`LazyAdagrad`).

    Args:
        collection: the :class:`ShardedEmbeddingCollection` to train.
        lr: learning rate (default 0.01).
        eps: added to ``sqrt(m)`` (default 1e-8).
        weight_decay: applied to touched rows only (default 0).
        weight_decay_mode: ``"l2"`` (added to the gradient) or ``"decoupled"``.
        initial_accumulator_value: starting ``m`` (default 0).
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"`` (the fused kernel).

    Raises:
        TypeError / ValueError: a non-collection, negative or non-finite numbers, an
            unknown mode or backend, ``"triton"`` without Triton or CUDA.
    """

    _STATES = (("momentum", "row"),)
    _HYPER = ("lr", "eps", "weight_decay", "weight_decay_mode")

    def __init__(
        self,
        collection: ShardedEmbeddingCollection,
        *,
        lr: float = 0.01,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        weight_decay_mode: Literal["l2", "decoupled"] = "l2",
        initial_accumulator_value: float = 0.0,
        backend: Backend = "auto",
    ):
        defaults = {
            "lr": check_float("lr", lr, minimum=0.0),
            "eps": check_float("eps", eps, minimum=0.0),
            "weight_decay": check_float("weight_decay", weight_decay, minimum=0.0),
            "weight_decay_mode": check_choice(
                "weight_decay_mode", weight_decay_mode, ("l2", "decoupled")
            ),
        }
        self._initial = check_float(
            "initial_accumulator_value", initial_accumulator_value, minimum=0.0
        )
        super().__init__(collection, defaults, backend)

    def _init_states(self) -> None:
        for s in self._storages:
            s["momentum"].fill_(self._initial)

    def _update(
        self,
        g: int,
        rows: torch.Tensor,
        grad: torch.Tensor,
        hp: dict[str, Any],
        step: int | torch.Tensor,
    ) -> None:
        fn = rowwise_adagrad_rows_
        if self.backend == "triton":
            from hyperrec.parallel5d.sparse._triton.update import rowwise_adagrad_rows as fn
        fn(
            self.collection._storage[g],
            self._storages[g]["momentum"],
            rows,
            grad,
            lr=hp["lr"],
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
            weight_decay_mode=hp["weight_decay_mode"],
        )


class LazyAdagrad(_RowOptimizer):
    """Element-wise Adagrad on the touched rows: ``torch.optim.Adagrad``'s rule
    (``lr_t = lr / (1 + (step - 1) * lr_decay)``; ``s += g^2``;
    ``w -= lr_t * g / (sqrt(s) + eps)``). A row with a zero gradient is left unchanged by
    that rule, so this equals ``torch.optim.Adagrad`` on the dense gradient (without
    weight decay, which would move untouched rows). ``dim`` float32 states per row.

    Args:
        collection: the :class:`ShardedEmbeddingCollection` to train.
        lr: learning rate (default 0.01). lr_decay: default 0. eps: default 1e-10
            (torch's). initial_accumulator_value: default 0.
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"``.

    Raises:
        TypeError / ValueError: as :class:`RowWiseAdagrad`.
    """

    _STATES = (("sum", "element"),)
    _HYPER = ("lr", "lr_decay", "eps")

    def _step_dependent(self, hp: dict[str, Any]) -> bool:
        # lr_t = lr / (1 + (step - 1) * lr_decay): tables of one group at different step
        # counts update one by one (each with its own count) when lr_decay is set
        return bool(hp["lr_decay"])

    def __init__(
        self,
        collection: ShardedEmbeddingCollection,
        *,
        lr: float = 0.01,
        lr_decay: float = 0.0,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        backend: Backend = "auto",
    ):
        defaults = {
            "lr": check_float("lr", lr, minimum=0.0),
            "lr_decay": check_float("lr_decay", lr_decay, minimum=0.0),
            "eps": check_float("eps", eps, minimum=0.0),
        }
        self._initial = check_float(
            "initial_accumulator_value", initial_accumulator_value, minimum=0.0
        )
        super().__init__(collection, defaults, backend)

    def _init_states(self) -> None:
        for s in self._storages:
            s["sum"].fill_(self._initial)

    def _update(
        self,
        g: int,
        rows: torch.Tensor,
        grad: torch.Tensor,
        hp: dict[str, Any],
        step: int | torch.Tensor,
    ) -> None:
        fn = adagrad_rows_
        if self.backend == "triton":
            from hyperrec.parallel5d.sparse._triton.update import adagrad_rows as fn
        fn(
            self.collection._storage[g],
            self._storages[g]["sum"],
            rows,
            grad,
            lr=hp["lr"] / (1.0 + (step - 1) * hp["lr_decay"]),
            eps=hp["eps"],
        )


class LazyAdam(_RowOptimizer):
    """Lazy Adam with ``torch.optim.SparseAdam``'s semantics: only touched rows update
    their moments and weights; bias correction uses the table's step count (steps with a
    backward), and ``eps`` is added to ``sqrt(v)`` before bias correction
    (``w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``). ``torch.optim.Adam``
    and FBGEMM add ``eps`` to the bias-corrected ``sqrt(v_hat)`` instead (a difference
    of ``eps * (1 - sqrt(1 - b2^t))`` in the denominator). ``2 * dim`` float32 states per
    row.

    Args:
        collection: the :class:`ShardedEmbeddingCollection` to train.
        lr: default 1e-3. betas: default (0.9, 0.999). eps: default 1e-8.
        weight_decay: decoupled (AdamW-style) decay of the touched rows; default 0.
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"``.

    Raises:
        TypeError / ValueError: as :class:`RowWiseAdagrad`; betas outside ``[0, 1)``.
    """

    _STATES = (("exp_avg", "element"), ("exp_avg_sq", "element"))
    _HYPER = ("lr", "betas", "eps", "weight_decay")
    _USES_STEP = True

    def __init__(
        self,
        collection: ShardedEmbeddingCollection,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        backend: Backend = "auto",
    ):
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise TypeError(f"betas must be a pair of floats, got {betas!r}")
        b1 = check_float("betas[0]", betas[0], minimum=0.0)
        b2 = check_float("betas[1]", betas[1], minimum=0.0)
        if b1 >= 1.0 or b2 >= 1.0:
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        defaults = {
            "lr": check_float("lr", lr, minimum=0.0),
            "betas": (b1, b2),
            "eps": check_float("eps", eps, minimum=0.0),
            "weight_decay": check_float("weight_decay", weight_decay, minimum=0.0),
        }
        super().__init__(collection, defaults, backend)

    def _update(
        self,
        g: int,
        rows: torch.Tensor,
        grad: torch.Tensor,
        hp: dict[str, Any],
        step: int | torch.Tensor,
    ) -> None:
        st = self._storages[g]
        if self.backend == "triton":
            from hyperrec.parallel5d.sparse._triton.update import adam_rows

            b1, b2 = hp["betas"]
            adam_rows(
                self.collection._storage[g],
                st["exp_avg"],
                st["exp_avg_sq"],
                rows,
                grad,
                beta1=b1,
                beta2=b2,
                eps=hp["eps"],
                decay=1.0 - hp["lr"] * hp["weight_decay"],
                step_size=_adam_step_size(hp["lr"], b1, b2, step),
            )
            return
        adam_rows_(
            self.collection._storage[g],
            st["exp_avg"],
            st["exp_avg_sq"],
            rows,
            grad,
            lr=hp["lr"],
            beta1=hp["betas"][0],
            beta2=hp["betas"][1],
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
            step=step,
        )
