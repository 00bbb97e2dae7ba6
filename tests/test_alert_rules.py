"""The alert rules of deploy/alerts.yml, unit-tested with `promtool test rules` (Debian's
`prometheus` package; `make test` installs it): every alert fires on the series that should raise
it and stays quiet on a near miss (deploy/alerts.test.yml)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("LLMFLEET_COMPOSE_REQUIRED"):  # CI: `make test` installs it
            pytest.fail("promtool is missing (Debian package prometheus)")
        pytest.skip("no promtool (Debian package prometheus)")
    return promtool


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    tests = yaml.safe_load((DEPLOY / "alerts.test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", ()) if case.get("exp_alerts")}
    assert alerts - fired == set(), "alerts without a unit test where they fire"
    assert fired <= alerts


def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = subprocess.run([_promtool(), "test", "rules", "alerts.test.yml"], cwd=DEPLOY,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
