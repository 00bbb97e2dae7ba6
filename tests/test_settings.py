"""The gateway's and the worker's settings are their CLI: one option per setting, with its default,
documented; and the deploy files repeat no default."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import yaml
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


def _defaults() -> dict[str, object]:
    """Every LLMFLEET_* variable the processes read, and its default (the settings', or the CLI's own)."""
    found: dict[str, object] = {}
    for command in (llmfleet.main, llmfleet.main.commands["gateway"], llmfleet.main.commands["worker"]):
        for param in command.params:
            if isinstance(param, click.Option) and param.default is not None:
                found[param.envvar or f"LLMFLEET_{param.name.upper()}"] = param.default
    return found


def _same(value: str, default: object) -> bool:
    if isinstance(default, bool):
        return value.lower() == str(default).lower()
    if isinstance(default, int | float):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    return value == str(default)


def _deploy_settings() -> list[tuple[str, str, str]]:
    """(file, variable, value) of every LLMFLEET_* variable a deploy file sets: a compose file's
    `${VAR:-value}` counts as `value`, the fallback it gives."""
    root = README.parent
    found = []
    for path in (root / "docker-compose.yml", root / "deploy/docker-compose.gpu.yml"):
        for variables in _environments(yaml.safe_load(path.read_text())):
            for name, value in variables.items():
                if name.startswith("LLMFLEET_") and isinstance(value, str):
                    fallback = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
                    found.append((path.name, name, fallback.group(1) if fallback else value))
    config = yaml.safe_load((root / "deploy/k8s/base/config.yaml").read_text())
    found += [("config.yaml", name, value) for name, value in config["data"].items() if name.startswith("LLMFLEET_")]
    return found


def _environments(node):
    if isinstance(node, dict):
        if isinstance(node.get("environment"), dict):
            yield node["environment"]
        for value in node.values():
            yield from _environments(value)


def test_the_deploy_files_repeat_no_default() -> None:
    """A deploy file sets what it changes; a default lives in the settings alone (an empty value
    leaves it), so changing one there changes every deployment."""
    defaults = _defaults()
    assert {"LLMFLEET_MAX_CONCURRENCY", "LLMFLEET_REQUEST_TIMEOUT", "LLMFLEET_LOG_LEVEL"} <= set(defaults)
    settings = _deploy_settings()
    assert len(settings) > 10
    repeated = [(file, name, value) for file, name, value in settings
                if value != "" and name in defaults and _same(value, defaults[name])]
    assert repeated == []
