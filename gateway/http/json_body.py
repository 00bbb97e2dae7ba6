"""Every route's JSON body read strictly, by orjson (`JSONRoute`).

FastAPI reads a body with the standard library's `json`, which takes what is not JSON: `NaN` and
`Infinity` (Python's `json.dumps` writes them for a float nan or inf) and a lone surrogate such as
"\\ud800". The handlers then read the same bytes again with orjson, to queue them as sent
(`request_json`), and orjson refuses those: each was a 500. Here the request FastAPI reads is a
`JSONRequest`, whose `json()` refuses what orjson refuses (`loads`): that is FastAPI's own
invalid-JSON error (a 400, gateway/http/errors.py), and the handlers' own parse takes every body
FastAPI took. They parse again rather than share FastAPI's dict: the validated model holds parts of
that dict, and the queued body must stay what the client sent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

_NOT_NUMBERS = (b"-Infinity", b"Infinity", b"NaN")
# orjson reads an integer outside [-2**63, 2**64) as a float. A body with a run of 19 digits or more
# is read again by the standard library, whose integers are exact, so that the request models see
# such an integer and refuse it where it would cross the wire (tests/test_fuzz.py). The run is found
# in the body with its digits made "0" and the rest " " (at about orjson's own speed; a regular
# expression took 15 times as long).
_DIGITS_AS_ZEROS = bytes(ord("0") if byte in b"0123456789" else ord(" ") for byte in range(256))
_LONG_RUN = b"0" * 19


def loads(body: bytes) -> Any:
    """orjson's parse of a body (the standard library's where an integer may be past 64 bits)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as refused:
        raise _in_words(body, refused) from None
    return json.loads(body) if _LONG_RUN in body.translate(_DIGITS_AS_ZEROS) else parsed


def _in_words(body: bytes, refused: orjson.JSONDecodeError) -> json.JSONDecodeError:
    """Why orjson refused a body: in the standard library's words where that refuses it too (FastAPI's,
    and so `vllm serve`'s, for a syntax error), else in orjson's, said plainly for NaN and Infinity."""
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        return exc
    except UnicodeDecodeError as exc:
        return json.JSONDecodeError(f"it is not UTF-8 ({exc.reason})", "", exc.start)
    except RecursionError:
        pass
    at = refused.pos
    token = next((t for t in _NOT_NUMBERS if body.startswith(t, at) or (at and body.startswith(t, at - 1))), None)
    if token is not None:
        return json.JSONDecodeError(f"{token.decode()} is not a JSON number", refused.doc, refused.pos)
    return json.JSONDecodeError(refused.msg, refused.doc, refused.pos)


class JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """An APIRoute whose handler is given a `JSONRequest` (FastAPI's custom route class)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def with_json_request(request: Request) -> Response:
            return await handle(JSONRequest(request.scope, request.receive, request._send))

        return with_json_request
