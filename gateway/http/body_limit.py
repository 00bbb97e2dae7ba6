"""Bounds on what one client can make a gateway hold: body size, open requests.

`BodySizeLimit` is plain ASGI middleware: it refuses a declared Content-Length over the limit
at once and stops reading a chunked body the moment it passes the limit, so a hostile client
never makes the gateway buffer more than `max_bytes`.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http import anthropic_errors
from gateway.http.errors import error_body

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, scope["path"])
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes and not refused:
                    refused = True
                    await self._refuse(send, scope["path"])
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is dropped
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Send, path: str) -> None:
        message = f"Request body exceeds the {self.max_bytes}-byte limit."
        if anthropic_errors.owns(path):
            body = orjson.dumps(anthropic_errors.error_body(message, 413))
        else:
            body = orjson.dumps(error_body(message, 413, err_type="RequestEntityTooLarge"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
