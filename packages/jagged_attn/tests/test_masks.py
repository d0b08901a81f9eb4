"""The mask algebra against hand-written matrices, the oracle and HSTU's construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jagged_oracle import Mask, oracle_mask

from hyperrec.jagged_attn import MaskSpec, mask_matrix


def _m(rows: str) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in r.split()] for r in rows.strip().splitlines()])


# Each case: (q_len, k_len, spec, num_targets, expected), expected worked out by hand from
# the rules in the README.
CASES = [
    pytest.param(
        8,
        8,
        MaskSpec(causal=True, contextual_len=2),
        2,
        """
        x x x x x x . .
        x x x x x x . .
        x x x . . . . .
        x x x x . . . .
        x x x x x . . .
        x x x x x x . .
        x x x x x x x .
        x x x x x x . x
        """,
        id="hstu-causal-contextual2-targets2",
    ),
    pytest.param(
        7,
        7,
        MaskSpec(block_size=2, block_previous=True, contextual_len=1),
        0,
        """
        x x x x x x x
        x x . . . . .
        x x x x . . .
        x x x x . . .
        x . x x x x .
        x . x x x x .
        x . . . x x x
        """,
        id="block2-previous-global1",
    ),
    pytest.param(
        3,
        5,
        MaskSpec(causal=True),
        0,
        """
        x x x . .
        x x x x .
        x x x x x
        """,
        id="causal-bottom-right-lq<lk",
    ),
    pytest.param(
        5,
        3,
        MaskSpec(causal=True),
        0,
        """
        . . .
        . . .
        x . .
        x x .
        x x x
        """,
        id="causal-bottom-right-lq>lk",
    ),
    pytest.param(
        4,
        4,
        MaskSpec(window_left=1, window_right=0),
        0,
        """
        x . . .
        x x . .
        . x x .
        . . x x
        """,
        id="window-1-0",
    ),
    pytest.param(
        4,
        4,
        MaskSpec(window_left=1, window_right=1),
        0,
        """
        x x . .
        x x x .
        . x x x
        . . x x
        """,
        id="window-1-1",
    ),
    pytest.param(
        4,
        4,
        MaskSpec(),
        1,
        """
        x x x .
        x x x .
        x x x .
        x x x x
        """,
        id="noncausal-target1",
    ),
    pytest.param(
        6,
        6,
        MaskSpec(causal=True, window_left=1),
        2,
        """
        x . . . . .
        x x . . . .
        . x x . . .
        . . x x . .
        . . . x x .
        . . . x . x
        """,
        id="causal-window1-targets2",
    ),
]


@pytest.mark.parametrize(("lq", "lk", "spec", "targets", "expected"), CASES)
def test_mask_matches_hand_written(lq, lk, spec, targets, expected):
    got = mask_matrix(lq, lk, spec, num_targets=targets)
    assert torch.equal(got, _m(expected))


def _spec_and_oracle(causal, left, right, ctx, block, previous):
    spec = MaskSpec(
        causal=causal,
        window_left=left,
        window_right=right,
        contextual_len=ctx,
        block_size=block,
        block_previous=previous and block > 0,
    )
    mask = Mask(causal, left, right, ctx, block, previous and block > 0)
    return spec, mask


@settings(deadline=None, max_examples=150)
@given(
    lq=st.integers(0, 9),
    lk=st.integers(0, 9),
    causal=st.booleans(),
    left=st.integers(-1, 4),
    right=st.integers(-1, 4),
    ctx=st.integers(0, 3),
    block=st.integers(0, 4),
    previous=st.booleans(),
    data=st.data(),
)
def test_mask_matches_oracle(lq, lk, causal, left, right, ctx, block, previous, data):
    targets = data.draw(st.integers(0, lk))
    spec, mask = _spec_and_oracle(causal, left, right, ctx, block, previous)
    got = mask_matrix(lq, lk, spec, num_targets=targets)
    assert torch.equal(got, oracle_mask(lq, lk, mask, targets))


def _hstu_mask(n: int, num_targets: int, window: int, contextual: int) -> torch.Tensor:
    """HSTU's causal mask for one sequence of length n, built its way: positions become
    ids (contextual positions share id 0, targets share the first target's id), a pair is
    valid on the diagonal or when the row id exceeds the column id (within the window),
    and contextual rows see every non-target column."""
    ids = torch.arange(n)
    max_id = n - num_targets
    if contextual > 0:
        ids = (ids - contextual + 1).clamp(min=0)
        max_id = max_id - contextual + 1
    ids = torch.minimum(ids, torch.tensor(max_id))
    row, col = ids.view(-1, 1), ids.view(1, -1)
    dist = row - col
    valid = torch.eye(n, dtype=torch.bool) | (dist > 0)
    if window > 0:
        valid &= dist <= window
    if contextual > 0:
        valid |= (row == 0) & (col < max_id)
    return valid


@settings(deadline=None, max_examples=80)
@given(
    n=st.integers(1, 12),
    window=st.integers(0, 4),
    contextual=st.integers(0, 3),
    data=st.data(),
)
def test_causal_mask_equals_hstu(n, window, contextual, data):
    # The only documented difference: HSTU windows contextual keys, we keep them global.
    if window > 0:
        contextual = 0
    contextual = min(contextual, n)
    targets = data.draw(st.integers(0, n - contextual))
    spec = MaskSpec(
        causal=True, window_left=window if window > 0 else -1, contextual_len=contextual
    )
    got = mask_matrix(n, n, spec, num_targets=targets)
    assert torch.equal(got, _hstu_mask(n, targets, window, contextual))


def test_hstu_windows_contextual_keys_but_we_do_not():
    spec = MaskSpec(causal=True, window_left=1, contextual_len=1)
    ours = mask_matrix(5, 5, spec)
    theirs = _hstu_mask(5, 0, 1, 1)
    assert ours[4, 0] and not theirs[4, 0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"causal": 1}, "causal"),
        ({"window_left": -2}, "window_left"),
        ({"window_right": 1.5}, "window_right"),
        ({"contextual_len": -1}, "contextual_len"),
        ({"block_size": -1}, "block_size"),
        ({"block_previous": True}, "block_previous"),
    ],
)
def test_mask_spec_rejects_bad_fields(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        MaskSpec(**kwargs)


def test_mask_matrix_rejects_bad_lengths():
    with pytest.raises(ValueError, match="q_len"):
        mask_matrix(-1, 2, MaskSpec())
    with pytest.raises(ValueError, match="num_targets"):
        mask_matrix(2, 2, MaskSpec(), num_targets=3)
