"""Triton kernels (private): the fused MX quantizer and the block-scaled GEMMs."""
