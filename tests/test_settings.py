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


def _readme_rows() -> list[tuple[list[str], list[str], str]]:
    """(options, processes, default cell) of each row of README's Configuration table."""
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            rows.append((re.findall(r"`(--[a-z-]+)`", cells[0]), [p.strip() for p in cells[1].split(",")], cells[2]))
    return rows


def _readme_default(cell: str, option: click.Option, index: int, of: int) -> object:
    """What README's default cell says of the `index`th of `of` options of its row, in the option's
    terms: `...` where it defers (vLLM's, a prose default)."""
    literals = re.findall(r"`([^`]*)`", cell)
    if literals:
        said = literals[index] if len(literals) == of else literals[0]
        return ... if said.startswith("--") else said  # `--model`: another option's value
    if cell in ("on", "off"):
        return cell == "on" if option.is_flag else None if cell == "off" else cell
    if cell == "none":
        return "" if option.default == "" else None if option.default is None else "none"
    return ...


def test_readmes_configuration_table_says_what_help_says() -> None:
    """Each option README's table lists exists on the processes it names, with the default it gives."""
    commands = {"gateway": llmfleet.main.commands["gateway"], "worker": llmfleet.main.commands["worker"]}
    rows = _readme_rows()
    assert len(rows) > 40
    for options, processes, cell in rows:
        for process in processes:
            command_list = [llmfleet.main, *commands.values()] if process == "all" else [commands[process]]
            for index, name in enumerate(options):
                found = [p for c in command_list for p in c.params if isinstance(p, click.Option) and name in p.opts]
                assert found, f"README lists {name} for {process}, which has no such option"
                said = _readme_default(cell, found[0], index, len(options))
                if said is ... or found[0].required:
                    continue
                default = found[0].default
                assert _same(str(said), default) if default not in (None, "") else said in (None, ""), \
                    f"README says {name} defaults to {cell}; --help says {default!r}"


def test_help_names_no_source_files_and_cuts_no_command_short() -> None:
    for args in ([], ["gateway"], ["worker"], ["up"], ["keys"], ["keys", "create"], ["tiny-model"]):
        text = CliRunner().invoke(llmfleet.main, [*args, "--help"], terminal_width=80).output
        assert not re.search(r"\b[\w/]+\.py\b", text), (args, re.findall(r"\b[\w/]+\.py\b", text))
        assert "..." not in text.split("Commands:")[-1] if "Commands:" in text else True, text


def test_a_json_option_takes_an_object_and_refuses_anything_else() -> None:
    """--custom-histogram-buckets, as vllm serve takes it: the engine gets the object, parsed."""
    param = next(p for p in llmfleet.main.commands["worker"].params if p.name == "custom_histogram_buckets")
    buckets = param.type.convert('{"inter_token_latency": [0.001, 0.002]}', param, None)
    assert WorkerSettings(model="m", custom_histogram_buckets=buckets).engine_args()["custom_histogram_buckets"] == {
        "inter_token_latency": [0.001, 0.002]}
    for bad, why in (("[0.001]", "must be a JSON object"), ("{inter_token_latency", "not JSON")):
        with pytest.raises(click.BadParameter, match=why):
            param.type.convert(bad, param, None)
    assert "custom_histogram_buckets" not in WorkerSettings(model="m").engine_args()
