"""The compose tier's stack: brought up once, for tests/compose/test_stack.py, from the images
tests/compose/preparation.py builds while the rest of the suite runs. How long each step took goes
to the log directory (compose-tier-timings.json), with the builds' and the stack's logs.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.compose.harness import elapsed
from tests.compose.preparation import PREPARATION, SERVICES, TIMINGS
from tests.procs import LOG_DIR, wait_for


@pytest.fixture(scope="module")  # down before the rest of the suite runs
def stack():
    session_start = time.monotonic()
    try:
        stack = PREPARATION.wait()
        started = time.monotonic()
        stack.started_at = time.time()
        try:
            stack("up", "-d", "--no-build", "--scale", "scripted=2", *SERVICES)
            stack.wait_healthy("lb", 1, 120)
            stack.wait_healthy("scripted", 2, 60)
            stack.api = stack.url("lb", 8000)
            wait_for(lambda: "scripted" in models(stack.api), 30, "the scripted model to be served")
            TIMINGS["up_s"] = elapsed(started)
            yield stack
        finally:
            stack.save_logs()
            started = time.monotonic()
            stack("down", "-v", "--remove-orphans", "-t", "10")
            TIMINGS["down_s"] = elapsed(started)
            TIMINGS["session_s"] = elapsed(session_start)
            (LOG_DIR / "compose-tier-timings.json").write_text(json.dumps(TIMINGS, indent=2))
    finally:
        PREPARATION.stop()


def models(api: str) -> list[str]:
    try:
        return [m["id"] for m in httpx.get(f"{api}/v1/models", timeout=5).json()["data"]]
    except (httpx.HTTPError, KeyError, ValueError):
        return []
