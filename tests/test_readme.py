"""A newcomer's first hour: `llmfleet up` (what `make up` runs) and README's examples, as pasted.

The examples are read from README.md and from the banner `up` prints, so neither can drift from
what runs: every `python` block of README, every `bash` block that starts with
`source .venv/bin/activate`, and every command of the banner, each in a shell that has nothing of
this test's environment but a bare PATH (a new terminal). The stack is `llmfleet up --engine
scripted --embeddings` (no vLLM; the models are still called `tiny` and `tiny-embed`); the only change made to an example is the
port it names (the quick start's 8000 is this stack's free port) and, for `llmfleet keys`, the
stack's Redis in LLMFLEET_REDIS_URL. PYTHONPATH names this checkout, which the `.venv` of a
`make up` has installed in editable mode (here it may be another checkout's).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.procs import LOG_DIR, ROOT, free_port, metric_value, wait_for

pytestmark = pytest.mark.integration

README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
FRESH_SHELL = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
               "PYTHONPATH": str(ROOT)}
BANNER_END = "source "  # the banner's last command


@dataclass
class Up:
    """An `llmfleet up` process in a session of its own, as a terminal runs it."""

    popen: subprocess.Popen
    port: int
    metrics_port: int
    redis_url: str
    stdout: Path
    stderr: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def banner(self) -> str:
        return self.stdout.read_text()

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")

    def ctrl_c(self) -> None:
        """What a terminal's Ctrl-C does: SIGINT to the foreground process group (`up`'s own)."""
        os.killpg(self.popen.pid, signal.SIGINT)

    def stop(self) -> None:
        """Ctrl-C, then SIGTERM (each makes `up` stop its children in order), then SIGKILL."""
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 60), (signal.SIGKILL, None)):
            if self.popen.poll() is not None:
                return
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                continue


def start_up(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> Up:
    port, metrics_port, redis_port = free_port(), free_port(), free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.time_ns()
    stdout, stderr = LOG_DIR / f"up-{stamp}.out", LOG_DIR / f"up-{stamp}.log"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"  # nothing answers there: `up` starts its own Redis
    with stdout.open("wb") as out, stderr.open("wb") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "llmfleet", "up", "--engine", "scripted", "--port", str(port), "--metrics-port",
             str(metrics_port), "--redis-url", redis_url, *args], stdout=out, stderr=err, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    up = Up(popen, port, metrics_port, redis_url, stdout, stderr)
    if wait:
        try:
            wait_for(lambda: popen.poll() is not None or BANNER_END in up.banner(), 90, "`llmfleet up` to serve",
                     interval=0.2)
        except TimeoutError:
            up.stop()
            raise
        assert popen.poll() is None, up.log()
    return up


@pytest.fixture(scope="module")
def up():
    stack = start_up("--embeddings")  # README's embeddings examples need `tiny-embed`
    yield stack
    stack.stop()


def run_shell(script: str, up: Up, **extra_env: str) -> subprocess.CompletedProcess:
    """`script` in bash with a new terminal's environment, the quick start's port made this stack's."""
    script = script.replace("127.0.0.1:8000", f"127.0.0.1:{up.port}")
    return subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**FRESH_SHELL, **extra_env})


def banner_commands(banner: str) -> list[str]:
    """The commands the banner offers: the paragraphs after "In a new terminal:", dedented."""
    tail = banner.split("In a new terminal:", 1)[1]
    return [re.sub(r"^  ", "", part, flags=re.M).strip() for part in re.split(r"\n\s*\n", tail) if part.strip()]


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def test_up_serves_without_polling_its_own_gateway_and_exposes_both_metrics(up: Up) -> None:
    # Nothing asked the gateway anything before this scrape: the readiness wait is Redis and a TCP connect.
    assert metric_value(up.base_url, "llmfleet_gateway_requests_total") == 0
    assert "/v1/models" not in up.log()
    worker_metrics = httpx.get(f"http://127.0.0.1:{up.metrics_port}/metrics", timeout=5).text
    assert "llmfleet_worker_queue_seconds_bucket" in worker_metrics
    assert f"http://127.0.0.1:{up.metrics_port}/metrics" in up.banner()


def test_the_banners_examples_run_as_pasted_in_a_new_terminal(up: Up) -> None:
    commands = banner_commands(up.banner())
    assert [c.split()[0] for c in commands] == ["curl", f"{VENV_BIN}/python", "source"], commands
    curl, python, activate = commands
    streamed = run_shell(curl, up)
    assert streamed.returncode == 0, streamed.stderr
    events = [line.removeprefix("data: ") for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # max_tokens: a short demo
    printed = run_shell(python, up)
    assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr
    # After the banner's activate line, `python` has the SDKs and `llmfleet` is a command.
    activated = run_shell(activate.split("#")[0] + "\npython -c 'import openai, anthropic'\nllmfleet --help", up)
    assert activated.returncode == 0 and "Usage: llmfleet" in activated.stdout, activated.stderr


@pytest.mark.parametrize("index", range(len(readme_blocks("python"))))
def test_readmes_python_examples_run_as_pasted(up: Up, index: int) -> None:
    block = readme_blocks("python")[index]
    ran = run_shell(f"source {VENV_BIN}/activate\npython - <<'EXAMPLE'\n{block}EXAMPLE", up)
    assert ran.returncode == 0 and ran.stdout.strip(), f"{block}\n{ran.stderr}"


def test_readme_has_the_examples_this_test_runs() -> None:
    shell = [b for b in readme_blocks("bash") if b.startswith("source .venv/bin/activate\n")]
    assert len(readme_blocks("python")) >= 4 and len(shell) >= 2


def test_readmes_shell_examples_run_as_pasted(up: Up) -> None:
    blocks = [b for b in readme_blocks("bash") if b.startswith("source .venv/bin/activate\n")]
    for block in blocks:
        script = block.replace("source .venv/bin/activate", f"source {VENV_BIN}/activate", 1)
        ran = run_shell(script, up, LLMFLEET_REDIS_URL=up.redis_url)
        assert ran.returncode == 0, f"{block}\n{ran.stdout}\n{ran.stderr}"


def test_a_second_up_on_a_taken_port_says_who_holds_it_and_starts_nothing(up: Up) -> None:
    second = subprocess.run([sys.executable, "-m", "llmfleet", "up", "--engine", "scripted", "--port", str(up.port)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert second.returncode == 1 and second.stdout == ""  # no banner, no stack
    error = second.stderr.strip()
    assert re.fullmatch(rf"Error: port {up.port} is in use by pid \d+ \(.*llmfleet gateway.*\): .*--port N`", error), \
        error
    assert httpx.get(f"{up.base_url}/health", timeout=5).status_code == 200


def test_ctrl_c_lets_a_stream_in_flight_finish_then_stops_gateway_worker_and_redis_in_order() -> None:
    stack = start_up(env={"LLMFLEET_SCRIPTED_TOKENS_PER_SECOND": "20"})
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 40,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks = []
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not chunks:
                    stack.ctrl_c()  # two seconds of stream to go
                chunks.append(line.removeprefix("data: "))
        assert chunks[-1] == "[DONE]"
        usage = json.loads(chunks[-2])["usage"]
        assert usage["completion_tokens"] == 40, chunks[-4:]
        assert stack.popen.wait(90) == 0
        stops = re.findall(r"stopping the (\w+)", stack.log())
        assert stops == ["gateway", "worker", "redis"], stack.log()[-3000:]
        assert "Lost the connection" not in stack.log() and "Connection refused" not in stack.log()
    finally:
        stack.stop()


@pytest.mark.parametrize("command", [["keys", "list"], ["worker", "--engine", "scripted", "--model", "x"]])
def test_an_unreachable_redis_is_one_line_saying_which_url_and_what_to_do(command: list[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    ran = subprocess.run([sys.executable, "-m", "llmfleet", *command, "--redis-url", url], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert ran.returncode == 1
    assert ran.stderr.count("\n") == 1 and ran.stderr.startswith(f"Error: cannot reach Redis at {url} ("), ran.stderr
    assert "--redis-url" in ran.stderr
