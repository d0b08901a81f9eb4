"""Compressed storage of saved activations through :mod:`hyperrec.mxfp8`.

A saved tensor is packed **per storage**: the storage is read as one flat run of
elements and quantized in blocks of consecutive elements along it, so every view of
that storage (``q``, ``k`` and ``v`` cut from one projection, a transpose, ...) is
rebuilt from one packed copy with its own size, stride and offset. For a contiguous
tensor whose last dim is a multiple of the block size these are exactly the row blocks
of the last dim. A storage is packable when its element count is a multiple of the
block size; it is quantized as a ``(rows, width)`` matrix (``width`` a multiple of the
block, up to 8192), which keeps the quantizer's launch grid small for any size.

| format | elements | block, scale | bytes per element |
|---|---|---|---|
| ``"mxfp8"`` | FP8 E4M3 | 32, E8M0 (OCP MXFP8) | 1 + 1/32 |
| ``"fp8_e4m3"`` | FP8 E4M3 | 128, E8M0 | 1 + 1/128 |
| ``"fp8_e5m2"`` | FP8 E5M2 | 128, E8M0 | 1 + 1/128 |
| ``"mx4"`` | FP4 E2M1, two a byte | 32, E8M0 (OCP MXFP4) | 1/2 + 1/32 |
| ``"mxint8"`` | INT8, value ``q / 64`` | 32, E8M0 (OCP MXINT8) | 1 + 1/32 |

The FP8/FP4 scales are RCEIL (``amax / max_elem`` rounded up to a power of two, nothing
saturates; rounding can still lift an fp16 element from 63,488 up past fp16's maximum,
so it unpacks as ``inf``: ``"mxint8"`` keeps such values finite). Their quantizer is
``hyperrec.mxfp8.to_mx`` (Triton on CUDA, the reference on the CPU); dequantization is
``MXTensor.dequantize`` (one Triton pass for the FP8 formats on CUDA).

``"mxint8"`` (OCP MX v1.0's MXINT8, see :func:`quantize_mxint8`) spends the byte on 7 bits
of magnitude instead of E4M3's exponent: a block's elements share its scale, so the
exponent bits of FP8 mostly repeat it. On Gaussian-like blocks its error is about a
quarter of MXFP8's (relative RMS ~0.6% against ~2.5%), which lets tensor classes whose
gradients are too sensitive for MXFP8 (normalisation inputs, residual sums) be packed at
the same size. It is written with PyTorch operations (several passes on the device,
where the FP8 formats take one Triton pass).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Literal

import torch

from hyperrec.autoac._validate import check_choice, check_int, check_tensor

if TYPE_CHECKING:
    from hyperrec.mxfp8 import MXTensor

__all__ = [
    "SAVE_FORMATS",
    "MXInt8Blocks",
    "PackedStorage",
    "SaveFormat",
    "can_pack",
    "dequantize_mxint8",
    "pack_storage",
    "packed_nbytes",
    "quantize_mxint8",
    "unpack_view",
]

SaveFormat = Literal["mxfp8", "fp8_e4m3", "fp8_e5m2", "mx4", "mxint8"]

#: Every format. The first four quantize through ``hyperrec.mxfp8``; ``"mxint8"`` is
#: the most precise per byte (on data without outliers inside a block).
SAVE_FORMATS: tuple[str, ...] = ("mxfp8", "fp8_e4m3", "fp8_e5m2", "mx4", "mxint8")

#: format -> (``to_mx`` element dtype, block size)
_SPEC: dict[str, tuple[torch.dtype | str, int]] = {
    "mxfp8": (torch.float8_e4m3fn, 32),
    "fp8_e4m3": (torch.float8_e4m3fn, 128),
    "fp8_e5m2": (torch.float8_e5m2, 128),
    "mx4": ("e2m1", 32),
    "mxint8": (torch.int8, 32),
}

#: Dtypes of saved tensors that may be packed.
PACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def packed_nbytes(numel: int, fmt: str) -> int:
    """Bytes of a packed run of ``numel`` elements: elements plus one scale byte a block.

    Raises:
        TypeError: ``numel`` not an int, ``fmt`` not a string.
        ValueError: a negative ``numel``, an unknown ``fmt``.
    """
    check_int("numel", numel, minimum=0)
    check_choice("fmt", fmt, SAVE_FORMATS)
    _, block = _SPEC[fmt]
    data = (numel + 1) // 2 if fmt == "mx4" else numel
    return data + math.ceil(numel / block)


def can_pack(dtype: torch.dtype, numel: int, fmt: str) -> bool:
    """Whether a storage of ``numel`` elements of ``dtype`` can be packed in ``fmt``: a
    float dtype and a whole number of blocks.

    Raises:
        TypeError: ``fmt`` not a string.
        ValueError: an unknown ``fmt``.
    """
    check_choice("fmt", fmt, SAVE_FORMATS)
    if dtype not in PACKABLE_DTYPES or numel <= 0:
        return False
    return numel % _SPEC[fmt][1] == 0


def _width(numel: int, block: int) -> int:
    w = 8192
    while w > block and numel % w:
        w //= 2
    return w


class PackedStorage:
    """One storage, quantized: an ``MXTensor`` over its flat elements plus its dtype.

    Attributes:
        mx: the quantized flat run (``hyperrec.mxfp8.MXTensor``; :class:`MXInt8Blocks`
            for ``"mxint8"``).
        numel: elements of the storage.
        dtype: element dtype of the original storage.
        fmt: the :data:`SaveFormat`.
    """

    __slots__ = ("__weakref__", "_flat", "dtype", "fmt", "mx", "numel")

    def __init__(
        self, mx: MXTensor | MXInt8Blocks, numel: int, dtype: torch.dtype, fmt: str
    ) -> None:
        self.mx = mx
        self.numel = numel
        self.dtype = dtype
        self.fmt = fmt
        self._flat: weakref.ref[torch.UntypedStorage] | None = None

    def dequantize_shared(self) -> torch.Tensor:
        """:meth:`dequantize`, reusing the result while it is alive (several views of
        one storage are unpacked once)."""
        st = self._flat() if self._flat is not None else None
        if st is not None:
            with torch.no_grad():
                return torch.empty(0, dtype=self.dtype, device=st.device).set_(
                    st, 0, (self.numel,), (1,)
                )
        full = self.dequantize()
        # Remember the storage, not the tensor: autograd keeps what an unpack hook
        # returns as a tensor of its own on the same storage, and ``full`` (often a
        # view) died as soon as the hook returned. A weak reference to it was dead at
        # the next unpack, so every saved view of the storage was dequantized again:
        # two saves of one tensor by one node (``a * a``) held two full copies at once.
        # The storage's Python object lives exactly as long as the storage.
        self._flat = weakref.ref(full.untyped_storage())
        return full

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copy (elements + scales)."""
        return self.mx.data.untyped_storage().nbytes() + self.mx.scale.untyped_storage().nbytes()

    def dequantize(self) -> torch.Tensor:
        """The flat storage contents back in :attr:`dtype`, shape ``(numel,)``.

        FP8 formats: on CUDA ``MXTensor.dequantize``'s one-pass Triton kernel
        (hyperrec-mxfp8 >= 0.3.2); elsewhere two passes in :attr:`dtype` (widen the
        elements, multiply by the block scale as a power of two) instead of the
        reference's four in FP32. All three round the exact product once: the same bits.
        MX4 uses ``MXTensor.dequantize`` (one Triton pass on CUDA with hyperrec-mxfp8 >=
        0.4.3, the reference before and elsewhere).
        """
        if isinstance(self.mx, MXInt8Blocks):
            return dequantize_mxint8(self.mx, self.dtype).reshape(-1)
        if self.fmt == "mx4" or self.mx.data.is_cuda:
            return self.mx.dequantize(self.dtype).reshape(-1)
        return _dequantize_fp8(self.mx.data, self.mx.scale, self.mx.block_size, self.dtype)


def _dequantize_fp8(
    data: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    rows, width = data.shape
    # BF16 and FP32 hold every E8M0 scale and every FP8 value exactly, so the product
    # rounds once, as in FP32; FP16's exponent range is too narrow: FP32 then a cast.
    work = torch.float32 if dtype == torch.float16 else dtype
    s = torch.exp2(scale.to(torch.float32) - 127.0)
    s = torch.where(scale == 255, torch.full_like(s, float("nan")), s).to(work)
    out = data.to(work).view(rows, width // block, block) * s.unsqueeze(-1)
    return out.view(-1).to(dtype)


def pack_storage(t: torch.Tensor, fmt: str) -> PackedStorage:
    """Quantize the whole storage that ``t`` views.

    Args:
        t: a tensor of a :data:`PACKABLE_DTYPES` dtype on any device; any view.
        fmt: a :data:`SaveFormat`.

    Returns:
        the packed storage; rebuild ``t`` with :func:`unpack_view`.

    Raises:
        TypeError: ``t`` not a tensor, ``fmt`` not a string.
        ValueError: unknown ``fmt``, or a storage that ``fmt`` cannot hold (see
            :func:`can_pack`: not a float dtype, or not a whole number of blocks).
    """
    from hyperrec.mxfp8 import to_mx

    check_tensor("t", t)
    check_choice("fmt", fmt, SAVE_FORMATS)
    esize = t.element_size()
    nbytes = t.untyped_storage().nbytes()
    numel = nbytes // esize
    if nbytes % esize or not can_pack(t.dtype, numel, fmt):
        raise ValueError(
            f"t must be a {PACKABLE_DTYPES} storage that {fmt} can hold, got {t.dtype} with "
            f"{nbytes} bytes"
        )
    elem, block = _SPEC[fmt]
    w = _width(numel, block)
    with torch.no_grad():
        rows = t.detach().as_strided((numel // w, w), (w, 1), 0)
        if fmt == "mxint8":
            return PackedStorage(quantize_mxint8(rows), numel, t.dtype, fmt)
        mx = to_mx(rows, elem_dtype=elem, block_size=block)
    if mx.scale_fp32 is not None:
        # The GEMM-side FP32 copy of the scales (written on Hopper's 128-block path) is
        # not needed to unpack: do not hold it.
        mx = dataclasses.replace(mx, scale_fp32=None)
    return PackedStorage(mx, numel, t.dtype, fmt)


def unpack_view(
    packed: PackedStorage | torch.Tensor,
    size: torch.Size | tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
) -> torch.Tensor:
    """Rebuild a view ``(size, stride, offset)`` of a packed storage.

    ``packed`` may also be an already dequantized flat tensor (shared between views).
    """
    flat = packed.dequantize() if isinstance(packed, PackedStorage) else packed
    return flat.as_strided(size, stride, offset)


# --------------------------------------------------------------------------- MXINT8
#: Smallest shared exponent ``"mxint8"`` uses (see :func:`quantize_mxint8`).
MXINT8_MIN_EXP = -120


@dataclasses.dataclass(frozen=True)
class MXInt8Blocks:
    """OCP MXINT8 data: ``data`` int8 ``(rows, width)``, ``scale`` uint8 E8M0 ``(rows,
    width // 32)``; element ``(i, j)`` is ``data[i, j] / 64 * 2**(scale[i, j // 32] -
    127)``, a scale byte of 255 makes its block NaN."""

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int = 32


def _use_triton(backend: str, device: torch.device) -> bool:
    check_choice("backend", backend, ("auto", "torch", "triton"))
    if backend == "auto":
        return device.type == "cuda"
    return backend == "triton"


def quantize_mxint8(x: torch.Tensor, *, backend: str = "auto") -> MXInt8Blocks:
    """Quantize a ``(rows, width)`` float tensor (``width`` a multiple of 32) to MXINT8.

    Per block of 32 consecutive elements of a row: shared exponent
    ``e = floor(log2(amax))`` (OCP MX v1.0; INT8's largest element is ``127/64``, its
    ``emax`` is 0), raised to :data:`MXINT8_MIN_EXP` for smaller blocks (magnitudes
    below ``2**-127`` become 0; an all-zero block gets that exponent); elements
    ``round_half_even(x * 2**(6 - e))`` clamped to ``[-127, 127]`` (only values within
    half a step of ``2 * 2**e`` clamp, by at most one step). A block holding NaN or
    +-Inf gets scale byte 255 and unpacks as NaN. The arithmetic is exact in bf16/fp32
    (a power of two times the input, then rounding), so the rounding is done once; fp16
    inputs are widened to fp32 first (fp16 cannot hold the factors). Works on any device
    with PyTorch operations, in row chunks of about ``2**23`` elements (the temporary a
    pack adds to the step's memory). ``backend="auto"`` runs one Triton pass instead on
    CUDA (``"torch"``/``"triton"`` force one; the bytes are identical).

    Raises:
        ValueError: ``x`` not 2-D bf16/fp16/fp32 with a width that is a multiple of
            32, or an unknown ``backend``.
    """
    if x.dim() != 2 or x.dtype not in PACKABLE_DTYPES or x.shape[1] % 32:
        # float64 would be rounded twice (narrowed to fp32 first), float8 has no amax
        raise ValueError(
            f"x must be a 2-D bfloat16/float16/float32 tensor whose width is a multiple "
            f"of 32, got {x.dtype} {tuple(x.shape)}"
        )
    if _use_triton(backend, x.device):
        from hyperrec.autoac import _triton

        return MXInt8Blocks(*_triton.pack(x.contiguous()))
    rows, width = x.shape
    blocks = x.view(rows, width // 32, 32)
    lo, hi = torch.aminmax(blocks, dim=-1)  # no |x| copy of the whole tensor
    amax = torch.maximum(-lo.float(), hi.float())
    # aminmax ignores nothing: a NaN anywhere in the block makes lo or hi NaN, and
    # maximum propagates it; +-Inf gives amax = Inf.
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2 amax) = e - 1
    e = torch.where(amax == 0, MXINT8_MIN_EXP, (e - 1).clamp_(min=MXINT8_MIN_EXP))
    bad = ~torch.isfinite(amax)
    scale = torch.where(bad, 255, e + 127).to(torch.uint8)
    # 2**(6 - e) <= 2**126 fits bf16/fp32 (their largest exponent is 127), not fp16.
    work = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    factor = torch.exp2((6 - e).to(torch.float32)).to(work).unsqueeze(-1)
    out = torch.empty(rows, width // 32, 32, dtype=torch.int8, device=x.device)
    # Rows in chunks of about 2**23 elements: the scaled copy is a temporary of the
    # working dtype, and a packed save may be a large activation packed while the
    # forward's other activations are alive.
    step = max(1, (1 << 23) // width)
    for r in range(0, rows, step):
        q = blocks[r : r + step].to(work) * factor[r : r + step]
        # a non-finite block stores zeros (its scale byte alone says NaN)
        q.round_().clamp_(-127.0, 127.0).masked_fill_(bad[r : r + step].unsqueeze(-1), 0.0)
        out[r : r + step] = q
    return MXInt8Blocks(out.view(rows, width), scale)


def dequantize_mxint8(
    blocks: MXInt8Blocks, dtype: torch.dtype, *, backend: str = "auto"
) -> torch.Tensor:
    """The values of :func:`quantize_mxint8`'s blocks in ``dtype`` (exact in bf16/fp32:
    a 7-bit integer times a power of two at least ``2**-126``), shape ``(rows, width)``.
    The result is the only full-size allocation (one Triton pass on CUDA)."""
    data, scale = blocks.data, blocks.scale
    if _use_triton(backend, data.device):
        from hyperrec.autoac import _triton

        return _triton.unpack(data, scale, dtype)
    rows, width = data.shape
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    f = torch.exp2(scale.to(torch.float32) - 133.0)  # 2**(e - 6)
    f = torch.where(scale == 255, torch.full_like(f, float("nan")), f).to(work)
    out = data.view(rows, width // 32, 32).to(work)
    out.mul_(f.unsqueeze(-1))  # in place: the result is the only full-size temporary
    return out.view(rows, width).to(dtype)
