"""Where Q/K/V quantization runs: the Triton kernel or the reference."""

from __future__ import annotations

import torch

from hyperrec.jagged_attn._triton import interpreting
from hyperrec.jagged_attn._triton._probe import triton_available
from hyperrec.jagged_attn.fp8 import FP8Config, QuantizedQKV

__all__ = ["fp8_kernels_supported", "key_shift", "quantize_qkv", "use_fp8_kernel"]

_FP8_CAPABILITY = (8, 9)  # FP8 tensor cores and E4M3 conversions: Ada, Hopper and later
_CAPABILITY: dict[int, tuple[int, int]] = {}


def fp8_kernels_supported(device: torch.device) -> bool:
    """Whether the FP8 kernels can run on ``device``: Triton and a CUDA GPU of compute
    capability >= 8.9, or a CPU tensor under ``TRITON_INTERPRET=1``."""
    if not triton_available():
        return False
    if interpreting():
        return device.type == "cpu"
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= _FP8_CAPABILITY


def use_fp8_kernel(backend: str, t: torch.Tensor, what: str) -> bool:
    """Whether ``backend`` (``"auto"``, ``"torch"`` or ``"triton"``) runs the FP8 Triton
    kernel on inputs like ``t``: ``"auto"`` only on CUDA GPUs that support it.

    Raises:
        ValueError: ``backend="triton"`` where the kernel cannot run (``what`` names the
            work in the message).
    """
    supported = fp8_kernels_supported(t.device) and t.dtype != torch.float64
    if backend == "triton" and not supported:
        raise ValueError(
            f"backend='triton' cannot {what} here: the FP8 kernels need Triton and a CUDA "
            "GPU of compute capability >= 8.9 (or CPU tensors under TRITON_INTERPRET=1) and "
            f"float16/bfloat16/float32 inputs; got {t.dtype} on {t.device}"
        )
    return backend == "triton" or (backend == "auto" and supported and t.device.type == "cuda")


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    config: FP8Config,
    backend: str,
    key_shift: torch.Tensor | None = None,
) -> QuantizedQKV:
    """The body of :func:`hyperrec.jagged_attn.fp8.quantize_qkv` (arguments checked)."""
    if use_fp8_kernel(backend, q, "quantize"):
        from hyperrec.jagged_attn._triton._fp8_launch import quantize_qkv as kernel

        return kernel(q, k, v, q_offsets, kv_offsets, config, key_shift=key_shift)
    from hyperrec.jagged_attn import reference_fp8

    return reference_fp8.quantize_qkv(q, k, v, q_offsets, kv_offsets, config, key_shift=key_shift)


def key_shift(k: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """The body of :func:`hyperrec.jagged_attn.fp8.key_shift`."""
    total, heads, dim = k.shape
    n_seq = kv_offsets.numel() - 1
    if total == 0 or n_seq <= 0 or heads == 0:
        return torch.zeros((max(n_seq, 0), heads, dim), dtype=torch.bfloat16, device=k.device)
    if fp8_kernels_supported(k.device) and k.dtype != torch.float64:
        from hyperrec.jagged_attn._triton._fp8_launch import key_mean

        return key_mean(k, kv_offsets)
    lengths = (kv_offsets[1:] - kv_offsets[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(n_seq, device=k.device), lengths,
                                  output_size=total)  # fmt: skip
    sums = torch.zeros((n_seq, heads, dim), dtype=torch.float64, device=k.device)
    counts = torch.zeros_like(sums)
    for t0 in range(0, total, 4096):  # bounded float64 temporaries
        x = k[t0 : t0 + 4096].double()
        finite = torch.isfinite(x)
        sums.index_add_(0, seq[t0 : t0 + 4096], torch.where(finite, x, 0.0))
        counts.index_add_(0, seq[t0 : t0 + 4096], finite.double())
    return (sums / counts.clamp(min=1)).to(torch.bfloat16)
