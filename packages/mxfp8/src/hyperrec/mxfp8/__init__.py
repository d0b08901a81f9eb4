"""hyperrec.mxfp8: OCP MX formats, fused quantization, FP8 GEMMs and an MXFP8 linear/MLP.

- :func:`to_mx` / :class:`MXTensor`: MXFP8 (E4M3, E5M2) and MX4 (E2M1) with E8M0 scales,
  FLOOR or RCEIL, bit-exact against :mod:`hyperrec.mxfp8.reference`.
- :func:`mx_quantize`: one pass writes row- and column-wise copies (+ activation,
  Hadamard transform, stochastic rounding).
- :func:`mx_mm`: block-scaled FP8 GEMMs (exact MX on Hopper, fast 128-block path,
  ``tl.dot_scaled`` on Blackwell).
- :class:`MXLinear`, :class:`MXMLP`, :class:`PrecisionPolicy`, :func:`convert`.
- :func:`rowwise_linear`: row-wise scaled FP8 forward/dgrad GEMMs whose quantization is
  plain PyTorch, for ``torch.compile``d code (fuses into the producing kernel).
"""

from hyperrec.mxfp8 import reference
from hyperrec.mxfp8._version import __version__
from hyperrec.mxfp8.convert import convert, plan_conversion
from hyperrec.mxfp8.formats import E2M1, E4M3, E5M2, ElemFormat, get_format
from hyperrec.mxfp8.gemm import mx_mm, native_mx_supported
from hyperrec.mxfp8.hadamard import HADAMARD_SIZES
from hyperrec.mxfp8.linear import MXLinear, mx_linear
from hyperrec.mxfp8.mlp import MXMLP
from hyperrec.mxfp8.policy import PrecisionPolicy
from hyperrec.mxfp8.quantize import BLOCK_SIZES, mx_quantize, to_mx
from hyperrec.mxfp8.rowwise import quantize_rows, rowwise_linear, rowwise_linear_reference
from hyperrec.mxfp8.tensor import MXTensor

__all__ = [
    "BLOCK_SIZES",
    "E2M1",
    "E4M3",
    "E5M2",
    "HADAMARD_SIZES",
    "MXLinear",
    "MXMLP",
    "MXTensor",
    "ElemFormat",
    "PrecisionPolicy",
    "__version__",
    "convert",
    "get_format",
    "mx_linear",
    "mx_mm",
    "mx_quantize",
    "native_mx_supported",
    "plan_conversion",
    "quantize_rows",
    "reference",
    "rowwise_linear",
    "rowwise_linear_reference",
    "to_mx",
]
