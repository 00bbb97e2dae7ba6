"""The compose stack end to end: docker-compose.yml as users run it, built and brought up with
docker-compose 1.29 (tests/compose/conftest.py). Redis, two gateways behind nginx, two scripted
workers (model "scripted", 8 requests at a time each, 20 tokens/s), one vLLM CPU worker on the
tiny model ("tiny"), a scripted encoder ("scripted-embed"), Prometheus and Alertmanager. The
tests run in file order on one stack; each leaves it as it found it, except the last, which
stops the vLLM worker.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from shared import keys
from tests.compose.conftest import TIMINGS, models
from tests.compose.harness import ROOT, metric_sum, run
from tests.procs import wait_for

pytestmark = pytest.mark.compose

WORDS = ["fleet", "of", "workers"]
SLOTS_PER_WORKER = 8  # LLMFLEET_MAX_CONCURRENCY of `scripted` in docker-compose.test.yml


def client(stack) -> openai.OpenAI:
    # No retries: a 503 or a dropped connection must show, not be retried away.
    return openai.OpenAI(base_url=f"{stack.api}/v1", api_key="unused", max_retries=0, timeout=120)


def scripted_text(max_tokens: int) -> str:
    return " ".join((WORDS * max_tokens)[:max_tokens])


@dataclass
class StreamRun:
    """One streamed chat completion, followed from another thread."""

    text: str = ""
    finish_reason: str | None = None
    error: Exception | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0


def stream(api: openai.OpenAI, max_tokens: int, model: str = "scripted", **options) -> StreamRun:
    result = StreamRun()

    def follow() -> None:
        try:
            for chunk in api.chat.completions.create(model=model, max_tokens=max_tokens, stream=True,
                                                     messages=[{"role": "user", "content": " ".join(WORDS)}],
                                                     **options):
                if chunk.choices and chunk.choices[0].delta.content:
                    result.text += chunk.choices[0].delta.content
                    result.first_token.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    result.finish_reason = chunk.choices[0].finish_reason
        except Exception as exc:  # noqa: BLE001 - what the client saw is the result
            result.error = exc
        finally:
            result.ended_at = time.monotonic()
            result.first_token.set()

    threading.Thread(target=follow, daemon=True).start()
    return result


def wait_ended(runs: list[StreamRun], timeout: float) -> None:
    wait_for(lambda: all(r.ended_at for r in runs), timeout, f"{len(runs)} streams to end", interval=0.2)


def live_workers(stack, model: str) -> float:
    return max(metric_sum(g, 8000, "llmfleet_gateway_live_workers", model=model) for g in stack.running("gateway"))


def wait_live_workers(stack, model: str, count: int) -> None:
    wait_for(lambda: live_workers(stack, model) == count, 60, f"{count} live workers of {model}", interval=0.5)


def test_the_openai_sdk_streams_through_nginx_to_both_models(stack):
    api = client(stack)
    wait_for(lambda: "tiny" in models(stack.api), 900, "the vLLM worker to load the tiny model", interval=2)
    TIMINGS["vllm_worker_ready_after_up_s"] = round(time.time() - stack.started_at, 1)
    for model in ("scripted", "tiny"):
        request = {"model": model, "max_tokens": 12, "temperature": 0,
                   "messages": [{"role": "user", "content": " ".join(WORDS)}]}
        whole = api.chat.completions.create(**request).choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           api.chat.completions.create(**request, stream=True) if chunk.choices)
        assert whole and streamed == whole, model
    assert whole != scripted_text(12)  # the last answer came from vLLM, not from the scripted engine


def test_a_killed_worker_fails_its_streams_fast_and_the_other_serves_the_queue(stack):
    """SIGKILL one scripted worker while both are full of streams that no other worker can go on
    with (they ask for a JSON object: a structured output's state is more than its text): its 8
    streams end with an error within 5 s, the other's 8 finish, and the 4 requests waiting in the
    queue are served by the survivor."""
    api = client(stack)
    victim, survivor = stack.running("scripted")
    served_before = metric_sum(survivor, 8001, "llmfleet_worker_requests_total", finish_reason="length")
    running = [stream(api, max_tokens=200, response_format={"type": "json_object"})  # 10 s each
               for _ in range(2 * SLOTS_PER_WORKER)]
    for run_ in running:
        assert run_.first_token.wait(30) and run_.error is None, run_.error
    queued = [stream(api, max_tokens=10) for _ in range(4)]
    wait_for(lambda: metric_sum(survivor, 8001, "llmfleet_worker_in_flight") == SLOTS_PER_WORKER, 5,
             "the survivor to be full")
    killed_at = time.monotonic()
    run("docker", "kill", victim.id)
    wait_ended(running + queued, 60)

    failed = [r for r in running if r.error is not None]
    finished = [r for r in running if r.error is None]
    delays = sorted(round(r.ended_at - killed_at, 2) for r in failed)
    TIMINGS["killed_worker_error_delays_s"] = delays
    assert len(failed) == SLOTS_PER_WORKER and delays[-1] < 5, delays
    assert all("worker" in str(r.error).lower() for r in failed), [str(r.error) for r in failed]
    assert all(r.finish_reason == "length" and r.text == scripted_text(200) for r in finished)
    assert all(r.error is None and r.text == scripted_text(10) for r in queued), [r.error for r in queued]
    served = metric_sum(survivor, 8001, "llmfleet_worker_requests_total", finish_reason="length") - served_before
    assert served == SLOTS_PER_WORKER + 4

    stack("up", "-d", "--no-recreate", "--scale", "scripted=2", "scripted")  # starts the killed container again
    stack.wait_healthy("scripted", 2, 60)
    wait_live_workers(stack, "scripted", 2)


def test_a_killed_workers_streams_go_on_on_the_other_worker(stack):
    """docker kill of a scripted worker in the middle of greedy and sampled streams: the other
    worker takes them over and each client reads its whole text, with no error (a greedy stream's
    replay is joined where its client stood, a sampled one is continued from there:
    docs/reliability.md)."""
    api = client(stack)
    workers = stack.running("scripted")
    gateways = stack.running("gateway")
    migrated_before = sum(metric_sum(g, 8000, "llmfleet_gateway_migrations_total") for g in gateways)
    # 10 s each: still in flight when the kill lands on a loaded machine (3 s streams had ended by then once)
    runs = [stream(api, max_tokens=200, temperature=t) for t in (0, 0, 0.8, 0.8, 0, 0.8)]
    for run_ in runs:
        assert run_.first_token.wait(30) and run_.error is None, run_.error
    holding = {w.id: metric_sum(w, 8001, "llmfleet_worker_in_flight") for w in workers}
    victim = max(workers, key=lambda w: holding[w.id])
    killed_at = time.monotonic()
    run("docker", "kill", victim.id)
    try:
        wait_ended(runs, 60)
        assert all(r.error is None for r in runs), [str(r.error) for r in runs]
        assert all(r.finish_reason == "length" and r.text == scripted_text(200) for r in runs), [r.text for r in runs]
        TIMINGS["greedy_streams_after_a_kill_ended_s"] = sorted(round(r.ended_at - killed_at, 2) for r in runs)
        migrated = sum(metric_sum(g, 8000, "llmfleet_gateway_migrations_total") for g in gateways) - migrated_before
        assert migrated == holding[victim.id] > 0
    finally:  # the next tests start from two workers, whatever this one found
        stack("up", "-d", "--no-recreate", "--scale", "scripted=2", "scripted")  # starts the killed container again
        stack.wait_healthy("scripted", 2, 60)
        wait_live_workers(stack, "scripted", 2)


def test_scaling_workers_up_takes_load_without_restarting_anything(stack):
    before = {c.name: (c.id, c.started_at) for c in stack.containers() if c.running}
    stack("up", "-d", "--no-recreate", "--scale", "scripted=3", "scripted")
    (added,) = [c for c in stack.running("scripted") if c.name not in before]
    stack.wait_healthy("scripted", 3, 60)
    wait_live_workers(stack, "scripted", 3)

    api = client(stack)
    runs = [stream(api, max_tokens=60) for _ in range(3 * SLOTS_PER_WORKER)]  # more than the old two can run
    wait_ended(runs, 60)
    assert all(r.error is None and r.text == scripted_text(60) for r in runs)
    assert metric_sum(added, 8001, "llmfleet_worker_requests_total") >= SLOTS_PER_WORKER
    after = {c.name: (c.id, c.started_at) for c in stack.containers() if c.running}
    assert {name: after.get(name) for name in before} == before  # nothing recreated or restarted


def test_a_gateway_stopped_mid_stream_finishes_its_streams_and_refuses_nothing(stack):
    """`docker stop` (SIGTERM) of a gateway carrying open streams, while new requests keep coming
    through nginx: every stream finishes, and no new request gets an error or a 503."""
    api = client(stack)
    runs = [stream(api, max_tokens=200) for _ in range(20)]  # 10 s each
    for run_ in runs:
        assert run_.first_token.wait(30) and run_.error is None, run_.error
    victim = stack.running("gateway")[0]
    on_victim = metric_sum(victim, 8000, "llmfleet_gateway_open_requests")
    assert on_victim > 0

    probes: list[str] = []
    stopping = threading.Event()

    def probe() -> None:
        while not stopping.is_set():
            try:
                api.chat.completions.create(model="scripted", max_tokens=2,
                                            messages=[{"role": "user", "content": "probe"}])
                probes.append("200")
            except openai.APIStatusError as exc:
                probes.append(str(exc.status_code))
            except openai.APIError as exc:
                probes.append(type(exc).__name__)

    try:
        with ThreadPoolExecutor(3) as pool:
            for _ in range(3):
                pool.submit(probe)
            stop_started = time.monotonic()
            run("docker", "stop", "-t", "40", victim.id, timeout=60)
            drained_in = time.monotonic() - stop_started
            # Not a wait for anything: the probes go on for 5 s after the gateway exited, past the
            # 2 s nginx may still use its cached address (deploy/nginx.conf).
            time.sleep(5)
            stopping.set()
        wait_ended(runs, 30)
        (stopped,) = [c for c in stack.containers("gateway") if c.id == victim.id]
    finally:  # the later tests want both gateways, whatever this one found
        stopping.set()
        stack("up", "-d", "--no-recreate", "gateway")  # starts the stopped gateway again
        stack.wait_healthy("gateway", 2, 60)

    TIMINGS["drain"] = {"streams": len(runs), "on_stopped_gateway": on_victim, "drained_in_s": round(drained_in, 1),
                        "probes": len(probes), "probe_failures": [p for p in probes if p != "200"]}
    assert stopped.exit_code == 0 and drained_in < 30
    assert all(r.error is None and r.finish_reason == "length" and r.text == scripted_text(200) for r in runs), \
        [str(r.error) for r in runs if r.error]
    assert len(probes) > 10 and set(probes) == {"200"}, TIMINGS["drain"]


def _panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/llmfleet.json").read_text())
    # As Grafana sends them with the model variable on "All" ($__rate_interval: 4 scrapes).
    return [(panel["title"], target["expr"].replace("$model", ".*").replace("$__rate_interval", "1m"))
            for panel in dashboard["panels"] if panel["type"] != "row" for target in panel["targets"]]


def _has_data(prometheus: str, expr: str, start: float) -> bool:
    """A range query over the tier's run, as a dashboard panel draws it, has a finite value."""
    result = httpx.get(f"{prometheus}/api/v1/query_range", timeout=10,
                       params={"query": expr, "start": start, "end": time.time(), "step": "10s"}).json()
    assert result["status"] == "success", (expr, result)
    return any(math.isfinite(float(v)) for series in result["data"]["result"] for _t, v in series["values"])


def test_every_target_is_up_and_every_dashboard_panel_has_data(stack):
    prometheus = stack.url("prometheus", 9090)
    api = client(stack)
    # Traffic the earlier tests did not make: a client that hangs up mid-stream (a cancel) and a
    # malformed entry on a request stream (a poison message). Then both models answer again, so
    # the last minute has traffic.
    with httpx.stream("POST", f"{stack.api}/v1/chat/completions", timeout=30,
                      json={"model": "scripted", "max_tokens": 100, "stream": True,
                            "messages": [{"role": "user", "content": "hang up"}]}) as response:
        next(response.iter_lines())
    redis = stack.running("redis")[0]
    run("docker", "exec", redis.id, "redis-cli", "XADD", keys.request_stream("scripted"), "*", "not-an-envelope", "1")
    for model in ("scripted", "tiny"):
        for _ in range(3):
            api.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hello"}])
    for _ in range(3):  # and the encoder, through the same gateways
        embedded = api.embeddings.create(model="scripted-embed", input=["hello world", "good night"])
        assert len(embedded.data) == 2 and embedded.usage.prompt_tokens == 4

    def targets() -> list[dict]:
        return httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def all_up() -> bool:
        jobs = [t["labels"]["job"] for t in targets() if t["health"] == "up"]
        return len(jobs) == len(targets()) and jobs.count("llmfleet-gateway") == 2 and \
            jobs.count("llmfleet-worker") == 5 and {"prometheus", "alertmanager"} <= set(jobs)

    wait_for(all_up, 60, "every target (2 gateways, 3 scripted + 1 encoder + 1 vLLM workers, Prometheus, "
             "Alertmanager) up",
             interval=2)

    queries = _panel_queries()
    assert len(queries) >= 20
    missing = list(queries)

    def all_have_data() -> bool:
        missing[:] = [(title, expr) for title, expr in missing if not _has_data(prometheus, expr, stack.started_at)]
        return not missing

    try:
        wait_for(all_have_data, 90, "every panel's query to return data", interval=5)
    except TimeoutError:
        pytest.fail(f"panels without data: {missing}")
    assert httpx.post(f"{prometheus}/-/reload", timeout=5).status_code == 403  # no lifecycle API


def test_a_model_without_workers_raises_an_alert_in_alertmanager(stack):
    alertmanager = stack.url("alertmanager", 9093)

    def active(model: str) -> list[dict]:
        alerts = httpx.get(f"{alertmanager}/api/v2/alerts", timeout=5).json()
        return [a for a in alerts if a["labels"].get("alertname") == "LlmfleetModelWithoutWorkers"
                and a["labels"].get("model") == model and a["status"]["state"] == "active"]

    assert not active("tiny")
    stack("stop", "worker")  # the vLLM worker drains and deregisters
    stopped_at = time.monotonic()
    wait_live_workers(stack, "tiny", 0)
    # What the alert says: the model's requests fail (after the queue timeout, 20 s here). One is
    # sent now, and waits out its queue timeout while the alert fires.
    with ThreadPoolExecutor(1) as beside:
        refused = beside.submit(client(stack).chat.completions.create, model="tiny", max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}])
        (alert,) = wait_for(lambda: active("tiny"), 120, "LlmfleetModelWithoutWorkers for tiny in Alertmanager",
                            interval=2)
        TIMINGS["alert_in_alertmanager_after_s"] = round(time.monotonic() - stopped_at, 1)
        assert alert["labels"]["severity"] == "critical"
        assert not active("scripted")
        with pytest.raises(openai.APIStatusError) as failed:
            refused.result(timeout=120)
    assert failed.value.status_code == 503
