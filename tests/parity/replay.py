"""The SDK checks of the parity battery read llmfleet's recorded answers again, not new ones.

The battery sends each case to llmfleet once; the official SDKs then make the same request and
read llmfleet's answer to it through `replaying`: the answer as received, the same bytes. An SDK
that writes the request otherwise than the case gets llmfleet's own answer to what it wrote.
"""

from __future__ import annotations

import json

import httpx
import httpx2

from tests.parity.battery import Case
from tests.parity.compare import Answer

LIVE: list[str] = []  # the cases whose SDK request differed from the case's, each sent again
# What of a recorded response an SDK reads again: its bytes as they were, so not their framing.
FRAMING = {"content-length", "content-encoding", "transfer-encoding", "connection"}


def replaying(case: Case, answer: Answer) -> httpx2.Client:
    """An HTTP client for an SDK that answers the case's request with the answer llmfleet gave it
    (`answer.response`, the same bytes), instead of asking llmfleet again. Only where the SDK's
    request is the case's, as JSON, method and path: a request the SDK wrote otherwise is sent to
    llmfleet, and its own answer read."""
    recorded = answer.response

    def answer_again(request: httpx2.Request) -> httpx2.Response:
        if (recorded is not None and request.method == "POST" and request.url.path == case.path
                and _as_sent(_json(request.content)) == _as_sent(case.body)):
            return _copy(recorded)
        LIVE.append(case.name)
        live = httpx.post(str(request.url), content=request.content, timeout=300,
                          headers={"content-type": request.headers.get("content-type", "application/json")})
        return _copy(live)

    return httpx2.Client(transport=httpx2.MockTransport(answer_again), timeout=300)


def _copy(response: httpx.Response) -> httpx2.Response:
    """The response as the SDKs' HTTP package (httpx2) holds it."""
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in FRAMING]
    return httpx2.Response(response.status_code, headers=headers, content=response.content)


def _as_sent(body: object) -> object:
    """The body as the API reads it: `"stream": false` is its default, which an SDK leaves out."""
    if isinstance(body, dict) and body.get("stream") is False:
        return {k: v for k, v in body.items() if k != "stream"}
    return body


def _json(content: bytes) -> object:
    try:
        return json.loads(content)
    except ValueError:
        return None
