"""The gateway's and the worker's settings are their CLI: one option per setting, with its default,
documented; and the deploy files repeat no default."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import llmfleet
from gateway.settings import GatewaySettings
from llmfleet import options_of, settings_from
from worker.settings import WorkerSettings

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("command, settings", [("gateway", GatewaySettings), ("worker", WorkerSettings)])
def test_every_setting_is_an_option_with_its_default(command, settings) -> None:
    help_text = CliRunner().invoke(llmfleet.main, [command, "--help"], terminal_width=400).output
    for name, default, _ in options_of(settings):
        if name == "model":  # required: no default
            assert "required]" in help_text.split("--model ")[1].split("\n")[0]
            continue
        shown = ",".join(default) if isinstance(default, tuple) else default
        if isinstance(default, bool):  # a flag and its negation
            assert f"--{name} / --no-{name}" in help_text, name
            shown = name if default else f"no-{name}"
        assert f"--{name}" in help_text and f"LLMFLEET_{name.upper().replace('-', '_')}" in help_text, name
        if shown is not None:
            assert f"default: {shown if shown != '' else chr(34) * 2}" in help_text.split(f"--{name}")[1], name


def test_options_make_the_settings() -> None:
    values = {name.replace("-", "_"): default for name, default, _ in options_of(GatewaySettings)}
    values |= {"queue_timeout": 5.0, "models": "a, b,,c", "response_store_max_entries": 7}
    settings = settings_from(GatewaySettings, "redis://example:6379/1", values)
    assert (settings.redis_url, settings.queue_timeout_s, settings.models, settings.response_store_max_entries) == (
        "redis://example:6379/1", 5.0, ("a", "b", "c"), 7)
    assert settings.request_timeout_s == GatewaySettings().request_timeout_s and settings.gateway_id


@pytest.mark.parametrize("settings", [GatewaySettings, WorkerSettings])
def test_the_readme_documents_every_option(settings) -> None:
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    missing = [name for name, _, _ in options_of(settings) if f"`--{name}`" not in table]
    assert missing == []
