"""Optimizer states sharded like their parameters, with DCP-ready state dicts.

The structure-aware optimizers keep every per-parameter state tensor as a DTensor with
the placements of its parameter (or of the parameter's blocks), so:

- ``state_dict()`` hands ``torch.distributed.checkpoint`` the live state tensors: with
  raggedshard's planners each rank writes only the pieces it holds, and ``dcp.load``
  writes the saved bytes straight into them on any world size and any shard layout;
- the states are the same global tensors whatever the mesh (the optimizers only ever
  act on whole blocks / whole matrices), so a checkpoint means the same thing on every
  mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from hyperrec.parallel5d.optim._local import local_flat, local_range
from hyperrec.raggedshard import full_tensor, redistribute

__all__ = ["ShardedStateOptimizer"]

_GROUP_KEYS_NOT_LOADED = ("params", "param_names")


class ShardedStateOptimizer(torch.optim.Optimizer):
    """Base of :class:`~hyperrec.parallel5d.Muon` and :class:`~hyperrec.parallel5d.AdamW8bit`.

    Subclasses define :meth:`_check_param` (raise if a parameter's sharding does not
    suit the optimizer) and :meth:`_new_state` (the zero state of one parameter).
    States are created when a parameter is added (not at its first step), so a freshly
    built optimizer's :meth:`state_dict` is already a complete destination for
    ``dcp.load``, and ``torch.distributed.checkpoint.state_dict`` helpers never run
    their zero-learning-rate initialisation step on it.
    """

    #: Param-group entries the states' meaning depends on: a state dict saved with
    #: another value cannot be loaded.
    _FIXED_GROUP_KEYS: tuple[str, ...] = ()

    # ------------------------------------------------------------ subclass hooks
    def _check_param(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (see ``torch.optim.Optimizer``); validates its parameters' sharding
        and creates their zero states.

        Raises:
            ValueError / TypeError: as the subclass documents; the group is not added.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                self._check_param(p, group)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        for p in group["params"]:
            self.state[p] = self._new_state(p, group)

    def _state_of(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:  # cleared by the caller (e.g. ``opt.state.clear()``): start afresh
            state.update(self._new_state(p, group))
        return state

    # --------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state in ``torch.optim``'s layout, ready for DCP.

        ``{"state": {id: {name: tensor}}, "param_groups": [{..., "params": [id, ...]}]}``
        with ids numbering the parameters in group order, exactly as
        ``torch.optim.Optimizer.state_dict``. Every parameter has an entry. The tensors
        are the live states (no copies): DTensors with the placements of their
        parameter (see the subclass for each state's shape), plain tensors for plain
        parameters; counters are 0-dim int64 tensors, so ``dcp.load`` restores them in
        place too.

        Save with ``dcp.save(opt.state_dict(), ..., planner=RaggedSavePlanner())`` (each
        rank writes only what it holds), or through
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (keys by
        parameter name).
        """
        sd = super().state_dict()
        # New dicts around the same tensors: DCP may write Python values into the dict
        # it is given, which must never alias the optimizer's own state dicts.
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict made by :meth:`state_dict` (possibly on another mesh).

        Parameters are matched by position, as ``torch.optim`` does (the keys may be
        ids or parameter names). Each value may be

        - the optimizer's own state tensor, already filled by ``dcp.load`` (nothing to
          copy: the common path, which never gathers a full tensor);
        - a DTensor of the same global shape on the same mesh (redistributed to the
          state's placements; no full tensor is built);
        - a plain tensor holding the full global value (this rank's piece is copied).

        A parameter without an entry in ``state_dict["state"]`` gets a fresh zero state.
        Param-group hyper-parameters are taken from the state dict. Everything is
        validated before anything is changed.

        Raises:
            TypeError: ``state_dict`` is not a mapping with ``"state"`` and
                ``"param_groups"``, or a state value has the wrong type.
            ValueError: a different number of groups or parameters, a state entry with
                other names, a state tensor whose global shape or dtype differs (a
                checkpoint of another model or optimizer), or a different value of a
                group entry the states depend on (``block_size``).
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, cast(dict[str, Any], state_dict))
            if out is not None:
                state_dict = out
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError(
                "state_dict must be a mapping with 'state' and 'param_groups' (from "
                f"{type(self).__name__}.state_dict()), got {type(state_dict).__name__}"
            )
        saved_groups = list(state_dict["param_groups"])
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        todo = []
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            keys = list(saved["params"])
            if len(keys) != len(group["params"]):
                raise ValueError(
                    f"param group {gi} of state_dict has {len(keys)} parameters, this "
                    f"optimizer's has {len(group['params'])}"
                )
            for name in self._FIXED_GROUP_KEYS:
                if name in saved and saved[name] != group[name]:
                    raise ValueError(
                        f"param group {gi} of state_dict was written with {name}="
                        f"{saved[name]!r}, this optimizer uses {name}={group[name]!r}; "
                        "its states cannot be reinterpreted"
                    )
            for key, p in zip(keys, group["params"]):
                src = saved_state.get(key)
                self._check_loaded(key, p, self._state_of(p, group), src)
                todo.append((p, group, src))

        for group, saved in zip(self.param_groups, saved_groups):
            for name, value in saved.items():
                if name not in _GROUP_KEYS_NOT_LOADED:
                    group[name] = value
        for p, group, src in todo:
            state = self.state[p]
            if src is None:
                state.clear()
                state.update(self._new_state(p, group))
                continue
            for name, dst in state.items():
                _copy_state_(dst, src[name])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @staticmethod
    def _check_loaded(key: Any, p: torch.Tensor, dst: Mapping[str, torch.Tensor], src: Any) -> None:
        if src is None:
            return
        what = f"the state of parameter {key!r} (shape {tuple(p.shape)})"
        if not isinstance(src, Mapping):
            raise TypeError(f"{what} must be a mapping of state names, got {type(src).__name__}")
        if set(src) != set(dst):
            raise ValueError(
                f"{what} has entries {sorted(src)}, expected {sorted(dst)} (a state of "
                "another optimizer?)"
            )
        for name, d in dst.items():
            s = src[name]
            if d.dim() == 0:  # a counter: any number will do
                if not isinstance(s, int | float | torch.Tensor) or (
                    isinstance(s, torch.Tensor) and s.numel() != 1
                ):
                    raise TypeError(f"{what}: {name!r} must be a number, got {s!r}")
                continue
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"{what}: {name!r} must be a tensor, got {type(s).__name__}")
            if tuple(s.shape) != tuple(d.shape):
                raise ValueError(
                    f"{what}: {name!r} has shape {tuple(s.shape)}, expected "
                    f"{tuple(d.shape)} (a checkpoint of another model?)"
                )
            # Codes and scales are only meaningful in their own dtype; float states
            # (momentum) may change precision like torch.optim's do.
            if (d.is_floating_point() and not s.is_floating_point()) or (
                not d.is_floating_point() and s.dtype != d.dtype
            ):
                raise ValueError(f"{what}: {name!r} has dtype {s.dtype}, expected {d.dtype}")
            if (
                isinstance(s, DTensor)
                and isinstance(d, DTensor)
                and s is not d
                and s.device_mesh != d.device_mesh
            ):
                raise ValueError(
                    f"{what}: {name!r} is a DTensor on another device mesh; load it with "
                    "dcp.load into this optimizer's state_dict() instead"
                )


def _copy_state_(dst: torch.Tensor, src: Any) -> None:
    """Write ``src`` (validated by ``_check_loaded``) into the state tensor ``dst``."""
    if src is dst:  # filled in place by dcp.load
        return
    if dst.dim() == 0:
        dst.fill_(src.item() if isinstance(src, torch.Tensor) else src)
        return
    out = local_flat(dst)
    if isinstance(dst, DTensor):
        if isinstance(src, DTensor):
            if tuple(src.placements) != tuple(dst.placements):
                src = redistribute(src, dst.placements)  # one all-to-all, no full tensor
            piece = src.to_local()
        else:
            start, stop = local_range(dst)
            piece = src.reshape(-1)[start:stop]
    else:
        # raggedshard's full_tensor: upstream's keeps a whole-tensor piece's local shape
        # (1, *shape) on a 1-rank mesh.
        piece = full_tensor(src) if isinstance(src, DTensor) else src
    out.copy_(piece.reshape(-1).to(device=out.device, dtype=out.dtype))
