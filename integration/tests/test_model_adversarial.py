"""Adversarial checks of the GEM model's math against an independent float64 reference.

The reference (:func:`_reference`) recomputes the model's documented function from its
``state_dict`` alone, one request at a time, with plain PyTorch loops: no batching, no
padding, no jagged ops, no module of the model. The batched model (hyperrec and naive
paths, fused tables, bucketed row counts) must match it on adversarial batches: empty
histories, histories at the cap, one long history among short ones, one and many
candidates, empty tag bags, event ages on the time-bucket boundaries.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyperrec.integration import GEMModel, esmm_loss
from hyperrec.integration.config import ModelConfig
from hyperrec.integration.data import ACTIONS, Batch, DataSchema
from hyperrec.integration.model import bucket_rows

SCHEMA = DataSchema(
    num_items=40,
    num_categories=5,
    num_tags=6,
    actions=ACTIONS,
    dense_features=("a", "b", "c"),
    max_seqlen=12,
    max_candidates=5,
)

MODEL = ModelConfig(
    dim=8,
    heads=2,
    seq_layers=3,
    block_attention_layers=1,
    attn_block_size=3,
    pma_queries=2,
    time_buckets=6,
    user_hash_size=7,
    cross_layers=2,
    cross_rank=3,
    mlp_dims=(12, 6),
    head_dims=(5,),
    embedding_dim=4,
)


# -- batches ------------------------------------------------------------------------------
def _request(g: torch.Generator, length: int, candidates: int, tags: int) -> dict:
    """One request with random ids; history ages spread over every time bucket."""
    t0 = 10_000_000
    ages = torch.randint(0, 60 * 2**7, (length,), generator=g).sort(descending=True).values
    click = (torch.rand(candidates, generator=g) < 0.5).float()
    return {
        "user": int(torch.randint(0, 1000, (1,), generator=g)),
        "time": t0,
        "dense": torch.randn(SCHEMA.num_dense, generator=g),
        "tags": torch.randint(0, SCHEMA.num_tags, (tags,), generator=g),
        "items": torch.randint(0, SCHEMA.num_items, (length,), generator=g),
        "categories": torch.randint(0, SCHEMA.num_categories, (length,), generator=g),
        "actions": torch.randint(0, SCHEMA.num_actions, (length,), generator=g),
        "history_time": t0 - ages,
        "candidates": torch.randint(0, SCHEMA.num_items, (candidates,), generator=g),
        "candidate_categories": torch.randint(0, SCHEMA.num_categories, (candidates,), generator=g),
        "click": click,
        "conversion": click * (torch.rand(candidates, generator=g) < 0.5).float(),
    }


def _requests(shapes, seed=0) -> list[dict]:
    """``shapes``: (history length, candidates, tags) per request."""
    g = torch.Generator().manual_seed(seed)
    return [_request(g, *s) for s in shapes]


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)


def _batch(reqs: list[dict]) -> Batch:
    cat = lambda key: torch.cat([r[key] for r in reqs])  # noqa: E731
    click = cat("click")
    return Batch(
        sample_ids=torch.arange(len(reqs)),
        user_ids=torch.tensor([r["user"] for r in reqs]),
        request_time=torch.tensor([r["time"] for r in reqs]),
        dense=torch.stack([r["dense"] for r in reqs]),
        tag_offsets=_offsets([len(r["tags"]) for r in reqs]),
        tags=cat("tags"),
        history_offsets=_offsets([len(r["items"]) for r in reqs]),
        history_items=cat("items"),
        history_categories=cat("categories"),
        history_actions=cat("actions"),
        history_time=cat("history_time"),
        candidate_offsets=_offsets([len(r["candidates"]) for r in reqs]),
        candidate_items=cat("candidates"),
        candidate_categories=cat("candidate_categories"),
        click=click,
        conversion=cat("conversion"),
        max_history_len=max(len(r["items"]) for r in reqs),
    )


# Adversarial compositions (history length, candidates, tags), all within the caps.
CAP, MC = SCHEMA.max_seqlen, SCHEMA.max_candidates
SHAPES = {
    "mixed": [(5, 2, 1), (0, 1, 2), (CAP, MC, 0), (1, 3, 3), (7, 1, 1), (0, MC, 0), (3, 2, 2)],
    "one_request": [(6, 3, 2)],
    "one_request_at_cap": [(CAP, 1, 1)],
    "one_empty_request": [(0, 2, 1)],
    "all_empty": [(0, 1, 1), (0, MC, 0), (0, 3, 3)],
    "one_long_many_short": [(CAP, 2, 1)] + [(1, 1, 1)] * 6 + [(0, 1, 0)] * 3,
    "all_at_cap": [(CAP, 1, 2), (CAP, MC, 1)],
    "last_has_no_tags": [(2, 1, 2), (4, 2, 0)],
    "no_tags_at_all": [(3, 1, 0), (0, 2, 0)],
}


# -- the reference ------------------------------------------------------------------------
def _age_bucket(age_seconds: int, buckets: int) -> int:
    """floor(log2(1 + age / 60 min)), clamped to [0, buckets): exact, in integers."""
    k = 0
    while 60 * 2 ** (k + 1) <= 60 + max(age_seconds, 0):
        k += 1
    return min(k, buckets - 1)


def _ln(x, p, name):
    return F.layer_norm(x, (x.shape[-1],), p[f"{name}.weight"], p[f"{name}.bias"], 1e-5)


def _lin(x, p, name, bias=True):
    return F.linear(x, p[f"{name}.weight"], p[f"{name}.bias"] if bias else None)


def _act(name, x):
    return {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
        "relu": F.relu,
    }[name](x)


def _softmax_pool(q, keys, values, scale):
    """One query over a list of keys (softmax); no key: zeros."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    w = torch.softmax(keys @ q * scale, dim=0)
    return (w[:, None] * values).sum(0)


def _reference(p: dict, cfg: ModelConfig, schema: DataSchema, r: dict):
    """(ctr logits [C], cvr logits [C]) of one request, float64, from the state dict."""
    d, hd, heads, e = cfg.dim, cfg.dim // cfg.heads, cfg.heads, cfg.table_dim
    scale = 1.0 / math.sqrt(hd)
    n = len(r["items"])
    rows = []
    for j in range(n):
        age = int(r["time"]) - int(r["history_time"][j])
        rows.append(
            p["item_embedding.weight"][r["items"][j]]
            + p["category_embedding.weight"][r["categories"][j]]
            + p["action_embedding.weight"][r["actions"][j]]
            + p["time_embedding.weight"][_age_bucket(age, cfg.time_buckets)]
        )
    x = torch.stack(rows) if rows else torch.zeros(0, e, dtype=torch.float64)
    if e != d:
        x = _lin(x, p, "token_proj")
    x = _ln(x, p, "token_norm")
    for layer in range(cfg.seq_layers):
        name = f"seq_layers.{layer}"
        h = F.silu(_lin(_ln(x, p, f"{name}.norm"), p, f"{name}.uvqk"))
        u, v, q, k = h[:, :d], h[:, d : 2 * d], h[:, 2 * d : 3 * d], h[:, 3 * d :]
        a = torch.zeros(n, d, dtype=torch.float64)
        block = cfg.attn_block_size if layer < cfg.block_attention_layers else 0
        for i in range(n):
            for hh in range(heads):
                sl = slice(hh * hd, (hh + 1) * hd)
                if block:
                    js = [j for j in range(i + 1) if j // block == i // block]
                else:
                    js = list(range(i + 1))
                if block or cfg.activation == "softmax":
                    a[i, sl] = _softmax_pool(q[i, sl], k[js, sl], v[js, sl], scale)
                else:
                    for j in js:
                        w = _act(cfg.activation, scale * (q[i, sl] @ k[j, sl]))
                        a[i, sl] += w * v[j, sl] / schema.max_seqlen
        x = x + _lin(_ln(a, p, f"{name}.attn_norm") * u, p, f"{name}.out")
    x = _ln(x, p, "seq_norm")

    user = p["user_embedding.weight"][r["user"] % cfg.user_hash_size]
    tag_rows = p["tag_embedding.weight"][r["tags"]]
    tags = tag_rows.mean(0) if len(r["tags"]) else torch.zeros(e, dtype=torch.float64)
    dense = _lin(r["dense"].double(), p, "dense_proj")
    request = [user, tags, dense]
    if cfg.pma_queries:
        k, v = _lin(x, p, "pma.kv").split(d, dim=-1)
        pooled = []
        for qi in range(cfg.pma_queries):
            for hh in range(heads):
                sl = slice(hh * hd, (hh + 1) * hd)
                pooled.append(_softmax_pool(p["pma.queries"][qi, sl], k[:, sl], v[:, sl], scale))
        request.append(_lin(torch.cat(pooled), p, "pma.out"))

    ctr, cvr = [], []
    for c in range(len(r["candidates"])):
        item = p["item_embedding.weight"][r["candidates"][c]]
        cat = p["category_embedding.weight"][r["candidate_categories"][c]]
        query = item + cat
        if e != d:
            query = _lin(query, p, "candidate_proj")
        qc = _lin(query, p, "cross_attention.q")
        k, v = _lin(x, p, "cross_attention.kv").split(d, dim=-1)
        o = torch.cat(
            [
                _softmax_pool(
                    qc[hh * hd : (hh + 1) * hd],
                    k[:, hh * hd : (hh + 1) * hd],
                    v[:, hh * hd : (hh + 1) * hd],
                    scale,
                )  # fmt: skip
                for hh in range(heads)
            ]
        )
        target = _lin(o, p, "cross_attention.out")
        groups, f, start = [item, cat, target, *request], [], 0
        for g in groups:  # one LayerNorm per feature group, each with its slice
            sl = slice(start, start + g.shape[-1])
            w, b = p["feature_norm.weight"][sl], p["feature_norm.bias"][sl]
            f.append(F.layer_norm(g, (g.shape[-1],), w, b, 1e-5))
            start += g.shape[-1]
        f = torch.cat(f)
        x0, xl = f, f
        for layer in range(cfg.cross_layers):
            name = f"interaction.layers.{layer}"
            if f"{name}.weight" in p:
                y = _lin(xl, p, name)
            else:
                y = _lin(F.linear(xl, p[f"{name}.0.weight"]), p, f"{name}.1")
            xl = x0 * y + xl
        hidden = xl
        for i in range(len(cfg.mlp_dims)):
            hidden = F.silu(_lin(hidden, p, f"mlp.{3 * i}"))
        for head, out in (("ctr_head", ctr), ("cvr_head", cvr)):
            if f"{head}.weight" not in p:
                continue
            t = hidden
            for i in range(len(cfg.head_dims)):
                t = F.silu(_lin(t, p, f"{head}.mlp.{3 * i}"))
            out.append(t @ p[f"{head}.weight"] + p[f"{head}.bias"][0])
    return torch.stack(ctr), (torch.stack(cvr) if cvr else None)


def _reference_batch(model: GEMModel, reqs: list[dict]):
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    if "tables.weight" in p:
        from hyperrec.integration.model import split_tables_state_dict

        p = split_tables_state_dict(p, model.config, model.schema)
    outs = [_reference(p, model.config, model.schema, r) for r in reqs]
    ctr = torch.cat([o[0] for o in outs])
    cvr = torch.cat([o[1] for o in outs]) if outs[0][1] is not None else None
    return ctr, cvr


WEIGHT_GAIN = 3.0


def _model(cfg=MODEL, schema=SCHEMA, seed=0, **kw) -> GEMModel:
    torch.manual_seed(seed)
    model = GEMModel(cfg, schema, **kw).double().eval()
    # Non-trivial norms and biases (the defaults are 1 and 0: a wrong gather or an
    # unapplied bias would go unnoticed), and larger weights, so that every part of the
    # network moves the logits well above float32 rounding.
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                prm.add_(torch.randn_like(prm) * 0.3)
            elif prm.dim() == 2 and "embedding" not in name and "tables" not in name:
                prm.mul_(WEIGHT_GAIN)
    return model


def _double(batch: Batch) -> Batch:
    return dataclasses.replace(batch, dense=batch.dense.double())


# -- the model against the reference ------------------------------------------------------
@pytest.mark.parametrize("shapes", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("impl", ["hyperrec", "naive"])
def test_batched_model_equals_the_per_request_reference(shapes, impl):
    from hyperrec.integration.loader import validate_batch

    reqs = _requests(SHAPES[shapes])
    validate_batch(_batch(reqs), SCHEMA)  # adversarial, but a valid batch
    model = _model(impl=impl)
    with torch.no_grad():
        ctr, cvr = model(_double(_batch(reqs)))
    want_ctr, want_cvr = _reference_batch(model, reqs)
    # TaskHead casts its logit to float32 before adding the bias: float32 rounding.
    torch.testing.assert_close(ctr, want_ctr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cvr, want_cvr, rtol=1e-6, atol=1e-6)


def _bce(p, label):
    return -(label * torch.log(p) + (1 - label) * torch.log1p(-p))


def _reference_grads(model: GEMModel, reqs: list[dict]) -> dict[str, torch.Tensor]:
    """Gradients of the summed ESMM loss (written as BCE of probabilities) through the
    reference, per parameter name."""
    p = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
    total = torch.zeros((), dtype=torch.float64)
    for r in reqs:
        ctr, cvr = _reference(p, model.config, model.schema, r)
        p_ctr, p_cvr = torch.sigmoid(ctr), torch.sigmoid(cvr)
        total = total + _bce(p_ctr, r["click"].double()).sum()
        total = total + _bce(p_ctr * p_cvr, r["conversion"].double()).sum()
    total.backward()
    return {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in p.items()}


def _model_grads(model: GEMModel, batch: Batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ctr, cvr = model(batch)
    sum(esmm_loss(ctr, cvr, batch.click.double(), batch.conversion.double())).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}  # fmt: skip


@pytest.mark.parametrize("shapes", ["mixed", "all_empty", "one_request_at_cap"])
@pytest.mark.parametrize(
    ("impl", "row_buckets", "fused"),
    [("hyperrec", 0, False), ("naive", 0, False), ("hyperrec", 2, False),
     ("hyperrec", 0, True), ("naive", 2, True)],  # naive: row_buckets has no effect
)  # fmt: skip
def test_gradients_equal_the_per_request_reference(shapes, impl, row_buckets, fused):
    """Backward of every path, through empty and capped histories. Caught: the naive
    path raised on a batch whose histories are all empty (``torch.cat`` of no HSTU
    query chunk: ``naive.hstu_attention`` with ``max_len == 0``)."""
    from hyperrec.integration.model import fuse_tables_state_dict

    reqs = _requests(SHAPES[shapes], seed=1)
    model = _model(impl=impl, row_buckets=row_buckets, fused_embeddings=fused)
    model.train()  # dropout 0: the same function
    got = _model_grads(model, _double(_batch(reqs)))
    plain = _model()
    plain.load_dense_state_dict(model.state_dict())
    want = _reference_grads(plain, reqs)
    if fused:
        want = fuse_tables_state_dict(want)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "softmax"])
@pytest.mark.parametrize("impl", ["hyperrec", "naive"])
def test_every_tower_activation_equals_the_reference(activation, impl):
    cfg = dataclasses.replace(MODEL, activation=activation)
    reqs = _requests(SHAPES["mixed"], seed=2)
    model = _model(cfg, impl=impl)
    with torch.no_grad():
        ctr, cvr = model(_double(_batch(reqs)))
    want_ctr, want_cvr = _reference_batch(model, reqs)
    torch.testing.assert_close(ctr, want_ctr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cvr, want_cvr, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["hyperrec", "naive"])
@pytest.mark.parametrize("shapes", ["mixed", "all_empty", "last_has_no_tags", "no_tags_at_all"])
def test_fused_tables_equal_the_reference(impl, shapes):
    reqs = _requests(SHAPES[shapes], seed=3)
    model = _model(impl=impl, fused_embeddings=True)
    with torch.no_grad():
        ctr, cvr = model(_double(_batch(reqs)))
    want_ctr, want_cvr = _reference_batch(model, reqs)
    torch.testing.assert_close(ctr, want_ctr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cvr, want_cvr, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("row_buckets", [1, 2, 4, 1024])
@pytest.mark.parametrize("shapes", ["mixed", "one_long_many_short", "all_empty", "one_request"])
def test_row_buckets_equal_the_reference(row_buckets, shapes):
    """Bucketed row counts pad several padding sequences (capped at ``max_seqlen``, never
    shorter than the longest history) after the real ones; 1024 per octave never pads
    these small counts, 1 pads up to the next power of two."""
    reqs = _requests(SHAPES[shapes], seed=4)
    batch = _double(_batch(reqs))
    if (shapes, row_buckets) == ("one_long_many_short", 1):  # the case does what it says:
        t = batch.num_history_events  # more padding rows than the cap (18 -> 32 rows)
        assert bucket_rows(t, 1) - t > SCHEMA.max_seqlen
    model = _model(row_buckets=row_buckets)
    with torch.no_grad():
        ctr, cvr = model(batch)
    assert ctr.shape == (batch.num_candidates,)
    want_ctr, want_cvr = _reference_batch(model, reqs)
    torch.testing.assert_close(ctr, want_ctr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cvr, want_cvr, rtol=1e-6, atol=1e-6)


# -- batch composition --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("impl", "row_buckets"), [("hyperrec", 0), ("naive", 0), ("hyperrec", 1), ("hyperrec", 4)]
)
def test_a_requests_logits_do_not_depend_on_the_rest_of_its_batch(impl, row_buckets):
    """Permuted, split into pieces, or alone: the same logits per request (HSTU's 1/N is
    the cap, padding sequences and padded candidates never reach a real request). Caught
    (naive): a request with an empty history, scored alone, raised (see the gradient
    test)."""
    reqs = _requests(SHAPES["mixed"] + SHAPES["one_long_many_short"], seed=5)
    model = _model(impl=impl, row_buckets=row_buckets)

    def logits(subset):
        with torch.no_grad():
            ctr, cvr = model(_double(_batch([reqs[i] for i in subset])))
        counts = [len(reqs[i]["candidates"]) for i in subset]
        return dict(zip(subset, ctr.split(counts))), dict(zip(subset, cvr.split(counts)))

    whole = logits(list(range(len(reqs))))
    order = list(np.random.default_rng(0).permutation(len(reqs)))
    pieces = [order[:1], order[1:4], order[4:]]
    for parts in ([order], pieces, [[i] for i in order]):
        for part in parts:
            got = logits(part)
            for i in part:
                for k in (0, 1):
                    torch.testing.assert_close(got[k][i], whole[k][i], rtol=1e-9, atol=1e-9)


# -- dropout, train and eval --------------------------------------------------------------
def test_dropout_is_off_in_eval_and_the_same_draws_in_both_paths():
    """Eval mode: the reference function whatever the dropout rate. Train mode: dropout
    acts (the outputs move), and the naive path draws the same masks as the hyperrec one
    (its linear layers run on the same unpadded rows), so the same seed gives the same
    logits."""
    cfg = dataclasses.replace(MODEL, dropout=0.4)
    reqs = _requests(SHAPES["mixed"], seed=6)
    batch = _double(_batch(reqs))
    fast = _model(cfg)
    slow = _model(cfg, impl="naive")
    slow.load_state_dict(fast.state_dict())
    with torch.no_grad():
        want = _reference_batch(fast, reqs)[0]
        torch.testing.assert_close(fast(batch)[0], want, rtol=1e-6, atol=1e-6)
        fast.train(), slow.train()
        torch.manual_seed(123)
        a = fast(batch)[0]
        torch.manual_seed(123)
        b = slow(batch)[0]
    assert (a - want).abs().max() > 1e-3
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# -- non-finite dense features ------------------------------------------------------------
@pytest.mark.parametrize(("impl", "row_buckets"), [("hyperrec", 0), ("naive", 0), ("hyperrec", 1)])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_dense_feature_poisons_its_own_request_only(impl, row_buckets, bad):
    """Batch.validate rejects NaN/Inf dense features (the trainer's loader calls it); the
    model itself does not check (no host sync), and must not spread the value to the
    other requests of the batch either."""
    reqs = _requests(SHAPES["mixed"], seed=7)
    batch = _double(_batch(reqs))
    dense = batch.dense.clone()
    dense[2, 1] = bad
    model = _model(impl=impl, row_buckets=row_buckets)
    with torch.no_grad():
        clean = model(batch)[0]
        ctr = model(dataclasses.replace(batch, dense=dense))[0]
    owner = torch.repeat_interleave(torch.arange(len(reqs)), batch.candidate_offsets.diff())
    assert not torch.isfinite(ctr[owner == 2]).any()
    torch.testing.assert_close(ctr[owner != 2], clean[owner != 2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="Batch.dense contains NaN or Inf"):
        dataclasses.replace(_batch(reqs), dense=dense.float()).validate(SCHEMA)


# -- the history-age buckets --------------------------------------------------------------
def test_age_buckets_on_every_power_of_two_boundary():
    """Events one second before, at, and after each ``2^k - 1`` minutes of age, up to the
    last bucket: ``floor(log2(1 + age / 60))`` exactly (the reference computes it in
    integers)."""
    schema = dataclasses.replace(SCHEMA, max_seqlen=64)
    cfg = dataclasses.replace(MODEL, time_buckets=16, seq_layers=1, block_attention_layers=0)
    ages = sorted({max(0, 60 * (2**k - 1) + d) for k in range(16) for d in (-1, 0, 1)})
    g = torch.Generator().manual_seed(8)
    reqs = []
    for start in range(0, len(ages), 16):
        chunk = torch.tensor(ages[start : start + 16][::-1])
        r = _request(g, len(chunk), 2, 1)
        r["history_time"] = r["time"] - chunk
        reqs.append(r)
    model = _model(cfg, schema)
    with torch.no_grad():
        ctr, _ = model(_double(_batch(reqs)))
    torch.testing.assert_close(ctr, _reference_batch(model, reqs)[0], rtol=1e-6, atol=1e-6)


# -- the ESMM loss ------------------------------------------------------------------------
def _ctcvr_reference(a: torch.Tensor, b: torch.Tensor, conversion: torch.Tensor) -> torch.Tensor:
    """BCE(sigmoid(a) * sigmoid(b), conversion), float64, stable for large logits:
    ``1 - s(a) s(b) = (e^-a + e^-b + e^-(a+b)) / ((1 + e^-a)(1 + e^-b))``."""
    log_p = -F.softplus(-a) - F.softplus(-b)
    log_q = torch.logsumexp(torch.stack([-a, -b, -(a + b)]), 0) - F.softplus(-a) - F.softplus(-b)
    return -(conversion * log_p + (1 - conversion) * log_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_esmm_loss_and_gradient_at_saturated_logits(dtype):
    """Caught: ``_log1mexp`` clamped log P(click & conversion) at -1e-7, so wherever both
    logits exceeded ~16 a non-conversion's loss was flat at 16.1 and its gradient exactly
    0 (the true gradient is ~0.5 per logit): a confidently wrong CVR head was never
    corrected. The loss and its gradient must follow the float64 formula at any logit."""
    grid = torch.tensor([-30.0, -12.0, -1.0, 0.0, 3.0, 15.0, 16.5, 20.0, 30.0, 60.0, 80.0])
    a, b = torch.meshgrid(grid, grid, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    for conv in (0.0, 1.0):
        click = torch.ones_like(a)
        conversion = torch.full_like(a, conv)
        x = a.to(dtype).clone().requires_grad_()
        y = b.to(dtype).clone().requires_grad_()
        terms = []
        for i in range(a.shape[0]):  # one impression at a time: per-element values
            terms.append(esmm_loss(x[i : i + 1], y[i : i + 1], click[i : i + 1].to(dtype),
                                   conversion[i : i + 1].to(dtype))[1])  # fmt: skip
        got = torch.stack(terms)
        got.sum().backward()
        ad, bd = a.double().requires_grad_(), b.double().requires_grad_()
        want = _ctcvr_reference(ad, bd, conversion.double())
        want.sum().backward()
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.double(), ad.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(y.grad.double(), bd.grad, rtol=tol, atol=tol)


def test_esmm_loss_stays_finite_where_the_joint_probability_rounds_to_one():
    """Logits so large that log P(click & conversion) is exactly 0 in float32: the
    non-conversion's loss is clamped (large, finite) and no gradient is NaN."""
    a = torch.tensor([200.0, 200.0, 120.0], requires_grad=True)
    b = torch.tensor([200.0, 200.0, 110.0], requires_grad=True)
    ctr, ctcvr = esmm_loss(a, b, torch.ones(3), torch.tensor([0.0, 1.0, 0.0]))
    (ctr + ctcvr).backward()
    assert torch.isfinite(ctcvr) and ctcvr > 150
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()


# -- bad arguments ------------------------------------------------------------------------
def test_pma_pools_the_first_num_requests_sequences_on_both_paths():
    """``num_requests`` (the padding sequences of bucketed rows follow the real ones):
    the naive path reshaped every sequence's pooling into ``num_requests`` rows (a shape
    error), and an out-of-range value failed inside the attention naming ``kv_index``."""
    from hyperrec.integration.model import PMAPooling

    torch.manual_seed(0)
    fast = PMAPooling(8, 2, 3).double()
    slow = PMAPooling(8, 2, 3, impl="naive").double()
    slow.load_state_dict(fast.state_dict())
    offsets = torch.tensor([0, 3, 3, 7, 9, 10])
    x = torch.randn(10, 8, dtype=torch.float64)
    want = fast(x, offsets, 4)[:2]
    for model in (fast, slow):
        torch.testing.assert_close(model(x, offsets, 4, num_requests=2), want)
        for bad, err in ((6, ValueError), (0, ValueError), (2.0, TypeError)):
            with pytest.raises(err, match="num_requests"):
                model(x, offsets, 4, num_requests=bad)


def _modules():
    from hyperrec.integration.model import (
        CandidateAttention,
        CrossNetwork,
        PMAPooling,
        SequenceBlock,
        TaskHead,
    )

    return SequenceBlock, PMAPooling, CandidateAttention, CrossNetwork, TaskHead


@pytest.mark.parametrize(
    ("build", "err", "match"),
    [
        (lambda m: m[0](8, 3, max_seqlen=4), ValueError, r"heads \(3\) must divide dim \(8\)"),
        (lambda m: m[0](8, 0, max_seqlen=4), ValueError, "heads must be >= 1"),
        (lambda m: m[0](8, 2.0, max_seqlen=4), TypeError, "heads must be an int"),
        (lambda m: m[0](8, 2, max_seqlen=0), ValueError, "max_seqlen must be >= 1"),
        (lambda m: m[0](8, 2, max_seqlen=4, block_size=-1), ValueError, "block_size"),
        (lambda m: m[0](8, 2, max_seqlen=4, activation="sigmoid"), ValueError, "activation"),
        (lambda m: m[1](8, 3, 2), ValueError, "heads"),
        (lambda m: m[1](8, 2, 0), ValueError, "queries must be >= 1"),
        (lambda m: m[2](8, 3), ValueError, "heads"),
        (lambda m: m[3](8, 2, rank=-1), ValueError, "rank must be >= 0"),
        (lambda m: m[3](8, -1), ValueError, "layers must be >= 0"),
        (lambda m: m[4](8, ()), ValueError, "hidden"),
        (lambda m: GEMModel(MODEL, SCHEMA, row_buckets=3), ValueError, "row_buckets"),
        (lambda m: GEMModel(MODEL, SCHEMA, row_buckets=-2), ValueError, "row_buckets"),
        (lambda m: GEMModel(MODEL, SCHEMA, row_buckets=2.0), TypeError, "row_buckets"),
        (lambda m: GEMModel(MODEL, SCHEMA, row_buckets=True), TypeError, "row_buckets"),
    ],
    ids=[
        "seq-heads-divide",
        "seq-heads-0",
        "seq-heads-float",
        "seq-max_seqlen-0",
        "seq-block_size",
        "seq-activation",
        "pma-heads",
        "pma-queries",
        "cand-heads",
        "cross-rank",
        "cross-layers",
        "head-hidden",
        "row_buckets-3",
        "row_buckets-neg",
        "row_buckets-float",
        "row_buckets-bool",
    ],  # fmt: skip
)
def test_bad_module_arguments_are_refused_at_construction_naming_them(build, err, match):
    """Caught: each of these was accepted and failed at the first forward in a ``view``
    (heads), a ZeroDivisionError (max_seqlen 0), a reshape (the naive path's negative
    block size), the naive path only (an activation the hyperrec kernels know), an
    IndexError (no head widths); ``row_buckets`` errors named ``bucket_rows``'s
    ``per_octave``, a float or bool a ValueError."""
    with pytest.raises(err, match=match):
        build(_modules())


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        (dict(max_history_len=5), ValueError, "Batch.max_history_len = 5 but the longest"),
        (dict(max_history_len=12.0), TypeError, "Batch.max_history_len must be an int"),
    ],
    ids=["max_history_len-short", "max_history_len-float"],
)
def test_the_naive_path_validates_the_maxima_it_pads_to(change, err, match):
    """Caught: with ``validate=True`` the hyperrec path raises a ValueError for a
    ``max_history_len`` below the longest history; the naive path failed in
    ``index_put`` with "index 6 is out of bounds for dimension 1 with size 6" (a device
    assert on CUDA), and a float maximum with a ``new_zeros`` TypeError."""
    batch = dataclasses.replace(_double(_batch(_requests(SHAPES["mixed"]))), **change)
    with pytest.raises(err, match=match):
        _model(impl="naive")(batch)
    with pytest.raises((ValueError, TypeError), match="max_seqlen"):
        _model(impl="hyperrec")(batch)


def test_the_naive_path_validates_the_candidate_cap():
    """A request with more candidates than ``max_candidates`` (the naive path pads every
    request's candidates to it) was an IndexError; the hyperrec path needs no cap."""
    batch = _double(_batch(_requests(SHAPES["mixed"])))
    schema = dataclasses.replace(SCHEMA, max_candidates=MC - 1)
    with pytest.raises(ValueError, match="DataSchema.max_candidates = 4"):
        _model(schema=schema, impl="naive")(batch)
    assert _model(schema=schema)(batch)[0].shape == (batch.num_candidates,)


# -- through the trainer ------------------------------------------------------------------
def _trainer_preset(micro, **train):
    base = dict(steps=4, eval_every=0, ckpt_every=0, global_batch_size=32, sub_batch_size=16)
    base.update(train)
    return dataclasses.replace(
        micro,
        # Empty histories and histories at the cap in the same steps.
        data=dataclasses.replace(micro.data, min_seqlen=0, seqlen_scale=3.0, eval_requests=96),
        train=dataclasses.replace(micro.train, **base),
    )


@pytest.mark.parametrize(("impl", "row_buckets"), [("hyperrec", 0), ("naive", 0), ("hyperrec", 2)])
def test_a_training_step_reports_the_mean_loss_of_the_requests_it_trained(
    micro, tmp_path, impl, row_buckets
):
    """launch_step/finish_step: the reported loss is the ESMM loss of the step's requests
    (rebuilt from the ids given to ``on_step``) under the parameters before the update,
    per impression; the update then changes the parameters."""
    from hyperrec.integration import TRAIN, Trainer

    preset = _trainer_preset(micro, impl=impl, row_buckets=row_buckets)
    records = []
    trainer = Trainer(preset, out_dir=tmp_path, progress=False, on_step=records.append)
    for _ in range(2):
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        metrics = trainer.train_step()
        batch = trainer.source.batch(TRAIN, records[-1].sample_ids.numpy())
        model = GEMModel(preset.model, trainer.schema)
        model.load_state_dict(before)
        with torch.no_grad():
            ctr, cvr = model(batch)
        want = float(sum(esmm_loss(ctr, cvr, batch.click, batch.conversion))) / len(ctr)
        assert metrics["loss"] == pytest.approx(want, rel=1e-5)
        assert records[-1].loss == metrics["loss"]
        moved = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
        assert moved


def test_evaluation_does_not_depend_on_chunking_impl_or_dropout_state(micro, tmp_path, monkeypatch):
    """evaluate(): requests scored in chunks of 7 or all at once, by the hyperrec or the
    naive path, give the same record; a dropout model is scored in eval mode (the RNG
    state does not matter) and left in train mode."""
    from hyperrec.integration import VALID, Trainer
    from hyperrec.integration import trainer as trainer_module

    preset = _trainer_preset(micro)
    preset = dataclasses.replace(preset, model=dataclasses.replace(preset.model, dropout=0.3))
    trainer = Trainer(preset, out_dir=tmp_path, progress=False)
    trainer.train_step()
    torch.manual_seed(1)
    whole = trainer.evaluate(VALID)
    assert trainer.model.training
    monkeypatch.setattr(trainer_module, "_EVAL_CHUNK", 7)
    torch.manual_seed(2)
    chunked = trainer.evaluate(VALID)
    trainer.model.set_impl("naive")
    slow = trainer.evaluate(VALID)
    trainer.model.set_impl("hyperrec")
    for key in ("loss", "ctr_auc", "ctr_gauc", "ctr_ne", "cvr_auc"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
        assert slow[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert whole["impressions"] == chunked["impressions"] == slow["impressions"]


CONFIGS = {
    "square_full_rank": (
        dataclasses.replace(MODEL, embedding_dim=0, cross_rank=0, block_attention_layers=2),
        SCHEMA,
    ),
    "no_tower_no_pma_no_cross": (
        dataclasses.replace(
            MODEL, seq_layers=0, block_attention_layers=0, pma_queries=0, cross_layers=0
        ),
        SCHEMA,
    ),
    "ctr_only_one_candidate": (
        dataclasses.replace(MODEL, heads=1, pma_queries=5, head_dims=(4, 3)),
        dataclasses.replace(SCHEMA, tasks=("ctr",), max_candidates=1),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("impl", ["hyperrec", "naive"])
def test_other_model_shapes_equal_the_reference(name, impl):
    cfg, schema = CONFIGS[name]
    shapes = [(min(n, schema.max_seqlen), min(c, schema.max_candidates), g)
              for n, c, g in SHAPES["mixed"]]  # fmt: skip
    reqs = _requests(shapes, seed=9)
    model = _model(cfg, schema, impl=impl)
    with torch.no_grad():
        ctr, cvr = model(_double(_batch(reqs)))
    want_ctr, want_cvr = _reference_batch(model, reqs)
    torch.testing.assert_close(ctr, want_ctr, rtol=1e-6, atol=1e-6)
    if schema.has_conversion:
        torch.testing.assert_close(cvr, want_cvr, rtol=1e-6, atol=1e-6)
    else:
        assert cvr is None and want_cvr is None


# -- the Triton kernels (interpreted on the CPU) ------------------------------------------
def test_triton_kernels_with_the_models_call_patterns(monkeypatch):
    """The trainer's GPU path: the jagged_attn Triton kernels in bf16, with padding
    sequences after the real ones (row_buckets: candidates and PMA read the first B
    sequences through kv_index), empty histories and one at the cap. Interpreted on the
    CPU (``TRITON_INTERPRET=1``, tiny shapes), against the float32 model: within bf16
    rounding, as the PyTorch backend in bf16 is."""
    import functools

    from hyperrec import jagged_attn
    from hyperrec.integration import model as model_module
    from hyperrec.jagged_attn._triton.ops import unsupported_reason

    probe = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    # (jagged_attn takes any value but "0" as on; Triton itself only "1", "true", ...)
    on = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    if not on or unsupported_reason(probe, probe) is not None:
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on the CPU")
    cfg = dataclasses.replace(MODEL, dim=32, embedding_dim=0, cross_rank=0)  # head dim 16
    schema = dataclasses.replace(SCHEMA, max_seqlen=8)
    reqs = _requests([(5, 2, 1), (0, 1, 2), (8, 3, 0), (1, 1, 1), (3, 2, 2)], seed=10)
    batch = _batch(reqs)

    def run(row_buckets, autocast):
        torch.manual_seed(0)
        model = GEMModel(cfg, schema, row_buckets=row_buckets)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ctr, cvr = model(batch)
        sum(esmm_loss(ctr.float(), cvr.float(), batch.click, batch.conversion)).backward()
        return ctr.detach().float(), {n: p.grad for n, p in model.named_parameters()}

    want = run(0, autocast=False)
    for name in ("gdpa", "jagged_attention", "block_attention"):
        fn = functools.partial(getattr(jagged_attn, name), backend="triton")
        monkeypatch.setattr(model_module, name, fn)
    got = run(1, autocast=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-2)
    for name, g in want[1].items():
        err = (got[1][name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err < 5e-2, (name, float(err))
