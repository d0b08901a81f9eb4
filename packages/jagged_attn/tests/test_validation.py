"""Bad input gets a TypeError/ValueError that names the argument."""

from __future__ import annotations

import pytest
import torch

from hyperrec.jagged_attn import block_attention, gdpa, jagged_attention


def _good(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 2, 4, generator=gen).to(dtype)
    k = torch.randn(7, 2, 4, generator=gen).to(dtype)
    v = torch.randn(7, 2, 3, generator=gen).to(dtype)
    return {"q": q, "k": k, "v": v, "offsets": torch.tensor([0, 3, 3, 7]), "max_seqlen": 4}


def _jagged(**over):
    args = _good() | over
    kw = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v", "offsets", "max_seqlen")}
    return jagged_attention(
        args["q"], args["k"], args["v"], args["offsets"], args["max_seqlen"], **kw
    )


def _gdpa(**over):
    base = _good()
    args = {
        "q": base["q"],
        "k": base["k"],
        "v": base["v"],
        "q_offsets": base["offsets"],
        "kv_offsets": base["offsets"],
        "max_seqlen_q": 4,
        "max_seqlen_kv": 4,
    } | over
    pos = [args.pop(n) for n in ("q", "k", "v", "q_offsets", "kv_offsets")]
    pos += [args.pop("max_seqlen_q"), args.pop("max_seqlen_kv")]
    return gdpa(*pos, **args)


def _block(**over):
    args = _good() | over
    kw = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v", "offsets", "max_seqlen")}
    return block_attention(
        args["q"], args["k"], args["v"], args["offsets"], args["max_seqlen"], **kw
    )


BAD_COMMON = [
    # (overrides, error, message fragment)
    ({"q": [[1.0]]}, TypeError, "q must be a torch.Tensor"),
    ({"q": torch.zeros(7, 2, 4, dtype=torch.int32)}, TypeError, "q must be a float16, bfloat16"),
    ({"k": torch.zeros(7, 2, 4, dtype=torch.float64)}, TypeError, "share one dtype"),
    ({"q": torch.zeros(7, 8)}, ValueError, "q must be 3-D"),
    ({"v": torch.zeros(7, 2, 3, 1)}, ValueError, "v must be 3-D"),
    ({"k": torch.zeros(7, 3, 4)}, ValueError, "same number of heads"),
    ({"v": torch.zeros(7, 1, 3)}, ValueError, "same number of heads"),
    ({"k": torch.zeros(7, 2, 5)}, ValueError, "k head_dim"),
    ({"v": torch.zeros(6, 2, 3)}, ValueError, r"v.shape\[0\]"),
    ({"q": torch.zeros(7, 0, 4)}, ValueError, "heads >= 1"),
    ({"q": torch.zeros(7, 2, 4).to_sparse()}, TypeError, "dense"),
]

BAD_OFFSETS = [
    (torch.tensor([0.0, 3.0, 7.0]), TypeError, "must be an int32 or int64 tensor, got float32"),
    (torch.tensor([[0, 3, 7]]), ValueError, "1-D"),
    (torch.tensor([], dtype=torch.long), ValueError, ">= 1 entries"),
    (torch.tensor([1, 3, 7]), ValueError, r"\[0\] must be 0"),
    (torch.tensor([0, 5, 3, 7]), ValueError, "non-decreasing"),
    (torch.tensor([0, 3, 6]), ValueError, r"\[-1\] must equal"),
    ([0, 3, 7], TypeError, "must be a torch.Tensor"),
]


@pytest.mark.parametrize(("over", "err", "match"), BAD_COMMON)
@pytest.mark.parametrize("fn", [_jagged, _gdpa, _block])
def test_bad_qkv(fn, over, err, match):
    with pytest.raises(err, match=match):
        fn(**over)


@pytest.mark.parametrize(("offsets", "err", "match"), BAD_OFFSETS)
def test_bad_offsets(offsets, err, match):
    with pytest.raises(err, match="offsets"):
        _jagged(offsets=offsets)
    with pytest.raises(err, match=match):
        _jagged(offsets=offsets)
    with pytest.raises(err, match="q_offsets"):
        _gdpa(q_offsets=offsets)
    with pytest.raises(err, match=match):
        _block(offsets=offsets)


def test_bad_kv_offsets():
    with pytest.raises(ValueError, match=r"kv_offsets\[-1\] must equal k.shape\[0\]"):
        _gdpa(kv_offsets=torch.tensor([0, 3, 3, 6]))
    with pytest.raises(ValueError, match="kv_offsets must have 4 entries"):
        _gdpa(kv_offsets=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="kv_offsets must be non-decreasing"):
        _jagged(kv_offsets=torch.tensor([0, 4, 2, 7]), max_seqlen_kv=7)


@pytest.mark.parametrize(
    ("fn", "over", "err", "match"),
    [
        (_jagged, {"max_seqlen": 3}, ValueError, "max_seqlen=3 is smaller than the longest"),
        (_jagged, {"max_seqlen": -1}, ValueError, "max_seqlen must be >= 0"),
        (_jagged, {"max_seqlen": 4.0}, TypeError, "max_seqlen must be an int"),
        (_jagged, {"max_seqlen": True}, TypeError, "max_seqlen must be an int"),
        (_gdpa, {"max_seqlen_q": 2}, ValueError, "max_seqlen_q=2"),
        (_gdpa, {"max_seqlen_kv": 2}, ValueError, "max_seqlen_kv=2"),
        (_block, {"max_seqlen": 1}, ValueError, "max_seqlen=1"),
        (
            _jagged,
            {"kv_offsets": torch.tensor([0, 3, 3, 7])},
            ValueError,
            "max_seqlen_kv is required",
        ),
        (_jagged, {"max_seqlen_kv": 4}, ValueError, "max_seqlen_kv is only meaningful"),
        (
            _jagged,
            {"kv_offsets": torch.tensor([0, 3, 3, 7]), "max_seqlen_kv": 2},
            ValueError,
            "max_seqlen_kv=2",
        ),
        (
            _jagged,
            {"k": torch.zeros(5, 2, 4), "v": torch.zeros(5, 2, 3)},
            ValueError,
            "without kv_offsets",
        ),
        (_jagged, {"causal": "yes"}, TypeError, "causal must be a bool"),
        (_jagged, {"scale": "x"}, TypeError, "scale must be a real number"),
        (_jagged, {"scale": float("nan")}, ValueError, "scale must be finite"),
        (_jagged, {"window_size": 3}, TypeError, "window_size"),
        (_jagged, {"window_size": (1, -2)}, ValueError, r"window_size\[1\]"),
        (_jagged, {"backend": "cuda"}, ValueError, "backend must be one of"),
        (_jagged, {"backend": None}, TypeError, "backend must be one of"),
        (_jagged, {"validate": 1}, TypeError, "validate must be True, False or 'full'"),
        (_gdpa, {"activation": "swish"}, ValueError, "activation must be one of"),
        (_gdpa, {"normalization": "mean"}, ValueError, "normalization must be one of"),
        (_gdpa, {"output_scale": float("inf")}, ValueError, "output_scale must be finite"),
        (_gdpa, {"contextual_len": -1}, ValueError, "contextual_len must be >= 0"),
        (_gdpa, {"kv_index": torch.tensor([0, 1])}, ValueError, "kv_index must have 3 entries"),
        (
            _gdpa,
            {"kv_index": torch.tensor([0.0, 1.0, 0.0])},
            TypeError,
            "kv_index must be an int32 or int64",
        ),
        (
            _gdpa,
            {"kv_index": torch.tensor([0, 3, 1])},
            ValueError,
            r"kv_index entries must lie in \[0, 3\)",
        ),
        (_gdpa, {"kv_index": torch.tensor([0, -1, 1])}, ValueError, "kv_index entries"),
        (
            _gdpa,
            {"num_targets": torch.tensor([1, 0])},
            ValueError,
            "num_targets must have 3 entries",
        ),
        (_gdpa, {"num_targets": torch.tensor([1, -1, 0])}, ValueError, "num_targets must be >= 0"),
        (
            _gdpa,
            {"num_targets": torch.tensor([4, 0, 0])},
            ValueError,
            "num_targets must not exceed",
        ),
        (
            _gdpa,
            {"num_targets": torch.tensor([0, 1, 0])},
            ValueError,
            "num_targets must not exceed",
        ),
        (_block, {"block_size": 0}, ValueError, "block_size must be >= 1"),
        (_block, {"num_global": -1}, ValueError, "num_global must be >= 0"),
        (_block, {"previous_block": 1}, TypeError, "previous_block must be a bool"),
        (
            _block,
            {"k": torch.zeros(5, 2, 4), "v": torch.zeros(5, 2, 3)},
            ValueError,
            "self-attention",
        ),
    ],
)
def test_bad_arguments(fn, over, err, match):
    with pytest.raises(err, match=match):
        fn(**over)


def test_kv_index_lets_query_and_kv_batches_differ():
    q = torch.randn(5, 2, 4)
    k, v = torch.randn(6, 2, 4), torch.randn(6, 2, 3)
    out = gdpa(
        q,
        k,
        v,
        torch.tensor([0, 2, 5]),
        torch.tensor([0, 1, 4, 6]),
        3,
        3,
        kv_index=torch.tensor([2, 2]),
    )
    assert out.shape == (5, 2, 3)
    with pytest.raises(ValueError, match="kv_offsets must have 3 entries"):
        gdpa(q, k, v, torch.tensor([0, 2, 5]), torch.tensor([0, 1, 4, 6]), 3, 3)


def test_triton_backend_rejects_unsupported_inputs():
    # float32 inputs (and, without a GPU, CPU tensors outside the interpreter)
    with pytest.raises(ValueError, match="backend='triton' cannot run this call"):
        _jagged(backend="triton")
    with pytest.raises(ValueError, match="backend='triton' cannot run this call"):
        _gdpa(backend="triton")


def test_validate_false_skips_only_the_value_checks():
    # Values are not checked ...
    out = _jagged(max_seqlen=1, validate=False)
    assert out.shape == (7, 2, 3)
    # ... shapes and dtypes still are.
    with pytest.raises(ValueError, match="same number of heads"):
        _jagged(k=torch.zeros(7, 3, 4), validate=False)


def test_device_mismatch_names_the_argument():
    meta = torch.zeros(7, 2, 4, device="meta")
    with pytest.raises(ValueError, match="one device"):
        _jagged(k=meta)
    with pytest.raises(ValueError, match="offsets must be on"):
        _jagged(offsets=torch.tensor([0, 3, 3, 7], device="meta"))
