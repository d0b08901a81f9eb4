"""hyperrec.jagged_attn: attention over jagged (variable-length, unpadded) sequences.

- :func:`jagged_attention`: softmax attention, causal with bottom-right alignment,
  asymmetric query/key lengths, sliding windows.
- :func:`gdpa`: Generalized Dot-Product Attention: element-wise activations (SiLU, GELU,
  an ALU-only polynomial GELU, ...) or softmax, explicit scale placement and
  normalisation, a query-sequence -> kv-sequence map, HSTU target/contextual masks.
- :func:`block_attention`: attention within fixed blocks of each sequence, O(L).
- ``precision="fp8" | "mxfp8"`` (or an :class:`FP8Config`) on all three: an FP8 forward
  with block-quantized Q/K/V (:func:`quantize_qkv`) and P quantized online; see
  :mod:`hyperrec.jagged_attn.fp8`. :func:`linear_quantize_qkv` runs the projection that
  produces Q/K/V with their quantization in its epilogue (``quantized=`` on the attention).

Backends: ``"torch"`` (the pure-PyTorch reference in :mod:`~hyperrec.jagged_attn.reference`);
the Triton kernels of the private ``_triton`` subpackage (``"triton"``; ``"auto"`` on CUDA).
Every function is a ``torch.library`` custom op underneath, so ``torch.compile``
traces it with ``fullgraph=True``.
"""

from hyperrec.jagged_attn._dispatch import BACKENDS
from hyperrec.jagged_attn._version import __version__
from hyperrec.jagged_attn.activations import ACTIVATIONS, gelu_poly
from hyperrec.jagged_attn.fp8 import PRECISIONS, FP8Config, linear_quantize_qkv, quantize_qkv
from hyperrec.jagged_attn.interface import block_attention, gdpa, jagged_attention
from hyperrec.jagged_attn.masks import MaskSpec, mask_matrix
from hyperrec.jagged_attn.spec import NORMALIZATIONS, AttentionSpec

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "NORMALIZATIONS",
    "PRECISIONS",
    "AttentionSpec",
    "FP8Config",
    "MaskSpec",
    "__version__",
    "block_attention",
    "gdpa",
    "gelu_poly",
    "jagged_attention",
    "linear_quantize_qkv",
    "mask_matrix",
    "quantize_qkv",
]
