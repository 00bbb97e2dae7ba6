"""The gateway process: uvicorn (uvloop, httptools) serving the FastAPI app.

SIGTERM drains. The gateway first leaves its load balancer's set of replicas: it closes its
listening socket at once, so a new connection is refused and nginx (`proxy_next_upstream error`)
or a client's retry takes another replica. A request that still reaches it, on a connection a
client kept alive, is answered 503 ("shutting down", never queued) with `Connection: close`, so
the client's retry opens a new connection; /ready turns 503 too. Open requests get up to
`drain_grace_s` to finish, then uvicorn shuts down: it waits up to `timeout_graceful_shutdown`
for the requests left, then `Fleet.stop` takes a bounded few seconds, whatever Redis does
(tests/faults/test_stops.py). A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import GatewaySettings
from shared import tracing

log = logging.getLogger(__name__)


TICK_S = 1.0  # how often uvicorn's loop wakes when nothing stops it: its Date header counts seconds


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        self._wake: asyncio.Event | None = None  # before uvicorn's __init__, which sets `should_exit`
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._drain: asyncio.Task | None = None

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set by a signal's handler, the drain, or uvicorn itself: wakes `main_loop` at once."""
        self._should_exit = value
        if value and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def main_loop(self) -> None:
        """uvicorn's loop, woken once a second instead of ten times (an idle gateway's most frequent
        wake-up), and at once when the server should exit. `on_tick` refreshes the Date header on
        every tenth count, so each tick counts ten."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._wake.wait()
            self._wake.clear()

    def handle_exit(self, sig, frame) -> None:
        fleet = getattr(self.app.state, "fleet", None)
        if self._drain is not None or fleet is None:
            super().handle_exit(sig, frame)
            return
        fleet.draining = True
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit(fleet))

    async def _drain_then_exit(self, fleet) -> None:
        # In the loop, not in the signal handler: uvloop's server must not be closed mid-callback.
        # uvicorn's own shutdown closes the servers again later, which does nothing.
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + self.grace_s
        log.info("draining %d open requests (grace %.0fs)", fleet.router.open_requests, self.grace_s)
        while fleet.router.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


class CloseWhenDraining:
    """Add `Connection: close` to every response a draining gateway starts, so that no client
    sends it another request on that connection.

    Requests that start before the drain pass straight through: their SSE writes are never
    wrapped, which keeps the hot path as it was.
    """

    def __init__(self, app: FastAPI):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        fleet = getattr(self.app.state, "fleet", None)
        if scope["type"] != "http" or fleet is None or not fleet.draining:
            await self.app(scope, receive, send)
            return

        async def send_closing(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def serve(settings: GatewaySettings, host: str, port: int, log_level: str = "info") -> None:
    if tracing.setup("llmfleet-gateway"):
        log.info("tracing on (OpenTelemetry)")
    app = create_app(settings)
    # No X-Forwarded-* rewriting: nothing here reads the client address, and the middleware
    # would wrap every request and every SSE write.
    # Idle keep-alive connections outlive those of the proxies and clients in front (nginx,
    # cloud load balancers: 60 s): a peer must never reuse a connection the gateway is closing,
    # which would surface as a reset on a request the gateway never saw.
    config = uvicorn.Config(CloseWhenDraining(app), host=host, port=port, loop="uvloop", http="httptools",
                            log_level=log_level, log_config=None, access_log=False, proxy_headers=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=75)
    # The modules loaded so far live as long as the process: keep them out of every collection,
    # so that a full collection with thousands of open streams scans only what those streams made.
    gc.collect()
    gc.freeze()
    DrainingServer(config, app, settings.drain_grace_s).run()
