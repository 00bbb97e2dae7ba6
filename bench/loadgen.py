"""A lean SSE load generator: one asyncio process (uvloop), raw sockets, httptools parsing.

The load generator shares the machine's two cores with the servers it measures, so its own
cost per request decides how much is left for them. httpx spends several times what the
gateway does per stream; this client parses HTTP in C (httptools, chunked encoding included),
keeps connections alive, sends prebuilt request bytes, and looks into an SSE event only to
count its content words (the scripted engine's tokens).

A response that is not an event stream (a JSON answer: embeddings, a non-streaming completion) is
kept whole in `StreamResult.body` for the caller to check.

Three shapes of load:
- `closed_loop`: `concurrency` clients, each sending its next request when the last ends;
- `open_loop`: requests started at Poisson times at `rate` per second, whatever is open;
- `hold_streams`: `count` streams opened together and held until the server ends them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
import orjson

from bench.common import percentile


@dataclass(slots=True)
class StreamResult:
    ok: bool
    ttft: float = 0.0  # seconds from sending the request to the first content event
    latency: float = 0.0  # seconds from sending the request to the end of the response
    tokens: int = 0  # content words received (the scripted engine sends one word per token)
    events: int = 0
    error: str = ""
    body: bytes = b""  # a JSON response's body (not kept for an event stream)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; streams one request at a time."""

    def __init__(self, on_first: Callable[[], None] | None = None):
        self.transport: asyncio.Transport | None = None
        self.on_first = on_first  # called at a stream's first content event
        self._done: asyncio.Future | None = None
        self._buffer = b""
        self._status = 0
        self._result = StreamResult(ok=False)
        self._sent = 0.0
        self._finished = False
        self._sse = True
        self._parser = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(f"bad HTTP: {exc}")

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._end("connection closed")

    # httptools callbacks
    def on_status(self, _status: bytes) -> None:
        self._status = self._parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._sse = value.startswith(b"text/event-stream")

    def on_body(self, body: bytes) -> None:
        self._buffer += body
        if not self._sse:
            return
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            self._event(event)

    def on_message_complete(self) -> None:
        if self._status != 200:
            self._end(f"HTTP {self._status}: {self._buffer[:200]!r}")
        elif not self._sse:
            self._result.body = self._buffer
            self._end("")
        elif not self._finished:
            self._end("stream ended without [DONE]")
        else:
            self._end("")

    def _event(self, event: bytes) -> None:
        result = self._result
        result.events += 1
        # `data: ...` then `id: N` (every event carries its index, for resuming): the data line.
        event = event.split(b"\n", 1)[0]
        if event == b"data: [DONE]":
            self._finished = True
            return
        if not event.startswith(b"data: {") or self._status != 200:
            return
        body = orjson.loads(event[6:])
        if "error" in body:
            result.error = str(body["error"].get("message"))[:200]
            return
        for choice in body["choices"]:
            content = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if content:
                if not result.tokens:
                    result.ttft = time.monotonic() - self._sent
                    if self.on_first is not None:
                        self.on_first()
                result.tokens += len(content.split())

    def _end(self, error: str) -> None:
        if self._done is None or self._done.done():
            return
        result = self._result
        result.latency = time.monotonic() - self._sent
        result.error = result.error or error
        result.ok = not result.error
        self._done.set_result(result)

    async def stream(self, request: bytes, timeout: float) -> StreamResult:
        """Send `request` and read its response; past `timeout` seconds, give up and close."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._buffer, self._status, self._finished, self._sse = b"", 0, False, True
        self._result = StreamResult(ok=False)
        self._sent = time.monotonic()
        self.transport.write(request)
        timer = loop.call_later(timeout, self._give_up)
        try:
            return await self._done
        finally:
            timer.cancel()

    def _give_up(self) -> None:
        self._end("timed out")
        self.close()

    def close(self) -> None:
        if self.transport is not None:  # None once the server has closed it
            self.transport.close()


class Target:
    """Where the load goes and the request it sends: one POST, prebuilt as bytes (`request_for`
    builds others to the same path, for loads whose requests differ)."""

    def __init__(self, url: str, path: str, body: dict, timeout: float = 60.0, headers: dict[str, str] | None = None):
        self.timeout = timeout
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port, path
        self.headers = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.request = self.request_for(body)

    def request_for(self, body: dict) -> bytes:
        payload = orjson.dumps(body)
        return (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.headers}"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload

    async def connect(self, on_first: Callable[[], None] | None = None) -> _Connection:
        loop = asyncio.get_running_loop()
        _transport, connection = await loop.create_connection(lambda: _Connection(on_first), self.host, self.port)
        return connection

    async def send(self, connection: _Connection | None,
                   request: bytes | None = None) -> tuple[StreamResult, _Connection | None]:
        """One request (the target's, or `request`) on `connection` (a new one when None or closed);
        returns a reusable connection."""
        try:
            if connection is None or connection.transport is None:
                connection = await self.connect()
            result = await connection.stream(request or self.request, self.timeout)
        except OSError as exc:
            return StreamResult(ok=False, error=f"connect: {exc}"), None
        return result, connection if result.ok and connection.transport is not None else None


async def closed_loop(target: Target, concurrency: int, seconds: float) -> tuple[list[StreamResult], float]:
    """`concurrency` clients back to back for `seconds`; the results and the elapsed time."""
    results: list[StreamResult] = []
    until = time.monotonic() + seconds

    async def client() -> None:
        connection = None
        while time.monotonic() < until:
            result, connection = await target.send(connection)
            results.append(result)
        if connection is not None:
            connection.close()

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.monotonic() - started


async def open_loop(target: Target, rate: float, seconds: float, seed: int = 0) -> tuple[list[StreamResult], float]:
    """Requests started at Poisson times, `rate` per second, for `seconds`; idle connections reused."""
    results: list[StreamResult] = []
    idle: list[_Connection] = []
    pending: set[asyncio.Task] = set()
    arrivals = random.Random(seed)

    async def one() -> None:
        result, connection = await target.send(idle.pop() if idle else None)
        results.append(result)
        if connection is not None:
            idle.append(connection)

    started = time.monotonic()
    next_at = started
    while next_at < started + seconds:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        task = asyncio.create_task(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
        next_at += arrivals.expovariate(rate)
    await asyncio.gather(*pending)
    for connection in idle:
        connection.close()
    return results, time.monotonic() - started


async def hold_streams(target: Target, count: int, opened: Callable[[int], None],
                       connect_parallel: int = 200) -> list[StreamResult]:
    """Open `count` streams (at most `connect_parallel` connecting at once) and read each to its end.

    `opened(n)` is called as each stream delivers its first token, with how many are open now
    (a first token received, the end not yet).
    """
    gate = asyncio.Semaphore(connect_parallel)
    open_now = 0

    def on_first() -> None:
        nonlocal open_now
        open_now += 1
        opened(open_now)

    async def one() -> StreamResult:
        async with gate:
            try:
                connection = await target.connect(on_first)
            except OSError as exc:
                return StreamResult(ok=False, error=f"connect: {exc}")
            request = asyncio.ensure_future(connection.stream(target.request, target.timeout))
            await asyncio.sleep(0)  # the request is written; the next connection may start
        result = await request
        if result.tokens:
            nonlocal open_now
            open_now -= 1
        connection.close()
        return result

    return list(await asyncio.gather(*(one() for _ in range(count))))


def summarize(results: list[StreamResult], elapsed: float, expected_tokens: int | None = None) -> dict:
    """Counts, rates and TTFT percentiles (ms) of a load run."""
    ok, errors = [], []
    for r in results:
        if r.ok and (expected_tokens is None or r.tokens == expected_tokens):
            ok.append(r)
        else:
            errors.append(r.error or f"{r.tokens} tokens instead of {expected_tokens}")
    ttfts = [r.ttft * 1000 for r in ok]
    return {
        "requests": len(ok), "errors": len(errors), "first_errors": sorted(set(errors))[:3],
        "seconds": elapsed, "requests_per_s": len(ok) / elapsed, "tokens": sum(r.tokens for r in ok),
        "tokens_per_s": sum(r.tokens for r in ok) / elapsed,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
    }
