"""vLLM's engine core dies under a running request: the request fails, the worker exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.vllm


def _children(pid: int) -> list[tuple[int, str]]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                found.append((child, (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_engine_death_fails_requests_and_exits_non_zero(redis_url, tiny_model_dir, redis_client):
    worker = start_worker(redis_url, tiny_model_dir, "--max-model-len", "2048", "--enforce-eager", "--dtype",
                          "float32", engine="vllm", served_name="tiny-doomed", env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                          timeout=240)
    gateway = start_gateway(redis_url)
    try:
        wait_until_served(gateway, "tiny-doomed")
        body = {"model": "tiny-doomed", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900,
                "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            engines = [pid for pid, cmd in _children(worker.pid) if "resource_tracker" not in cmd]
            assert engines, f"no engine process under the worker: {_children(worker.pid)}"
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] in (500, 502) and rest[-1] == "data: [DONE]"
        print(f"engine death surfaced to the client after {time.monotonic() - killed_at:.2f}s")
        assert worker.popen.wait(60) != 0
        assert not list(redis_client.scan_iter(match=f"llmfleet:worker:*-{worker.pid}-*"))
        wait_for(lambda: "tiny-doomed" not in {m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]},
                 10, "the dead worker to leave the registry")
    finally:
        gateway.stop()
        worker.kill()
