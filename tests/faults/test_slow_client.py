"""A client that stops reading is cut off past a bounded buffer; other streams keep flowing."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


def test_a_stalled_reader_is_cancelled_and_others_are_not_slowed(redis_url):
    model = f"firehose-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--max-model-len", "200000")
    gateway = start_gateway(redis_url, "--max-buffered-chunks", "64")
    try:
        wait_until_served(gateway, model)
        body = {"model": model, "messages": [{"role": "user", "content": "a " * 50}], "max_tokens": 150000,
                "stream": True, "n": 4}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as stalled:
            lines = stalled.iter_lines()
            next(lines)  # then stop reading
            wait_for(lambda: metric_value(gateway.url, "llmfleet_gateway_slow_client_cancels_total") == 1, 30,
                     "the gateway to give up on the stalled reader")
            wait_for(lambda: metric_value(worker.url, "llmfleet_worker_in_flight") == 0, 10, "the worker to stop")
            assert metric_value(worker.url, "llmfleet_worker_cancels_total", cause="slow_client") == 1
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            other = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "fine"}],
                                                   max_tokens=3)
            assert other.choices[0].message.content == "fine fine fine"
            lines.close()
    finally:
        gateway.stop()
        worker.stop()
