"""Compile the Gluon kernels ahead of time for sm_90 and report registers, spills, SMEM.

Needs no GPU and no PyTorch: only Triton 3.6 (the Gluon API the kernel targets), whose
wheel ships ``ptxas``. The kernel module is loaded from its file, so the script runs in a
bare venv::

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python bench/compile_gluon.py [--out results/compile_gluon.json] [--dump DIR]

For every configuration of the forward (head dim x causal x activation x ping-pong x ring
depth), of the backward's dK/dV and dQ kernels (head dim x causal x activation x ring
depth) and of the FP8 forward (head dim x causal x activation, two variants) it
compiles Gluon -> TTGIR -> LLVM -> PTX -> cubin for ``GPUTarget("cuda", 90, 32)`` and
reports: the kernel's register cap and what ptxas used, spill stores/loads and stack,
SASS instruction counts by kind (byte permutes, shuffles, ``exp2``, FP8 conversions),
the ``setmaxnreg`` values of the partitions, wgmma instructions, dynamic shared memory,
warps and compile time. A failure is reported with the compiler's message and the script
goes on; the exit status is 1 if any configuration failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
GLUON = HERE.parent / "src" / "hyperrec" / "jagged_attn" / "_gluon"
KERNEL = GLUON / "_kernel.py"
BWD_KERNEL = GLUON / "_bwd_kernel.py"
FP8_KERNEL = GLUON / "_fp8_kernel.py"
FP8_CONSTANTS = GLUON.parent / "fp8.py"

# Must match _gluon/_launch.py.
WG_ROWS = 64
MAXNREG = 168
SMEM_LIMIT = 232448


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # registered before it runs: the backward module imports the forward's helpers by
    # their package name, which then resolves here without importing the package
    # (and PyTorch)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_kernel_module():
    return _load("hyperrec.jagged_attn._gluon._kernel", KERNEL)


def load_bwd_module():
    load_kernel_module()
    return _load("hyperrec.jagged_attn._gluon._bwd_kernel", BWD_KERNEL)


def load_fp8_module():
    """The FP8 forward, whose two constants of ``fp8.py`` come from that file's source
    (importing it would import PyTorch)."""
    import math
    import types

    load_kernel_module()
    consts = types.ModuleType("hyperrec.jagged_attn.fp8")
    text = FP8_CONSTANTS.read_text()
    for name in ("P_LOG2_MAX", "P_EXP_MAX"):
        expr = re.search(rf"^{name} = (.+)$", text, re.M).group(1)
        setattr(consts, name, eval(expr, {"math": math}))  # a literal or math.log2(...)
    sys.modules[consts.__name__] = consts
    return _load("hyperrec.jagged_attn._gluon._fp8_kernel", FP8_KERNEL)


def configs() -> list[dict]:
    out = []
    for head_dim, stages in ((128, 2), (64, 3)):
        for causal in (False, True):
            for act in (0, 1):
                for pingpong in (True, False):
                    out.append(dict(head_dim=head_dim, causal=causal, act=act,
                                    pingpong=pingpong, stages=stages, block_n=128))  # fmt: skip
    out.append(dict(head_dim=128, causal=True, act=0, pingpong=True, stages=1, block_n=128))
    out.append(dict(head_dim=128, causal=True, act=0, pingpong=True, stages=3, block_n=64))
    out.append(dict(head_dim=64, causal=False, act=0, pingpong=True, stages=4, block_n=128))
    # the value-tile guard off (GluonConfig(isolate_values=False))
    out.append(dict(head_dim=128, causal=True, act=0, pingpong=True, stages=2, block_n=128,
                    isolate=False))  # fmt: skip
    # the dK/dV kernel (``_bwd_kernel.py``): 128-key items, 64-row query tiles
    for head_dim in (128, 64):
        for causal in (False, True):
            for act in (0, 1):
                out.append(dict(kernel="dkdv", head_dim=head_dim, causal=causal, act=act,
                                pingpong=False, stages=3, block_n=128))  # fmt: skip
    out.append(dict(kernel="dkdv", head_dim=128, causal=False, act=0, pingpong=False,
                    stages=2, block_n=128))  # fmt: skip
    # the dQ kernel (same module): 128-row query items, BLOCK_N-key tiles
    for head_dim in (128, 64):
        for causal in (False, True):
            for act in (0, 1):
                out.append(dict(kernel="dq", head_dim=head_dim, causal=causal, act=act,
                                pingpong=False, stages=3, block_n=64))  # fmt: skip
    out.append(dict(kernel="dq", head_dim=128, causal=False, act=0, pingpong=False, stages=2,
                    block_n=128))  # fmt: skip
    # the FP8 forward (``_fp8_kernel.py``): 128-key tiles, E4M3 operands, V transposed
    for head_dim in (128, 64):
        for causal in (False, True):
            for act in (0, 1):
                out.append(dict(kernel="fp8", head_dim=head_dim, causal=causal, act=act,
                                pingpong=True, stages=3, block_n=128))  # fmt: skip
    out.append(dict(kernel="fp8", head_dim=128, causal=False, act=0, pingpong=False, stages=4,
                    block_n=128))  # fmt: skip
    out.append(dict(kernel="fp8", head_dim=128, causal=False, act=0, pingpong=False, stages=3,
                    block_n=128))  # fmt: skip
    # 256-key tiles (FlashAttention-3 uses 224 for FP8 at head dim 128; Gluon's register
    # tensors need power-of-two shapes): what the larger S tile costs in registers
    out.append(dict(kernel="fp8", head_dim=128, causal=False, act=0, pingpong=True, stages=2,
                    block_n=256))  # fmt: skip
    for permuted in (True, False):  # V in mma_order or token order, same pipeline
        out.append(dict(kernel="fp8", head_dim=128, causal=True, act=0, pingpong=False,
                        stages=3, block_n=128, permuted_p=permuted))  # fmt: skip
    # the P V wait kept after the softmax (GluonConfig(overlap_pv=True)); by default
    # ptxas hoists it above
    for act in (0, 1):
        out.append(dict(head_dim=128, causal=False, act=act, pingpong=True, stages=2,
                        block_n=128, overlap_pv=True))  # fmt: skip
        out.append(dict(kernel="fp8", head_dim=128, causal=False, act=act, pingpong=True,
                        stages=3, block_n=128, overlap_pv=True))  # fmt: skip
    # the row maximum as a tree (_launch.ROW_MAX_TREE = True)
    for causal in (False, True):
        for head_dim, stages in ((128, 2), (64, 3)):
            out.append(dict(head_dim=head_dim, causal=causal, act=0, pingpong=True,
                            stages=stages, block_n=128, tree_max=True))  # fmt: skip
        for act in (0, 1):
            out.append(dict(kernel="fp8", head_dim=128, causal=causal, act=act, pingpong=True,
                            stages=3, block_n=128, tree_max=True))  # fmt: skip
    out.append(dict(head_dim=128, causal=True, act=0, pingpong=True, stages=3, block_n=64,
                    tree_max=True))  # fmt: skip
    # the static snake schedule (GluonConfig(dynamic=False), _bwd_launch.DYNAMIC = False)
    out.append(dict(head_dim=128, causal=True, act=0, pingpong=True, stages=2, block_n=128,
                    dynamic=False))  # fmt: skip
    out.append(dict(kernel="dkdv", head_dim=128, causal=True, act=0, pingpong=False, stages=3,
                    block_n=128, dynamic=False))  # fmt: skip
    out.append(dict(kernel="dq", head_dim=128, causal=True, act=0, pingpong=False, stages=3,
                    block_n=64, dynamic=False))  # fmt: skip
    # dQ fused into the dK/dV kernel (bulk reduce-adds into an fp32 buffer)
    for head_dim, stages in ((128, 3), (128, 2), (64, 3)):
        for causal in (False, True):
            for act in (0, 1):
                out.append(dict(kernel="dkdv", head_dim=head_dim, causal=causal, act=act,
                                pingpong=False, stages=stages, block_n=128, fused_dq=True))  # fmt: skip
    for causal in (False, True):  # both GEMMs issued after dS (EARLY_DV off)
        out.append(dict(kernel="dkdv", head_dim=128, causal=causal, act=0, pingpong=False,
                        stages=3, block_n=128, early_dv=False))  # fmt: skip
    return out


def ptxas_report(ptx: str, ptxas: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
        path = f.name
    res = subprocess.run(
        [ptxas, "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
        capture_output=True,
        text=True,
        check=False,
    )
    log = (res.stdout + res.stderr).replace(path, "kernel.ptx")

    def grab(pattern: str) -> int | None:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "ptxas_ok": res.returncode == 0,
        "ptxas_log": log.strip()[-2000:],
    }


def sass_counts(cubin: bytes, ptxas: str) -> dict:
    """Instructions of the compiled kernel by kind (``cuobjdump -sass``, shipped next to
    ptxas in Triton's wheel): byte permutes and shuffles (what converting P into the
    FP8 operand costs), ``exp2`` and FP8 conversions. Empty if cuobjdump is missing."""
    tool = Path(ptxas).with_name("cuobjdump")
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    res = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                         check=False)  # fmt: skip
    sass = res.stdout
    return {
        "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
        "sass_prmt": len(re.findall(r"\bPRMT\b", sass)),
        "sass_shfl": len(re.findall(r"\bSHFL\.", sass)),
        "sass_mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
        "sass_f2fp": len(re.findall(r"\bF2FP\.", sass)),
        **main_loop_counts(sass),
    }


def main_loop_counts(sass: str) -> dict:
    """The static body of the kernel's tile loop: the smallest range closed by a backward
    branch that holds at least 16 MUFU operations (a tile's ``exp2`` or ``tanh`` per
    thread: 16 in the dK/dV kernel's 32-row SiLU tiles) and a GEMM. Static: a block
    skipped at run time (masking of edge tiles) counts too. Empty if no such loop."""
    ins = [(int(a, 16), t.strip()) for a, t in
           re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass, re.M)]  # fmt: skip
    best = None
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo = int(m.group(1), 16)
        body = [t for a, t in ins if lo <= a <= addr]
        if (sum("MUFU." in t for t in body) >= 16 and any("GMMA" in t for t in body)
                and (best is None or addr - lo < best[1] - best[0])):  # fmt: skip
            best = (lo, addr)
    if best is None:
        return {}
    body = [re.sub(r"^@!?U?P[T0-9]+\s+", "", t) for a, t in ins if best[0] <= a <= best[1]]
    ops = [t.split()[0] for t in body]
    # Where ptxas put the loop's waits for all GEMMs (``wgmma.wait_group 0``) relative
    # to its exponentials: a wait before the last MUFU op means the GEMM it waits for
    # no longer overlaps the rest of the softmax.
    mufu = [i for i, o in enumerate(ops) if o.startswith("MUFU.")]
    wait0 = [i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR.LE")
             and t.rstrip().endswith("0x0")]  # fmt: skip
    return {
        "loop_wait0_positions": wait0,
        "loop_mufu_span": [mufu[0], mufu[-1]] if mufu else [],
        "loop_instructions": len(ops),
        "loop_prmt": ops.count("PRMT"),
        "loop_lop3": sum(o.startswith("LOP3") for o in ops),
        "loop_shf": sum(o.startswith("SHF") for o in ops),
        "loop_mufu_ex2": ops.count("MUFU.EX2"),
    }


def compile_one(mod, cfg: dict, dump: Path | None) -> dict:
    import triton.language as tl
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor, mangle_type

    d, bn, heads = cfg["head_dim"], cfg["block_n"], 8

    def desc(rows: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        base = MockTensor(tl.bfloat16, shape=[4096, heads * d])
        return mangle_type(
            TensorDescriptor(base, [4096, heads * d], [heads * d, 1], [rows, d], layout)
        )

    if cfg.get("kernel") == "fp8":

        def desc8(rows: int, cols: int, width: int) -> str:
            layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)
            base = MockTensor(tl.float8e4nv, shape=[4096, width])
            return mangle_type(TensorDescriptor(base, [4096, width], [width, 1], [rows, cols],
                                                layout))  # fmt: skip

        fn = mod.jagged_fp8_fwd_kernel
        signature = {
            "q_desc": desc8(WG_ROWS, d, heads * d), "k_desc": desc8(bn, d, heads * d),
            "v_desc": desc8(d, bn, 4096), "o_desc": desc(WG_ROWS), "O": "*bf16", "LSE": "*fp32",
            "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "tile_seq": "*i32",
            "tile_idx": "*i32", "q_off": "*i32", "kv_off": "*i32", "v_off": "*i32",
            "total_ptr": "*i32", "work": "*i32", "stride_ot": "i32", "stride_lh": "i32",
            "stride_st": "i32", "qk_scale": "fp32", "coef": "fp32",
        }  # fmt: skip
        constexprs = {
            "H": heads, "HEAD_DIM": d, "BLOCK_N": bn, "NUM_STAGES": cfg["stages"],
            "CAUSAL": cfg["causal"], "ACT": cfg["act"], "PINGPONG": cfg["pingpong"],
            "PERMUTED_P": cfg.get("permuted_p", True), "DYNAMIC": cfg.get("dynamic", True),
            "OVERLAP_PV": cfg.get("overlap_pv", False), "TREE_MAX": cfg.get("tree_max", False),
        }  # fmt: skip
        aligned = ("O", "LSE", "QS", "KS", "VS", "tile_seq", "tile_idx", "q_off", "kv_off",
                   "v_off", "total_ptr", "work", "stride_ot")  # fmt: skip
        return _compile(fn, signature, constexprs, aligned, cfg, dump, "fp8")
    if cfg.get("kernel") == "dkdv":
        fn = mod.jagged_bwd_dkdv_kernel
        fused = bool(cfg.get("fused_dq", False))
        # _gluon/_bwd_launch.py: block_m (head dim 128: 64 rows for softmax, 32 for SiLU;
        # 64 with the fused dQ)
        bm = cfg.get("block_m", 64 if d <= 64 or cfg["act"] == 0 or fused else 32)
        # _bwd_launch.py's dQ accumulator: fp32, unswizzled [bm, d / 2] boxes
        dqa_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        cols = d // 2
        dqa = mangle_type(TensorDescriptor(MockTensor(tl.float32, shape=[4096, heads * d]),
                                           [4096, heads * d], [heads * d, 1], [bm, cols],
                                           dqa_layout))  # fmt: skip
        signature = {
            "q_desc": desc(bm), "do_desc": desc(bm), "k_desc": desc(WG_ROWS),
            "v_desc": desc(WG_ROWS), "dk_desc": desc(WG_ROWS), "dv_desc": desc(WG_ROWS),
            "dqa_desc": dqa, "DK": "*bf16", "DV": "*bf16", "LSE": "*fp32",
            "DELTA": "*fp32", "tile_seq": "*i32", "tile_idx": "*i32", "q_off": "*i32",
            "kv_off": "*i32", "total_ptr": "*i32", "work": "*i32", "stride_kt": "i32",
            "stride_lh": "i32", "qk_scale": "fp32", "coef": "fp32", "dk_scale": "fp32",
        }  # fmt: skip
        constexprs = {
            "H": heads, "HEAD_DIM": d, "BLOCK_M": bm, "NUM_STAGES": cfg["stages"],
            "CAUSAL": cfg["causal"],
            "ACT": cfg["act"], "ISOLATE_ROWS": cfg.get("isolate", True),
            "EARLY_DV": cfg.get("early_dv", True), "DYNAMIC": cfg.get("dynamic", True),
            "FUSED_DQ": fused,
        }  # fmt: skip
        aligned = ("DK", "DV", "LSE", "DELTA", "tile_seq", "tile_idx", "q_off", "kv_off",
                   "total_ptr", "work", "stride_kt")  # fmt: skip
        return _compile(fn, signature, constexprs, aligned, cfg, dump, "dkdv")
    if cfg.get("kernel") == "dq":
        fn = mod.jagged_bwd_dq_kernel
        signature = {
            "q_desc": desc(WG_ROWS), "do_desc": desc(WG_ROWS), "k_desc": desc(bn),
            "v_desc": desc(bn), "dq_desc": desc(WG_ROWS), "DQ": "*bf16", "LSE": "*fp32",
            "DELTA": "*fp32", "tile_seq": "*i32", "tile_idx": "*i32", "q_off": "*i32",
            "kv_off": "*i32", "total_ptr": "*i32", "work": "*i32", "stride_qt": "i32",
            "stride_lh": "i32", "qk_scale": "fp32", "coef": "fp32", "dq_scale": "fp32",
        }  # fmt: skip
        constexprs = {
            "H": heads, "HEAD_DIM": d, "BLOCK_N": bn, "NUM_STAGES": cfg["stages"],
            "CAUSAL": cfg["causal"], "ACT": cfg["act"], "ISOLATE_ROWS": cfg.get("isolate", True),
            "DYNAMIC": cfg.get("dynamic", True),
        }  # fmt: skip
        aligned = ("DQ", "LSE", "DELTA", "tile_seq", "tile_idx", "q_off", "kv_off",
                   "total_ptr", "work", "stride_qt")  # fmt: skip
        return _compile(fn, signature, constexprs, aligned, cfg, dump, "dq")
    fn = mod.jagged_fwd_kernel
    signature = {
        "q_desc": desc(WG_ROWS), "k_desc": desc(bn), "v_desc": desc(bn), "o_desc": desc(WG_ROWS),
        "O": "*bf16", "LSE": "*fp32", "tile_seq": "*i32", "tile_idx": "*i32", "q_off": "*i32",
        "kv_off": "*i32", "total_ptr": "*i32", "work": "*i32",
        "stride_ot": "i32", "stride_lh": "i32", "qk_scale": "fp32", "coef": "fp32",
    }  # fmt: skip
    constexprs = {
        "H": heads, "HEAD_DIM": d, "BLOCK_N": bn, "NUM_STAGES": cfg["stages"],
        "CAUSAL": cfg["causal"], "ACT": cfg["act"], "SCALE_IN_EXP": cfg["act"] == 0,
        "PINGPONG": cfg["pingpong"], "ISOLATE_VALUES": cfg.get("isolate", True),
        "DYNAMIC": cfg.get("dynamic", True), "OVERLAP_PV": cfg.get("overlap_pv", False),
        "TREE_MAX": cfg.get("tree_max", False),
    }  # fmt: skip
    aligned = ("O", "LSE", "tile_seq", "tile_idx", "q_off", "kv_off", "total_ptr", "work",
               "stride_ot")  # fmt: skip
    return _compile(fn, signature, constexprs, aligned, cfg, dump, "fwd")


def _compile(fn, signature, constexprs, aligned, cfg: dict, dump: Path | None, kind: str) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for name in constexprs:
        signature[name] = "constexpr"
    # what the JIT would specialise for 16-aligned pointers and strides
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG}
    )
    seconds = time.perf_counter() - t0
    ptx = kernel.asm["ptx"]
    report = {
        "compile_s": round(seconds, 2),
        "shared_bytes": kernel.metadata.shared,
        "shared_fits": kernel.metadata.shared <= SMEM_LIMIT,
        "maxnreg": MAXNREG,
        "threads": int(m.group(1)) if (m := re.search(r"\.reqntid (\d+)", ptx)) else None,
        "setmaxnreg": sorted(
            set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
        ),
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma_loads": ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global"),
        "tma_stores": ptx.count("cp.async.bulk.tensor.2d.global.shared"),
        **ptxas_report(ptx, knobs.nvidia.ptxas.path),
        **sass_counts(kernel.asm["cubin"], knobs.nvidia.ptxas.path),
    }
    if dump is not None:
        name = kind + "_d{head_dim}_c{causal:d}_a{act}_pp{pingpong:d}_s{stages}"
        name += (
            "_n{block_n}_i{isolate:d}_dyn{dynamic:d}_f{fused_dq:d}_e{early_dv:d}_o{overlap_pv:d}"
            "_t{tree_max:d}"
        )
        name = name.format(**{"isolate": True, "dynamic": True, "fused_dq": False,
                              "early_dv": True, "overlap_pv": False, "tree_max": False,
                              **cfg})  # fmt: skip
        dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "llir", "ptx"):
            (dump / f"{name}.{ext}").write_text(kernel.asm[ext])
        (dump / f"{name}.cubin").write_bytes(kernel.asm["cubin"])
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the reports as JSON here")
    ap.add_argument("--dump", type=Path, default=None, help="write TTGIR/LLIR/PTX/cubin here")
    args = ap.parse_args()
    # compile for real every time (the reported compile times must not be cache hits)
    os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")
    import triton

    print(f"triton {triton.__version__}, target cuda sm_90 (compile only, no device)")
    mod = load_kernel_module()
    bwd = load_bwd_module()
    fp8 = load_fp8_module()
    modules = {"dkdv": bwd, "dq": bwd, "fp8": fp8}
    rows, failed = [], 0
    only = os.environ.get("COMPILE_ONLY")
    for cfg in configs():
        if only and cfg.get("kernel", "fwd") != only:
            continue
        label = cfg.get("kernel", "fwd") + (
            " D={head_dim} causal={causal:d} act={act} pingpong={pingpong:d} stages={stages} "
            "BN={block_n} isolate={isolate:d} dynamic={dynamic:d} fused_dq={fused_dq:d} "
            "overlap_pv={overlap_pv:d} tree_max={tree_max:d}"
        ).format(**{"isolate": True, "dynamic": True, "fused_dq": False, "overlap_pv": False,
                    "tree_max": False, **cfg})  # fmt: skip
        try:
            rep = compile_one(modules.get(cfg.get("kernel"), mod), cfg, args.dump)
            ok = rep["ptxas_ok"] and rep["shared_fits"] and not rep["spill_stores"]
            failed += not ok
            print(
                f"{'ok  ' if ok else 'WARN'} {label}: regs {rep['registers']}/{rep['maxnreg']} "
                f"setmaxnreg {rep['setmaxnreg']} spills {rep['spill_stores']}/{rep['spill_loads']} B "
                f"smem {rep['shared_bytes']} B threads {rep['threads']} wgmma {rep['wgmma']} "
                f"loop waits {rep.get('loop_wait0_positions')} MUFU {rep.get('loop_mufu_span')} "
                f"({rep['compile_s']} s)"
            )
        except Exception as e:  # report every failure, keep going
            failed += 1
            rep = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(f"FAIL {label}: {rep['error'][:2000]}")
        rows.append({"config": cfg, **rep})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"triton": triton.__version__, "target": "cuda:90", "results": rows}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
