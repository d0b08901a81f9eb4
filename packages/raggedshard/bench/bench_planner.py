"""Planner benchmark: runtime and padding of ``plan_layout`` on realistic parameter sets.

Parameter sets (shapes from the public model configs):

- ``llama3-70b``: hidden 8192, FFN 28672, 80 layers, 64 query / 8 KV heads of 128,
  vocab 128256, untied embeddings (70.6 B parameters, 723 tensors).
- ``gpt-oss-120b``: hidden 2880, 36 layers, 64 query / 8 KV heads of 64, attention sinks
  and biases, 128 experts of FFN 2880 stored as 3-D stacks (``(128, 2880, 5760)`` gate-up
  and ``(128, 2880, 2880)`` down, with biases), router, vocab 201088 (116.8 B, 615 tensors).
- ``gem-like``: a recsys model: 4 ID tables of 200 M x 128, 28 of 10 M x 128, 96 small
  tables (1 K - 1 M rows x 64), a 24-block attention tower of width 1024, 4 cross-attention
  blocks, PMA queries, an interaction MLP (8192-4096-2048-1024) and 2 task heads.

Granularities (blocks never cut by a rank boundary), per tensor:

- ``element``: 1.  ``row``: one row of the matrix (``shape[-1]`` elements; 1 for vectors).
- ``32rows``: 32 matrix rows.  ``2048``: 2,048 elements (8-bit Adam blocks).
- ``muon``: hidden matrices whole (``prod(shape[-2:])``, one expert of a 3-D stack);
  embeddings, unembedding, vectors element-wise (they are AdamW's in a Muon recipe).

Baseline ``fsdp2``: what FSDP2 pads, per tensor: dim 0 chunked ``torch.chunk``-style over
the ranks and every rank's shard padded to the first chunk,
``world_size * ceil(shape[0] / world_size) * prod(shape[1:]) - numel`` (it honours whole
dim-0 slices only, so for ``32rows``/``2048``/``muon`` it is not a like-for-like layout).

Runtime: wall time of ``plan_layout`` (all strategies) on 10,000 tensors x 1,024 ranks,
median of 5, for several granularities.

    python bench_planner.py [--out results/planner_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from hyperrec.raggedshard import plan_layout
from hyperrec.testing import write_result

WORLD_SIZES = (8, 32, 128, 256, 1024)
GRANULARITIES = ("element", "row", "32rows", "2048", "muon")
TARGETS = {"row": 0.001, "2048": 0.001, "32rows": 0.005}  # at <= 256 ranks


def llama3_70b() -> list[tuple[str, tuple[int, ...]]]:
    h, f, kv, vocab = 8192, 28672, 8 * 128, 128256
    out = [("embed", (vocab, h))]
    for i in range(80):
        out += [
            (f"l{i}.q", (h, h)),
            (f"l{i}.k", (kv, h)),
            (f"l{i}.v", (kv, h)),
            (f"l{i}.o", (h, h)),
            (f"l{i}.gate", (f, h)),
            (f"l{i}.up", (f, h)),
            (f"l{i}.down", (h, f)),
            (f"l{i}.norm1", (h,)),
            (f"l{i}.norm2", (h,)),
        ]
    return out + [("norm", (h,)), ("lm_head", (vocab, h))]


def gpt_oss_120b() -> list[tuple[str, tuple[int, ...]]]:
    h, e, f, heads, kv, hd, vocab = 2880, 128, 2880, 64, 8, 64, 201088
    out = [("embed", (vocab, h))]
    for i in range(36):
        out += [
            (f"l{i}.norm1", (h,)),
            (f"l{i}.q", (heads * hd, h)),
            (f"l{i}.q_bias", (heads * hd,)),
            (f"l{i}.k", (kv * hd, h)),
            (f"l{i}.k_bias", (kv * hd,)),
            (f"l{i}.v", (kv * hd, h)),
            (f"l{i}.v_bias", (kv * hd,)),
            (f"l{i}.o", (h, heads * hd)),
            (f"l{i}.o_bias", (h,)),
            (f"l{i}.sinks", (heads,)),
            (f"l{i}.norm2", (h,)),
            (f"l{i}.router", (e, h)),
            (f"l{i}.router_bias", (e,)),
            (f"l{i}.gate_up", (e, h, 2 * f)),
            (f"l{i}.gate_up_bias", (e, 2 * f)),
            (f"l{i}.down", (e, f, h)),
            (f"l{i}.down_bias", (e, h)),
        ]
    return out + [("norm", (h,)), ("lm_head", (vocab, h))]


def gem_like() -> list[tuple[str, tuple[int, ...]]]:
    out = [(f"id_table{i}", (200_000_000, 128)) for i in range(4)]
    out += [(f"mid_table{i}", (10_000_000, 128)) for i in range(28)]
    rows = np.geomspace(1_000, 1_000_000, 96).astype(int).tolist()
    out += [(f"small_table{i}", (r, 64)) for i, r in enumerate(rows)]
    d = 1024

    def block(p: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            (f"{p}.norm1.w", (d,)),
            (f"{p}.norm1.b", (d,)),
            (f"{p}.qkv", (3 * d, d)),
            (f"{p}.qkv_bias", (3 * d,)),
            (f"{p}.o", (d, d)),
            (f"{p}.norm2.w", (d,)),
            (f"{p}.norm2.b", (d,)),
            (f"{p}.ffn1", (4 * d, d)),
            (f"{p}.ffn1_bias", (4 * d,)),
            (f"{p}.ffn2", (d, 4 * d)),
            (f"{p}.ffn2_bias", (d,)),
        ]

    for i in range(24):
        out += block(f"seq{i}")
    for i in range(4):
        out += block(f"cross{i}")
    out.append(("pma_queries", (16, d)))
    for i, (a, b) in enumerate([(8192, 4096), (4096, 2048), (2048, 1024)]):
        out += [(f"mlp{i}", (b, a)), (f"mlp{i}_bias", (b,))]
    for t in ("ctr", "cvr"):
        out += [(f"head_{t}", (1, d)), (f"head_{t}_bias", (1,))]
    return out


def synthetic_10k(seed: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """10,000 tensors: 70% matrices (64-16384 rows x 1024-8192 cols), 30% vectors."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(10_000):
        if rng.random() < 0.3:
            out.append((f"v{i}", (int(rng.choice([1024, 2048, 4096, 8192])),)))
        else:
            rows = int(np.exp(rng.uniform(math.log(64), math.log(16384))))
            out.append((f"m{i}", (rows, int(rng.choice([1024, 2048, 4096, 8192])))))
    return out


MODELS = {"llama3-70b": llama3_70b, "gpt-oss-120b": gpt_oss_120b, "gem-like": gem_like}
EMBEDDINGS = ("embed", "lm_head", "table")


def block_of(name: str, shape: tuple[int, ...], granularity: str) -> int:
    numel = math.prod(shape)
    row = shape[-1] if len(shape) >= 2 else 1
    if granularity == "element":
        return 1
    if granularity == "row":
        return row
    if granularity == "32rows":
        return min(32 * row, numel) if len(shape) >= 2 else 32
    if granularity == "2048":
        return 2048
    if granularity == "muon":
        if len(shape) < 2 or any(tag in name for tag in EMBEDDINGS):
            return 1
        return math.prod(shape[-2:])
    raise ValueError(granularity)


def fsdp2_padding(shapes: list[tuple[int, ...]], world_size: int) -> int:
    pad = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        pad += (world_size * -(-shape[0] // world_size) - shape[0]) * rest
    return pad


def timed(
    numels: np.ndarray, blocks: np.ndarray, world_size: int, repeats: int
) -> tuple[float, object]:
    times, layout = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        layout = plan_layout(numels, blocks, world_size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), layout


def markdown(path: str) -> str:
    """README tables from a result JSON (so no figure is transcribed by hand)."""
    data = json.loads(Path(path).read_text())
    m = data["machine"]
    lines = [
        f"Measured {m['date'][:10]} on {m['cpu_count']} CPU cores ({m['cpu'] or 'cpu'}), "
        f"python {m['python']}, torch {m['torch']}; `{Path(path).name}`.",
        "",
        "Padding `(world_size * shard_numel - total) / total`, in %: ours / lower bound / FSDP2.",
        "",
    ]
    rows = data["padding"]
    sizes = sorted({r["world_size"] for r in rows})
    lines.append("| model | granularity | " + " | ".join(f"W={w}" for w in sizes) + " |")
    lines.append("|---|---|" + "---|" * len(sizes))
    for model in dict.fromkeys(r["model"] for r in rows):
        for gran in dict.fromkeys(r["granularity"] for r in rows):
            cells = []
            for w in sizes:
                (r,) = [
                    x
                    for x in rows
                    if (x["model"], x["granularity"], x["world_size"]) == (model, gran, w)
                ]
                mark = "" if r["meets_target"] is not False else " (miss)"
                cells.append(
                    f"{100 * r['padding_ratio']:.3f} / {100 * r['padding_lower_bound_ratio']:.3f} / "
                    f"{100 * r['fsdp2_padding_ratio']:.3f}{mark}"
                )
            lines.append(f"| {model} | {gran} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| granularity | 10,000 tensors x 1,024 ranks | padding % | bound % |",
        "|---|---|---|---|",
    ]
    for r in data["runtime"]:
        lines.append(
            f"| {r['granularity']} | {1e3 * r['seconds_median']:.1f} ms | "
            f"{100 * r['padding_ratio']:.4f} | {100 * r['padding_lower_bound_ratio']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_cpu.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--markdown", metavar="JSON", help="print README tables for a result and exit")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(args.markdown))
        return

    rows = []
    print(
        f"{'model':<13} {'gran':<8} {'W':>5} {'padding %':>10} {'bound %':>9} {'fsdp2 %':>9} {'strategy':<11} {'ms':>7}"
    )
    for model, build in MODELS.items():
        params = build()
        shapes = [s for _, s in params]
        numels = np.array([math.prod(s) for s in shapes], dtype=np.int64)
        total = int(numels.sum())
        for gran in GRANULARITIES:
            blocks = np.array([block_of(n, s, gran) for n, s in params], dtype=np.int64)
            for w in WORLD_SIZES:
                sec, layout = timed(numels, blocks, w, 1)
                row = {
                    "model": model,
                    "granularity": gran,
                    "world_size": w,
                    "tensors": len(params),
                    "total_numel": total,
                    "shard_numel": layout.shard_numel,
                    "padding": layout.padding,
                    "padding_ratio": layout.padding_ratio,
                    "lower_bound_shard_numel": layout.lower_bound_shard_numel,
                    "padding_lower_bound_ratio": layout.padding_lower_bound / total,
                    "fsdp2_padding_ratio": fsdp2_padding(shapes, w) / total,
                    "strategy": layout.strategy,
                    "strategies": {k: v / total for k, v in layout.candidates.items()},
                    "plan_seconds": sec,
                }
                target = TARGETS.get(gran)
                row["target_ratio"] = target if target is not None and w <= 256 else None
                row["meets_target"] = (
                    None if row["target_ratio"] is None else layout.padding_ratio <= target
                )
                rows.append(row)
                print(
                    f"{model:<13} {gran:<8} {w:>5} {100 * layout.padding_ratio:>10.4f} "
                    f"{100 * row['padding_lower_bound_ratio']:>9.4f} "
                    f"{100 * row['fsdp2_padding_ratio']:>9.4f} {layout.strategy:<11} {1e3 * sec:>7.1f}"
                )

    runtime = []
    params = synthetic_10k()
    numels = np.array([math.prod(s) for _, s in params], dtype=np.int64)
    print(f"\n10,000 tensors x 1,024 ranks (median of {args.repeats}):")
    for gran in GRANULARITIES:
        blocks = np.array([block_of(n, s, gran) for n, s in params], dtype=np.int64)
        sec, layout = timed(numels, blocks, 1024, args.repeats)
        runtime.append(
            {
                "granularity": gran,
                "tensors": len(params),
                "world_size": 1024,
                "seconds_median": sec,
                "padding_ratio": layout.padding_ratio,
                "padding_lower_bound_ratio": layout.padding_lower_bound / int(numels.sum()),
                "strategy": layout.strategy,
            }
        )
        print(
            f"  {gran:<8} {1e3 * sec:8.1f} ms   padding {100 * layout.padding_ratio:.4f}%  "
            f"(bound {100 * runtime[-1]['padding_lower_bound_ratio']:.4f}%)  {layout.strategy}"
        )
    path = write_result(args.out, {"benchmark": "plan_layout", "padding": rows, "runtime": runtime})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
