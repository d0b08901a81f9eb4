import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.raggedshard import STRATEGIES, Layout, RaggedShard, Strategy, plan_layout
from hyperrec.raggedshard.reference import layout_violations


def check_contract(layout: Layout) -> None:
    """Everything plan_layout promises, checked independently of how it was planned."""
    n, g, s, w, a = (
        layout.numels.tolist(),
        layout.granularities.tolist(),
        layout.shard_numel,
        layout.world_size,
        layout.alignment,
    )
    off = layout.offsets.tolist()
    if sum(n) == 0:
        assert s == 0 and layout.padding == 0
        return
    assert layout_violations(off, n, g, s, w, a) == []
    assert s % a == 0
    assert s >= layout.lower_bound_shard_numel
    assert layout.lower_bound_shard_numel * w >= sum(n)
    assert layout.padding == w * s - sum(n) >= layout.padding_lower_bound >= 0
    assert layout.gap == layout.padding - layout.padding_lower_bound
    assert layout.strategy in layout.candidates
    assert layout.candidates[layout.strategy] == min(layout.candidates.values()) == layout.padding
    # Per-rank views agree with the offsets.
    for i in range(len(n)):
        ranges = layout.rank_ranges(i)
        assert ranges[0, 0] == 0 and ranges[-1, 1] == n[i]
        assert (ranges[1:, 0] == ranges[:-1, 1]).all()
        for r in (0, w - 1, int(off[i] // s) if s else 0):
            r = min(r, w - 1)
            lo, hi = layout.rank_range(i, r)
            assert (lo, hi) == tuple(ranges[r])
            p0, p1 = layout.shard_range(i, r)
            assert p1 - p0 == hi - lo and 0 <= p0 <= p1 <= s
            assert (off[i] + lo) - r * s == p0 if hi > lo else (p0, p1) == (0, 0)
        # The placement handed to DTensor names the same elements as the layout (checked
        # where it is cheap: building a placement is O(world_size) Python).
        if n[i] and w <= 64:
            bounds = layout.placement(i, (int(n[i]),)).element_bounds((int(n[i]),))
            assert [tuple(b) for b in bounds] == [tuple(x) for x in ranges.tolist()]


@st.composite
def problems(draw):
    count = draw(st.integers(0, 40))
    world = draw(st.sampled_from([1, 2, 3, 7, 8, 64, 100, 1024, 4096]))
    kind = draw(st.sampled_from(["small", "mixed", "large"]))
    top = {"small": 100, "mixed": 100_000, "large": 10_000_000}[kind]
    numels = draw(st.lists(st.integers(0, top), min_size=count, max_size=count))
    grans = []
    for n in numels:
        choice = draw(st.sampled_from(["one", "small", "row", "whole", "big"]))
        if choice == "one":
            grans.append(1)
        elif choice == "small":
            grans.append(draw(st.integers(1, 64)))
        elif choice == "row":
            grans.append(draw(st.sampled_from([128, 1000, 4096])))
        elif choice == "whole":
            grans.append(max(n, 1))
        else:
            grans.append(draw(st.integers(1, max(top, 1))))
    alignment = draw(st.sampled_from([1, 1, 4, 16, 128]))
    return numels, grans, world, alignment


@settings(deadline=None, max_examples=120)
@given(problems())
def test_contract_holds_for_random_inputs(problem):
    numels, grans, world, alignment = problem
    layout = plan_layout(numels, grans, world, alignment=alignment)
    check_contract(layout)
    again = plan_layout(list(numels), list(grans), world, alignment=alignment)
    assert np.array_equal(again.offsets, layout.offsets) and again.shard_numel == layout.shard_numel


@settings(deadline=None, max_examples=40)
@given(problems())
def test_best_strategy_is_never_worse_than_given_or_size_order(problem):
    numels, grans, world, alignment = problem
    best = plan_layout(numels, grans, world, alignment=alignment)
    for name in ("given", "size"):
        only = [s for s in STRATEGIES if s.name == name]
        alone = plan_layout(numels, grans, world, alignment=alignment, strategies=only)
        check_contract(alone)
        assert best.padding <= alone.padding


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.integers(1, 50_000), min_size=1, max_size=30),
    st.sampled_from([1, 8, 100, 512]),
    st.sampled_from([1, 7, 64, 1000]),
    st.sampled_from([1, 4, 16]),
)
def test_padding_bound_for_a_common_block(numels, world, block, alignment):
    # The documented bound: with one block size shared by all tensors, the planner pads
    # less than 2 * world_size * lcm(block, alignment) above the lower bound.
    layout = plan_layout(numels, [block] * len(numels), world, alignment=alignment)
    check_contract(layout)
    assert layout.gap < 2 * world * math.lcm(block, alignment)


def test_one_block_tensors_never_straddle_a_boundary():
    numels = [7, 5, 5, 4, 3, 3, 2, 2, 1]
    layout = plan_layout(numels, numels, world_size=4)  # granularity = whole tensor
    check_contract(layout)
    s = layout.shard_numel
    for off, n in zip(layout.offsets.tolist(), numels):
        assert off // s == (off + n - 1) // s
    assert s >= 8  # 32 elements over 4 shards, 7 must fit whole: 8 is optimal here
    assert layout.shard_numel == 8


def test_tensor_spanning_two_boundaries_forces_a_multiple_of_its_block():
    # 1 tensor of 10,000 with blocks of 300 over 16 ranks: it crosses >= 2 boundaries, so
    # shard_numel must be a multiple of 300 (the lower bound says so too).
    layout = plan_layout([10_000], [300], 16)
    check_contract(layout)
    assert layout.lower_bound_shard_numel % 300 == 0
    assert layout.shard_numel % 300 == 0
    assert layout.shard_numel == 900  # ceil(10000 / 16) = 625 -> 900


def test_alignment_rounds_offsets_and_shards():
    layout = plan_layout([5, 3, 9, 1], [1, 1, 1, 1], 2, alignment=4)
    check_contract(layout)
    assert all(o % 4 == 0 for o in layout.offsets.tolist())
    assert layout.shard_numel % 4 == 0


def test_empty_and_zero_sized_inputs():
    empty = plan_layout([], [], 8)
    assert empty.shard_numel == 0 and empty.padding == 0 and len(empty.offsets) == 0
    zeros = plan_layout([0, 0], [1, 5], 3)
    assert zeros.shard_numel == 0 and zeros.numels_per_rank(1) == (0, 0, 0)
    mixed = plan_layout([0, 12, 0], [1, 4, 1], 3)
    check_contract(mixed)


def test_layout_is_read_only_and_index_checked():
    layout = plan_layout([10, 20], [1, 5], 2)
    with pytest.raises(ValueError):
        layout.offsets[0] = 3
    with pytest.raises(IndexError):
        layout.rank_ranges(2)
    with pytest.raises(IndexError):
        layout.rank_range(0, 2)


def test_placements_follow_the_layout():
    shapes = [(12, 6), (5,), (3, 4, 8), (64, 3)]
    numels = [math.prod(s) for s in shapes]
    grans = [6, 1, 32, 3 * 16]  # rows, elements, whole matrices of the stack, 16 rows
    layout = plan_layout(numels, grans, 5)
    check_contract(layout)
    for i, shape in enumerate(shapes):
        p = layout.placement(i, shape)
        assert isinstance(p, RaggedShard)
        assert [e - s for s, e in p.element_bounds(shape)] == list(layout.numels_per_rank(i))
    assert layout.placement(0, (12, 6)).dims in ((), (0,))  # row blocks: whole rows
    with pytest.raises(ValueError, match="elements"):
        layout.placement(0, (5, 5))


def test_tensors_on_rank_matches_ranges():
    layout = plan_layout([100, 3, 250, 0, 40], [10, 1, 50, 1, 40], 4)
    for r in range(4):
        expected = [i for i in range(5) if np.diff(layout.rank_ranges(i)[r])[0] > 0]
        assert layout.tensors_on_rank(r).tolist() == expected


def test_custom_strategies_are_pluggable():
    numels = [30, 20, 10, 40]
    rev = Strategy(name="reverse", order=lambda n, b: np.arange(len(n))[::-1].copy())
    layout = plan_layout(numels, [1] * 4, 2, strategies=[rev])
    check_contract(layout)
    assert layout.strategy == "reverse"
    assert layout.offsets.tolist() == [70, 50, 40, 0]  # 40 | 10 | 20 | 30

    def back_to_front(numels, blocks, sizes, s, a):
        return np.cumsum(np.r_[0, sizes[:-1]])[::-1].copy()

    custom = Strategy(name="custom", place=back_to_front)
    with pytest.raises(ValueError, match="exactly one"):
        Strategy(name="both", order=rev.order, place=back_to_front)
    bad = Strategy(name="bad", order=lambda n, b: np.zeros(len(n), dtype=np.int64))
    with pytest.raises(ValueError, match="permutation"):
        plan_layout(numels, [1] * 4, 2, strategies=[bad])
    layout = plan_layout([5, 5, 5, 5], [1] * 4, 2, strategies=[custom])
    check_contract(layout)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"numels": [1, -2], "granularities": [1, 1], "world_size": 2}, ValueError, "numels"),
        ({"numels": [1, 2], "granularities": [1, 0], "world_size": 2}, ValueError, "granular"),
        ({"numels": [1, 2], "granularities": [1], "world_size": 2}, ValueError, "granular"),
        ({"numels": [1, 2], "granularities": 1, "world_size": 0}, ValueError, "world_size"),
        ({"numels": [1, 2], "granularities": 1, "world_size": 2.0}, TypeError, "world_size"),
        ({"numels": [1.5], "granularities": 1, "world_size": 2}, TypeError, "numels"),
        ({"numels": "12", "granularities": 1, "world_size": 2}, TypeError, "numels"),
        ({"numels": [1], "granularities": 1, "world_size": 2, "alignment": 0}, ValueError, "align"),
        (
            {"numels": [1], "granularities": 1, "world_size": 2, "strategies": []},
            ValueError,
            "strat",
        ),
    ],
)
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        plan_layout(**kwargs)


def test_ten_thousand_tensors_on_four_thousand_ranks():
    rng = np.random.default_rng(7)
    numels = rng.integers(1, 2_000_000, size=10_000)
    grans = rng.choice([1, 64, 2048], size=10_000)
    layout = plan_layout(numels, grans, 4096)
    check_contract(layout)
    assert layout.padding_ratio < 1e-3
