"""Pure-PyTorch specification of the FP8 / MXFP8 attention (``precision="fp8" | "mxfp8"``).

Everything the kernels quantize is defined here, in the order they do it:

1. **Hadamard** (Q and K, when the config rotates): ``x * signs`` then the unnormalised
   Walsh-Hadamard transform along the head dim, as float32 butterflies (pairs ``(i, i + h)``,
   ``h = 1, 2, 4, ...``, ``(a + b, a - b)``). The kernel runs the same butterflies in the
   same order, so the rotated values agree bit for bit.
2. **Key smoothing** (softmax with ``smooth_k``): each kv sequence's keys minus
   :func:`~hyperrec.jagged_attn.fp8.key_shift` (their mean per head, a bf16 vector),
   subtracted in float32 before step 1's rotation (:func:`smoothing_shift`).
3. **Q/K/V quantization**. ``"fp8"``: per block of ``block`` consecutive tokens of one
   sequence and one head (over the head dim), ``amax`` from the float32 values; the scale
   is ``2**e`` with ``e = ceil(log2(fl(amax / 448)))`` (``"pow2"``, the RCEIL rule of MX
   applied to a whole block; computed from ``amax``'s bits, which equals the division
   rule for every ``amax >= 2**-24``) or ``fl(amax / 448)`` (``"fp32"``, applied as
   ``x * fl(448 / amax)``). Blocks with ``amax < 2**-24`` are scaled as if ``amax`` were
   ``2**-24``; an all-zero block gets scale 1; a block holding NaN or Inf gets scale NaN
   and every element the NaN byte ``0x7F``. Elements: ``x / scale`` rounded to E4M3
   (round-to-nearest-even, saturating at 448, signed zeros kept). ``"mxfp8"``:
   :func:`hyperrec.mxfp8.reference.quantize_blocks` (E4M3, 32, RCEIL) along the head dim
   (Q, K) or along the tokens of each sequence (V; each sequence's last block
   zero-padded).
4. **Attention with P quantized per tile.** The keys of each (query sequence, kv sequence)
   pair are cut into tiles of ``n = config.tile_n`` keys from its first key (the kernel's
   key tiles). For query row ``i`` and tile ``j``, with ``s`` the scaled scores of the
   dequantized operands:

   * softmax, in base 2 (``t = log2(e) * s``, masked keys ``-inf``): ``M_j`` = the tile's
     row max, ``m_j = max(M_1..M_j)`` (the running max), ``k_j = min(floor(log2(440) +
     m_j - M_j), 32)``, ``P8_j = e4m3(exp2(t - m_j + k_j))``; the output is
     ``sum_j 2**(m_j - m_J - k_j) P8_j V_j / sum exp2(t - m_J)`` (``J`` the last tile;
     the denominator from the unquantized weights).
   * element-wise activations: ``a = act(s)`` (0 on masked pairs), ``A_j`` = the tile's
     row max of ``|a|``, ``k_j = clamp(floor(log2(440) - log2(A_j)), -32, 32)``,
     ``P8_j = e4m3(a * 2**k_j)``; output ``coef * sum_j 2**-k_j P8_j V_j``.

   The tile's largest weight thus lands in ``(220, 440]``: E4M3's full relative precision
   with headroom for the kernel's ``exp2`` rounding. The kernel computes the scores with
   FP8 (or, for MX, bf16) tensor-core products accumulated in float32, and the
   exponentials in float32; the reference computes everything from the same quantized
   operands in ``dtype`` (float64 by default): the two differ by accumulation order and
   rounding, which can move a value across an E4M3 rounding boundary or a scale's
   ``floor``.

Also here: :func:`naive_attention_forward`, the baseline a plain FP8 attention gives
(per-tensor scales for Q, K, V; P cast to E4M3 without a scale), and
:func:`error_metrics` (relative L1, RMSE, cosine similarity, SNR).

Inputs are assumed valid (the public functions validate them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from hyperrec.jagged_attn.activations import activation, activation_derivative
from hyperrec.jagged_attn.fp8 import (
    E4M3_MAX,
    GRAD_GROUP,
    GRAD_TINY_AMAX,
    MX_BLOCK,
    P_EXP_MAX,
    P_LOG2_MAX,
    FP8Config,
    QuantizedJagged,
    QuantizedQKV,
    hadamard_scale,
    mma_column,
    mxfp8_module,
)
from hyperrec.jagged_attn.masks import allowed
from hyperrec.jagged_attn.spec import AttentionSpec

__all__ = [
    "NAN_BYTE",
    "TINY_AMAX",
    "attention_backward",
    "attention_forward",
    "cols_width",
    "dequantize",
    "error_metrics",
    "fp8_block_scales",
    "fwht",
    "group_quantize",
    "hadamard_signs",
    "linear_quantize_qkv",
    "naive_attention_forward",
    "pad_offsets",
    "projection_chunks",
    "quantize_cols",
    "quantize_qkv",
    "quantize_rows",
    "quantize_tokens",
    "round_e4m3",
    "smoothing_shift",
]

#: E4M3 byte written for every element of a block that holds NaN or Inf.
NAN_BYTE = 0x7F
#: Blocks are scaled as if their absolute max were at least this.
TINY_AMAX = 2.0**-24
_LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------- Hadamard
def hadamard_signs(n: int, seed: int) -> torch.Tensor:
    """The fixed random sign vector (float32 +-1, length ``n``, CPU) of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform along the last dim (a power of two), as
    float32 butterflies in the kernels' order: ``fwht(x) = x @ H`` with Sylvester's ``H``
    (entries +-1, ``H H^T = n I``)."""
    x = x.float()
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, n)
        h *= 2
    return x


# --------------------------------------------------------------------------- scales
def _pow2(e: torch.Tensor) -> torch.Tensor:
    # 2**e for integer e in [-126, 127], from the exponent field (exact).
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    # |x|'s float32 bits as int32: integer order is |x| order, NaN above Inf above all.
    return x.float().contiguous().view(torch.int32) & 0x7FFFFFFF


def fp8_block_scales(
    amax_bits: torch.Tensor, rule: str, tiny: float = TINY_AMAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inv)`` float32 of blocks whose ``|x|`` max has float32 bits ``amax_bits``,
    scaled as if that max were at least ``tiny`` (:data:`TINY_AMAX` for the forward's
    operands, :data:`~hyperrec.jagged_attn.fp8.GRAD_TINY_AMAX` for the FP8 backward's).

    ``"pow2"``: ``e = ceil(log2(fl(amax / 448)))`` read from the bits of ``amax`` (for a
    normal ``amax = m * 2**E`` the quotient rounds above ``2**(E - 8)`` exactly when
    ``m > 1.75``, i.e. mantissa bits above ``0x600000``); ``scale = 2**e``,
    ``inv = 2**-e``. ``"fp32"``: ``scale = fl(amax / 448)``, ``inv = fl(448 / amax)``.
    See the module doc for tiny, zero and non-finite blocks.
    """
    bits = amax_bits.to(torch.int32)
    bad = bits >= 0x7F800000
    zero = bits == 0
    a = bits.contiguous().view(torch.float32).clamp(min=tiny)
    if rule == "pow2":
        ab = a.view(torch.int32)
        e = ((ab >> 23) & 0xFF) - 135 + ((ab & 0x7FFFFF) > 0x600000).to(torch.int32)
        scale, inv = _pow2(e), _pow2(-e)
    elif rule == "fp32":
        # tensor / tensor: PyTorch may turn a division by (or of) a Python scalar into a
        # multiplication by a reciprocal, which rounds twice.
        full = torch.full_like(a, E4M3_MAX)
        scale, inv = a / full, full / a
    else:
        raise ValueError(f"rule must be 'pow2' or 'fp32', got {rule!r}")
    one = torch.ones_like(scale)
    scale, inv = torch.where(zero, one, scale), torch.where(zero, one, inv)
    nan = torch.full_like(scale, float("nan"))
    return torch.where(bad, nan, scale), torch.where(bad, nan, inv)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E4M3 (via float32; nearest-even, saturating at +-448), in
    ``x.dtype``."""
    y = x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return y.to(x.dtype)


def _e4m3(y: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    codes = y.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(bad, NAN_BYTE, codes).view(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- layout
def _positions(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position within it) of each of ``total`` token rows."""
    offsets = offsets.long()
    rows = torch.arange(total, device=offsets.device)
    seq = torch.searchsorted(offsets[1:].contiguous(), rows, right=True)
    return seq, rows - offsets[seq]


def pad_offsets(offsets: torch.Tensor, pad: int) -> torch.Tensor:
    """``(B + 1,)`` int32 column offsets of the sequences in the transposed V layout:
    each sequence's length rounded up to a multiple of ``pad``."""
    lengths = (offsets[1:] - offsets[:-1]).long()
    padded = (lengths + pad - 1) // pad * pad
    out = torch.zeros(offsets.numel(), dtype=torch.int32, device=offsets.device)
    out[1:] = torch.cumsum(padded, 0).to(torch.int32)
    return out


def cols_width(total: int, n_seq: int, pad: int) -> int:
    """Columns of the transposed V buffer: an upper bound on the padded offsets from
    shapes alone (``T + (pad - 1) * B``), rounded up to a multiple of ``pad``."""
    return -(-(total + (pad - 1) * n_seq) // pad) * pad


# --------------------------------------------------------------------------- quantizers
def _rotate(
    x: torch.Tensor,
    config: FP8Config,
    shift: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    # ``shift`` (B, H, D): row b subtracted from sequence b of ``offsets`` (float32)
    xf = x.float()
    if shift is not None:
        assert offsets is not None, "a per-sequence shift needs the offsets"
        seq, _ = _positions(offsets, x.shape[0])
        xf = xf - shift.float()[seq]
    if config.rotates(x.shape[-1]):
        signs = hadamard_signs(x.shape[-1], config.hadamard_seed).to(x.device)
        xf = fwht(xf * signs)
    return xf


def _fp8_rows(
    xf: torch.Tensor, offsets: torch.Tensor, block: int, rule: str, tiny: float = TINY_AMAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-block quantization of float32 ``(T, H, D)``: ``(data, per-row scale)``."""
    total, heads = xf.shape[:2]
    seq, pos = _positions(offsets, total)
    lengths = (offsets[1:] - offsets[:-1]).long()
    n_blocks = (lengths + block - 1) // block
    first = torch.cumsum(n_blocks, 0) - n_blocks
    blk = first[seq] + pos // block
    row_bits = _abs_bits(xf).amax(-1)
    table = torch.zeros(int(n_blocks.sum()), heads, dtype=torch.int32, device=xf.device)
    table = table.scatter_reduce(0, blk[:, None].expand(-1, heads), row_bits, "amax")
    bits = table[blk]
    scale, inv = fp8_block_scales(bits, rule, tiny)
    data = _e4m3(xf * inv[..., None], (bits >= 0x7F800000)[..., None])
    return data, scale


def quantize_rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    config: FP8Config,
    *,
    role: str,
    shift: torch.Tensor | None = None,
) -> QuantizedJagged:
    """Q (``role="q"``) or K (``"k"``) in the ``"rows"`` layout of
    :class:`~hyperrec.jagged_attn.fp8.QuantizedJagged` (``shift`` ``(B, H, D)``: row ``b``
    subtracted from sequence ``b`` in float32; then Hadamard applied if configured)."""
    xf = _rotate(x, config, shift, offsets)
    total, heads, dim = xf.shape
    if config.mx:
        mx = mxfp8_module()
        codes, scale = mx.reference.quantize_blocks(xf.reshape(-1, dim), mx.E4M3, MX_BLOCK,
                                                    "rceil")  # fmt: skip
        data = codes.view(torch.float8_e4m3fn).reshape(total, heads, dim)
        scale = scale.reshape(total, heads, dim // MX_BLOCK)  # (not -1: T may be 0)
        return QuantizedJagged(data=data, scale=scale, layout="rows")
    block = config.q_block if role == "q" else config.kv_block
    data, scale = _fp8_rows(xf, offsets, block, config.scale_rule)
    return QuantizedJagged(data=data, scale=scale, layout="rows")


def quantize_cols(v: torch.Tensor, offsets: torch.Tensor, config: FP8Config) -> QuantizedJagged:
    """V in the transposed ``"cols"`` layout (no Hadamard). Columns between sequences are
    zero here; the kernel leaves them unwritten (nothing reads them)."""
    total, heads, dim = v.shape
    n_seq = offsets.numel() - 1
    pad = config.v_pad
    poff = pad_offsets(offsets, pad)
    width = cols_width(total, n_seq, pad)
    seq, pos = _positions(offsets, total)
    col = poff.long()[seq] + pos
    vf = v.float()
    if config.mx:
        mx = mxfp8_module()
        xp = torch.zeros(heads, dim, width, device=v.device)
        xp[:, :, col] = vf.permute(1, 2, 0)
        codes, scale = mx.reference.quantize_blocks(xp.reshape(heads * dim, width), mx.E4M3,
                                                    MX_BLOCK, "rceil")  # fmt: skip
        data = codes.view(torch.float8_e4m3fn).reshape(heads, dim, width)
        scale = scale.reshape(heads, dim, width // MX_BLOCK)
        return QuantizedJagged(data=data, scale=scale, layout="cols", pad_offsets=poff)
    rows, scale = _fp8_rows(vf, offsets, config.kv_block, config.scale_rule)
    data = torch.zeros(heads, dim, width, dtype=torch.uint8, device=v.device)
    data[:, :, col] = rows.view(torch.uint8).permute(1, 2, 0)
    return QuantizedJagged(data=data.view(torch.float8_e4m3fn), scale=scale, layout="cols",
                           pad_offsets=poff)  # fmt: skip


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    config: FP8Config,
    *,
    key_shift: torch.Tensor | None = None,
) -> QuantizedQKV:
    """Reference of :func:`hyperrec.jagged_attn.fp8.quantize_qkv`."""
    return QuantizedQKV(
        q=quantize_rows(q, q_offsets, config, role="q"),
        k=quantize_rows(k, kv_offsets, config, role="k", shift=key_shift),
        v=quantize_cols(v, kv_offsets, config),
        config=config,
    )


def projection_chunks(y: torch.Tensor, heads: int, chunks: str) -> dict[str, torch.Tensor]:
    """The ``(T, H, D)`` views of the chunks of a projection output ``y`` ``(T, N)``
    (``N = len(chunks) * H * D``), by their letter in ``chunks``."""
    total, width = y.shape
    dim = width // (len(chunks) * heads)
    return {
        name: y[:, i * heads * dim : (i + 1) * heads * dim].unflatten(1, (heads, dim))
        for i, name in enumerate(chunks)
    }


def linear_quantize_qkv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    config: FP8Config,
    *,
    heads: int,
    chunks: str,
    activation: str,
) -> tuple[torch.Tensor, QuantizedQKV]:
    """Reference of :func:`hyperrec.jagged_attn.fp8.linear_quantize_qkv`: ``y`` from a
    float32 product (``act(x @ W^T + b)``, SiLU as ``z * sigmoid(z)``) rounded to
    ``x.dtype``, and :func:`quantize_qkv` of its ``q``/``k``/``v`` chunks (no key shift).
    The kernel's ``y`` differs from this one by its accumulation order only; its quantized
    operands equal :func:`quantize_qkv` of its own ``y`` bit for bit."""
    z = x.float() @ weight.float().T
    if bias is not None:
        z = z + bias.float()
    if activation == "silu":
        z = z * torch.sigmoid(z)
    y = z.to(x.dtype)
    parts = projection_chunks(y, heads, chunks)
    qkv = quantize_qkv(parts["q"], parts["k"], parts["v"], offsets, offsets, config)
    return y, qkv


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    return mxfp8_module().reference.e8m0_to_fp32(scale)


def dequantize(
    t: QuantizedJagged,
    config: FP8Config,
    offsets: torch.Tensor,
    total: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(T, H, D)`` values of a quantized tensor (rotated values for Q/K with Hadamard).

    Raises:
        ValueError: a ``"cols"`` tensor without ``pad_offsets``.
    """
    if t.layout == "rows":
        vals = t.data.float()
        if config.mx:
            s = _e8m0(t.scale).repeat_interleave(MX_BLOCK, -1)[..., : vals.shape[-1]]
        else:
            s = t.scale[..., None]
        return (vals * s).to(dtype)
    if t.pad_offsets is None:
        raise ValueError("t.pad_offsets must be given for layout='cols', got None")
    seq, pos = _positions(offsets, total)
    col = t.pad_offsets.long()[seq] + (mma_column(pos) if t.mma_order else pos)
    vals = t.data.float()[:, :, col].permute(2, 0, 1)  # (T, H, Dv)
    if config.mx:
        s = _e8m0(t.scale)[:, :, col // MX_BLOCK].permute(2, 0, 1)
    else:
        s = t.scale[..., None]
    return (vals * s).to(dtype)


# --------------------------------------------------------------------------- attention
def _coef(spec: AttentionSpec, lk: int) -> float:
    coef = spec.output_scale
    if spec.normalization == "max_seqlen":
        coef /= max(spec.max_seqlen_kv, 1)
    elif spec.normalization == "length":
        coef /= max(lk, 1)
    return coef


def _softmax_tiles(
    s: torch.Tensor, ok: torch.Tensor, v: torch.Tensor, n: int, quantize_p: bool = True
) -> torch.Tensor:
    """Softmax attention with P quantized per (row, tile of ``n`` keys); ``s`` is
    ``(H, R, Lk_pad)``, ``ok`` ``(R, Lk_pad)``, ``v`` ``(H, Lk_pad, Dv)``."""
    h, r, lk = s.shape
    t = torch.where(ok, s * _LOG2E, float("-inf")).reshape(h, r, lk // n, n)
    tile_max = t.amax(-1)
    has = tile_max > float("-inf")
    m = torch.cummax(tile_max, -1).values
    m = torch.where(m > float("-inf"), m, 0.0)
    k = torch.floor(P_LOG2_MAX + m - tile_max).clamp(max=P_EXP_MAX)
    k = torch.where(has, k, 0.0)
    p8 = torch.exp2(t - (m - k)[..., None])
    p8 = round_e4m3(p8) if quantize_p else p8
    m_last = m[..., -1:]
    w = torch.where(has, torch.exp2(m - m_last - k), 0.0)
    num = torch.matmul((p8 * w[..., None]).reshape(h, r, lk), v)
    denom = torch.exp2(t - m_last[..., None]).sum((-1, -2))
    # 0 for a row without keys; a NaN denominator (NaN/Inf in the row's Q or keys: its
    # tiles count as empty above) must give NaN, not that 0
    has_keys = (denom > 0) | denom.isnan()
    safe = torch.where(has_keys, denom, 1.0)[..., None]
    return torch.where(has_keys[..., None], num / safe, 0.0)


def _activation_tiles(
    s: torch.Tensor, ok: torch.Tensor, v: torch.Tensor, n: int, name: str, quantize_p: bool = True
) -> torch.Tensor:
    """Element-wise activation with P quantized per (row, tile of ``n`` keys)."""
    h, r, lk = s.shape
    a = torch.where(ok, activation(name, s), 0.0).reshape(h, r, lk // n, n)
    amax = a.abs().amax(-1)
    k = torch.floor(P_LOG2_MAX - torch.log2(amax)).clamp(-P_EXP_MAX, P_EXP_MAX)
    k = torch.where(amax > 0, k, 0.0)
    p8 = a * torch.exp2(k)[..., None]
    p8 = round_e4m3(p8) if quantize_p else p8
    return torch.matmul((p8 * torch.exp2(-k)[..., None]).reshape(h, r, lk), v)


def _pairs(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Per query sequence ``b``: ``(b, q start, q end, kv start, kv end, targets)``."""
    qo, ko = q_offsets.long().tolist(), kv_offsets.long().tolist()
    kvi = None if kv_index is None else kv_index.long().tolist()
    nt = None if num_targets is None else num_targets.long().tolist()
    for b in range(len(qo) - 1):
        kb = b if kvi is None else kvi[b]
        yield b, qo[b], qo[b + 1], ko[kb], ko[kb + 1], 0 if nt is None else nt[b]


#: ``weights_fn(scores, allowed, values) -> (H, R, Dv)`` (see :func:`_pair_loop`)
_WeightsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _pair_loop(
    qd: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    n: int,
    weights_fn: _WeightsFn,
    chunk_elements: int,
) -> torch.Tensor:
    """Shared driver: for each pair, rows in chunks, keys padded to a multiple of ``n``;
    ``weights_fn(s, ok, v) -> (H, R, Dv)`` un-normalised by ``coef``."""
    heads = qd.shape[1]
    out = qd.new_zeros(qd.shape[0], heads, vd.shape[2])
    for _, qs, qe, ks, ke, nt in _pairs(q_offsets, kv_offsets, kv_index, num_targets):
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        lk_pad = -(-lk // n) * n
        kb = torch.nn.functional.pad(kd[ks:ke], (0, 0, 0, 0, 0, lk_pad - lk)).transpose(0, 1)
        vb = torch.nn.functional.pad(vd[ks:ke], (0, 0, 0, 0, 0, lk_pad - lk)).transpose(0, 1)
        j = torch.arange(lk_pad, device=qd.device)
        rows = max(1, chunk_elements // (heads * lk_pad))
        for r0 in range(0, lq, rows):
            i = torch.arange(r0, min(r0 + rows, lq), device=qd.device)
            ok = allowed(i[:, None], j[None, :], torch.tensor(lq), torch.tensor(lk),
                         None if nt == 0 else torch.tensor(nt), spec.mask)  # fmt: skip
            qb = qd[qs + r0 : qs + r0 + i.numel()].transpose(0, 1)
            s = torch.matmul(qb, kb.transpose(-1, -2)) * spec.scale
            o = weights_fn(s, ok, vb) * _coef(spec, lk)
            out[qs + r0 : qs + r0 + i.numel()] = o.transpose(0, 1)
    return out


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
    config: FP8Config,
    *,
    kv_index: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    qkv: QuantizedQKV | None = None,
    dtype: torch.dtype = torch.float64,
    chunk_elements: int = 1 << 24,
    operands: str = "qkvp",
) -> torch.Tensor:
    """The FP8 attention of the module doc: ``(Tq, H, Dv)`` in ``q.dtype``.

    Args:
        q, k, v, q_offsets, kv_offsets, spec, kv_index, num_targets: as in
            :func:`hyperrec.jagged_attn.reference.attention_forward`.
        config: the quantization.
        qkv: already quantized operands (else quantized here with :func:`quantize_qkv`,
            K shifted by :func:`smoothing_shift`).
        dtype: what the dequantized operands, scores and weights are computed in.
        chunk_elements: bound on one ``(H, rows, keys)`` score chunk.
        operands: which of ``q``, ``k``, ``v`` and ``p`` are quantized (the others keep
            their input values; Q and K are still rotated): for attributing the error.
    """
    shift = smoothing_shift(k, kv_offsets, spec, config)
    if qkv is None:
        qkv = quantize_qkv(q, k, v, q_offsets, kv_offsets, config, key_shift=shift)
    rotated = (_rotate(q, config), _rotate(k, config, shift, kv_offsets))
    qd = dequantize(qkv.q, config, q_offsets, q.shape[0], dtype) if "q" in operands else None
    kd = dequantize(qkv.k, config, kv_offsets, k.shape[0], dtype) if "k" in operands else None
    vd = dequantize(qkv.v, config, kv_offsets, v.shape[0], dtype) if "v" in operands else None
    qd = rotated[0].to(dtype) if qd is None else qd
    kd = rotated[1].to(dtype) if kd is None else kd
    vd = v.to(dtype) if vd is None else vd
    quantize_p = "p" in operands
    spec_q = _rescaled(spec, 1.0 / hadamard_scale(config, q.shape[2]))
    n = config.tile_n
    if spec.activation == "softmax":
        fn = lambda s, ok, vb: _softmax_tiles(s, ok, vb, n, quantize_p)  # noqa: E731
    else:
        fn = lambda s, ok, vb: _activation_tiles(s, ok, vb, n, spec.activation, quantize_p)  # noqa: E731
    out = _pair_loop(qd, kd, vd, q_offsets, kv_offsets, spec_q, kv_index, num_targets, n, fn,
                     chunk_elements)  # fmt: skip
    return out.to(q.dtype)


def smoothing_shift(
    k: torch.Tensor, kv_offsets: torch.Tensor, spec: AttentionSpec, config: FP8Config
) -> torch.Tensor | None:
    """The per-sequence shift subtracted from the keys before quantization:
    :func:`~hyperrec.jagged_attn.fp8.key_shift` for softmax with ``config.smooth_k``, else
    None (activations are not shift-invariant)."""
    if spec.activation != "softmax" or not config.smooth_k:
        return None
    # the attention entry points validated k and the offsets already
    from hyperrec.jagged_attn._fp8.quantize import key_shift as _key_shift

    return _key_shift(k, kv_offsets)


# --------------------------------------------------------------------------- backward
def quantize_tokens(
    x: torch.Tensor,
    config: FP8Config,
    *,
    rotate: bool,
    shift: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> QuantizedJagged:
    """``backward="fp8"``'s operand quantization: E4M3 with one power-of-two scale per token
    and head (``"rows"`` layout, scale ``(T, H)`` float32), blocks scaled as if their
    ``amax`` were at least :data:`~hyperrec.jagged_attn.fp8.GRAD_TINY_AMAX`; ``rotate``
    applies the config's Hadamard rotation first (Q and K), after subtracting ``shift``
    ``(B, H, D)`` per sequence of ``offsets`` (K with ``smooth_k``)."""
    xf = _rotate(x, config if rotate else _NO_ROTATION, shift, offsets)
    data, scale = _fp8_rows(xf, _per_token_offsets(xf.shape[0], x.device), 1, "pow2",
                            GRAD_TINY_AMAX)  # fmt: skip
    return QuantizedJagged(data=data, scale=scale, layout="rows")


_NO_ROTATION = FP8Config(hadamard=False)


def _per_token_offsets(total: int, device: torch.device) -> torch.Tensor:
    # One "sequence" over all rows: with blocks of one token, sequences do not matter.
    return torch.tensor([0, total], device=device)


def group_quantize(x: torch.Tensor, group: int = GRAD_GROUP) -> torch.Tensor:
    """Dequantized values of ``x`` (``(..., R, L)``) quantized to E4M3 per row over groups
    of ``group`` consecutive columns from column 0 (the last group zero-padded): the values
    are rounded to float32 (what the kernel forms them in), scaled by a power of two per
    (row, group) with the :func:`fp8_block_scales` ``"pow2"`` rule and
    :data:`~hyperrec.jagged_attn.fp8.GRAD_TINY_AMAX`. Returned in ``x.dtype``."""
    *lead, rows, cols = x.shape
    padded = -(-cols // group) * group
    xf = torch.nn.functional.pad(x.float(), (0, padded - cols))
    xf = xf.reshape(*lead, rows, padded // group, group)
    bits = _abs_bits(xf).amax(-1)
    scale, inv = fp8_block_scales(bits, "pow2", GRAD_TINY_AMAX)
    codes = _e4m3(xf * inv[..., None], (bits >= 0x7F800000)[..., None])
    out = codes.to(x.dtype) * scale[..., None].to(x.dtype)
    return out.reshape(*lead, rows, padded)[..., :cols]


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
    config: FP8Config,
    *,
    kv_index: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    quantize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 backward (``FP8Config(backward="fp8")``): ``(dq, dk, dv)`` in the inputs'
    dtypes.

    The steps the kernels take, computed in ``dtype`` from the same quantized values:

    1. Q, K (rotated when the config rotates), V and ``grad_out`` quantized per token
       (:func:`quantize_tokens`); ``sq``, ``sk``, ``sv``, ``sdo`` their scales.
    2. Per (query sequence, kv sequence) pair: scores ``s = scale / D * Q8 K8^T`` (``D``
       the Hadamard factor) and ``dP = dO8 V8^T`` of the dequantized operands. Softmax:
       ``P = exp(s - lse)`` over the allowed keys and ``dS = P * (c dP - delta)``, with
       ``lse`` and ``delta = c * rowsum(P * dP)`` both of *these* scores and ``dP`` (not
       the forward's output and log-sum-exp, which come from other scores: only
       statistics that agree with ``P`` keep ``rowsum(dS) = 0``, without which dQ picks
       up an error along the attention-weighted key); activations: ``P = act(s)``,
       ``dS = dP * act'(s)``, both 0 on masked pairs. ``c`` is the output coefficient.
    3. ``dV = c * sum_g G(P^T sdo) @ dO8``, ``dK = m * sum_g G(dS^T sq) @ Q8`` (``G``:
       :func:`group_quantize` of the rows of the (keys x queries) matrix over groups of
       queries; ``X sdo`` scales column ``i`` by ``sdo[i]``), ``dQ = m * G(dS sk) @ K8``
       (groups of keys), with ``m = scale / D`` (softmax) or ``c * scale / D``; operands
       in codes (``Q8`` etc. without their scales, which were folded into ``G``'s input).
    4. With rotation, ``dQ = fwht(dQ) * signs`` and the same for ``dK`` (the transpose of
       the forward's rotation).

    Args:
        q, k, v, q_offsets, kv_offsets, spec, kv_index, num_targets: as in
            :func:`attention_forward`.
        grad_out: ``(Tq, H, Dv)``, the gradient of the output.
        config: the quantization (its ``format`` does not matter here).
        quantize: False runs steps 2-4 without quantizing anything (operands, P and dS
            keep their values): the exact gradient, computed the FP8 way (rotated
            operands, float32 rotation back), for checking the steps themselves.
    """
    rotate = config.rotates(q.shape[2])
    d = hadamard_scale(config, q.shape[2])

    shift = smoothing_shift(k, kv_offsets, spec, config)

    def operand(
        x: torch.Tensor, rot: bool, sh: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not quantize:
            xf = _rotate(x, config if rot else _NO_ROTATION, sh, kv_offsets).to(dtype)
            return xf, torch.ones(x.shape[:2], dtype=dtype, device=x.device)
        t = quantize_tokens(x, config, rotate=rot, shift=sh, offsets=kv_offsets)
        return t.data.to(dtype), t.scale.to(dtype)

    (qc, sq), (kc, sk), (vc, sv), (oc, so) = (
        operand(q, rotate), operand(k, rotate, shift), operand(v, False),
        operand(grad_out, False),
    )  # fmt: skip
    gq = group_quantize if quantize else (lambda x: x)
    scale = spec.scale / d
    softmax = spec.activation == "softmax"
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    for _, qs, qe, ks, ke, nt in _pairs(q_offsets, kv_offsets, kv_index, num_targets):
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        c = _coef(spec, lk)
        i = torch.arange(lq, device=q.device)
        j = torch.arange(lk, device=q.device)
        ok = allowed(i[:, None], j[None, :], torch.tensor(lq), torch.tensor(lk),
                     None if nt == 0 else torch.tensor(nt), spec.mask)  # fmt: skip

        def heads_first(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            return x[lo:hi].transpose(0, 1)  # (H, L, D) or (H, L)

        qh, kh, vh, oh = (heads_first(qc, qs, qe), heads_first(kc, ks, ke),
                          heads_first(vc, ks, ke), heads_first(oc, qs, qe))  # fmt: skip
        sqh, skh, svh, soh = (heads_first(sq, qs, qe), heads_first(sk, ks, ke),
                              heads_first(sv, ks, ke), heads_first(so, qs, qe))  # fmt: skip
        s = (qh @ kh.transpose(-1, -2)) * (sqh[..., :, None] * skh[..., None, :]) * scale
        dp = (oh @ vh.transpose(-1, -2)) * (soh[..., :, None] * svh[..., None, :])
        if softmax:
            t = torch.where(ok, s, float("-inf"))
            lse = torch.logsumexp(t, -1, keepdim=True)
            # (a row without keys has lse = -inf: shift by 0; a NaN lse stays NaN)
            p = torch.where(ok, torch.exp(t - torch.where(lse == float("-inf"), 0.0, lse)), 0.0)
            # (a NaN dP on a masked pair must not reach the row: where, not a product)
            delta = c * torch.where(p > 0, p * dp, 0.0).sum(-1, keepdim=True)
            ds = p * (dp * c - delta)
            m = scale
        else:
            p = torch.where(ok, activation(spec.activation, s), 0.0)
            ds = torch.where(ok, dp * activation_derivative(spec.activation, s), 0.0)
            m = scale * c
        x = gq(p.transpose(-1, -2) * soh[..., None, :])  # (H, Lk, Lq), groups of queries
        y = gq(ds.transpose(-1, -2) * sqh[..., None, :])
        z = gq(ds * skh[..., None, :])  # (H, Lq, Lk), groups of keys
        dv[ks:ke] += (c * (x @ oh)).transpose(0, 1)
        dk[ks:ke] += (m * (y @ qh)).transpose(0, 1)
        dq[qs:qe] += (m * (z @ kh)).transpose(0, 1)
    if rotate:
        signs = hadamard_signs(q.shape[2], config.hadamard_seed).to(q.device)
        dq = (fwht(dq) * signs).to(dtype)
        dk = (fwht(dk) * signs).to(dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _rescaled(spec: AttentionSpec, factor: float) -> AttentionSpec:
    from dataclasses import replace

    return replace(spec, scale=spec.scale * factor) if factor != 1.0 else spec


def _per_tensor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized per-tensor E4M3 (scale ``amax / 448``) of ``x``."""
    xf = x.float()
    amax = xf.abs().amax() if xf.numel() else xf.new_ones(())
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (round_e4m3(xf / scale) * scale).to(dtype)


def naive_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
    *,
    kv_index: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    chunk_elements: int = 1 << 24,
) -> torch.Tensor:
    """Baseline FP8 attention: one scale per tensor for Q, K and V (``amax / 448``), P cast
    to E4M3 with no scale (softmax weights ``exp(s - rowmax)`` in [0, 1]; activations as
    they are, saturating at 448), float accumulation, the softmax denominator from the
    unquantized weights. ``(Tq, H, Dv)`` in ``q.dtype``."""
    qd, kd, vd = (_per_tensor(t, dtype) for t in (q, k, v))

    def softmax(s: torch.Tensor, ok: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        t = torch.where(ok, s, float("-inf"))
        mx = t.amax(-1, keepdim=True)
        e = torch.exp(t - torch.where(mx > float("-inf"), mx, 0.0))
        denom = e.sum(-1, keepdim=True)
        num = torch.matmul(round_e4m3(e), vb)
        return torch.where(denom > 0, num / torch.where(denom > 0, denom, 1.0), 0.0)

    def act(s: torch.Tensor, ok: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        return torch.matmul(round_e4m3(torch.where(ok, activation(spec.activation, s), 0.0)), vb)

    fn = softmax if spec.activation == "softmax" else act
    out = _pair_loop(qd, kd, vd, q_offsets, kv_offsets, spec, kv_index, num_targets, 1, fn,
                     chunk_elements)  # fmt: skip
    return out.to(q.dtype)


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Errors of ``out`` against ``ref`` (computed in float64): ``rel_l1`` =
    ``sum|out - ref| / sum|ref|``, ``rmse``, ``cosine`` similarity of the flattened
    tensors, ``snr_db`` = ``10 log10(sum ref^2 / sum (out - ref)^2)``, ``max_abs``."""
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    d = o - r
    sig, noise = float((r * r).sum()), float((d * d).sum())
    denom = float(o.norm() * r.norm())
    return {
        "rel_l1": float(d.abs().sum() / r.abs().sum().clamp_min(1e-300)),
        "rmse": math.sqrt(noise / max(d.numel(), 1)),
        "cosine": float((o * r).sum()) / denom if denom > 0 else float("nan"),
        "snr_db": 10 * math.log10(sig / noise) if noise > 0 else float("inf"),
        "max_abs": float(d.abs().max()) if d.numel() else 0.0,
    }
