"""Configuration objects of :func:`hyperrec.parallel5d.fully_shard`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Granularity", "MixedPrecisionPolicy", "resolve_granularity"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision, with the semantics of PyTorch FSDP2's policy.

    The sharded (master) parameters keep their original dtype; the optimizer updates
    them. ``torch.distributed.fsdp.MixedPrecisionPolicy`` objects are accepted too.

    Raises:
        TypeError: a dtype field that is neither ``None`` nor a floating ``torch.dtype``
            (checked here, not at the first forward), or a non-bool
            ``cast_forward_inputs``.
    """

    param_dtype: torch.dtype | None = None
    """dtype of the unsharded parameters (forward/backward compute and the all-gather).
    ``None``: the original dtype."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are accumulated and reduce-scattered in (e.g. ``torch.float32``
    for fp32 reduction of bf16 compute). ``None``: ``param_dtype``."""
    output_dtype: torch.dtype | None = None
    """If set, floating-point forward outputs of the module are cast to it."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs to ``param_dtype``."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(self, name)
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise TypeError(f"{name} must be None or a floating torch.dtype, got {dt!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")


Granularity = int | str | Callable[[str, nn.Parameter], "int | str"] | None
"""Block size that no shard boundary may cut, per parameter:

* ``None`` or ``"element"``: 1 element;
* ``"row"``: one row (``numel // shape[0]``; FSDP2-like dim-0 cuts, but uneven);
* ``"matrix"``: a whole tensor for parameters with 2 or more dims (Muon), 1 otherwise;
* ``"tensor"``: a whole tensor, always;
* an ``int`` ``n``: blocks of ``n`` elements counted from each tensor's start (8-bit
  Adam quantization blocks);
* a callable ``(fqn, param) -> one of the above``.
"""


def resolve_granularity(spec: Any, fqn: str, param: nn.Parameter) -> int:
    """Granularity in elements for one parameter.

    Raises:
        ValueError: an unknown string or a non-positive int.
        TypeError: any other type.
    """
    if callable(spec) and not isinstance(spec, str):
        spec = spec(fqn, param)
    numel = max(param.numel(), 1)
    if spec is None or spec == "element":
        return 1
    if isinstance(spec, bool):
        raise TypeError(f"granularity must be an int, a string or a callable, got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"granularity for {fqn!r} must be >= 1 element, got {spec}")
        return spec
    if spec == "row":
        return max(math.prod(param.shape[1:]), 1) if param.dim() > 0 else 1
    if spec == "matrix":
        return numel if param.dim() >= 2 else 1
    if spec == "tensor":
        return numel
    if isinstance(spec, str):
        raise ValueError(
            f"granularity for {fqn!r} must be 'element', 'row', 'matrix', 'tensor' or an int, "
            f"got {spec!r}"
        )
    raise TypeError(f"granularity must be an int, a string or a callable, got {spec!r}")
