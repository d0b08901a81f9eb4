"""Bad-input catalogue of hyperrec.integration's public metrics and configs.

One line per case: the call, the exception type, and a substring of the message that
names the argument (or config field) as the caller spelled it; every type must also be
listed in the ``Raises:`` section of the public function's docstring. The CLI's own
checks are tested with the CLI (``test_train.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrec.integration import (
    DataConfig,
    ModelConfig,
    Preset,
    TrainConfig,
    auc,
    get_preset,
    log_loss,
    normalized_entropy,
    override,
)
from hyperrec.integration.config import micro
from hyperrec.integration.metrics import WindowedAUC, calibration, task_metrics
from hyperrec.testing.bad_inputs import (
    case,
    catalogue_tests,
    rejects_cleanly,
)

T = TypeError
V = ValueError
nan, inf = math.nan, math.inf
P = torch.tensor([0.2, 0.7, 0.9])
Y = torch.tensor([0.0, 1.0, 1.0])
DATA = dict(num_items=64, num_topics=4, num_users=16, max_seqlen=8)
MODEL = dict(dim=16, heads=2, seq_layers=1)
TRAIN = dict(steps=10, global_batch_size=64)
PRESET = micro()


def _preset(**changes):
    return dataclasses.replace(PRESET, **changes)


def _update(scores, labels):
    WindowedAUC(2).update(scores, labels)


CASES = [
    # auc
    case(T, "scores", auc, [0.1, 0.2], Y[:2]),
    case(T, "labels", auc, P, [0, 1, 1]),
    case(T, "scores", auc, P.to(torch.complex64), Y),
    case(V, "equal length", auc, P, Y[:2]),
    case(V, "scores and labels", auc, P[None], Y[None]),
    case(V, "scores", auc, torch.tensor([0.1, nan, 0.3]), Y),
    case(V, "scores", auc, torch.tensor([0.1, inf, 0.3]), Y),
    case(V, "labels", auc, P, torch.tensor([0.0, 2.0, 1.0])),
    case(V, "labels", auc, P, torch.tensor([0.0, 0.5, 1.0])),
    # log_loss / normalized_entropy / calibration
    case(V, "log_loss: probs", log_loss, torch.tensor([1.5, 0.2, 0.3]), Y),
    case(V, "log_loss: probs", log_loss, torch.tensor([-0.1, 0.2, 0.3]), Y),
    case(V, "log_loss: probs", log_loss, torch.tensor([]), torch.tensor([])),
    case(T, "log_loss: probs", log_loss, 0.5, Y),
    case(V, "normalized_entropy: probs", normalized_entropy, torch.tensor([1.5, 0.2, 0.3]), Y),
    case(V, "normalized_entropy: probs", normalized_entropy, torch.tensor([nan, 0.2, 0.3]), Y),
    case(V, "normalized_entropy: labels", normalized_entropy, P, torch.tensor([0.0, 3.0, 1.0])),
    case(V, "normalized_entropy: probs", normalized_entropy, P, Y[:1]),
    case(T, "normalized_entropy: probs", normalized_entropy, [0.2], Y[:1]),
    case(V, "calibration: probs", calibration, torch.tensor([nan, 0.2, 0.3]), Y),
    case(T, "calibration: labels", calibration, P, None),
    # task_metrics (every input checked before any metric)
    case(T, "p_ctr", task_metrics, [0.1], P, Y, Y),
    case(T, "conversion", task_metrics, P, P, Y, None),
    case(V, "p_ctr", task_metrics, torch.tensor([1.2, 0.1, 0.1]), P, Y, Y),
    case(V, "p_cvr", task_metrics, P, torch.tensor([0.1, -0.1, 0.1]), Y, Y),
    case(V, "click", task_metrics, P, P, torch.tensor([0.0, 2.0, 1.0]), Y),
    case(V, "conversion", task_metrics, P, P, Y, torch.tensor([0.0, 1.0, 7.0])),
    case(V, "p_cvr and conversion", task_metrics, P, P[:2], Y, Y),
    case(V, "p_cvr", task_metrics, P, torch.tensor([nan, 0.1, 0.1]), Y, Y),
    # WindowedAUC
    case(V, "window", WindowedAUC, 0),
    case(T, "window", WindowedAUC, 2.0),
    case(T, "window", WindowedAUC, True),
    case(T, "scores", _update, [0.1], Y, doc=WindowedAUC.update),
    case(V, "labels", _update, P, torch.tensor([0.0, 5.0, 1.0]), doc=WindowedAUC.update),
    case(V, "scores", _update, torch.tensor([nan, 0.1, 0.1]), Y, doc=WindowedAUC.update),
    # DataConfig
    case(V, "DataConfig.num_topics", DataConfig, **{**DATA, "num_topics": 1}),
    case(T, "DataConfig.num_items", DataConfig, **{**DATA, "num_items": 64.0}),
    case(V, "DataConfig.num_items", DataConfig, **{**DATA, "num_items": 63}),
    case(V, "DataConfig.min_seqlen", DataConfig, **DATA, min_seqlen=9),
    case(V, "DataConfig.min_seqlen", DataConfig, **DATA, min_seqlen=-1),
    case(V, "DataConfig.seqlen_alpha", DataConfig, **DATA, seqlen_alpha=0.0),
    case(V, "DataConfig.seqlen_scale", DataConfig, **DATA, seqlen_scale=nan),
    case(T, "DataConfig.item_zipf", DataConfig, **DATA, item_zipf="1.05"),
    case(V, "DataConfig.user_zipf", DataConfig, **DATA, user_zipf=6.0),
    case(V, "DataConfig.noise_std", DataConfig, **DATA, noise_std=-0.1),
    case(V, "DataConfig.base_ctr_logit", DataConfig, **DATA, base_ctr_logit=inf),
    case(V, "DataConfig.eval_requests", DataConfig, **DATA, eval_requests=0),
    case(T, "DataConfig.seed", DataConfig, **DATA, seed=None),
    case(T, "DataConfig.max_candidates", DataConfig, **DATA, max_candidates=True),
    # ModelConfig
    case(T, "ModelConfig.dim", ModelConfig, **{**MODEL, "dim": 16.0}),
    case(V, "ModelConfig.heads", ModelConfig, **{**MODEL, "heads": 3}),
    case(V, "ModelConfig.heads", ModelConfig, **{**MODEL, "heads": 0}),
    case(V, "ModelConfig.seq_layers", ModelConfig, **{**MODEL, "seq_layers": -1}),
    case(V, "ModelConfig.block_attention_layers", ModelConfig, **MODEL, block_attention_layers=2),
    case(V, "ModelConfig.activation", ModelConfig, **MODEL, activation="tanh"),
    case(T, "ModelConfig.mlp_dims", ModelConfig, **MODEL, mlp_dims=[64]),
    case(T, "ModelConfig.mlp_dims", ModelConfig, **MODEL, mlp_dims=(64.0,)),
    case(V, "ModelConfig.head_dims", ModelConfig, **MODEL, head_dims=(32, 0)),
    case(V, "ModelConfig.dropout", ModelConfig, **MODEL, dropout=1.0),
    case(V, "ModelConfig.dropout", ModelConfig, **MODEL, dropout=nan),
    case(T, "ModelConfig.cross_rank", ModelConfig, **MODEL, cross_rank=0.5),
    # TrainConfig
    case(V, "TrainConfig.steps", TrainConfig, **{**TRAIN, "steps": 0}),
    case(T, "TrainConfig.steps", TrainConfig, **{**TRAIN, "steps": 10.0}),
    case(V, "sub_batch_size", TrainConfig, **{**TRAIN, "global_batch_size": 100}),
    case(V, "TrainConfig.lr", TrainConfig, **TRAIN, lr=nan),
    case(V, "TrainConfig.lr", TrainConfig, **TRAIN, lr=0.0),
    case(V, "TrainConfig.weight_decay", TrainConfig, **TRAIN, weight_decay=2.0),
    case(V, "TrainConfig.grad_clip", TrainConfig, **TRAIN, grad_clip=-1.0),
    case(V, "TrainConfig.amp", TrainConfig, **TRAIN, amp="fp8"),
    case(V, "TrainConfig.sharding", TrainConfig, **TRAIN, sharding="ddp"),
    case(T, "TrainConfig.validate_inputs", TrainConfig, **TRAIN, validate_inputs=1),
    case(V, "TrainConfig.window_steps", TrainConfig, **TRAIN, window_steps=0),
    case(V, "TrainConfig.cpu_threads", TrainConfig, **TRAIN, cpu_threads=-1),
    case(V, "world_size", TrainConfig(**TRAIN).sub_batches_per_rank, 3),
    case(V, "world_size", TrainConfig(**TRAIN).sub_batches_per_rank, 0),
    case(T, "world_size", TrainConfig(**TRAIN).sub_batches_per_rank, "2"),
    # Preset / get_preset / override
    case(T, "Preset.model", _preset, model=None, doc=Preset),
    case(T, "Preset.name", _preset, name=3, doc=Preset),
    case(
        V,
        "attn_block_size",
        _preset,
        model=dataclasses.replace(PRESET.model, block_attention_layers=1, attn_block_size=10_000),
        doc=Preset,
    ),
    case(V, "'huge'", get_preset, "huge"),
    case(T, "name", get_preset, 3),
    case(T, "preset", override, "tiny", ["model.dim=64"]),
    case(T, "assignments", override, PRESET, "model.dim=64"),
    case(T, "assignments", override, PRESET, [("model.dim", 64)]),
    case(V, "section.field=value", override, PRESET, ["model.dim"]),
    case(V, "section", override, PRESET, ["optim.lr=1"]),
    case(V, "no field 'width'", override, PRESET, ["model.width=3"]),
    case(V, "model.dim", override, PRESET, ["model.dim=1.5"]),
    case(V, "train.lr", override, PRESET, ["train.lr=fast"]),
    case(V, "train.validate_inputs", override, PRESET, ["train.validate_inputs=maybe"]),
    case(V, "model.mlp_dims", override, PRESET, ["model.mlp_dims=64,x"]),
    case(V, "ModelConfig.heads", override, PRESET, ["model.heads=7"]),
    case(V, "assigned twice", override, PRESET, ["model.dim=32", "model.dim=64"]),
]


test_bad_input_is_rejected_naming_the_argument, test_exception_type_is_documented = catalogue_tests(
    CASES
)


def test_catalogue_size():
    assert len(CASES) >= 80


# ----------------------------------------------------------------------------- fuzzing
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_PROB = st.one_of(st.floats(0, 1), st.sampled_from([-0.5, 1.5, nan, inf]))


@_FUZZ
@given(
    probs=st.lists(_PROB, max_size=8),
    labels=st.lists(st.sampled_from([0.0, 1.0, 2.0, 0.5]), max_size=8),
)
def test_fuzz_normalized_entropy(probs, labels):
    good = (
        len(probs) == len(labels) >= 1
        and all(0 <= p <= 1 for p in probs)
        and all(y in (0.0, 1.0) for y in labels)
    )
    p, y = torch.tensor(probs, dtype=torch.float64), torch.tensor(labels)
    err = rejects_cleanly(normalized_entropy, p, y)
    assert (err is None) == good, err
    if err is not None:
        assert "log_loss" not in str(err), err  # names its own function


@_FUZZ
@given(
    assignments=st.lists(
        st.sampled_from(
            [
                "model.dim=32",
                "model.dim=x",
                "train.steps=5",
                "train.steps=0",
                "data.seed=3",
                "data.nope=1",
                "x.y=1",
                "model.dim",
                "=",
                "model.mlp_dims=8,4",
                "train.amp=bf16",
            ]
        ),
        max_size=4,
    )
)
def test_fuzz_override(assignments):
    err = rejects_cleanly(override, PRESET, assignments)
    bad = {"model.dim=x", "train.steps=0", "data.nope=1", "x.y=1", "model.dim", "="}
    fields = [a.partition("=")[0] for a in assignments]
    twice = len(fields) != len(set(fields))
    assert (err is None) == (not bad.intersection(assignments) and not twice), err
