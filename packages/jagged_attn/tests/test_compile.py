"""torch.library registration: opcheck, and torch.compile(fullgraph=True) over a module."""

from __future__ import annotations

import pytest
import torch
from jagged_oracle import make_problem

from hyperrec.jagged_attn import AttentionSpec, MaskSpec, block_attention, gdpa, jagged_attention
from hyperrec.jagged_attn._opschema import spec_op_args
from hyperrec.jagged_attn._torch.ops import attention_torch, attention_torch_backward


def _spec_args(activation, scale, output_scale, normalization, **mask) -> tuple:
    """The op arguments that follow the tensors, for one spec."""
    spec = AttentionSpec(activation=activation, scale=scale, output_scale=output_scale,
                         normalization=normalization, max_seqlen_q=6, max_seqlen_kv=6,
                         mask=MaskSpec(**mask))  # fmt: skip
    return spec_op_args(spec)


SPECS = [
    _spec_args("softmax", 0.5, 1.0, "none", causal=True),
    _spec_args("silu", 0.3, 2.0, "max_seqlen", causal=True, window_left=2, window_right=0,
               contextual_len=1),
    _spec_args("gelu_poly", 1.0, 1.0, "length", block_size=2, block_previous=True),
]  # fmt: skip


def _inputs(with_map: bool):
    p = make_problem([4, 0, 6], [6, 3, 5], heads=2, dim=4, dim_v=3, dtype=torch.float32)
    q, k, v = p.leaves()
    kv_index = torch.tensor([2, 1, 0]) if with_map else None
    targets = torch.tensor([1, 0, 2]) if with_map else None
    return q, k, v, p.q_offsets_t, p.kv_offsets_t, kv_index, targets


@pytest.mark.parametrize("spec", SPECS, ids=["softmax", "silu", "gelu_poly"])
@pytest.mark.parametrize("with_map", [False, True])
def test_opcheck_forward(spec, with_map):
    torch.library.opcheck(attention_torch, (*_inputs(with_map), *spec))


@pytest.mark.parametrize("spec", SPECS[:2], ids=["softmax", "silu"])
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


def test_spec_round_trips_through_the_op_arguments():
    from hyperrec.jagged_attn._opschema import AttentionCall

    spec = AttentionSpec(
        activation="gelu_tanh",
        scale=0.3,
        output_scale=1.5,
        normalization="length",
        max_seqlen_q=5,
        max_seqlen_kv=9,
        mask=MaskSpec(causal=True, window_left=3, window_right=0, contextual_len=2,
                      block_size=4, block_previous=True),
    )  # fmt: skip
    q, k, v, qo, ko, kvi, nt = _inputs(True)
    call = AttentionCall(q=q, k=k, v=v, q_offsets=qo, kv_offsets=ko, kv_index=kvi,
                         num_targets=nt, spec=spec)  # fmt: skip
    back = AttentionCall.from_op_args(call.op_args())
    assert back.spec == spec and all(a is b for a, b in zip(back.tensors, call.tensors))
    assert len(call.op_args()) == len(call.tensors) + len(spec_op_args(spec))
    with pytest.raises(ValueError, match="not an encoded attention spec"):
        AttentionCall.from_op_args((*call.tensors, "activation=softmax", 1.0, 1.0, 5, 9))


def test_compile_dynamic_with_mask_arguments():
    # Mask fields passed into the compiled function (symbolic ints under dynamic=True) are
    # specialised into the op's spec string; maxima and scale stay symbolic.
    def fn(q, k, v, offsets, max_len, left, ctx, targets):
        return gdpa(q, k, v, offsets, offsets, max_len, max_len, causal=True,
                    window_size=(left, -1), contextual_len=ctx, num_targets=targets)  # fmt: skip

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for lengths, left, ctx in (([3, 5], 2, 1), ([2, 7, 1], 2, 1), ([6, 0, 4], 3, 0)):
        p = make_problem(lengths, dtype=torch.float32)
        targets = torch.tensor([min(1, n) for n in lengths])
        args = (p.q, p.k, p.v, p.q_offsets_t, max(lengths), left, ctx, targets)
        torch.testing.assert_close(compiled(*args), fn(*args))
