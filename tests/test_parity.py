"""Parity with `vllm serve`: the same battery to both servers, every answer identical.

See tests/parity/: `vllm serve` and llmfleet (gateway, Redis, vLLM worker) run side by side on
the tiny model with the same engine options; each case goes to both and the answers are compared
field by field, ignoring only ids and timestamps. Every valid chat/completions case is also read
through the official openai SDK. The table and any differences go to the test log directory.
"""

from __future__ import annotations

import pytest

from tests.parity import battery_messages, battery_responses
from tests.parity.battery import build
from tests.parity.harness import details, run_battery, running_servers, summary
from tests.procs import LOG_DIR

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_battery_covers_the_surface():
    cases = build()
    assert len(cases) >= 60 and sum(c.invalid for c in cases) >= 20
    assert sum(c.stream for c in cases) >= 20
    assert {c.feature for c in cases} >= {"sampling", "n>1", "logprobs", "stream_options", "structured", "tools",
                                          "reasoning", "messages", "tokenize", "errors"}


def test_messages_battery_covers_the_surface():
    cases = battery_messages.build()
    assert len(cases) >= 40 and sum(c.invalid for c in cases) >= 10 and sum(c.stream for c in cases) >= 10
    assert {c.feature for c in cases} >= {"anthropic text", "anthropic stop", "anthropic tools", "anthropic thinking",
                                          "anthropic count_tokens", "anthropic errors"}


def test_responses_battery_covers_the_surface():
    cases = battery_responses.build()
    assert len(cases) >= 40 and sum(c.invalid for c in cases) >= 10 and sum(c.stream for c in cases) >= 10
    assert {c.feature for c in cases} >= {"responses", "structured", "tools", "reasoning", "errors"}


def test_every_answer_matches_vllm_serve(tiny_model_dir):
    with running_servers(tiny_model_dir) as servers:  # its own Redis: no other test's workers
        results = run_battery(servers)
    report = summary(results)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "parity-report.md").write_text(report + "\n\n" + details(results) + "\n")
    print("\n" + report)
    assert all(r.identical for r in results), "\n" + report + "\n\n" + details(results)
