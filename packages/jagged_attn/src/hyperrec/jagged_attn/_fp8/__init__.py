"""The FP8 / MXFP8 path behind ``precision=`` (private).

``quantize.py`` chooses between the quantization kernel and its reference; ``ops.py``
registers the ``torch.library`` ops of the FP8 forward (Triton kernels, and the
pure-PyTorch emulation of :mod:`hyperrec.jagged_attn.reference_fp8`) with the bf16
backward, and resolves ``precision`` + ``backend`` to one of them.
"""
