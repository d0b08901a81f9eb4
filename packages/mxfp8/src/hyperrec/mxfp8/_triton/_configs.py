"""Launch configurations of the MX kernels: a committed table looked up by bucketed shapes.

:func:`select_quantize_config` and :func:`select_mm_config` are pure functions of the
call's options, the GPU architecture and the *size buckets* of its shape (powers of
two), never of the exact shape and never of a timing: nothing is tuned at run time, so
a new shape costs no benchmarking, no host sync and at most one compilation per distinct
tile, and ``torch.compile``/CUDA graphs see a deterministic launch.

Every table entry names its evidence in ``source``: the committed result file (under
``packages/mxfp8/bench/results/``) in which the tile won against the other candidates
(for the quantizer: the default unless another was more than :data:`MARGIN` faster),
or ``"unmeasured: ..."`` with the reason it was chosen anyway (``tests/
test_kernel_configs.py`` checks every measured entry against its file). A bucket
without an entry takes the entry of the nearest measured bucket of the same kernel and
options (``source`` then says so); a class with no measured entry at all (another GPU,
block sizes 16/64, column-only quantization) takes the first legal candidate, labelled
unmeasured. The timings were taken with bf16 inputs on one H200 (torch 2.11, triton 3.6).

To extend the tables, run ``bench/sweep_quantize.py`` (quantizer) and
``bench/bench_mxfp8.py --explore`` (GEMMs) on the target GPU: both time every candidate
of :func:`quantize_candidates` / :func:`mm_candidates` with explicit configs and write
the fastest per shape into their JSON, from which entries are copied here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "MMConfig",
    "QuantizeConfig",
    "device_arch",
    "mm_candidates",
    "quantize_candidates",
    "select_mm_config",
    "select_quantize_config",
    "size_bucket",
]

_SWEEP = "h200_sweep_2026-11-29.json"
_GEMM = "h200_2026-11-29.json"
UNMEASURED = "unmeasured"


@dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """Tile of the fused quantizer: ``(block_m, block_k)`` elements per program."""

    block_m: int
    """Rows per tile (holds whole column-wise scale blocks and Hadamard groups)."""
    block_k: int
    """Columns per tile (holds whole row-wise scale blocks)."""
    num_warps: int
    """Warps per program."""
    source: str = UNMEASURED
    """Evidence: the result file that timed this tile fastest, or ``"unmeasured: ..."``."""

    @property
    def tile(self) -> tuple[int, int, int]:
        """``(block_m, block_k, num_warps)``, the launcher's ``config`` argument."""
        return self.block_m, self.block_k, self.num_warps

    @property
    def measured(self) -> bool:
        """Whether a committed result backs this entry."""
        return not self.source.startswith(UNMEASURED)


@dataclass(frozen=True, kw_only=True)
class MMConfig:
    """Tile and launch parameters of one block-scaled GEMM kernel."""

    block_m: int
    """Output rows per program."""
    block_n: int
    """Output columns per program."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipelining depth of the K loop."""
    group_m: int = 8
    """Programs along M that share B tiles in L2 (grouped ordering)."""
    sub: int | None = None
    """``fixup`` kernel: scale blocks per K step (1, 2 or 4)."""
    block_k: int | None = None
    """``upcast``/``dot_scaled`` kernels: K elements per step."""
    source: str = UNMEASURED
    """Evidence: the result file that timed this tile fastest, or ``"unmeasured: ..."``."""

    def launch_kwargs(self) -> dict[str, int]:
        """Keyword arguments of the kernel launch (meta-parameters and launch options)."""
        out = {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }
        if self.sub is not None:
            out["SUB"] = self.sub
        if self.block_k is not None:
            out["BLOCK_K"] = self.block_k
        return out

    @property
    def measured(self) -> bool:
        """Whether a committed result backs this entry."""
        return not self.source.startswith(UNMEASURED)


def size_bucket(n: int) -> int:
    """The power of two ``>= n`` (at least 1), capped at 16,384: the shape key of the tables.

    The best tile depends on a size only through occupancy, so one class per octave.
    """
    return min(1 << max(int(n) - 1, 0).bit_length(), 1 << 14)


@functools.cache
def _arch_of(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def device_arch(device: object) -> str:
    """``"sm90"`` etc. for a CUDA device (cached per device), ``"cpu"`` otherwise."""
    import torch

    dev = torch.device(device)  # type: ignore[call-overload]
    if dev.type != "cuda":
        return "cpu"
    return _arch_of(dev.index if dev.index is not None else torch.cuda.current_device())


# -- the fused quantizer -------------------------------------------------------------------

# Candidates timed by bench/sweep_quantize.py, (BLOCK_M, BLOCK_K, num_warps), default first.
# On an H200 (BF16 in, device time from CUDA graphs): with 32-blocks small tiles on one or
# two warps win (no cross-warp reductions: 32x128 on 2 warps, ~84% of the copy bandwidth
# row+col); 128-blocks need 128x128 tiles, best on 4 warps (~75-78%); the row-wise copy
# alone is bandwidth-bound on any of them (93-97%).
_COLWISE_CANDIDATES = ((32, 128, 2), (32, 64, 1), (32, 256, 4), (64, 128, 2), (64, 256, 8))
_COLWISE_128 = ((128, 128, 4), (128, 128, 8), (128, 256, 8))
_ROWWISE_CANDIDATES = ((32, 256, 4), (64, 256, 8), (32, 128, 2))


_K = TypeVar("_K", bound=tuple[Any, ...])


def _quantize_minimums(
    block_size: int, hadamard: int, rowwise: bool, colwise: bool
) -> tuple[int, int]:
    bm_min = max(block_size if colwise else 1, hadamard, 16)
    bk_min = max(block_size if rowwise else 1, 32)
    return bm_min, bk_min


def quantize_candidates(
    block_size: int, hadamard: int, *, rowwise: bool = True, colwise: bool = True
) -> list[tuple[int, int, int]]:
    """Legal tiles ``(BLOCK_M, BLOCK_K, num_warps)`` for these options, the default first.

    A tile holds whole scale blocks along each blocked dim it writes (and whole Hadamard
    groups along M).
    """
    bm_min, bk_min = _quantize_minimums(block_size, hadamard, rowwise, colwise)
    shapes: tuple[tuple[int, int, int], ...]
    if not colwise:
        shapes = _ROWWISE_CANDIDATES
    elif bm_min > 64:
        shapes = _COLWISE_128
    else:
        shapes = _COLWISE_CANDIDATES + _COLWISE_128
    found = [(m, k, w) for m, k, w in shapes if m >= bm_min and k >= bk_min]
    if not found:  # e.g. 64-blocks on both dims
        bm, bk = 1 << (bm_min - 1).bit_length(), 1 << (bk_min - 1).bit_length()
        found = [(bm, bk, 4 if bm * bk <= 16384 else 8)]
    return found


def _q(bm: int, bk: int, w: int, source: str) -> QuantizeConfig:
    return QuantizeConfig(block_m=bm, block_k=bk, num_warps=w, source=source)


#: The quantizer's rule: the default candidate unless another was more than this much
#: faster (differences below it are timing noise and would only cost compilations).
MARGIN = 0.04
_SWEPT = f"{_SWEEP}: 'quantize' section, the default unless another tile was >4% faster"
_PICKED = f"{_SWEEP}: timed pick of the candidates ('autotuned quantize configs')"

#: ``(arch, block_size, rowwise, colwise, m_bucket, k_bucket) -> config``. The sweep also
#: timed the bs32 row+col quantizer with a 16-Hadamard, stochastic rounding and a fused
#: gelu at both shapes: each picked the plain tile, so the options are not in the key.
QUANTIZE_TABLE: dict[tuple[str, int, bool, bool, int, int], QuantizeConfig] = {
    ("sm90", 32, True, True, 16384, 4096): _q(32, 128, 2, _SWEPT),
    ("sm90", 32, True, True, 8192, 16384): _q(32, 128, 2, _SWEPT),
    ("sm90", 32, True, False, 16384, 4096): _q(32, 256, 4, _SWEPT),
    ("sm90", 32, True, False, 8192, 16384): _q(32, 256, 4, _SWEPT),
    ("sm90", 128, True, True, 16384, 4096): _q(128, 128, 4, _SWEPT),
    ("sm90", 128, True, True, 8192, 16384): _q(128, 128, 4, _SWEPT),
    ("sm90", 128, True, True, 512, 512): _q(128, 128, 4, _PICKED),
    ("sm90", 128, True, True, 4096, 4096): _q(128, 128, 4, _PICKED),
    ("sm90", 128, True, True, 8192, 8192): _q(128, 128, 4, _PICKED),
    ("sm90", 128, True, True, 16384, 8192): _q(128, 128, 4, _PICKED),
    ("sm90", 128, True, False, 512, 512): _q(64, 256, 8, _PICKED),
    ("sm90", 128, True, False, 4096, 4096): _q(32, 256, 4, _PICKED),
    ("sm90", 128, True, False, 8192, 8192): _q(32, 256, 4, _PICKED),
}


def _nearest(keys: list[_K], sizes: tuple[int, ...]) -> _K | None:
    """The key whose trailing size buckets are closest to ``sizes`` (octaves; ties: the
    first in table order)."""
    best, best_d = None, None
    for key in keys:
        d = sum(abs(a.bit_length() - b.bit_length()) for a, b in zip(key[-len(sizes) :], sizes))
        if best_d is None or d < best_d:
            best, best_d = key, d
    return best


def select_quantize_config(
    *,
    arch: str,
    block_size: int,
    hadamard: int,
    rowwise: bool,
    colwise: bool,
    m: int,
    k: int,
    interpret: bool = False,
) -> QuantizeConfig:
    """The quantizer tile for a call (a pure function; see the module docstring).

    ``interpret``: the Triton CPU interpreter, which gets the smallest legal tile (CPU
    tests run at small shapes; not a performance choice).
    """
    bm_min, bk_min = _quantize_minimums(block_size, hadamard, rowwise, colwise)
    if interpret:
        return _q(max(32, bm_min), max(32, block_size), 4, "unmeasured: interpreter tile")
    mb, kb = size_bucket(m), size_bucket(k)
    cls = [
        key
        for key in QUANTIZE_TABLE
        if key[:4] == (arch, block_size, rowwise, colwise)
        and QUANTIZE_TABLE[key].block_m >= bm_min
        and QUANTIZE_TABLE[key].block_k >= bk_min
    ]
    if (arch, block_size, rowwise, colwise, mb, kb) in cls:
        return QUANTIZE_TABLE[(arch, block_size, rowwise, colwise, mb, kb)]
    near = _nearest(cls, (mb, kb))
    if near is not None:
        hit = QUANTIZE_TABLE[near]
        where = f"nearest measured bucket {near[4]}x{near[5]} ({hit.source})"
        return _q(hit.block_m, hit.block_k, hit.num_warps, where)
    bm, bk, w = quantize_candidates(block_size, hadamard, rowwise=rowwise, colwise=colwise)[0]
    return _q(bm, bk, w, f"unmeasured: default candidate (no timed entry for {arch})")


# -- the block-scaled GEMMs ----------------------------------------------------------------


def mm_candidates(kernel: str, block_size: int) -> list[MMConfig]:
    """Tiles timed by ``bench/bench_mxfp8.py --explore``, the default first. 4-warp tiles
    let two or three CTAs share an SM, so one CTA's FP32 promotion overlaps another's
    tensor-core work."""

    def cfg(
        m: int, n: int, w: int, s: int, *, sub: int | None = None, block_k: int | None = None
    ) -> MMConfig:
        return MMConfig(block_m=m, block_n=n, num_warps=w, num_stages=s, sub=sub, block_k=block_k)

    if kernel == "dot_scaled":
        return [cfg(128, 256, 8, 3, block_k=128)]
    if kernel == "upcast":
        return [
            cfg(128, 128, 4, 4, block_k=64),
            cfg(128, 128, 8, 3, block_k=128),
            cfg(128, 256, 8, 3, block_k=64),
        ]
    if block_size == 32:
        return [cfg(64, 128, 4, 4, sub=4), cfg(128, 128, 8, 3, sub=4), cfg(64, 128, 4, 6, sub=1)]
    return [
        cfg(64, 128, 4, 4, sub=1),
        cfg(128, 64, 4, 4, sub=1),
        cfg(64, 256, 8, 3, sub=1),
        cfg(128, 128, 8, 4, sub=1),
    ]


_TIMED = f"{_GEMM}: fastest of the candidates ('gemm' section, best_config)"


def _mm(
    m: int,
    n: int,
    w: int,
    s: int,
    source: str = _TIMED,
    *,
    sub: int | None = None,
    block_k: int | None = None,
) -> MMConfig:
    return MMConfig(
        block_m=m, block_n=n, num_warps=w, num_stages=s, sub=sub, block_k=block_k, source=source
    )


#: ``(arch, kernel, block_size, m_bucket, n_bucket, k_bucket) -> config``.
MM_TABLE: dict[tuple[str, str, int, int, int, int], MMConfig] = {
    ("sm90", "fixup", 32, 4096, 4096, 4096): _mm(64, 128, 4, 4, sub=4),
    ("sm90", "fixup", 32, 8192, 8192, 8192): _mm(64, 128, 4, 4, sub=4),
    ("sm90", "fixup", 32, 16384, 16384, 4096): _mm(64, 128, 4, 4, sub=4),
    ("sm90", "fixup", 32, 16384, 4096, 16384): _mm(64, 128, 4, 4, sub=4),
    ("sm90", "upcast", 32, 4096, 4096, 4096): _mm(128, 128, 4, 4, block_k=64),
    ("sm90", "upcast", 32, 8192, 8192, 8192): _mm(128, 256, 8, 3, block_k=64),
    ("sm90", "upcast", 32, 16384, 16384, 4096): _mm(128, 256, 8, 3, block_k=64),
    ("sm90", "upcast", 32, 16384, 4096, 16384): _mm(128, 128, 4, 4, block_k=64),
    ("sm90", "fixup", 128, 4096, 4096, 4096): _mm(64, 128, 4, 4, sub=1),
    ("sm90", "fixup", 128, 8192, 8192, 8192): _mm(128, 64, 4, 4, sub=1),
    ("sm90", "fixup", 128, 16384, 16384, 4096): _mm(128, 64, 4, 4, sub=1),
    ("sm90", "fixup", 128, 16384, 4096, 16384): _mm(128, 64, 4, 4, sub=1),
    ("sm90", "dot_scaled", 32, 8192, 8192, 8192): _mm(
        128, 256, 8, 3, f"{_GEMM}: the only candidate, timed (not compared)", block_k=128
    ),
}


def select_mm_config(
    *,
    arch: str,
    kernel: str,
    block_size: int,
    m: int,
    n: int,
    k: int,
    interpret: bool = False,
) -> MMConfig:
    """The GEMM tile for a call (a pure function; see the module docstring).

    ``interpret``: the Triton CPU interpreter, which gets small tiles (CPU tests run at
    small shapes; not a performance choice).
    """
    if interpret:
        return MMConfig(
            block_m=32,
            block_n=32,
            group_m=4,
            num_warps=4,
            num_stages=1,
            sub=2 if kernel == "fixup" else None,
            block_k=None if kernel == "fixup" else 64,
            source="unmeasured: interpreter tile",
        )
    sizes = (size_bucket(m), size_bucket(n), size_bucket(k))
    cls = [key for key in MM_TABLE if key[:3] == (arch, kernel, block_size)]
    if (arch, kernel, block_size, *sizes) in cls:
        return MM_TABLE[(arch, kernel, block_size, *sizes)]
    near = _nearest(cls, sizes)
    if near is not None:
        hit = MM_TABLE[near]
        where = f"nearest measured bucket {near[3]}x{near[4]}x{near[5]} ({hit.source})"
        return _replace_source(hit, where)
    first = mm_candidates(kernel, block_size)[0]
    return _replace_source(first, f"unmeasured: default candidate (no timed entry for {arch})")


def _replace_source(c: MMConfig, source: str) -> MMConfig:
    from dataclasses import replace

    return replace(c, source=source)
