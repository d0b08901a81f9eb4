import dataclasses

import pytest

from hyperrec.integration import PRESETS, DataConfig, ModelConfig, TrainConfig, get_preset, override
from hyperrec.integration.model import estimate_memory


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_are_frozen(name):
    preset = get_preset(name)
    assert preset.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.model.dim = 1  # type: ignore[misc]
    assert preset.train.global_batch_size % preset.train.sub_batch_size == 0


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (
            ModelConfig,
            {"dim": 30, "heads": 4, "seq_layers": 1},
            r"heads \(4\) must divide ModelConfig.dim \(30\)",
        ),
        (
            ModelConfig,
            {"dim": 32, "heads": 2, "seq_layers": 1, "block_attention_layers": 2},
            "block_attention_layers",
        ),
        (ModelConfig, {"dim": 32, "heads": 2, "seq_layers": 1, "activation": "tanh"}, "activation"),
        (ModelConfig, {"dim": 32, "heads": 2, "seq_layers": 1, "dropout": 1.0}, "dropout"),
        (ModelConfig, {"dim": 0, "heads": 1, "seq_layers": 1}, "ModelConfig.dim"),
        (
            DataConfig,
            {"num_items": 100, "num_topics": 8, "num_users": 5, "max_seqlen": 8},
            "multiple of num_topics",
        ),
        (
            DataConfig,
            {"num_items": 64, "num_topics": 8, "num_users": 5, "max_seqlen": 8, "min_seqlen": 9},
            "min_seqlen",
        ),
        (
            DataConfig,
            {
                "num_items": 64,
                "num_topics": 8,
                "num_users": 5,
                "max_seqlen": 8,
                "seqlen_alpha": 0.0,
            },
            "seqlen_alpha",
        ),
        (
            TrainConfig,
            {"steps": 10, "global_batch_size": 100, "sub_batch_size": 32},
            "multiple of sub_batch_size",
        ),
        (TrainConfig, {"steps": 0, "global_batch_size": 64}, "TrainConfig.steps"),
        (TrainConfig, {"steps": 10, "global_batch_size": 64, "lr": float("nan")}, "TrainConfig.lr"),
        (TrainConfig, {"steps": 10, "global_batch_size": 64, "amp": "fp8"}, "TrainConfig.amp"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (ModelConfig, {"dim": 32.0, "heads": 2, "seq_layers": 1}, "ModelConfig.dim must be an int"),
        (
            ModelConfig,
            {"dim": 32, "heads": True, "seq_layers": 1},
            "ModelConfig.heads must be an int",
        ),
        (ModelConfig, {"dim": 32, "heads": 2, "seq_layers": 1, "mlp_dims": [64]}, "mlp_dims"),
        (
            TrainConfig,
            {"steps": 10, "global_batch_size": 64, "validate_inputs": 1},
            "validate_inputs",
        ),
    ],
)
def test_wrong_types_raise_type_error(cls, kwargs, match):
    with pytest.raises(TypeError, match=match):
        cls(**kwargs)


def test_configs_are_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(32, 2, 1)  # type: ignore[misc]


def test_sub_batches_per_rank():
    cfg = TrainConfig(steps=1, global_batch_size=256, sub_batch_size=32)
    assert [cfg.sub_batches_per_rank(w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="sub_batch_size \\* world_size"):
        cfg.sub_batches_per_rank(3)


def test_override_parses_types_and_revalidates(micro):
    p = override(
        micro,
        ["model.dim=32", "model.mlp_dims=64,8", "train.lr=1e-3", "train.validate_inputs=false"],
    )
    assert (p.model.dim, p.model.mlp_dims, p.train.lr, p.train.validate_inputs) == (
        32,
        (64, 8),
        1e-3,
        False,
    )
    assert p.data == micro.data
    with pytest.raises(ValueError, match="must divide"):
        override(micro, ["model.heads=3"])
    with pytest.raises(ValueError, match="has no field 'width'"):
        override(micro, ["model.width=3"])
    with pytest.raises(ValueError, match="section"):
        override(micro, ["optim.lr=3"])
    with pytest.raises(ValueError, match="expected an int"):
        override(micro, ["train.steps=ten"])
    with pytest.raises(ValueError, match="section.field=value"):
        override(micro, ["steps"])


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_preset("huge")


def test_h200_preset_fills_one_h200():
    est = estimate_memory(get_preset("h200"))
    gb = est.total / 1e9
    assert 80 <= gb <= 140, f"h200 estimate {gb:.1f} GB"
    assert est.parameters > 2e9 and est.embedding_parameters / est.parameters > 0.9


def test_tiny_is_small():
    est = estimate_memory(get_preset("tiny"))
    assert est.parameters < 1_000_000 and est.total < 1e8


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name):
    import json

    from hyperrec.integration import Preset

    preset = get_preset(name)
    assert Preset.from_dict(json.loads(json.dumps(preset.to_dict()))) == preset


def test_event_log_presets_override_and_round_trip():
    import json

    from hyperrec.integration import EventLogConfig, Preset

    tiny = get_preset("tiny")
    log = dataclasses.replace(tiny, data=EventLogConfig(path="events.csv", max_seqlen=64))
    changed = override(
        log,
        ["data.rating_threshold=4", "data.dense_columns=price,age", "data.shuffle=false",
         "train.epochs=3", "train.early_stopping_patience=2"],
    )  # fmt: skip
    assert changed.data.rating_threshold == 4.0 and changed.data.dense_columns == ("price", "age")
    assert changed.data.shuffle is False and changed.train.epochs == 3
    assert override(changed, ["data.rating_threshold=none"]).data.rating_threshold is None
    back = Preset.from_dict(json.loads(json.dumps(changed.to_dict())))
    assert back == changed and back.to_dict()["data"]["source"] == "event_log"
    with pytest.raises(ValueError, match="attn_block_size"):
        dataclasses.replace(tiny, data=EventLogConfig(path="e.csv", max_seqlen=8))
    with pytest.raises(ValueError, match="has no field"):
        Preset.from_dict({**tiny.to_dict(), "model": {**tiny.to_dict()["model"], "depth": 2}})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks": ("cvr",)}, "DataSchema.tasks"),
        ({"num_items": 0}, "DataSchema.num_items"),
        ({"actions": ()}, "at least one action"),
        ({"dense_features": ("a", 3)}, "dense_features"),
    ],
)
def test_data_schema_is_validated(kwargs, match):
    from hyperrec.integration import DataSchema

    base = dict(num_items=4, num_categories=2, num_tags=2, actions=("a",),
                dense_features=("x",), max_seqlen=4)  # fmt: skip
    with pytest.raises((ValueError, TypeError), match=match):
        DataSchema(**{**base, **kwargs})


def test_big_presets_keep_the_logistic_baseline_small():
    # It regenerates its requests on the CPU; long histories make the default slow.
    for name, n in (("h200", 8192), ("gem", 4096)):
        assert get_preset(name).train.baseline_requests == n
    assert get_preset("tiny").train.baseline_requests == 65536


def test_seeds_and_threads_have_upper_bounds():
    """Seeds past 64 bits overflowed in torch.manual_seed / the data hash and
    ``cpu_threads=100000`` crashed torch; all are config errors naming the field now."""
    from hyperrec.integration.config import MAX_CPU_THREADS, MAX_SEED

    micro = get_preset("micro")
    for field, bad in (("train.seed", MAX_SEED + 1), ("data.seed", 2**64),
                       ("train.cpu_threads", MAX_CPU_THREADS + 1)):  # fmt: skip
        name = field.split(".")[1]
        with pytest.raises(ValueError, match=rf"Config\.{name} must be <= "):
            override(micro, [f"{field}={bad}"])
    assert override(micro, [f"train.seed={MAX_SEED}", f"data.seed={MAX_SEED}"])
    with pytest.raises(ValueError, match=r"grad_clip must be in \[0.0, inf\), got inf"):
        override(micro, ["train.grad_clip=inf"])
