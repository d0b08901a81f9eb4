"""An un-checkpointed region with packed saves: the pack hook's quantizer runs while the
region's ops are being numbered. Its own ops (adds, muls, casts) must not take the
region's occurrence numbers, or every decision after the first pack lands on another
tensor (here the residual add was saved unpacked and an add inside the quantizer was
"packed" instead: the step held more than predicted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autoac_cases import attn_tower, step_for

from hyperrec import autoac
from hyperrec.autoac.model import Assignment, build_problem, compress, held_of, profile_of


@pytest.mark.parametrize("fmt", ["mxint8", "fp8_e4m3"])
def test_none_region_packs_the_planned_tensors(fmt: str) -> None:
    torch.manual_seed(0)
    model = attn_tower(n=3, dim=64, heads=4)
    step = step_for(torch.randn(2, 64, 64))
    cfg = autoac.ProfileConfig(cost="flops", steps=1, formats=(fmt,), min_pack_bytes=4096)
    prof = autoac.profile(model, step, config=cfg)
    free = autoac.plan(prof, budget=1e15)
    # every region un-checkpointed, packing its LN output, its first projection and its
    # residual add (the add comes after the first two packs have run their quantizer)
    saves = {
        ("aten.native_layer_norm.default", 0): fmt,
        ("aten.addmm.default", 0): fmt,
        ("aten.add.Tensor", 0): fmt,
    }
    prob = compress(build_problem(prof, formats=(fmt,)))
    picks = []
    for g in prob.groups:
        kinds = [c.kind for c in g.choices["none"]]
        want = saves.get(g.op.key, "keep")
        assert want == "keep" or want in kinds, (g.op.key, kinds)
        picks.append(kinds.index(want) if want in kinds else 0)
    a = Assignment(tuple("none" for _ in prob.regions), tuple(picks))
    predicted = int(profile_of(prob, a).max())
    regions = tuple(
        dataclasses.replace(
            r, mode="none", saves=dict(saves), held_bytes=r.input_bytes + held_of(prob, a, i)
        )
        for i, r in enumerate(free.regions)
    )
    p = dataclasses.replace(free, regions=regions, predicted_peak=predicted, budget=predicted)
    h = autoac.apply_plan(model, p)
    try:
        measured = autoac.measure_step(model, step).peak_bytes
    finally:
        h.remove()
    assert measured == predicted
