"""The Triton backend's ``torch.library`` ops: schema/fake/autograd checks (``opcheck``),
``torch.compile(fullgraph=True)`` over a block that calls them, and the FLOP formula.

CPU runs use the Triton interpreter at tiny shapes; the ``gpu`` test compiles with Inductor.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hyperrec.jagged_attn._opschema import spec_op_args
from hyperrec.jagged_attn.masks import MaskSpec
from hyperrec.jagged_attn.spec import AttentionSpec

pytest.importorskip("triton")

from hyperrec.jagged_attn._triton import flops_upper_bound, supports
from hyperrec.jagged_attn._triton.ops import (
    attention_triton,
    unsupported_reason,
)

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if CUDA else "cpu"
if not supports(DEVICE):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

OPS = torch.ops.hyperrec_jagged_attn


def _inputs(lens, heads=2, dim=32, dtype=torch.bfloat16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (
        torch.randn(t, heads, dim, generator=g).to(dtype).to(DEVICE).requires_grad_(requires_grad)
        for _ in range(3)
    )
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    return q, k, v, off


def _spec(lens, dim=32, **kw) -> tuple:
    """The spec arguments of the ops (what follows the tensors)."""
    mask = kw.pop("mask", MaskSpec())
    spec = AttentionSpec(scale=1 / math.sqrt(dim), max_seqlen_q=max(lens),
                         max_seqlen_kv=max(lens), mask=mask, **kw)  # fmt: skip
    return spec_op_args(spec)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(activation="silu", normalization="max_seqlen", mask=MaskSpec(causal=True))],
    ids=["softmax", "hstu"],
)
def test_opcheck(kw):
    lens = (5, 0, 19)
    q, k, v, off = _inputs(lens, requires_grad=True)
    spec = _spec(lens, **kw)
    torch.library.opcheck(OPS.attention_triton_fwd, (q, k, v, off, off, None, None, *spec))
    out, lse = OPS.attention_triton_fwd(q, k, v, off, off, None, None, *spec)
    do = torch.randn_like(out)
    tensors = (q.detach(), k.detach(), v.detach(), off, off, None, None)
    args = (do, out.detach(), lse.detach(), *tensors, *spec)
    torch.library.opcheck(OPS.attention_triton_bwd, args)


def test_compile_fullgraph_matches_eager():
    lens = (7, 12, 1)
    heads, dim = 2, 32
    spec = _spec(lens, activation="gelu_poly", output_scale=0.5, mask=MaskSpec(causal=True))
    _, _, _, off = _inputs(lens)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(lens), 64, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(3, 64, heads * dim, generator=g) / 8).to(torch.bfloat16).to(DEVICE)

    def block(x, w):
        q, k, v = ((x @ w[i]).view(-1, heads, dim) for i in range(3))
        out = attention_triton(q, k, v, off, off, None, None, *spec)
        return out.float().square().sum()

    backend = "inductor" if CUDA else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    w1 = w.clone().requires_grad_()
    w2 = w.clone().requires_grad_()
    loss1, loss2 = block(x, w1), compiled(x, w2)
    loss1.backward()
    loss2.backward()
    assert torch.allclose(loss1, loss2, rtol=1e-3)
    assert torch.allclose(w1.grad.float(), w2.grad.float(), rtol=1e-2, atol=1e-2)


def test_flop_formula():
    from torch.utils.flop_counter import FlopCounterMode

    lens = (16, 16)
    q, k, v, off = _inputs(lens, requires_grad=True)
    spec = _spec(lens)
    with FlopCounterMode(display=False) as counter:
        out = attention_triton(q, k, v, off, off, None, None, *spec)
        out.backward(torch.ones_like(out))
    counts = counter.get_flop_counts()["Global"]
    fwd = flops_upper_bound(32, 32, 16, 16, 2, 32)
    assert counts[OPS.attention_triton_fwd] == fwd == 4 * (2 * 16 * 16) * 2 * 32
    assert counts[OPS.attention_triton_bwd] == 2.5 * fwd


def test_unsupported_reason():
    q = torch.zeros(4, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    assert unsupported_reason(q, q) is None
    assert "float32" in unsupported_reason(q.float(), q.float())
    assert "head_dim" in unsupported_reason(q[..., :8], q[..., :8])
