"""The one-launch schedule builder (``_triton/_tiles.py``) against the PyTorch builders of
``_schedule.py``: the same tiles, heaviest first, the int32 offsets, valid padding.
Runs in the Triton interpreter on the CPU (and on a GPU as it is)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrec.jagged_attn._triton._schedule import (
    kv_tile_schedule,
    q_tile_schedule,
    work_upper_bound,
)

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

from hyperrec.jagged_attn._triton._tiles import _BINS, CAUSAL_RUNS_ENV, causal_runs, tile_schedule

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)


def _offsets(lens, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()],
                        dtype=dtype, device=DEVICE)  # fmt: skip


def _check(q_lens, k_lens, *, causal, block, kv_tiles, kv_index=None, dtype=torch.int64,
           same=False, max_len=None):  # fmt: skip
    qo = _offsets(q_lens, dtype)
    ko = qo if same else _offsets(k_lens, dtype)
    ki = None if kv_index is None else torch.tensor(kv_index, dtype=torch.int32, device=DEVICE)
    n = len(k_lens) if kv_tiles else len(q_lens)
    tokens = int((ko if kv_tiles else qo)[-1])
    upper = work_upper_bound(tokens, n, block)
    longest = max([*q_lens, *k_lens, 0])
    q32, k32, seq, idx, total = tile_schedule(qo, ko, ki, block, causal, upper,
                                              longest if max_len is None else max_len,
                                              kv_tiles=kv_tiles)  # fmt: skip
    qi, ko32 = qo.to(torch.int32), ko.to(torch.int32)
    if kv_tiles:
        r_seq, r_idx, r_total, *_ = kv_tile_schedule(qi, ko32, None, block, causal, tokens)
        lq, lk = torch.tensor(q_lens), torch.tensor(k_lens)
    else:
        r_seq, r_idx, r_total = q_tile_schedule(qi, ko32, ki, block, causal, tokens)
        lq = torch.tensor(q_lens)
        lk = torch.tensor(k_lens)[ki.long().cpu()] if ki is not None else torch.tensor(k_lens)
    t = int(total)
    assert t == int(r_total)
    assert q32.dtype == k32.dtype == torch.int32
    assert torch.equal(q32, qi) and torch.equal(k32, ko32)
    if dtype == torch.int32:
        assert q32 is qo  # int32 offsets are used as they are
    got = sorted(zip(seq[:t].tolist(), idx[:t].tolist()))
    assert got == sorted(zip(r_seq[:t].tolist(), r_idx[:t].tolist()))  # the same tiles
    # heaviest first: costs (the PyTorch builder's model) never increase by more than a
    # bucket's width
    s, i = seq[:t].long().cpu(), idx[:t].long().cpu()
    if kv_tiles:
        work = lq[s]
        if causal:
            work = (lq[s] - (i * block - (lk[s] - lq[s])).clamp(min=0)).clamp(min=0)
    else:
        work = lk[s]
        if causal:
            last = torch.minimum((i + 1) * block, lq[s]) + lk[s] - lq[s]
            work = torch.minimum(lk[s], last).clamp(min=0)
    gran = max(1, -(-((longest if max_len is None else max_len) + block + 1) // _BINS))
    bucket = ((work + block) // gran).clamp(max=_BINS - 1)
    runs = not causal or causal_runs()
    if runs:
        # a sequence's tiles are one run, heaviest first (programs running side by side
        # share its keys and values in L2; interleaved, the H200 forward lost ~20%), and
        # runs come heaviest first by their heaviest tile
        heads = []
        for q in set(s.tolist()):
            pos = (s == q).nonzero().flatten()
            assert bool((pos[1:] - pos[:-1] == 1).all()), (q, pos.tolist())
            order = list(range(len(pos)))
            if causal and not kv_tiles:
                order = order[::-1]
            assert i[pos].tolist() == order
            assert int(bucket[pos].max()) == int(bucket[pos[0]])
            heads.append((int(pos[0]), int(bucket[pos[0]])))
        b = [bk for _, bk in sorted(heads)]
        assert all(x >= y for x, y in zip(b, b[1:]))
    else:
        assert bool((bucket[1:] <= bucket[:-1]).all()) or t < 2
    # padding entries: a valid tile of the last sequence
    assert bool((seq[t:] == n - 1).all()) and bool((idx[t:] == 0).all())


def test_examples():
    _check([5, 0, 40, 17], [5, 0, 40, 17], causal=True, block=16, kv_tiles=False, same=True)
    _check([5, 0, 40, 17], [5, 0, 40, 17], causal=True, block=16, kv_tiles=True, same=True)
    _check([3, 30, 1], [20, 2, 0, 9], causal=True, block=16, kv_tiles=False, kv_index=[0, 3, 1])
    _check([40, 1], [8, 33], causal=False, block=16, kv_tiles=True, dtype=torch.int32)
    _check([0, 0], [0, 0], causal=False, block=16, kv_tiles=False)  # no tile at all
    # a max_len below the real maximum (validate=False with a wrong bound): same tiles
    _check([100, 7], [100, 7], causal=True, block=16, kv_tiles=False, max_len=4)


def test_causal_runs_switch(monkeypatch):
    monkeypatch.delenv(CAUSAL_RUNS_ENV, raising=False)
    monkeypatch.delenv("JAGGED_ATTN_GLUON_DYNAMIC", raising=False)
    assert causal_runs()  # the default since 0.2.18
    monkeypatch.setenv("JAGGED_ATTN_GLUON_DYNAMIC", "0")  # the fixed order: per tile
    assert not causal_runs()
    monkeypatch.setenv(CAUSAL_RUNS_ENV, "1")  # unless asked for
    assert causal_runs()
    monkeypatch.delenv("JAGGED_ATTN_GLUON_DYNAMIC")
    monkeypatch.setenv(CAUSAL_RUNS_ENV, "x")
    with pytest.raises(ValueError, match=CAUSAL_RUNS_ENV):
        causal_runs()
    monkeypatch.setenv(CAUSAL_RUNS_ENV, "0")
    assert not causal_runs()
    # per tile: costs never increase along the table (checked by _check)
    _check([5, 0, 40, 17, 33], [5, 0, 40, 17, 33], causal=True, block=16, kv_tiles=False,
           same=True)  # fmt: skip
    _check([5, 0, 40, 17, 33], [5, 0, 40, 17, 33], causal=True, block=16, kv_tiles=True,
           same=True)  # fmt: skip
    monkeypatch.setenv(CAUSAL_RUNS_ENV, "1")
    assert causal_runs()
    _check([5, 0, 40, 17, 33], [5, 0, 40, 17, 33], causal=True, block=16, kv_tiles=False,
           same=True)  # fmt: skip
    _check([5, 0, 40, 17, 33], [5, 0, 40, 17, 33], causal=True, block=16, kv_tiles=True,
           same=True)  # fmt: skip
    _check([3, 30, 1], [20, 2, 0, 9], causal=True, block=16, kv_tiles=False, kv_index=[0, 3, 1])


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_matches_pytorch_builder(data):
    n = data.draw(st.integers(1, 9), label="B")
    q_lens = data.draw(st.lists(st.integers(0, 70), min_size=n, max_size=n), label="Lq")
    kv_tiles = data.draw(st.booleans(), label="key tiles")
    same = data.draw(st.booleans(), label="self-attention")
    mapped = not kv_tiles and not same and data.draw(st.booleans(), label="map")
    n_kv = data.draw(st.integers(1, 5), label="Bk") if mapped else n
    k_lens = q_lens if same else data.draw(st.lists(st.integers(0, 70), min_size=n_kv,
                                                    max_size=n_kv), label="Lk")  # fmt: skip
    kv_index = (
        data.draw(st.lists(st.integers(0, n_kv - 1), min_size=n, max_size=n)) if mapped else None
    )
    _check(q_lens, k_lens, causal=data.draw(st.booleans(), label="causal"),
           block=data.draw(st.sampled_from([16, 32]), label="block"), kv_tiles=kv_tiles,
           kv_index=kv_index, same=same,
           dtype=data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (not the interpreter)")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_large_batches(causal):
    # thousands of sequences (several steps of the kernel's loops), zeros, long ones
    g = torch.Generator().manual_seed(1)
    u = torch.rand(5000, generator=g, dtype=torch.float64)
    lens = (2048 * u**2.8).floor().long().tolist()  # power law, many zeros and ones
    lens[17] = 2048
    for kv_tiles in (False, True):
        _check(lens, lens, causal=causal, block=128, kv_tiles=kv_tiles, same=True)
    k_lens = torch.randint(0, 300, (700,), generator=g).tolist()
    kv_index = torch.randint(0, 700, (5000,), generator=g).tolist()
    _check(lens, k_lens, causal=causal, block=64, kv_tiles=False, kv_index=kv_index)
