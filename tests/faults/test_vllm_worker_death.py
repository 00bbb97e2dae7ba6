"""A vLLM worker SIGKILLed mid-generation: its non-streaming request is rerun by the next vLLM
worker of the model with the same answer; its stream ends with a 502 error event. Never a hang."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.faults.test_engine_failure import _children
from tests.procs import metric_value, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "Write about lighthouses."}]
ENGINE = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32"]


def _kill_with_engine(worker) -> None:
    children = [pid for pid, _cmd in _children(worker.pid)]
    worker.kill()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _vllm_worker(redis_url, model_dir, name, *args):
    return start_worker(redis_url, model_dir, *ENGINE, *args, engine="vllm", served_name=name,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=240)


def test_vllm_worker_killed_mid_generation(vllm_stack, redis_url, tiny_model_dir):
    request = {"messages": MESSAGES, "max_tokens": 1500, "temperature": 0}
    expected = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", timeout=120,
                          json={**request, "model": vllm_stack.model}).json()["choices"][0]["message"]["content"]
    name = "tiny-mortal"
    doomed = _vllm_worker(redis_url, tiny_model_dir, name)
    rescuer = None
    try:
        url = f"{vllm_stack.gateway.url}/v1/chat/completions"
        wait_until_served(vllm_stack.gateway, name)
        result: dict = {}
        rerun = threading.Thread(target=lambda: result.update(
            response=httpx.post(url, json={**request, "model": name}, timeout=180)))
        rerun.start()
        with httpx.stream("POST", url, json={**request, "model": name, "stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            wait_for(lambda: metric_value(doomed.url, "llmfleet_worker_in_flight") == 2, 20,
                     "the doomed worker to run both requests")
            _kill_with_engine(doomed)
            killed_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            surfaced = time.monotonic() - killed_at
        print(f"vLLM worker death surfaced to the streaming client after {surfaced:.2f}s")
        assert json.loads(rest[-2][6:])["error"]["code"] == 502 and rest[-1] == "data: [DONE]"
        assert surfaced < 6.0
        rescuer = _vllm_worker(redis_url, tiny_model_dir, name, "--claim-idle", "1")
        rerun.join(180)
        answer = result["response"]
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected  # the same greedy answer
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 2  # both; the stream got a 502
    finally:
        _kill_with_engine(doomed)
        if rescuer is not None:
            assert rescuer.stop(timeout=60) == 0
