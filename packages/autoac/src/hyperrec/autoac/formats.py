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

Scales are RCEIL (``amax / max_elem`` rounded up to a power of two, nothing
saturates). The quantizer is ``hyperrec.mxfp8.to_mx`` (Triton on CUDA, the reference
on the CPU); dequantization is ``MXTensor.dequantize`` (one Triton pass for the FP8
formats on CUDA).
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
    "PackedStorage",
    "SaveFormat",
    "can_pack",
    "pack_storage",
    "packed_nbytes",
    "unpack_view",
]

SaveFormat = Literal["mxfp8", "fp8_e4m3", "fp8_e5m2", "mx4"]

#: Every format, from the most to the least precise.
SAVE_FORMATS: tuple[str, ...] = ("mxfp8", "fp8_e4m3", "fp8_e5m2", "mx4")

#: format -> (``to_mx`` element dtype, block size)
_SPEC: dict[str, tuple[torch.dtype | str, int]] = {
    "mxfp8": (torch.float8_e4m3fn, 32),
    "fp8_e4m3": (torch.float8_e4m3fn, 128),
    "fp8_e5m2": (torch.float8_e5m2, 128),
    "mx4": ("e2m1", 32),
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
        mx: the quantized flat run (``hyperrec.mxfp8.MXTensor``).
        numel: elements of the storage.
        dtype: element dtype of the original storage.
        fmt: the :data:`SaveFormat`.
    """

    __slots__ = ("__weakref__", "_flat", "dtype", "fmt", "mx", "numel")

    def __init__(self, mx: MXTensor, numel: int, dtype: torch.dtype, fmt: str) -> None:
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
