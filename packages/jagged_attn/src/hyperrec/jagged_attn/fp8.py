"""FP8 / MXFP8 attention: the ``precision=`` option of the public functions.

``precision="fp8"`` (or an :class:`FP8Config`) runs the forward with FP8 E4M3 operands and
float32 accumulation:

* **Q, K, V block-quantized** before the kernel, in one pass over the three inputs
  (:func:`quantize_qkv`). ``"fp8"``: one scale per block of ``block_q`` (Q) or ``block_kv``
  (K, V) consecutive tokens of one sequence and one head, over the whole head dim (a
  power of two by default, or a float32 scale). ``"mxfp8"``: OCP MX blocks of 32 elements
  with E8M0 scales (RCEIL), along the head dim for Q and K and along the tokens for V
  (what a block-scaled ``P @ V`` reduces over), with the element and scale rules of
  ``hyperrec.mxfp8``. Blocks never cross a sequence boundary, so a non-finite value
  reaches only its own sequence.
* **Hadamard rotation of Q and K** (FlashAttention-3's incoherent processing; on by
  default for power-of-two head dims, ``hadamard=False`` turns it off): both are
  multiplied by the same randomised Walsh-Hadamard matrix ``H diag(signs)`` along the head
  dim before quantization. ``H H^T = D I``, so
  ``Q' K'^T = D Q K^T`` exactly and the kernel divides the scores by ``D``; outliers are
  spread over the head dim, which shrinks the block scales' dynamic range.
* **Key smoothing** (softmax, ``smooth_k=True`` by default): each kv sequence's keys are
  shifted by their mean (:func:`key_shift`) before the rotation and
  quantization. Every score of a query row moves by the same ``q . shift``, which softmax
  cancels exactly; what changes is the quantization error: keys that share a large
  common component (a projection bias) quantize with the range of their own variation
  (SageAttention's smoothing of K). Activations (GDPA) are not shift-invariant and never
  smooth.
* **P quantized online** in the kernel to E4M3 with one power-of-two scale per query row
  and key tile of ``p_block`` keys (32 for ``"mxfp8"``: an MX block along the keys), chosen
  so that the tile's largest weight lands in ``(220, 440]``. Softmax: the scale comes from
  the running row max at no cost (the weights are ``exp2(s - m)``, so the tile max is
  known in the log domain) and is folded into the exponent; GDPA: from the tile's row
  maxima of ``|act(s)|``. Softmax and activations run in float32.

**Backward.** ``FP8Config(backward="bf16")`` (the default) runs the package's bf16
backward on the original inputs (autograd keeps them); for softmax it recomputes the
log-sum-exp and ``delta`` from those inputs (by a bf16 forward where the Gluon backward
serves the call, else in the Triton dQ kernel), never reading the FP8 forward's.
``backward="fp8"`` runs every backward product on FP8 operands with float32 accumulation,
whatever the forward's format:

* Q and K (rotated as in the forward), V and dO are quantized to E4M3 **per token and
  head** (one power-of-two scale per row of the head dim), in one pass. Per-token scales
  factor out of every product of the backward, whichever side they are on.
* The scores and ``dP = dO V^T`` are recomputed from those operands; P (or the activation
  output) and dS are formed in float32, then quantized online per row over groups of
  :data:`GRAD_GROUP` (64) consecutive queries (the operands of ``dV = P^T dO`` and
  ``dK = dS^T Q``, grouped along the queries they reduce over, aligned at the sequence
  start) or keys (of ``dQ = dS K``, aligned at the kv sequence start), after the other
  operand's per-token scale has been folded in. Scales are powers of two.
* dQ and dK of rotated Q and K are rotated back in the kernels' epilogue.

Gradient scales are unbounded (a loss averaged over a large batch gives tiny ``dO``), so
the backward's quantizers scale blocks down to ``amax`` = :data:`GRAD_TINY_AMAX` (2**-118)
instead of the forward's 2**-24. ``bench/fp8_grad_error.py`` measures the gradient error
against float64 and the bf16 backward; choose ``backward="fp8"`` only where that error is
acceptable for your model (an 8-bit backward has cost AUC in recommendation models).

:mod:`hyperrec.jagged_attn.reference_fp8` is the pure-PyTorch specification of every
quantization here (bit-exact against the kernels for Q, K and V; the online P
quantization differs from the kernel's only through the kernel's accumulation order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any, Literal

import torch

from hyperrec.jagged_attn._validate import check_bool, check_choice, check_int

__all__ = [
    "BACKWARDS",
    "FORMATS",
    "GRAD_GROUP",
    "GRAD_TINY_AMAX",
    "PRECISIONS",
    "SCALE_RULES",
    "FP8Config",
    "Precision",
    "QuantizedJagged",
    "QuantizedQKV",
    "PROJECTION_ACTIVATIONS",
    "key_shift",
    "linear_quantize_qkv",
    "mma_column",
    "quantize_qkv",
    "resolve_precision",
]

#: Names accepted by ``precision=`` (an :class:`FP8Config` is accepted too).
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "mxfp8")
#: ``FP8Config.format`` values.
FORMATS: tuple[str, ...] = ("fp8", "mxfp8")
#: ``FP8Config.scale`` values.
SCALE_RULES: tuple[str, ...] = ("pow2", "fp32")
#: ``FP8Config.backward`` values.
BACKWARDS: tuple[str, ...] = ("bf16", "fp8")
#: ``backward="fp8"``: queries (dK, dV) or keys (dQ) per P / dS quantization group.
GRAD_GROUP = 64
#: ``backward="fp8"``: blocks are scaled as if their absolute max were at least this.
GRAD_TINY_AMAX = 2.0**-118
Precision = Literal["bf16", "fp8", "mxfp8"]

#: Largest finite E4M3 value.
E4M3_MAX = 448.0
#: MX block size (OCP).
MX_BLOCK = 32
_POW2_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_KV_BLOCKS = (32, 64, 128, 256)


@dataclass(frozen=True, kw_only=True)
class FP8Config:
    """How ``precision="fp8"`` / ``"mxfp8"`` quantizes (``precision=FP8Config(...)``).

    ``FP8Config()`` is what ``precision="fp8"`` means; ``FP8Config(format="mxfp8")`` what
    ``precision="mxfp8"`` means. The block fields and ``scale`` apply to ``"fp8"`` only
    (``"mxfp8"`` fixes them to 32-element MX blocks with E8M0 scales); leave them ``None``
    there.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an unknown ``format``, ``scale`` or ``backward``, a block size not in its list,
            ``block_kv`` not a multiple of ``p_block``, a ``hadamard_seed`` outside
            ``[0, 2**64)`` (a ``torch.Generator`` seed), or a
            block field or ``scale`` given with ``format="mxfp8"``.
    """

    format: str = "fp8"
    """``"fp8"`` (per-token-block scales) or ``"mxfp8"`` (OCP MX, 32-element blocks)."""
    block_q: int | None = None
    """``"fp8"``: tokens per Q scale block (a power of two in [1, 256]; default 128). Any
    value costs the same in the kernel (Q scales are applied per query row)."""
    block_kv: int | None = None
    """``"fp8"``: tokens per K and V scale block (32, 64, 128 or 256, a multiple of
    ``p_block``; default 128)."""
    p_block: int | None = None
    """``"fp8"``: keys per P scale tile, the kernel's key tile (32, 64 or 128; default
    128). Part of the numerics: the reference uses the same tiles."""
    scale: str | None = None
    """``"fp8"``: ``"pow2"`` (default; scale ``2**ceil(log2(amax / 448))``, exact to apply)
    or ``"fp32"`` (``amax / 448``)."""
    hadamard: bool | None = None
    """Rotate Q and K by the same randomised Hadamard matrix along the head dim. ``None``
    (default): on when the q/k head dim is a power of two; ``True`` requires one."""
    hadamard_seed: int = 0
    """Seed of the Hadamard sign vector."""
    backward: str = "bf16"
    """``"bf16"`` (default: the bf16 backward on the unquantized inputs) or ``"fp8"``
    (FP8 operands in every backward product; see the module doc). Any ``format``."""
    smooth_k: bool = True
    """Softmax only: subtract each sequence's mean key per head (:func:`key_shift`) from
    its keys before quantizing K. Softmax is invariant to it (every score of a row moves by the
    same ``q . shift``), so only the quantization error changes: keys that share a large
    common component (a projection bias, channel outliers shared across tokens) quantize
    with their own variation's range instead of the component's. Activations (GDPA) are
    not shift-invariant and never smooth."""

    def __post_init__(self) -> None:
        check_choice("format", self.format, FORMATS)
        check_choice("backward", self.backward, BACKWARDS)
        if self.hadamard is not None:
            check_bool("hadamard", self.hadamard)
        check_bool("smooth_k", self.smooth_k)
        if check_int("hadamard_seed", self.hadamard_seed, minimum=0) >= 2**64:
            # torch.Generator.manual_seed takes 64 bits: a larger seed used to pass here and
            # fail at the first attention call with "Overflow when unpacking long long"
            raise ValueError(f"hadamard_seed must be < 2**64, got {self.hadamard_seed}")
        fp8 = self.format == "fp8"
        for name in ("block_q", "block_kv", "p_block", "scale"):
            if not fp8 and getattr(self, name) is not None:
                raise ValueError(
                    f"{name} applies to format='fp8' only (mxfp8 uses 32-element MX "
                    f"blocks), got {name}={getattr(self, name)!r}"
                )
        if not fp8:
            return
        if self.block_q is not None:
            check_choice("block_q", check_int("block_q", self.block_q), _POW2_BLOCKS)
        if self.block_kv is not None:
            check_choice("block_kv", check_int("block_kv", self.block_kv), _KV_BLOCKS)
        if self.p_block is not None:
            check_choice("p_block", check_int("p_block", self.p_block), (32, 64, 128))
        if self.scale is not None:
            check_choice("scale", self.scale, SCALE_RULES)
        if self.kv_block % self.tile_n:
            raise ValueError(
                f"block_kv must be a multiple of p_block = {self.tile_n}, got {self.kv_block}"
            )

    # Resolved values (defaults filled in).
    @property
    def mx(self) -> bool:
        """True for ``"mxfp8"``."""
        return self.format == "mxfp8"

    @property
    def q_block(self) -> int:
        """Tokens per Q scale block (1 for MX: the blocks run along the head dim)."""
        return 1 if self.mx else (128 if self.block_q is None else self.block_q)

    @property
    def kv_block(self) -> int:
        """Tokens per K/V scale block (MX: V blocks of 32 tokens; K blocks along D)."""
        return MX_BLOCK if self.mx else (128 if self.block_kv is None else self.block_kv)

    @property
    def tile_n(self) -> int:
        """Keys per P scale tile (= the kernel's key tile)."""
        return MX_BLOCK if self.mx else (128 if self.p_block is None else self.p_block)

    @property
    def scale_rule(self) -> str:
        """``"pow2"`` or ``"fp32"`` (MX scales are E8M0 powers of two)."""
        return "pow2" if self.mx or self.scale is None else self.scale

    def rotates(self, head_dim: int) -> bool:
        """Whether Q and K are rotated for this q/k head dim (``hadamard`` resolved)."""
        if self.hadamard is None:
            return head_dim >= 2 and head_dim & (head_dim - 1) == 0
        return self.hadamard

    @property
    def v_pad(self) -> int:
        """Column padding of each sequence in the transposed V layout."""
        return MX_BLOCK if self.mx else 16

    def encode(self) -> str:
        """A canonical string (the custom ops' argument); :meth:`decode` inverts it."""
        return ";".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def decode(cls, text: str) -> FP8Config:
        """Inverse of :meth:`encode`."""
        pairs = dict(item.split("=", 1) for item in text.split(";"))
        kw: dict[str, Any] = {}
        for f in fields(cls):
            raw = pairs[f.name]
            if raw == "None":
                kw[f.name] = None
            elif f.name in ("format", "scale", "backward"):
                kw[f.name] = raw
            elif f.name in ("hadamard", "smooth_k"):
                kw[f.name] = raw == "True"  # (None handled above)
            else:
                kw[f.name] = int(raw)
        return cls(**kw)

    def check_shapes(self, head_dim: int, head_dim_v: int) -> None:
        """Raise ValueError (naming ``precision``) for head dims this config cannot describe
        (the kernels' own range, 16-256, is checked where the backend is chosen)."""
        del head_dim_v  # any V head dim: V is blocked along the tokens or whole rows
        if self.mx and head_dim % MX_BLOCK:
            raise ValueError(
                f"precision='mxfp8' needs a q/k head_dim that is a multiple of 32 (MX blocks "
                f"along the head dim), got {head_dim}"
            )
        if self.hadamard and head_dim & (head_dim - 1):
            raise ValueError(
                f"precision with hadamard=True needs a power-of-two q/k head_dim, got {head_dim}"
            )


def mxfp8_module() -> ModuleType:
    """``hyperrec.mxfp8`` (the optional dependency of ``precision="mxfp8"``).

    Raises:
        ModuleNotFoundError: hyperrec-mxfp8 is not installed.
    """
    try:
        import hyperrec.mxfp8 as mx
    except ImportError as e:
        raise ModuleNotFoundError(
            "precision='mxfp8' needs the hyperrec-mxfp8 package (its MX formats and scale "
            "rules): pip install 'hyperrec-jagged-attn[fp8]'"
        ) from e
    return mx


def resolve_precision(precision: object) -> FP8Config | None:
    """``None`` for ``"bf16"`` (the inputs' own precision), else the :class:`FP8Config`.

    Raises:
        TypeError: ``precision`` is neither a str nor an :class:`FP8Config`.
        ValueError: an unknown name.
        ModuleNotFoundError: ``"mxfp8"`` without hyperrec-mxfp8 installed.
    """
    if precision == "bf16" and type(precision) is str:  # the default: no checks to run
        return None
    if isinstance(precision, FP8Config):
        config = precision
    elif isinstance(precision, str):
        check_choice("precision", precision, PRECISIONS)
        if precision == "bf16":
            return None
        config = FP8Config(format=precision)
    else:
        raise TypeError(
            f"precision must be one of {PRECISIONS} or an FP8Config, got "
            f"{type(precision).__name__} {precision!r}"
        )
    if config.mx:
        mxfp8_module()
    return config


@dataclass(frozen=True, kw_only=True)
class QuantizedJagged:
    """One jagged tensor in the kernels' FP8 layout.

    ``layout="rows"`` (Q, K): ``data`` is ``(T, H, D)`` ``float8_e4m3fn``; ``scale`` is
    ``(T, H)`` float32 for ``"fp8"`` (each token row holds its block's scale, so kernels
    index scales like the data) or ``(T, H, D // 32)`` uint8 E8M0 for ``"mxfp8"``.

    ``layout="cols"`` (V, transposed so that ``P @ V`` reads it along the reduction dim):
    ``data`` is ``(H, Dv, Tp)`` ``float8_e4m3fn``; token ``j`` of sequence ``b`` is column
    ``pad_offsets[b] + j`` (each sequence starts at a multiple of 16, or 32 for MX;
    columns between sequences are never read). ``scale`` is ``(T, H)`` float32 (``"fp8"``)
    or ``(H, Dv, Tp // 32)`` uint8 (``"mxfp8"``: one E8M0 byte per 32 columns).

    The value of an element is ``float(data) * scale`` (``2**(byte - 127)`` for E8M0);
    when the config rotates, Q and K hold the rotated values.
    """

    data: torch.Tensor
    """The E4M3 elements."""
    scale: torch.Tensor
    """Scales (see the class doc)."""
    layout: str
    """``"rows"`` or ``"cols"``."""
    pad_offsets: torch.Tensor | None = None
    """``"cols"``: ``(B + 1,)`` int32 column offsets of the sequences."""
    mma_order: bool = False
    """``"cols"`` only: within every 16 columns of a sequence, token ``j`` is stored at
    column :func:`mma_column` ``(j)`` instead of ``j``: the order in which the Gluon FP8
    forward's threads hold P's columns after the ``Q K^T`` product, so P becomes the
    ``P V`` operand without moving values between threads."""


def mma_column(pos: torch.Tensor) -> torch.Tensor:
    """Column of token position ``pos`` (int tensor, within its sequence) in the
    ``mma_order`` layout: in each group of 16, token ``8a + 2t + b`` (``a``, ``b`` in
    {0, 1}, ``t`` in 0..3) goes to column ``4t + 2a + b`` (a transpose of the group viewed
    as 2 x 4 x 2)."""
    group, u = pos // 16 * 16, pos % 16
    return group + 4 * ((u >> 1) & 3) + 2 * ((u >> 3) & 1) + (u & 1)


@dataclass(frozen=True, kw_only=True)
class QuantizedQKV:
    """Q, K and V quantized for one attention call (see :func:`quantize_qkv`)."""

    q: QuantizedJagged
    k: QuantizedJagged
    v: QuantizedJagged
    config: FP8Config


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    precision: str | FP8Config = "fp8",
    backend: str = "auto",
    key_shift: torch.Tensor | None = None,
) -> QuantizedQKV:
    """Quantize Q, K and V into the FP8 kernels' layout, in one pass.

    One kernel launch reads each input once (strided views of one projection output, such
    as ``h.split(dim, -1)`` viewed as ``(T, H, D)``, are read in place: only the last dim
    must be contiguous) and writes the E4M3 data and scales of all three; V is written
    transposed. This is what ``precision="fp8"`` runs before the attention kernel.

    Args:
        q: ``(Tq, H, D)`` bf16/fp16/fp32. k: ``(Tk, H, D)``; v: ``(Tk, H, Dv)``.
        q_offsets: ``(Bq + 1,)`` int32/int64 query offsets (valid: not checked here).
        kv_offsets: ``(Bk + 1,)`` key/value offsets; default ``q_offsets``.
        precision: ``"fp8"``, ``"mxfp8"`` or an :class:`FP8Config`.
        backend: ``"auto"`` (the Triton kernel on CUDA GPUs of compute capability >= 8.9,
            or under ``TRITON_INTERPRET=1``; else the reference), ``"torch"`` (the
            reference, :mod:`hyperrec.jagged_attn.reference_fp8`) or ``"triton"``.
        key_shift: ``(Bk, H, D)`` (any float dtype, applied in float32), row ``b``
            subtracted from the keys of kv sequence ``b`` before the rotation and
            quantization (what softmax attention with ``smooth_k`` does, with
            :func:`key_shift`); default none.

    Returns:
        A :class:`QuantizedQKV` (layouts in :class:`QuantizedJagged`).

    Raises:
        TypeError: non-tensor inputs (offsets: not int32/int64 tensors) or a bad
            ``precision`` type.
        ValueError: offsets not 1-D with >= 1 entries or on another device than ``q``,
            unsupported head dims for the config, an unknown ``precision`` or
            ``backend``, or ``backend="triton"`` where the kernel cannot run.
        ModuleNotFoundError: ``"mxfp8"`` without hyperrec-mxfp8.
    """
    from hyperrec.jagged_attn._fp8.quantize import quantize_qkv as _impl
    from hyperrec.jagged_attn._validate import check_index_tensor, check_qkv

    check_qkv(q, k, v)
    for name, offsets in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if offsets is not None:  # types only: the values are trusted (no host sync)
            check_index_tensor(name, offsets, q.device, what="(B + 1 sequence offsets)")
    config = resolve_precision(precision)
    if config is None:
        raise ValueError("precision must be 'fp8', 'mxfp8' or an FP8Config, got 'bf16'")
    config.check_shapes(q.shape[2], v.shape[2])
    check_choice("backend", backend, ("auto", "torch", "triton"))
    kv = q_offsets if kv_offsets is None else kv_offsets
    want = (kv.numel() - 1, *k.shape[1:])
    if key_shift is not None and (
        not isinstance(key_shift, torch.Tensor) or tuple(key_shift.shape) != want
        or not key_shift.is_floating_point() or key_shift.device != k.device
    ):  # fmt: skip
        raise ValueError(f"key_shift must be a float tensor of shape {want} on {k.device}, "
                         f"got {key_shift!r:.80}")  # fmt: skip
    return _impl(q, k, v, q_offsets, q_offsets if kv_offsets is None else kv_offsets, config,
                 backend, key_shift)  # fmt: skip


#: ``activation=`` values of :func:`linear_quantize_qkv`.
PROJECTION_ACTIVATIONS: tuple[str, ...] = ("none", "silu")


def linear_quantize_qkv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    *,
    heads: int,
    chunks: str = "qkv",
    activation: str = "none",
    precision: str | FP8Config = "fp8",
    backend: str = "auto",
    v_mma_order: bool = False,
) -> tuple[torch.Tensor, QuantizedQKV]:
    """The projection that produces Q/K/V, with their FP8 quantization in its epilogue.

    ``y = act(x @ weight^T + bias)``, and the chunks of ``y`` named ``q``, ``k`` and ``v``
    quantized as :func:`quantize_qkv` quantizes them, by one kernel that reads ``x`` once
    and writes ``y`` and the E4M3 operands together (no second pass over Q/K/V). Pass the
    result to the attention as ``quantized=`` with the same ``precision``; the attention
    then skips its own quantization. For an HSTU layer's ``silu(W x)`` split into
    ``u, v, q, k``: ``chunks="uvqk", activation="silu"``.

    Args:
        x: ``(T, K)`` float16/bfloat16/float32: the rows of all sequences.
        weight: ``(N, K)`` (an ``nn.Linear``'s weight), same dtype and device;
            ``N = len(chunks) * heads * D``.
        bias: ``(N,)`` or None.
        offsets: ``(B + 1,)`` int32/int64 sequence offsets of the rows (the attention's
            ``offsets``; self-attention: Q, K and V share them). Values are trusted here
            (no host sync); the attention checks them.
        heads: heads per chunk (>= 1).
        chunks: one letter per chunk of ``weight``'s rows, in order; ``q``, ``k`` and ``v``
            exactly once each, any other letters pass through unquantized (default
            ``"qkv"``).
        activation: ``"none"`` (default) or ``"silu"``, applied to every chunk.
        precision: ``"fp8"`` (default), ``"mxfp8"`` or an :class:`FP8Config`; it must be
            the attention's. Softmax attention with ``smooth_k`` (FP8Config's default)
            cannot take operands quantized here (its key shift needs every key first):
            use ``FP8Config(smooth_k=False)`` there, or GDPA, which never smooths.
        backend: ``"auto"`` (the fused Triton kernel on CUDA GPUs of compute capability
            >= 8.9, else PyTorch's linear followed by the reference quantizer),
            ``"torch"`` or ``"triton"`` (also CPU tensors under ``TRITON_INTERPRET=1``).
        v_mma_order: write V in the Gluon FP8 forward's column order
            (:attr:`QuantizedJagged.mma_order`, ``"fp8"`` only; only that kernel reads it:
            the attention then raises where it would run the Triton FP8 kernel).

    Returns:
        ``(y, qkv)``: ``y`` ``(T, N)`` in ``x.dtype``, differentiable in ``x``, ``weight``
        and ``bias`` (the chunks' ``(T, H, D)`` views are the attention's ``q``/``k``/``v``:
        :func:`~hyperrec.jagged_attn.reference_fp8.projection_chunks`); ``qkv`` a
        :class:`QuantizedQKV` equal bit for bit to :func:`quantize_qkv` of ``y``'s chunks.
        The kernel's ``y`` differs from PyTorch's linear by accumulation order only.

    Raises:
        TypeError: non-tensor inputs, dtypes that are not float16/bfloat16/float32 or
            differ, offsets that are not int32/int64, a non-str ``chunks``/``activation``,
            a non-int ``heads``, a bad ``precision`` type.
        ValueError: wrong ranks or shapes (``weight.shape[1] != x.shape[1]``, ``N`` not a
            multiple of ``len(chunks) * heads``, a bias of another length), tensors on
            several devices, ``chunks`` without exactly one each of ``q``/``k``/``v``, an
            unknown ``activation``/``backend``/``precision``, ``"bf16"``, a head dim the
            config cannot quantize, ``v_mma_order`` with ``"mxfp8"``, or
            ``backend="triton"`` where the kernel cannot run.
    """
    from hyperrec.jagged_attn._fp8.projection import linear_quantize_qkv as _impl
    from hyperrec.jagged_attn._validate import _dense, check_index_tensor

    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    _dense("x", x, dtypes)
    _dense("weight", weight, dtypes)
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got shapes {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight.shape[1] must equal x.shape[1] = {x.shape[1]}, got "
                         f"weight of shape {tuple(weight.shape)}")  # fmt: skip
    if bias is not None:
        _dense("bias", bias, dtypes)
        if bias.dtype != x.dtype or bias.device != x.device:
            raise TypeError(f"bias must have x's dtype and device ({x.dtype}, {x.device}), "
                            f"got {bias.dtype} on {bias.device}")  # fmt: skip
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got "
                             f"{tuple(bias.shape)}")  # fmt: skip
    check_index_tensor("offsets", offsets, x.device, what="(B + 1 sequence offsets)", like="x")
    check_int("heads", heads, minimum=1)
    if not isinstance(chunks, str):
        raise TypeError(f"chunks must be a str, got {type(chunks).__name__}")
    if any(chunks.count(c) != 1 for c in "qkv"):
        raise ValueError(f"chunks must name 'q', 'k' and 'v' exactly once each, got {chunks!r}")
    check_choice("activation", activation, PROJECTION_ACTIVATIONS)
    check_choice("backend", backend, ("auto", "torch", "triton"))
    check_bool("v_mma_order", v_mma_order)
    per = len(chunks) * heads
    if weight.shape[0] % per or weight.shape[0] == 0:
        raise ValueError(f"weight.shape[0] must be a positive multiple of len(chunks) * heads "
                         f"= {per}, got {weight.shape[0]}")  # fmt: skip
    config = resolve_precision(precision)
    if config is None:
        raise ValueError("precision must be 'fp8', 'mxfp8' or an FP8Config, got 'bf16'")
    dim = weight.shape[0] // per
    config.check_shapes(dim, dim)
    if v_mma_order and config.mx:
        raise ValueError("v_mma_order applies to format 'fp8' only, got precision 'mxfp8'")
    return _impl(x, weight, bias, offsets, heads=heads, chunks=chunks, activation=activation,
                 config=config, backend=backend, v_mma_order=v_mma_order)  # fmt: skip


def key_shift(k: torch.Tensor, kv_offsets: torch.Tensor) -> torch.Tensor:
    """The ``smooth_k`` shift of keys ``k`` ``(T, H, D)``: per kv sequence and head, the
    mean of its keys (element-wise over the finite values only), ``(B, H, D)`` bfloat16.

    Per sequence, so a request's numerics never depend on the rest of its batch and a
    NaN/Inf key reaches no other sequence; any constant shift is exact for softmax, and
    the mean removes a common component best (means of samples of the keys, 32 or 256 of
    them, cost up to 1.6 or 1.1 dB with outlier channels; the full mean 0.0-0.1 dB).
    Summed in float64 (exact for bf16/fp16 keys, so the Triton launch and the PyTorch path
    agree bit for bit) and rounded to bfloat16. Empty sequences get zeros. No host sync:
    the offsets' values are checked only for CPU tensors (elsewhere they are trusted, as
    by :func:`quantize_qkv`).

    Raises:
        TypeError: ``k`` not a dense float tensor, ``kv_offsets`` not an int32/int64 tensor.
        ValueError: ``k`` not 3-D, ``kv_offsets`` not 1-D with >= 1 entries or on another
            device; on the CPU, offsets that do not start at 0, decrease, or end elsewhere
            than ``k.shape[0]``.
    """
    from hyperrec.jagged_attn._fp8.quantize import key_shift as _impl
    from hyperrec.jagged_attn._validate import (
        FLOAT_DTYPES,
        _check_offsets,
        _dense,
        _offsets_summary,
        check_index_tensor,
    )

    _dense("k", k, FLOAT_DTYPES)
    if k.dim() != 3:
        raise ValueError(
            f"k must be 3-D (total_tokens, heads, head_dim), got shape {tuple(k.shape)}"
        )
    check_index_tensor("kv_offsets", kv_offsets, k.device, what="(B + 1 sequence offsets)",
                       like="k")  # fmt: skip
    if k.device.type == "cpu":
        values = [int(x) for x in _offsets_summary(kv_offsets)]
        _check_offsets("kv_offsets", values, k.shape[0], "k.shape[0]")
    return _impl(k, kv_offsets)


def hadamard_scale(config: FP8Config, head_dim: int) -> float:
    """Factor the scores of rotated Q, K carry (``D`` when rotated, else 1)."""
    return float(head_dim) if config.rotates(head_dim) else 1.0


#: log2 of the largest P value after scaling (P's tile maximum lands in (220, 440]).
P_LOG2_MAX = math.log2(440.0)
#: Bound on P's power-of-two scale exponent (``|k| <= P_EXP_MAX``).
P_EXP_MAX = 32
