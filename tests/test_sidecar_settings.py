"""predictor-sidecar's settings and command line, with no data, server or MLflow: the model's validation, and the
flags derived from its fields (one flag per field, with the field's default, type and choices; a refused value is one
line naming its flag)."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from predictor.sidecar.cli import FLAG_GROUPS, _check, build_parser, flag_name, flag_type
from predictor.sidecar.settings import DEFAULT_MODEL, SidecarSettings

pytestmark = pytest.mark.unit

FIELDS = SidecarSettings.model_fields


def flags() -> dict[str, argparse.Action]:
    """The parser's actions by destination, --help left out."""
    return {a.dest: a for a in build_parser()._actions if a.dest != "help"}


def test_defaults_are_valid_and_suit_a_small_cpu_machine():
    s = SidecarSettings()
    assert s.model == DEFAULT_MODEL and s.host == "127.0.0.1" and s.port == 8100
    assert s.workers == 1 and s.threads is None and s.precision == "fp32" and not s.ort_spin


@pytest.mark.parametrize(("field", "value"), [
    ("port", 0), ("port", 65536), ("max_batch", 0), ("max_wait_ms", -0.5), ("threads", 0), ("workers", 0),
    ("workers", 65), ("token_budget", 0), ("precision", "fp16"), ("max_body_bytes", 1023), ("lru_size", 0),
    ("reload_interval", -1.0), ("window_size", 0), ("window_seconds", 0.0), ("padding", -0.01), ("log_level", "trace"),
])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValidationError) as exc:
        SidecarSettings(**{field: value})
    assert [e["loc"] for e in exc.value.errors()] == [(field,)]


@pytest.mark.parametrize(("field", "value"), [
    ("port", 1), ("port", 65535), ("max_wait_ms", 0.0), ("threads", None), ("threads", 1), ("workers", 64),
    ("precision", "int8"), ("max_body_bytes", 1024), ("reload_interval", 0.0), ("padding", 0.0), ("alarm_margin", -0.5),
])
def test_boundary_values_are_accepted(field, value):
    assert getattr(SidecarSettings(**{field: value}), field) == value


def test_unknown_fields_are_refused_and_settings_are_frozen():
    with pytest.raises(ValidationError):
        SidecarSettings(max_batchh=8)
    s = SidecarSettings()
    with pytest.raises(ValidationError):
        s.port = 9000


def test_every_field_has_a_described_flag_and_every_flag_a_field():
    actions = flags()
    assert set(actions) == set(FIELDS)
    for name, field in FIELDS.items():
        assert field.description, f"{name} has no description (it is the flag's help)"
        assert actions[name].option_strings == [flag_name(name)]
    grouped = [n for names in FLAG_GROUPS.values() for n in names]
    assert len(grouped) == len(set(grouped)) and set(grouped) <= set(FIELDS), "FLAG_GROUPS names a field twice or not at all"


@pytest.mark.parametrize("name", list(FIELDS))
def test_each_flag_has_its_fields_default_type_and_choices(name):
    action, field = flags()[name], FIELDS[name]
    assert action.default == field.default
    if field.annotation is bool:  # off by default: --switch turns it on; on by default: --no-switch turns it off
        assert isinstance(action, argparse._StoreFalseAction if field.default else argparse._StoreTrueAction)
        return
    kind, choices = flag_type(field)
    assert action.type is kind and kind in (str, int, float)
    assert action.choices == choices


def test_no_flags_give_the_default_settings():
    p = build_parser()
    assert _check(p.parse_args([]), p) == SidecarSettings()


def test_flags_reach_the_settings():
    p = build_parser()
    s = _check(p.parse_args(["--model", "models:/m/3", "--port", "9001", "--max-wait-ms", "0.5", "--threads", "2",
                             "--precision", "int8", "--ort-spin", "--reload-interval", "0", "--log-level", "debug"]), p)
    assert (s.model, s.port, s.max_wait_ms, s.threads, s.precision, s.ort_spin, s.reload_interval, s.log_level) == \
        ("models:/m/3", 9001, 0.5, 2, "int8", True, 0.0, "debug")


def test_feedback_store_flags_reach_the_settings():
    p = build_parser()
    s = _check(p.parse_args(["--no-store-prompts", "--feedback-db", "/tmp/x.db", "--feedback-max-rows", "50",
                             "--feedback-max-age-days", "0.5"]), p)
    assert (s.store_prompts, s.feedback_store, s.feedback_db, s.feedback_max_rows, s.feedback_max_age_days) == \
        (False, True, "/tmp/x.db", 50, 0.5)
    assert _check(p.parse_args(["--no-feedback-store"]), p).feedback_store is False
    assert SidecarSettings().store_prompts and SidecarSettings().feedback_max_rows == 200_000


@pytest.mark.parametrize(("argv", "message"), [
    (["--feedback-max-rows", "0"], "--feedback-max-rows is out of range: 0"),
    (["--feedback-max-age-days", "0"], "--feedback-max-age-days is out of range: 0.0"),
])
def test_a_refused_store_flag_exits_2(argv, message, capsys):
    p = build_parser()
    with pytest.raises(SystemExit) as exc:
        _check(p.parse_args(argv), p)
    assert exc.value.code == 2 and capsys.readouterr().err == f"predictor-sidecar: error: {message} (see --help)\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "70000"], "--port must be between 1 and 65535, got 70000"),
    (["--max-batch", "0"], "--max-batch is out of range: 0"),
    (["--window-seconds", "0"], "--window-seconds is out of range: 0.0"),
    (["--workers", "65"], "--workers is out of range: 65"),
    (["--max-body-bytes", "10"], "--max-body-bytes is out of range: 10"),
])
def test_a_refused_flag_exits_2_with_one_line_naming_it(argv, message, capsys):
    p = build_parser()
    with pytest.raises(SystemExit) as exc:
        _check(p.parse_args(argv), p)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == f"predictor-sidecar: error: {message} (see --help)\n"


def test_help_shows_each_flag_in_its_group_with_its_default():
    text = build_parser().format_help()
    for title, names in FLAG_GROUPS.items():
        section = text.split(f"{title}:\n", 1)[1].split("\n\n", 1)[0]
        for name in names:
            assert flag_name(name) in section, f"{flag_name(name)} is not under '{title}'"
    words = " ".join(text.split())  # --help wraps to the terminal's width
    assert "(default: 100000)" in words and "(default: fp32)" in words
