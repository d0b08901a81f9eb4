"""Random Hadamard transforms (RHT) for the wgrad operands.

``dW = dY^T X`` reduces over the token dim M. Transforming both operands along M with the
same orthogonal block transform leaves the product unchanged and spreads outliers across
each group, so the MX blocks along M (the column-wise copies) quantize with less error.
We use ``H_n diag(s)`` per group of ``n`` (16 or 32) tokens: Sylvester ``H_n`` with +-1
entries and one fixed random sign vector ``s``. The matrix is left unnormalised (exact in
any precision), so a GEMM over two transformed operands is divided by ``n`` (a power of
two, exact): :func:`hyperrec.mxfp8.mx_mm`'s ``alpha`` does it.
"""

from __future__ import annotations

import functools

import torch

from hyperrec.mxfp8._validate import check_choice
from hyperrec.mxfp8.reference import hadamard_matrix, hadamard_signs

__all__ = ["HADAMARD_SIZES", "block_diag", "check_hadamard", "seeded_block_diag", "signs"]

#: Supported transform sizes (0 disables the transform).
HADAMARD_SIZES = (0, 16, 32)


def check_hadamard(hadamard: int, block_size: int) -> int:
    """Validate a Hadamard size against the MX block size.

    Raises:
        TypeError: not an int.
        ValueError: not in ``HADAMARD_SIZES`` or not dividing ``block_size``.
    """
    check_choice("hadamard", hadamard, HADAMARD_SIZES)
    if hadamard and block_size % hadamard:
        raise ValueError(f"hadamard={hadamard} must divide block_size={block_size}")
    return hadamard


@functools.lru_cache(maxsize=64)
def _signs_cpu(n: int, seed: int) -> torch.Tensor:
    return hadamard_signs(n, seed)


def signs(n: int, seed: int) -> torch.Tensor:
    """The fixed random sign vector (float32 +-1, length ``n``) for ``seed`` (CPU)."""
    return _signs_cpu(n, seed).clone()


@functools.lru_cache(maxsize=64)
def _block_diag_cached(
    sign_key: tuple[float, ...], size: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    n = len(sign_key)
    hs = hadamard_matrix(n) * torch.tensor(sign_key)[None, :]
    return torch.block_diag(*([hs] * (size // n))).to(dtype=dtype, device=device).contiguous()


def block_diag(
    sign_vec: torch.Tensor, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[size, size]`` block-diagonal ``kron(I, H_n diag(s))`` (cached per device/dtype)."""
    key = tuple(float(v) for v in sign_vec.cpu())
    return _block_diag_cached(key, size, dtype, str(device))


@functools.lru_cache(maxsize=64)
def _seeded_block_diag(
    n: int, seed: int, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return block_diag(_signs_cpu(n, seed), size, dtype, device)


def seeded_block_diag(
    n: int, seed: int, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """:func:`block_diag` of the sign vector ``signs(n, seed)``, cached on the ints (no
    per-call work once built; build it outside a CUDA graph capture)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _seeded_block_diag(n, seed, size, dtype, device)
