"""TrainConfig is the one definition of the predictor job's settings: the command line's flags and the MLflow
params a run logs must read the same defaults and types back."""

from __future__ import annotations

import argparse
import types
import typing

import pytest
from pydantic import ValidationError

from training.cli import build_parser, config_from_args
from training.config import TrainConfig
from training.pipeline import config_from_params

# flags whose argparse default differs from the field's on purpose: --data is required; --bucket-width stays None
# so --edges can be told apart, and config_from_args fills in the field's default when neither is given
NOT_DEFAULTED = {"data", "bucket_width"}


def _flags() -> dict[str, argparse.Action]:
    return {a.dest: a for a in build_parser()._actions if a.dest in TrainConfig.model_fields}


def _base_type(annotation: object) -> object:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


@pytest.mark.unit
def test_every_flag_of_a_field_has_its_default_and_type():
    flags = _flags()
    assert set(TrainConfig.model_fields) - set(flags) == {"baselines"}  # set by --no-baselines
    for name, action in flags.items():
        field = TrainConfig.model_fields[name]
        kind = _base_type(field.annotation)
        if name not in NOT_DEFAULTED:
            assert action.default == field.default, name
        if kind is bool:
            assert action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction), name
        elif kind in (int, float):  # the type itself, or a checker that returns it (e.g. "0 or more")
            assert action.type is kind or type(action.type("1")) is kind, name
        elif typing.get_origin(kind) is typing.Literal:
            assert tuple(action.choices) == typing.get_args(kind), name
        elif kind is str or typing.get_origin(kind) is list:  # a list as one comma-separated string
            assert action.type in (None, str), name
        else:
            pytest.fail(f"--{name.replace('_', '-')}: a {kind} field needs its flag checked here")


@pytest.mark.unit
def test_no_flags_give_the_fields_defaults():
    assert config_from_args(build_parser().parse_args(["--data", "d.json"])) == TrainConfig(data="d.json")


@pytest.mark.unit
def test_flags_reach_their_fields():
    a = build_parser().parse_args(["--data", "d", "--edges", "64,128", "--max-samples", "0", "--lora-targets", "q,v",
                                   "--no-register", "--alias", "", "--no-baselines", "--no-length-hints", "--lr", "0.01",
                                   "--label", "soft", "--rank-loss-weight", "0.25"])
    cfg = config_from_args(a)
    assert (cfg.edges, cfg.bucket_width, cfg.max_samples, cfg.lora_targets) == ("64,128", None, None, ["q", "v"])
    assert (cfg.register, cfg.alias, cfg.baselines, cfg.length_hints, cfg.lr) == (None, None, False, False, 0.01)
    assert (cfg.label, cfg.rank_loss_weight) == ("soft", 0.25)


@pytest.mark.unit
def test_logged_params_read_back_as_the_config():
    cfg = TrainConfig(data="d", tokenizer=None, first_turn_only=True, bucket_width=None, edges="64,128", max_samples=None,
                      lr=0.003, lora_targets=["query", "value"], register=None, promote=True, padding=0.2,
                      label="soft", rank_loss_weight=0.5)
    params = {k: str(v)[:500] for k, v in cfg.model_dump().items()}  # as run() logs them
    assert config_from_params(params) == cfg
    params["lora_targets"] = "query,value"  # run() logs the resolved targets comma-joined
    assert config_from_params(params) == cfg
    assert config_from_params({"data": "d", "unrelated": "1"}) == TrainConfig(data="d")


@pytest.mark.unit
def test_every_field_is_described_and_unknown_ones_are_refused():
    assert all(f.description for f in TrainConfig.model_fields.values())
    with pytest.raises(ValidationError):
        TrainConfig(data="d", epoch=3)
