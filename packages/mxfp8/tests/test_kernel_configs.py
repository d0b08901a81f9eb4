"""The kernel-config tables: pure selection, legal tiles, every measured entry backed by
the committed result it names, everything else labelled unmeasured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hyperrec.mxfp8._triton import _configs as cf

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_buckets_are_octaves():
    assert [cf.size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 4096, 4097, 10**6)] == [
        1,
        1,
        2,
        4,
        4,
        8,
        4096,
        8192,
        16384,
    ]


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("hadamard", [0, 16, 32])
@pytest.mark.parametrize(("rowwise", "colwise"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("arch", ["sm90", "sm100", "cpu"])
@pytest.mark.parametrize("interpret", [False, True])
def test_quantize_selection_is_legal_and_pure(
    block_size, hadamard, rowwise, colwise, arch, interpret
):
    if hadamard > block_size or (hadamard and not colwise):
        return
    for m, k in ((1, 1), (100, 3000), (16384, 4096), (70000, 512)):
        kw = dict(
            arch=arch,
            block_size=block_size,
            hadamard=hadamard,
            rowwise=rowwise,
            colwise=colwise,
            m=m,
            k=k,
            interpret=interpret,
        )
        got = cf.select_quantize_config(**kw)
        assert got == cf.select_quantize_config(**kw)  # a pure function of its arguments
        assert not colwise or got.block_m % max(block_size, hadamard) == 0
        assert not rowwise or got.block_k % block_size == 0
        assert got.block_m <= 128 or not hadamard  # the stored Hadamard matrix
        if arch != "sm90" or interpret or block_size in (16, 64) or not rowwise:
            assert not got.measured and got.source.startswith("unmeasured")


def test_quantize_entries_match_the_committed_sweep():
    sweep = _json("h200_sweep_2026-11-29.json")
    variants = {"row+col e4m3 bs32": (32, True), "row+col e4m3 bs128": (128, True)}
    variants["row e4m3 bs32"] = (32, False)
    checked = 0
    for row in sweep["quantize"]:
        if row["variant"] not in variants:
            continue  # options (Hadamard, SR, gelu) are checked below
        bs, colwise = variants[row["variant"]]
        m, k = row["shape"]
        entry = cf.QUANTIZE_TABLE[("sm90", bs, True, colwise, cf.size_bucket(m), cf.size_bucket(k))]
        assert entry.source.startswith("h200_sweep_2026-11-29.json: 'quantize'")
        times = {tuple(c["config"]): c["graph ms"] for c in row["configs"]}
        default = cf.quantize_candidates(bs, 0, rowwise=True, colwise=colwise)[0]
        best = min(times, key=times.get)
        want = best if times[best] < (1 - cf.MARGIN) * times[default] else default
        assert entry.tile == want, row["variant"]
        checked += 1
    assert checked == 6
    # The timed picks recorded by the same run (its keys end with the option flags and
    # the size buckets): every entry citing them is there with the same tile, and the
    # bs32 runs with a Hadamard, stochastic rounding or gelu picked the plain tile.
    picks = {}
    for key, tile in sweep["autotuned quantize configs"].items():
        f = [x.strip() for x in key.strip("()").split(",")]
        sb, row, col, act, had, sr = int(f[1]), f[11], f[12], f[13], f[14], f[16]
        opts = (act, had, sr) != ("0", "0", "False")
        picks.setdefault((sb, row == "True", col == "True", opts, int(f[21]), int(f[22])), tile)
    for key, entry in cf.QUANTIZE_TABLE.items():
        if "autotuned quantize configs" in entry.source:
            assert list(entry.tile) == picks[(*key[1:4], False, *key[4:])]
    for (sb, _, col, opts, mb, kb), tile in picks.items():
        if opts:
            assert tuple(tile) == cf.QUANTIZE_TABLE[("sm90", sb, True, col, mb, kb)].tile


def _parse_best(text: str) -> dict[str, int]:
    pairs = dict(re.findall(r"(\w+): (\w+)", text))
    return {k: int(v) for k, v in pairs.items() if v.isdigit() and k not in ("num_ctas",)}


def test_gemm_entries_match_the_committed_benchmark():
    bench = _json("h200_2026-11-29.json")
    names = {
        "ours exact MX (bs32 fixup)": ("fixup", 32),
        "ours exact MX (bs32 upcast)": ("upcast", 32),
        "ours fast (bs128 fixup)": ("fixup", 128),
        "ours tl.dot_scaled (bs32)": ("dot_scaled", 32),
    }
    cited = {k for k, v in cf.MM_TABLE.items() if v.measured}
    seen = set()
    for row in bench["gemm"]:
        m, k, n = row["M"], row["K"], row["N"]
        for name, (kernel, bs) in names.items():
            if name + " best_config" not in row:
                continue
            key = ("sm90", kernel, bs, *(cf.size_bucket(x) for x in (m, n, k)))
            assert cf.MM_TABLE[key].launch_kwargs() == _parse_best(row[name + " best_config"])
            seen.add(key)
    assert seen == cited  # no measured entry without its measurement


@pytest.mark.parametrize("kernel", ["fixup", "upcast", "dot_scaled"])
def test_gemm_selection_falls_back_honestly(kernel):
    bs = 32
    hit = cf.select_mm_config(arch="sm90", kernel=kernel, block_size=bs, m=3000, n=6000, k=8000)
    assert hit.measured and "bucket" in hit.source  # the nearest measured bucket, said so
    other = cf.select_mm_config(arch="sm100", kernel=kernel, block_size=bs, m=64, n=64, k=64)
    assert not other.measured
    assert other.launch_kwargs() == cf.mm_candidates(kernel, bs)[0].launch_kwargs()
    small = cf.select_mm_config(
        arch="sm90", kernel=kernel, block_size=bs, m=64, n=64, k=64, interpret=True
    )
    assert not small.measured and small.block_m == 32
