"""torch.library registration: opcheck, and torch.compile(fullgraph=True) over a module."""

from __future__ import annotations

import pytest
import torch
from jagged_oracle import make_problem

from hyperrec.jagged_attn import block_attention, gdpa, jagged_attention
from hyperrec.jagged_attn.ops import attention_torch, attention_torch_backward

#  activation, scale, output_scale, normalization, max_q, max_kv, causal, left, right,
#  contextual, block_size, block_previous
SPECS = [
    ("softmax", 0.5, 1.0, "none", 6, 6, True, -1, -1, 0, 0, False),
    ("silu", 0.3, 2.0, "max_seqlen", 6, 6, True, 2, 0, 1, 0, False),
    ("gelu_poly", 1.0, 1.0, "length", 6, 6, False, -1, -1, 0, 2, True),
]


def _inputs(with_map: bool):
    p = make_problem([4, 0, 6], [6, 3, 5], heads=2, dim=4, dim_v=3, dtype=torch.float32)
    q, k, v = p.leaves()
    kv_index = torch.tensor([2, 1, 0]) if with_map else None
    targets = torch.tensor([1, 0, 2]) if with_map else None
    return q, k, v, p.q_offsets_t, p.kv_offsets_t, kv_index, targets


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s[0])
@pytest.mark.parametrize("with_map", [False, True])
def test_opcheck_forward(spec, with_map):
    torch.library.opcheck(attention_torch, (*_inputs(with_map), *spec))


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s[0])
def test_opcheck_backward(spec):
    q, k, v, *rest = _inputs(True)
    grad = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    args = (grad, q.detach(), k.detach(), v.detach(), *rest, *spec)
    torch.library.opcheck(attention_torch_backward, args)


class _Block(torch.nn.Module):
    """A toy layer calling all three functions, as a model's sequence tower would."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, offsets, max_len, hist, hist_offsets, cand_to_hist):
        t, d = x.shape
        q, k, v = self.qkv(x).view(t, self.heads, 3 * d // self.heads).chunk(3, dim=-1)
        a = jagged_attention(q, k, v, offsets, max_len, causal=True)
        b = block_attention(q, k, v, offsets, max_len, block_size=2, previous_block=True)
        h = hist.view(hist.shape[0], self.heads, -1)
        c = gdpa(
            q,
            h,
            h,
            offsets,
            hist_offsets,
            max_len,
            8,
            kv_index=cand_to_hist,
            normalization="length",
        )
        return (a + b + c).reshape(t, d)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(backend):
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(9, 8)
    offsets = torch.tensor([0, 4, 4, 9])
    hist = torch.randn(11, 8)
    hist_offsets = torch.tensor([0, 8, 11])
    cand_to_hist = torch.tensor([1, 0, 0])
    args = (x, offsets, 5, hist, hist_offsets, cand_to_hist)

    eager = model(*args)
    eager.square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(*args)
    got.square().sum().backward()
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    for g, w in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_compile_dynamic_shapes_does_not_recompile_per_batch():
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def fn(q, k, v, offsets, max_len):
        return jagged_attention(q, k, v, offsets, max_len, causal=True)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counting_backend)
    for lengths in ([3, 5], [2, 7, 1], [6, 0, 4, 2]):
        p = make_problem(lengths, dtype=torch.float32)
        want = fn(p.q, p.k, p.v, p.q_offsets_t, max(lengths))
        got = compiled(p.q, p.k, p.v, p.q_offsets_t, max(lengths))
        torch.testing.assert_close(got, want)
    assert len(compiles) == 1
