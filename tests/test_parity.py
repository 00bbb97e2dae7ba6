"""Parity with `vllm serve`: the same battery to both servers, every answer identical.

See tests/parity/: `vllm serve` and llmfleet (gateway, Redis, vLLM worker) run side by side on
the tiny model with the same engine options; each case goes to both and the answers are compared
field by field, ignoring only ids and timestamps. Every valid chat/completions case is also read
through the official openai SDK, every Messages case through the anthropic SDK: each SDK makes
the case's request and reads llmfleet's answer to it (tests/parity/replay.py). The table and any
differences go to the test log directory.
"""

from __future__ import annotations

import pytest

from tests.conftest import AFTER_THE_PARITY_BATTERY, start_if_the_session_needs
from tests.parity import battery_messages, battery_responses
from tests.parity.battery import build
from tests.parity.harness import details, run_battery, running_servers, summary
from tests.parity.replay import LIVE
from tests.procs import LOG_DIR

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

# Invalid cases that `vllm serve` answers with a 200 (and llmfleet alike): its chat template renders
# a role it does not know.
ACCEPTED_BY_VLLM = {"unknown role"}


def test_every_answer_matches_vllm_serve(tiny_model_dir, parser_workers, vllm_serves, request):
    with running_servers(tiny_model_dir, parser_workers, vllm_serves) as servers:
        results = run_battery(servers)
    vllm_serves.stop()  # no other test needs them: their memory goes back before the compose stack's engine
    start_if_the_session_needs(request, *AFTER_THE_PARITY_BATTERY)  # in their place
    report = summary(results)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "parity-report.md").write_text(report + "\n\n" + details(results) + "\n")
    print("\n" + report + f"\nSDK requests that differed from their case's, sent again: {len(LIVE)} {LIVE}")
    assert all(r.identical for r in results), "\n" + report + "\n\n" + details(results)
    # What was compared covers the surface: every valid request was one `vllm serve` answered
    # (two identical errors prove nothing), and each battery sent what it is for.
    assert [r.case.name for r in results if not r.case.invalid and r.expected_status != 200] == []
    # ... and every invalid one it refused (a stream's error may come inside a 200), but those held
    # to the API instead (`Case.api`) and those it accepts, which llmfleet answers alike.
    assert [r.case.name for r in results if r.case.invalid and not r.case.stream and r.case.api is None
            and r.expected_status == 200 and r.case.name not in ACCEPTED_BY_VLLM] == []
    batteries = {"chat and completions": (build(), 60, 20, {"sampling", "n>1", "logprobs", "stream_options",
                                                            "structured", "tools", "reasoning", "messages",
                                                            "tokenize", "errors"}),
                 "messages": (battery_messages.build(), 40, 10, {"anthropic text", "anthropic stop", "anthropic tools",
                                                                 "anthropic thinking", "anthropic count_tokens",
                                                                 "anthropic errors"}),
                 "responses": (battery_responses.build(), 40, 10, {"responses", "structured", "tools", "reasoning",
                                                                   "errors"})}
    for battery, (cases, least, least_invalid, features) in batteries.items():
        names = {c.name for c in cases}
        sent = [r for r in results if r.case.name in names]
        assert len(sent) >= least and sum(r.case.invalid for r in sent) >= least_invalid, battery
        assert sum(r.case.stream and r.expected_status == 200 for r in sent) >= 10, battery
        assert {r.case.feature for r in sent} >= features, battery
