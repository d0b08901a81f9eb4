"""Packed saves inside compiled regions: MXINT8 quantization traced into the graphs.

Eager packing (``_exec``) quantizes a saved tensor from Python after the op that made it,
one call per save (host-bound on a GPU: 56-144 us per call measured on the H200). Under
``torch.compile`` AOTAutograd can instead *inline* saved-tensor hooks that are
``torch.fx.GraphModule``\\ s: for every intermediate the forward graph saves for the
backward, the pack hook's graph is appended to the forward graph and the unpack hook's
graph prepended to the backward graph (``torch._functorch._aot_autograd``'s
``maybe_inline_graph_saved_tensors_hooks``). The compiler then sees the quantization as
ordinary ops: Inductor can fuse the pack into the kernel that produces the tensor and the
unpack into the kernels that read it, so a packed save costs no pass or launch of its own.

Which saves to pack: the hooks run once per saved node while the graphs are built, with
the node in reach (``_get_saved_tensor_hook_context()["_node"]``); its
``meta["original_aten"]`` is the op of the region's forward it came from, before
decomposition. A region packs the saved nodes whose op is one of the op classes its plan
packs (any occurrence), in ``"mxint8"``: the plan's per-occurrence decisions become per
class, which packs at least what the plan packs (at most the memory it predicts) and only
classes whose gradient error the profiler measured within its bound. Only intermediates
of the graph are offered to the hooks (AOTAutograd's default filter): region inputs,
outputs and parameters stay as they are.

The bytes are those of :func:`hyperrec.autoac.formats.quantize_mxint8` (tested), written
without in-place ops or data-dependent Python so that they trace: the shared exponent is
read from the float32 bits of the block's largest magnitude and the powers of two are
built from bits too (exact, no ``exp2``/``frexp`` lowering needed).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from hyperrec.autoac.formats import MXINT8_MIN_EXP, PACKABLE_DTYPES

__all__ = [
    "COMPILED_FORMATS",
    "compiled_packing_supported",
    "mxint8_pack_flat",
    "mxint8_unpack_flat",
    "pack_hooks",
]

#: Formats a compiled region can pack (the others keep such regions eager).
COMPILED_FORMATS: tuple[str, ...] = ("mxint8",)


@functools.cache
def _hook_context_fn() -> Any:
    try:
        from torch._functorch._aot_autograd import graph_compile, utils
    except ImportError:  # pragma: no cover - every supported torch has the module
        return None
    if not hasattr(utils, "saved_tensors_hooks_are_inlineable"):
        return None
    return getattr(graph_compile, "_get_saved_tensor_hook_context", None)


def compiled_packing_supported() -> bool:
    """Whether this torch inlines ``GraphModule`` saved-tensor hooks into compiled graphs
    and shows the hooks the saved node (feature test; without it packed regions run
    eagerly under ``torch.compile``)."""
    return _hook_context_fn() is not None


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 23).view(torch.float32)


def mxint8_pack_flat(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXINT8 of a tensor's elements in row-major order, as traceable ops.

    Args:
        x: bf16/fp16/fp32, ``x.numel()`` a multiple of 32.

    Returns:
        ``(data, scale)``: int8 ``(numel // 32, 32)`` and uint8 E8M0 ``(numel // 32,)``,
        the bytes :func:`~hyperrec.autoac.formats.quantize_mxint8` writes for
        ``x.reshape(-1, 32)``.
    """
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=-1).to(torch.float32)  # NaN propagates; Inf stays Inf
    # floor(log2(amax)) for normal amax is its biased exponent - 127; every amax below
    # 2**MIN_EXP (zero and fp32 subnormals included) takes MIN_EXP, as the format says.
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(min=MXINT8_MIN_EXP)
    bad = ~torch.isfinite(amax)
    scale = torch.where(bad, 255, e + 127).to(torch.uint8)
    work = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    # 2**(6 - e): e in [-120, 127] keeps the biased exponent 133 - e in [6, 253]
    factor = _bits_to_f32(133 - e).to(work).unsqueeze(-1)
    q = (blocks.to(work) * factor).round().clamp(-127.0, 127.0)
    q = torch.where(bad.unsqueeze(-1), 0.0, q)
    return q.to(torch.int8), scale


def mxint8_unpack_flat(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shape: tuple[Any, ...]
) -> torch.Tensor:
    """Inverse of :func:`mxint8_pack_flat`: a contiguous ``shape`` tensor of ``dtype``."""
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    # 2**(e - 6) = 2**(scale - 133); scale >= 7 (e >= -120) keeps the biased exponent
    # scale - 6 normal. Scale 255 marks a non-finite block.
    f = _bits_to_f32(scale.to(torch.int32) - 6)
    f = torch.where(scale == 255, float("nan"), f).to(work).unsqueeze(-1)
    return (data.to(work) * f).to(dtype).reshape(shape)


class _Pack:
    """The pack hook's one call (a ``call_function`` target of the hook graph)."""

    def __init__(self, classes: frozenset[str], min_bytes: int, counts: dict[str, int]) -> None:
        self.classes = classes
        self.min_bytes = min_bytes
        self.counts = counts
        self.__name__ = "autoac_pack"

    def _node_to_pack(self, x: torch.Tensor) -> Any:
        """The saved node ``x`` stands for, if it is to be packed; else ``None``."""
        ctx = _hook_context_fn()
        state = ctx() if ctx is not None else None
        if not state or "_node" not in state:
            # Called outside graph building: an eager stretch of the region (a graph
            # break) runs with the hooks set; its saves stay as they are.
            return None
        node = state["_node"]
        op = node.meta.get("original_aten")
        wanted = (
            op is not None
            and str(op) in self.classes
            and x.dtype in PACKABLE_DTYPES
            and x.numel() % 32 == 0
            and x.numel() * x.element_size() >= max(self.min_bytes, 1)
            and x.is_contiguous()
        )
        return node if wanted else None

    def __call__(self, x: torch.Tensor) -> tuple[Any, ...]:
        node = self._node_to_pack(x)
        if node is None:
            return (x,)
        # called twice per node while building (once to see the output, once to trace)
        self.counts[node.name] = self.counts.get(node.name, 0) + 1
        data, scale = mxint8_pack_flat(x)
        return (data, scale, x.dtype, tuple(x.shape))


def _unpack(packed: tuple[Any, ...]) -> torch.Tensor:
    if len(packed) == 1:
        t: torch.Tensor = packed[0]
        return t
    data, scale, dtype, shape = packed
    return mxint8_unpack_flat(data, scale, dtype, shape)


def _graph_module(fn: Any) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(fn, (x,)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def pack_hooks(
    classes: Mapping[str, str], min_bytes: int
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, dict[str, int]]:
    """Inlineable ``(pack, unpack)`` hooks for one set of packed op classes.

    Args:
        classes: op name (``"aten.mm.default"``) -> format; every format must be in
            :data:`COMPILED_FORMATS`.
        min_bytes: saved tensors smaller than this stay unpacked.

    Returns:
        ``(pack, unpack, counts)``: the hooks for ``saved_tensors_hooks`` around a
        compiled call, and a dict that counts, per saved node name, the hook calls that
        chose to pack it while graphs were built (for tests and reports).

    Raises:
        ValueError: a format that compiled regions cannot pack.
    """
    bad = sorted({f for f in classes.values() if f not in COMPILED_FORMATS})
    if bad:
        raise ValueError(
            f"classes: compiled regions pack only {COMPILED_FORMATS}, got formats {bad}"
        )
    counts: dict[str, int] = {}
    pack = _Pack(frozenset(classes), min_bytes, counts)
    return _graph_module(pack), _graph_module(_unpack), counts
