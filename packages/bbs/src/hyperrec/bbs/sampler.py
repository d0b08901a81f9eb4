"""A ``torch.utils.data`` batch sampler that applies BBS to a map-style dataset.

Give it every sample's cost (e.g. ``CostModel(...).sample_costs(lengths)``) and use it
as ``DataLoader(dataset, batch_sampler=sampler)``; each iteration yields this rank's
sample indices for one step. Two modes, both communication-free and deterministic:

- ``"local"``: the rank reads its own shard (``perm[rank::world_size]`` of a seeded
  permutation shared by all ranks, like ``DistributedSampler``), cuts it into
  sub-batches and balances windows of its own sub-batches only. This is what a
  per-rank streaming reader can do.
- ``"global"``: for readers that share the index. Every rank computes the same plan
  for all ranks (:func:`global_shuffle_plan` over every rank's sub-batches of the
  window) and keeps its own row; sub-batches may move across ranks.

Each epoch has ``len(sampler)`` steps on every rank; the ``n mod (world_size * k * s)``
samples left over after the last full step are dropped (different each epoch when
shuffling).

A state saved mid-epoch also loads into a sampler of another world size (or ``k``,
``W``): the new ranks replay every earlier layout of the epoch (no communication) to
find the samples already trained, and share the rest of the epoch's permutation, in its
order, among themselves; the next epoch starts normally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from hyperrec.bbs._validate import as_costs, check_bool, check_choice, check_int
from hyperrec.bbs.plan import _check_method, plan_global_windows, plan_windows

__all__ = ["BalancedBatchSampler"]

_STATE_VERSION = 2  # 2 added "segments"; version-1 states still load
_MODES = ("local", "global")


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this rank's sample indices, one list per step, load-balanced by BBS.

    Args:
        sample_costs: ``(n,)`` non-negative cost of every sample of the dataset.
        samples_per_sub_batch: ``s >= 1``, the reader's unit.
        sub_batches_per_step: ``k >= 1`` per rank and step (``k * s`` samples a step).
        window_steps: ``W >= 1``; a sub-batch is trained at most ``W - 1`` steps away
            from its natural step (its position in the epoch's order).
        mode: ``"local"`` (default) or ``"global"`` (see the module docstring).
        rank, world_size: this rank and the number of ranks; ``None`` reads them from
            an initialised default process group (no collective), else 0 and 1.
        shuffle: permute samples each epoch with ``(seed, epoch)``; ``False`` keeps
            dataset order (still balanced within windows).
        seed: shared by all ranks.
        method: partition algorithm (default ``"auto"``).

    Raises:
        TypeError / ValueError: invalid costs or sizes (named), ``rank`` outside
            ``[0, world_size)``, or fewer samples than one step of every rank needs.
    """

    def __init__(
        self,
        sample_costs: Any,
        *,
        samples_per_sub_batch: int,
        sub_batches_per_step: int,
        window_steps: int,
        mode: str = "local",
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        method: str = "auto",
    ) -> None:
        self._costs = as_costs("sample_costs", sample_costs, ndim=1)
        self.samples_per_sub_batch = check_int(
            "samples_per_sub_batch", samples_per_sub_batch, minimum=1
        )
        self.sub_batches_per_step = check_int(
            "sub_batches_per_step", sub_batches_per_step, minimum=1
        )
        self.window_steps = check_int("window_steps", window_steps, minimum=1)
        self.mode = check_choice("mode", mode, _MODES)
        if world_size is None:
            world_size = _dist_default("get_world_size", 1)
        self.world_size = check_int("world_size", world_size, minimum=1)
        if rank is None:
            rank = _dist_default("get_rank", 0)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed, minimum=0)
        _check_method(method)
        self.method = method
        per_step = self.world_size * self.sub_batches_per_step * self.samples_per_sub_batch
        self._steps = self._costs.size // per_step
        if self._steps == 0:
            raise ValueError(
                f"sample_costs has {self._costs.size} samples; one step of {self.world_size} "
                f"ranks x {self.sub_batches_per_step} x {self.samples_per_sub_batch} needs "
                f"{per_step}"
            )
        self._full_steps = self._steps
        self.epoch = 0
        self._step = 0  # steps of this epoch already yielded
        # Earlier layouts of the current epoch, (world_size, k, window_steps, steps), when
        # it was resumed on another shape; empty otherwise.
        self._segments: list[tuple[int, int, int, int]] = []
        self._stream_cache: tuple[Any, np.ndarray] | None = None
        self._cache: tuple[int, int, np.ndarray] | None = None  # (epoch, window, plan)
        self._order_cache: tuple[int, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        """Steps of the current epoch (the same on every rank; fewer in an epoch resumed
        on another world size, which shares only what was left)."""
        return self._steps

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reseeds the permutation); restarts it at step 0.

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch < 0``.
        """
        self.epoch = check_int("epoch", epoch, minimum=0)
        self._step = 0
        self._set_segments([])

    def _set_segments(self, segments: list[tuple[int, int, int, int]]) -> None:
        self._segments = [(int(a), int(b), int(c), int(d)) for a, b, c, d in segments]
        self._cache = self._order_cache = None
        per_step = self.world_size * self.sub_batches_per_step * self.samples_per_sub_batch
        self._steps = self._epoch_stream().size // per_step if self._segments else self._full_steps

    def _epoch_stream(self) -> np.ndarray:
        """This epoch's sample order shared by all ranks: the permutation, minus what
        earlier layouts of the epoch (``_segments``) already trained, in its order."""
        key = (self.epoch, tuple(self._segments))
        if self._stream_cache is not None and self._stream_cache[0] == key:
            return self._stream_cache[1]
        n = self._costs.size
        if self.shuffle:
            stream = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            stream = np.arange(n)
        for world, k, window, steps in self._segments:
            stream = stream[~self._consumed(stream, world, k, window, steps)]
        self._stream_cache = (key, stream)
        return stream

    def _consumed(
        self, stream: np.ndarray, world: int, k: int, window: int, steps: int
    ) -> np.ndarray:
        """Mask of ``stream`` positions that ``steps`` steps of a ``world``-rank layout
        trained. Whole windows trained all their sub-batches; the partial one the
        members of its first steps, from the same plan the ranks followed."""
        s = self.samples_per_sub_batch
        total = stream.size // (world * k * s)
        if steps > total:
            raise ValueError(f"state['step'] must be <= {total} for that layout, got {steps}")
        used = total * world * k * s
        w0, done = divmod(steps, window)
        w = min(window, total - w0 * window)

        def trained(positions: np.ndarray, per_step: int, plan: Callable[..., Any]) -> np.ndarray:
            # Stream positions trained by one plan: `positions` are those it covers (in
            # order), `per_step` its sub-batches a step, `plan` the window planner.
            sb_costs = self._costs[stream[positions]].reshape(-1, s).sum(axis=1)
            first = w0 * window * per_step
            members = np.arange(first)
            if done:
                part = plan(sb_costs[first : first + w * per_step][None])[0][:done]
                members = np.concatenate([members, part.reshape(-1) + first])
            return positions.reshape(-1, s)[members].reshape(-1)

        mask = np.zeros(stream.size, dtype=bool)
        if self.mode == "local":
            local = lambda c: plan_windows(c, k, w, method=self.method)  # noqa: E731
            for r in range(world):
                mask[trained(np.arange(r, used, world), k, local)] = True
        else:
            glob = lambda c: plan_global_windows(c, world, k, w, method=self.method)  # noqa: E731
            mask[trained(np.arange(used), world * k, glob)] = True
        return mask

    def __iter__(self) -> Iterator[list[int]]:
        start = self._step
        for step in range(start, self._steps):
            indices = self.step_indices(step)
            self._step = step + 1
            yield indices
        # The epoch is over: the next iteration is the next epoch.
        self.epoch += 1
        self._step = 0
        if self._segments:
            self._set_segments([])

    def step_indices(self, step: int) -> list[int]:
        """This rank's sample indices for ``step`` of the current epoch (no state change).

        Raises:
            ValueError: ``step`` outside ``[0, len(self))``.
        """
        step = check_int("step", step, minimum=0)
        if step >= self._steps:
            raise ValueError(f"step must be < {self._steps}, got {step}")
        w0 = step // self.window_steps
        plan = self._window_plan(w0)  # (window steps, k) sub-batch ids of this rank
        sub_batches = plan[step - w0 * self.window_steps]
        s = self.samples_per_sub_batch
        order, _ = self._epoch_data()
        return [int(i) for sb in sub_batches for i in order[sb * s : (sb + 1) * s]]

    def _epoch_data(self) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's sample order (this rank's stream in local mode, everyone's in
        global mode) and the cost of each of its sub-batches; cached per epoch."""
        if self._order_cache is not None and self._order_cache[0] == self.epoch:
            return self._order_cache[1], self._order_cache[2]
        perm = self._epoch_stream()
        used = self._steps * self.world_size * self.sub_batches_per_step
        used *= self.samples_per_sub_batch
        if self.mode == "local":
            order = perm[self.rank :: self.world_size][: used // self.world_size]
        else:
            order = perm[:used]
        sb_costs = self._costs[order].reshape(-1, self.samples_per_sub_batch).sum(axis=1)
        self._order_cache = (self.epoch, order, sb_costs)
        return order, sb_costs

    def _window_plan(self, window: int) -> np.ndarray:
        if self._cache is not None and self._cache[:2] == (self.epoch, window):
            return self._cache[2]
        k, r = self.sub_batches_per_step, self.world_size
        w = min(self.window_steps, self._steps - window * self.window_steps)
        _, sb_costs = self._epoch_data()
        if self.mode == "local":
            first = window * self.window_steps * k
            costs = sb_costs[first : first + w * k]
            plan = plan_windows(costs[None], k, w, method=self.method)[0] + first
        else:
            first = window * self.window_steps * r * k
            costs = sb_costs[first : first + w * r * k]
            full = plan_global_windows(costs[None], r, k, w, method=self.method)[0]
            plan = full[:, self.rank, :] + first
        self._cache = (self.epoch, window, plan)
        return plan

    def state_dict(self, *, step: int | None = None) -> dict[str, Any]:
        """Epoch and position, plus the shape for checking.

        Args:
            step: steps of the current epoch already *trained*. Default: the steps
                already yielded. A ``DataLoader`` with workers pulls indices ahead of
                training, so pass the training loop's own count there, or a resumed
                run would skip the prefetched steps.

        Raises:
            ValueError: ``step`` outside ``[0, len(self)]``.
        """
        if step is None:
            step = self._step
        else:
            step = check_int("step", step, minimum=0)
            if step > self._steps:
                raise ValueError(f"step must be <= {self._steps}, got {step}")
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "step": step,
            "seed": self.seed,
            "mode": self.mode,
            "world_size": self.world_size,
            "samples_per_sub_batch": self.samples_per_sub_batch,
            "sub_batches_per_step": self.sub_batches_per_step,
            "window_steps": self.window_steps,
            "num_samples": int(self._costs.size),
            "segments": [list(seg) for seg in self._segments],
            "shuffle": self.shuffle,
            "method": self.method,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the remaining steps of the epoch.

        With the same world size, ``k`` and ``W`` the resume is exact (the same steps
        the saving run would have yielded). With another world size, ``k`` or ``W`` the
        samples the saved run has not trained yet this epoch are shared by the new ranks
        (in the epoch's order, balanced by the new plan); none is trained twice, and
        this epoch's leftover is what does not fill a step of the new layout. Nothing is
        communicated: every rank replays the earlier layouts.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: version mismatch; another seed, mode, shuffle, method, sub-batch
                size or dataset size; ``step`` out of range.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("version") not in (1, _STATE_VERSION):
            raise ValueError(f"state version {state.get('version')!r} != {_STATE_VERSION}")
        mine = self.state_dict()
        for key in ("seed", "mode", "samples_per_sub_batch", "num_samples"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"state has {key}={state.get(key)!r}, this sampler has {mine[key]!r}"
                )
        # `shuffle` picks the epoch's order and `method` the plans, like `seed`: resumed
        # under another value, the remaining steps (and the replay of earlier layouts)
        # follow another order, training some samples twice and others never, silently.
        # States saved before these keys existed lack them and are taken on trust.
        for key in ("shuffle", "method"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"state has {key}={state[key]!r}, this sampler has {mine[key]!r}")
        shape = {}
        for key in ("world_size", "sub_batches_per_step", "window_steps"):
            shape[key] = check_int(f"state[{key!r}]", state.get(key), minimum=1)
        segments = state.get("segments", [])
        if not isinstance(segments, (list, tuple)) or any(
            not isinstance(seg, (list, tuple)) or len(seg) != 4 for seg in segments
        ):
            raise ValueError("state['segments'] must be a list of [world, k, W, steps]")
        segments = [
            tuple(check_int("state['segments']", v, minimum=0) for v in seg) for seg in segments
        ]
        step = check_int("state['step']", state["step"], minimum=0)
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        same_shape = (
            shape["world_size"] == self.world_size
            and shape["sub_batches_per_step"] == self.sub_batches_per_step
            and shape["window_steps"] == self.window_steps
        )
        if not same_shape and step > 0:
            # What the saved layout trained becomes one more replayed segment.
            segments = [
                *segments,
                (shape["world_size"], shape["sub_batches_per_step"], shape["window_steps"], step),
            ]
            step = 0
        # The replay below is what validates the segments and the step, and it needs the
        # new epoch in place. A rejected state must leave the sampler as it was: before,
        # it kept the state's epoch (a caller that caught the error and went on trained
        # another epoch's order) or segments that raised at every later iteration.
        previous = (self.epoch, self._step, list(self._segments))
        self.epoch = epoch
        try:
            self._set_segments(segments)
            if step > self._steps:
                raise ValueError(f"state['step'] must be <= {self._steps}, got {step}")
        except BaseException:
            self.epoch, self._step = previous[0], previous[1]
            self._set_segments(previous[2])
            raise
        self._step = step


def _dist_default(fn: str, fallback: int) -> int:
    # Only reads the process group's metadata: get_rank/get_world_size are no collective.
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(getattr(dist, fn)())
    return fallback
