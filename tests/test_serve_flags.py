"""``lengthwise serve``'s flags against :class:`GatewaySettings`, the one definition of the gateway's settings.

Every flag sets one field and takes its default from it (``serving/gateway/cli.py: _setting``); these tests fail if a
flag comes to restate a default of its own, or sets no field.
"""

from __future__ import annotations

import argparse
import json

import pytest

from serving.gateway.cli import BACKEND_FLAGS, add_parser, settings_from_args
from serving.gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit


def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``lengthwise`` with only its ``serve`` command, as serving/cli.py adds it; and ``serve``'s own parser."""
    root = argparse.ArgumentParser(prog="lengthwise")
    return root, add_parser(root.add_subparsers(dest="command", required=True))


def test_every_flag_sets_a_field_and_has_its_default():
    flags = [a for a in parsers()[1]._actions if a.option_strings and a.dest != "help" and a.dest not in BACKEND_FLAGS]
    assert len(flags) >= 30 and not set(BACKEND_FLAGS) & set(GatewaySettings.model_fields)
    for action in flags:
        field = GatewaySettings.model_fields.get(action.dest)
        assert field is not None, f"{action.option_strings[0]} sets no GatewaySettings field ({action.dest})"
        default = json.loads(action.default) if action.dest == "scheduler_config" else action.default  # JSON text
        assert default == field.get_default(call_default_factory=True), f"{action.option_strings[0]}'s default"


def test_serve_without_flags_gives_the_settings_defaults():
    parser, _ = parsers()
    assert settings_from_args(parser.parse_args(["serve", "--model", "m"])) == GatewaySettings(model="m")
    a = parser.parse_args(["serve", "--engine-url", "http://e:1", "--no-feedback", "--engines", "1", "--t-p", "0.5"])
    assert settings_from_args(a) == GatewaySettings(engine_urls=["http://e:1"], feedback=False, t_p_s=0.5)


def test_the_operators_slo_kind_reaches_the_plugin_knobs():
    parser, _ = parsers()
    s = settings_from_args(parser.parse_args(["serve", "--model", "m", "--slo-kind", "ttft+tpot", "--slo-ttft-ms", "400"]))
    assert s.scheduler_config["knobs"] == {"slo_kind": "ttft+tpot", "ttft_s": 0.4}
    kept = settings_from_args(parser.parse_args(["serve", "--model", "m", "--slo-kind", "normalised", "--scheduler-config",
                                                 '{"knobs": {"slo_kind": "jct", "padding": 0.2}}']))
    assert kept.scheduler_config["knobs"] == {"slo_kind": "jct", "padding": 0.2}  # the plug-in settings win
    assert "knobs" not in settings_from_args(parser.parse_args(["serve", "--model", "m"])).scheduler_config
