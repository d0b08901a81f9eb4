"""Compile the FP8 quantization kernels for sm_90 without a GPU and report their resources.

Triton compiles for a target it is told about (``GPUTarget("cuda", 90, 32)``) with the
``ptxas`` its wheel ships, so a machine without a GPU can check that a kernel edited and
tested under the interpreter also compiles for Hopper, and read its register and stack
use (``cuobjdump --dump-resource-usage``; a stack frame at 255 registers means spills).
Run it with ``TRITON_INTERPRET`` unset (the interpreter replaces ``@triton.jit``). The
Triton here may be newer than the GPU machine's, so a clean compile is evidence, not
proof. Kernels: ``_proj_quant_kernel`` (``linear_quantize_qkv``) and
``_quant_qkv_kernel`` (``quantize_qkv``), D = 128, 128-token tiles.

    python bench/compile_sm90.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hyperrec.jagged_attn._triton import _fp8_kernels


def _compile(fn, pointers: dict[str, str], const: dict[str, object], **options):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for p in names:
        if p in const:
            sig[p] = "constexpr"
        else:
            sig[p] = pointers.get(p, "i32")
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _usage(kernel) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return {k.lower(): int(v) for k, v in fields.items() if k in ("REG", "STACK", "SHARED")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the kernels")
    rows = []
    proj_ptrs = {p: "*bf16" for p in ("X", "W", "BIAS", "Y", "Z")}
    proj_ptrs |= {p: "*u8" for p in ("QD", "KD", "VD")}
    proj_ptrs |= {
        p: "*i32" for p in ("offsets", "v_poffsets", "tile_seq", "tile_idx", "tile_total")
    }
    for mx, hadamard, mma, warps in ((False, True, False, 8), (False, True, True, 8),
                                     (False, False, False, 8), (True, True, False, 8),
                                     (False, True, False, 16)):  # fmt: skip
        ptrs = proj_ptrs | {p: "*u8" if mx else "*fp32" for p in ("QS", "KS", "VS")}
        ptrs["SIGNS"] = "*fp32"
        const = dict(H=8, D=128, BD=128, BK=64, TILE=128, GROUP_Q=128, GROUP_KV=128,
                     MODE_QK=1 if mx else 0, MODE_V=2 if mx else 0, POW2=True,
                     HADAMARD=hadamard, LOG2D=7, ADD=0, ODD=0, CHUNK_Q=2, CHUNK_K=3, CHUNK_V=1,
                     HAS_BIAS=True, SILU=True, STORE_Z=True, DOT_F32=False, V_MMA_ORDER=mma,
                     N_CHUNKS=4)  # fmt: skip
        k = _compile(_fp8_kernels._proj_quant_kernel, ptrs, const, num_warps=warps, num_stages=3)
        rows.append(dict(kernel="_proj_quant_kernel", mx=mx, hadamard=hadamard, v_mma_order=mma,
                         num_warps=warps, **_usage(k)))  # fmt: skip
    quant_ptrs = {p: "*bf16" for p in ("Q", "K", "V")} | {p: "*u8" for p in ("QD", "KD", "VD")}
    quant_ptrs |= {p: "*fp32" for p in ("QS", "KS", "VS", "SIGNS", "SHIFT")}
    quant_ptrs |= {p: "*i32" for p in ("q_offsets", "kv_offsets", "v_poffsets", "q_seq", "q_idx",
                                       "q_total", "kv_seq", "kv_idx", "kv_total")}  # fmt: skip
    const = dict(D=128, BD=128, DV=128, BDV=128, TILE_Q=128, GROUP_Q=128, TILE_KV=128,
                 GROUP_KV=128, MODE_QK=0, MODE_V=0, POW2=True, HADAMARD=True, LOG2D=7, ADD=0,
                 ODD=0, HAS_SHIFT=False, V_MMA_ORDER=False)  # fmt: skip
    k = _compile(_fp8_kernels._quant_qkv_kernel, quant_ptrs, const, num_warps=4)
    rows.append(dict(kernel="_quant_qkv_kernel", mx=False, hadamard=True, v_mma_order=False,
                     num_warps=4, **_usage(k)))  # fmt: skip
    for r in rows:
        print(r)
    if args.out is not None:
        args.out.write_text(json.dumps(dict(triton=triton.__version__, target="sm_90",
                                            rows=rows), indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
