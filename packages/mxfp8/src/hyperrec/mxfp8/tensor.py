"""``MXTensor``: MX elements plus their E8M0 scales (a plain container, not a subclass)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hyperrec.mxfp8 import reference as ref
from hyperrec.mxfp8.formats import ElemFormat

__all__ = ["MXTensor"]


@dataclass(frozen=True)
class MXTensor:
    """A tensor quantized to an MX format along one dim.

    Build one with :func:`hyperrec.mxfp8.to_mx` or :func:`hyperrec.mxfp8.mx_quantize`.

    Attributes:
        data: the elements. FP8 formats: ``fmt.storage_dtype`` with the logical
            ``shape``. MX4: ``uint8`` with two E2M1 codes a byte packed along ``axis``
            (``shape[axis] / 2`` bytes). May be a non-contiguous view: column-wise copies
            are stored with the blocked dim contiguous, the layout GEMMs read.
        scale: ``uint8`` E8M0 bytes, ``shape`` with ``shape[axis]`` replaced by
            ``ceil(shape[axis] / block_size)``; byte ``b`` means ``2**(b - 127)``, 255 NaN.
        fmt: the element format.
        block_size: elements per scale along ``axis``.
        axis: the blocked dim (non-negative).
        shape: logical shape of the quantized tensor.
        orig_dtype: dtype of the tensor that was quantized (the default of
            :meth:`dequantize`).
        scale_fp32: optional ``float32`` copy of ``scale`` (``2**(b - 127)``, NaN for
            255; same shape and strides) that the quantizer writes on the cuBLAS fast
            path (``block_size=128`` E4M3 on Hopper), so the GEMM needs no conversion;
            ``None`` otherwise. Not compared or printed.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: ElemFormat
    block_size: int
    axis: int
    shape: torch.Size
    orig_dtype: torch.dtype
    scale_fp32: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def elem_dtype(self) -> torch.dtype:
        """The element dtype (``torch.float4_e2m1fn_x2`` for MX4 where torch has it)."""
        if self.fmt.packed:
            return getattr(torch, "float4_e2m1fn_x2", torch.uint8)
        return self.fmt.storage_dtype

    @property
    def device(self) -> torch.device:
        """Device of ``data`` and ``scale``."""
        return self.data.device

    def dequantize(
        self, dtype: torch.dtype | None = None, *, backend: str = "auto"
    ) -> torch.Tensor:
        """``decode(data) * 2**(scale - 127)`` with ``shape``, in ``dtype`` (default
        ``orig_dtype``). Blocks with a NaN scale dequantize to NaN.

        ``backend``: ``"auto"`` (one Triton pass on CUDA, see below; the reference
        otherwise), ``"torch"`` or ``"triton"`` (CUDA, or CPU tensors under
        ``TRITON_INTERPRET=1``). The Triton pass serves every format (MX4 since 0.4.3)
        blocked along the last dim with that dim contiguous, into
        float32/bfloat16/float16; other cases (column-wise copies) run the reference
        whatever ``backend`` says. Both give the
        same bits (the product of an FP8 or E2M1 value and a power of two, rounded once), except
        that a GPU may flush products below float32's normal range to zero.

        Raises:
            ValueError: unknown ``backend``, or ``"triton"`` for CPU tensors without the
                interpreter.
        """
        from hyperrec.mxfp8._dispatch import resolve_backend

        out_dtype = dtype or self.orig_dtype
        last = self.data.dim() - 1
        width = self.shape[-1] if self.shape else 0
        stored = (width + 1) // 2 if self.fmt.packed else width
        if (
            resolve_backend(backend, self.data.device) == "triton"
            and self.data.dim() >= 1
            and self.axis == last
            and self.data.shape[-1] == stored
            and out_dtype in (torch.float32, torch.bfloat16, torch.float16)
            and self.data.stride(-1) == 1
        ):
            from hyperrec.mxfp8._triton.dequantize import dequantize_rows

            data = self.data.reshape(-1, stored)
            scale = self.scale.reshape(-1, self.scale.shape[-1])
            fp4 = width if self.fmt.packed else None
            return dequantize_rows(data, scale, self.block_size, out_dtype, fp4).view(self.shape)
        return ref.dequantize(
            self.data,
            self.scale,
            self.fmt,
            self.block_size,
            self.axis,
            self.shape[self.axis],
            out_dtype,
        )

    def t(self) -> MXTensor:
        """Transpose of a 2-D MX tensor (views, no copy); the blocked dim moves with it.

        Raises:
            ValueError: not 2-D.
        """
        if len(self.shape) != 2:
            raise ValueError(f"t() needs a 2-D MXTensor, got shape {tuple(self.shape)}")
        return MXTensor(
            data=self.data.t(),
            scale=self.scale.t(),
            fmt=self.fmt,
            block_size=self.block_size,
            axis=1 - self.axis,
            shape=torch.Size((self.shape[1], self.shape[0])),
            orig_dtype=self.orig_dtype,
            scale_fp32=None if self.scale_fp32 is None else self.scale_fp32.t(),
        )

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={tuple(self.shape)}, fmt={self.fmt.name}, "
            f"block_size={self.block_size}, axis={self.axis}, device={self.device})"
        )
