"""Block granularities: how many consecutive elements a shard boundary must never cut.

A *block* is ``block_numel`` consecutive elements of a tensor in row-major order,
counted from the tensor's first element; the last block may be shorter. Structure-aware
optimizers define their blocks: Muon needs whole matrices, 8-bit Adam needs its
quantisation blocks (e.g. 2,048 elements), 32x32 tile quantisation needs 32 rows.

Granularities are given as an ``int`` (elements) or a small string grammar:

=====================================  ======================================
spec                                   block (elements)
=====================================  ======================================
``"element"`` / ``"elements"``         1
``"row"`` / ``"rows"``                 ``prod(shape[1:])`` (1 for a 1-D tensor)
``"<k> rows"`` (e.g. ``"32 rows"``)    ``k * prod(shape[1:])``
``"<n> elements"``                     ``n``
``"matrix"`` / ``"whole matrix"``      ``prod(shape[-2:])`` (whole tensor if 1-D)
``"tensor"`` / ``"whole tensor"``      ``numel`` (the tensor is never cut)
=====================================  ======================================
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from hyperrec.raggedshard._validate import check_int

__all__ = ["GranularitySpec", "block_numel"]

GranularitySpec = int | str

_COUNTED = re.compile(r"^\s*(\d+)\s+(row|rows|element|elements)\s*$")


def _shape_tuple(shape: Sequence[int], name: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, str | bytes):
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}")
    try:
        out = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}") from None
    for s in out:
        # A float size is a bug upstream: never truncate it.
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{name} must hold ints, got {shape!r}")
        if s < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {shape!r}")
    return out


def block_numel(shape: Sequence[int], granularity: GranularitySpec) -> int:
    """Number of elements in one block of a tensor of ``shape`` for ``granularity``.

    Args:
        shape: the tensor's global shape (non-negative ints; ``()`` for a scalar).
        granularity: an ``int >= 1`` (elements) or a string from the module's grammar:
            ``"element"``, ``"row"``, ``"<k> rows"``, ``"<n> elements"``,
            ``"matrix"``/``"whole matrix"``, ``"tensor"``/``"whole tensor"``.

    Returns:
        The block size in elements, always ``>= 1`` (a tensor with zero elements has
        blocks of 1 element by convention, so it never constrains a layout).

    Raises:
        TypeError: ``shape`` is not a sequence of ints or ``granularity`` not int/str.
        ValueError: negative sizes, ``granularity < 1``, a count of 0, or an unknown spec.
    """
    dims = _shape_tuple(shape)
    numel = math.prod(dims)
    row = math.prod(dims[1:]) if dims else 1
    if isinstance(granularity, bool) or not isinstance(granularity, int | str):
        raise TypeError(f"granularity must be an int or a str, got {type(granularity).__name__}")
    if isinstance(granularity, int):
        return check_int("granularity", granularity, minimum=1)
    spec = granularity.strip().lower()
    if spec in ("element", "elements"):
        return 1
    if spec in ("row", "rows"):
        return max(row, 1)
    if spec in ("tensor", "whole tensor", "whole"):
        return max(numel, 1)
    if spec in ("matrix", "whole matrix"):
        return max(math.prod(dims[-2:]) if len(dims) >= 2 else numel, 1)
    m = _COUNTED.match(spec)
    if m is None:
        raise ValueError(
            f"granularity {granularity!r} is not understood; use an int, 'element', 'row', "
            "'<k> rows', '<n> elements', 'matrix' or 'tensor'"
        )
    count, unit = int(m.group(1)), m.group(2)
    if count < 1:
        raise ValueError(f"granularity {granularity!r} must count at least 1 {unit}")
    return count * max(row, 1) if unit.startswith("row") else count
