"""The tests' zygote (tests/zygote.py): a child is `llmfleet` run with its own arguments, environment
and log, and its end comes back as a `subprocess.Popen`'s would."""

from __future__ import annotations

import signal
import time

import pytest

from tests.procs import LOG_DIR, free_port, start_redis
from tests.zygote import Zygote


@pytest.fixture
def plain():
    zygote = Zygote("plain", {})
    yield zygote
    assert zygote.close() == 0


def _log(name: str):
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return LOG_DIR / f"zygote-{name}-{time.time_ns()}.log"


def test_a_child_runs_llmfleet_with_its_arguments_and_its_exit_status_comes_back(plain):
    helped = plain.spawn(["--help"], {}, help_log := _log("help"))
    assert helped.wait(30) == 0
    assert "OpenAI-compatible serving" in help_log.read_text()
    wrong = plain.spawn(["no-such-command"], {}, log := _log("wrong"))
    assert wrong.wait(30) == 2  # click's usage error
    assert "No such command" in log.read_text()
    assert helped.pid != wrong.pid


def test_a_child_has_the_environment_it_asks_for_not_the_zygotes():
    """The zygote's own variables are not a child's: a child asked for without LLMFLEET_LOG_LEVEL
    runs as if it were unset, though the zygote has it (invalid); one asked for with it fails on it."""
    zygote = Zygote("plain", {"LLMFLEET_LOG_LEVEL": "bogus"})
    try:
        clean = zygote.spawn(["gateway", "--help"], {"PATH": "/usr/bin:/bin"}, clean_log := _log("clean"))
        assert clean.wait(30) == 0, clean_log.read_text()
        bogus = zygote.spawn(["gateway", "--help"], {"LLMFLEET_LOG_LEVEL": "bogus"}, bogus_log := _log("bogus"))
        assert bogus.wait(30) == 2
        assert "Invalid value for '--log-level'" in bogus_log.read_text()
    finally:
        assert zygote.close() == 0


def test_a_child_killed_reports_the_signal_and_another_stopped_reports_its_exit(plain):
    redis = start_redis()
    children = []
    try:
        args = ["gateway", "--host", "127.0.0.1", "--redis-url", redis.url]
        children.append(killed := plain.spawn([*args, "--port", str(free_port())], {}, _log("killed")))
        children.append(stopped := plain.spawn([*args, "--port", str(free_port())], {}, stopped_log := _log("stopped")))
        time.sleep(1.0)
        assert killed.poll() is None and stopped.poll() is None  # both serve until told
        killed.kill()
        assert killed.wait(30) == -signal.SIGKILL
        stopped.terminate()  # a gateway drains and exits cleanly on SIGTERM
        assert stopped.wait(60) == 0, stopped_log.read_text()[-2000:]
    finally:
        for child in children:  # a failed assertion leaves no gateway running: each killed by its PID
            if child.poll() is None:
                child.kill()
                child.wait(30)
        redis.stop()
