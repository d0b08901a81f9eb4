"""The precision policy: which linears run in MXFP8, and with which recipe."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from hyperrec.mxfp8._dispatch import BACKENDS, Backend
from hyperrec.mxfp8._validate import check_bool, check_choice, check_int
from hyperrec.mxfp8.formats import ScaleMode, check_scale_mode, get_format
from hyperrec.mxfp8.gemm import KERNELS, Kernel
from hyperrec.mxfp8.hadamard import check_hadamard

__all__ = ["PrecisionPolicy"]


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """How :class:`~hyperrec.mxfp8.MXLinear` quantizes, and which layers stay high precision.

    The defaults are the MXFP8 recipe of Mishra et al. (E4M3 everywhere, RCEIL scales,
    32-element blocks), with the first and last linear and layers smaller than
    ``min_features`` kept in the input precision. On Hopper, ``block_size=128`` is the
    fast recipe (see the README's benchmark).

    Raises:
        TypeError: a field of the wrong type (a non-int size or seed, a non-bool flag,
            ``keep`` not a tuple of strings, a dtype that is neither a dtype nor a name).
        ValueError: an unsupported ``block_size``, element format (MX4 is not a training
            format), ``scale_mode``, ``hadamard``, ``kernel`` or ``backend``; a negative
            ``min_features``/``min_tokens``/``hadamard_seed``.
    """

    block_size: int = 32
    """Elements per E8M0 scale. 32 = OCP MX (exact MX GEMMs; native on Blackwell, emulated
    on Hopper at about BF16 speed). 128 = the fast Hopper path (one power-of-two scale
    per 128 along K, DeepSeek-V3-style promotion): coarser than MX, near FP8 speed."""
    elem_dtype: torch.dtype = torch.float8_e4m3fn
    """Elements of activations and weights (E4M3 or E5M2)."""
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    """Elements of output gradients dY (E4M3, or E5M2 for more range)."""
    scale_mode: ScaleMode = "rceil"
    """``"rceil"`` (round the scale up; nothing saturates) or ``"floor"`` (OCP v1.0)."""
    hadamard: int = 0
    """Random Hadamard transform size (0, 16 or 32) on the wgrad operands (the
    column-wise copies of X and dY, along the token dim)."""
    hadamard_seed: int = 0
    """Seed of the transform's fixed random sign vector."""
    stochastic_rounding: bool = False
    """Round dY's elements stochastically (both copies) instead of to nearest-even."""
    wgrad_high_precision: bool = False
    """Run the wgrad GEMM ``dY^T X`` in the input precision (no FP8 there)."""
    keep_first: bool = True
    """:func:`convert` keeps the model's first ``nn.Linear`` in high precision."""
    keep_last: bool = True
    """:func:`convert` keeps the model's last ``nn.Linear`` (often the head) high precision."""
    keep: tuple[str, ...] = ()
    """``fnmatch`` patterns of module names :func:`convert` leaves alone (e.g. ``"*head*"``)."""
    min_features: int = 4096
    """:func:`convert` keeps linears with ``in_features`` or ``out_features`` below this:
    for small layers the casts cost more than the FP8 GEMMs save (measured on an H200 at
    16,384 tokens: 2048-wide layers run 0.16x BF16, a 4096 <-> 16384 MLP 1.04x)."""
    min_tokens: int = 0
    """At run time, inputs with fewer rows (tokens) than this use the high-precision path."""
    kernel: Kernel = "auto"
    """GEMM kernel: ``"auto"``, ``"fixup"`` or ``"dot_scaled"`` (see ``mx_mm``)."""
    backend: Backend = "auto"
    """``"auto"`` (Triton on CUDA, reference on CPU), ``"triton"`` or ``"torch"``."""

    def __post_init__(self) -> None:
        from hyperrec.mxfp8.quantize import _check_block_size

        _check_block_size(self.block_size)
        for name in ("elem_dtype", "grad_dtype"):
            try:
                fmt = get_format(getattr(self, name))
            except (TypeError, ValueError) as e:
                # get_format speaks of "elem_dtype"; name the field the caller set.
                raise type(e)(str(e).replace("elem_dtype", name, 1)) from None
            if fmt.packed:
                raise ValueError(f"{name} must be an FP8 format for training GEMMs, got MX4")
        # Case-insensitive like to_mx's: store the canonical name, which the quantizers
        # compare against ("RCEIL" would otherwise run FLOOR on the Triton path).
        object.__setattr__(self, "scale_mode", check_scale_mode(self.scale_mode))
        check_hadamard(self.hadamard, self.block_size)
        for name in ("stochastic_rounding", "wgrad_high_precision", "keep_first", "keep_last"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.keep, tuple) or not all(isinstance(p, str) for p in self.keep):
            raise TypeError(f"keep must be a tuple of strings, got {self.keep!r}")
        for name in ("min_features", "min_tokens", "hadamard_seed"):
            check_int(name, getattr(self, name), minimum=0)
        check_choice("kernel", self.kernel, KERNELS)
        check_choice("backend", self.backend, BACKENDS)

    def keep_reason(
        self, name: str, module: torch.nn.Linear, *, is_first: bool, is_last: bool
    ) -> str | None:
        """Why ``module`` (called ``name``) stays high precision, or ``None`` to convert it."""
        if self.keep_first and is_first:
            return "first linear"
        if self.keep_last and is_last:
            return "last linear"
        for pattern in self.keep:
            if fnmatch.fnmatchcase(name, pattern):
                return f"matches keep pattern {pattern!r}"
        small = min(module.in_features, module.out_features)
        if small < self.min_features:
            return f"min(in, out) = {small} < min_features = {self.min_features}"
        return None
