"""The one msgpack codec for everything that crosses Redis.

Decoding is typed and bounded: bytes become an envelope of the expected type (`shared.envelopes`)
with every field checked, or raise `EnvelopeError` saying why not (not msgpack, more than
`MAX_ENVELOPE_BYTES`, a field missing, of the wrong type or out of range, an unknown kind or
wire version). Nothing that fails here reaches the code that would act on it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
import msgspec

from shared.envelopes import WIRE_VERSION, CancelNotice, ChunkEnvelope, Continuation, RequestEnvelope, WorkerInfo
from shared.errors import EnvelopeError

MAX_ENVELOPE_BYTES = 8 * 1024 * 1024

Envelope = TypeVar("Envelope", RequestEnvelope, ChunkEnvelope, CancelNotice, WorkerInfo, Continuation)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(kind)
             for kind in (RequestEnvelope, ChunkEnvelope, CancelNotice, WorkerInfo, Continuation)}
_BATCH = msgspec.msgpack.Decoder(list[bytes])


def encode(envelope: RequestEnvelope | ChunkEnvelope | CancelNotice | WorkerInfo | Continuation) -> bytes:
    """Raises OverflowError for an integer outside msgpack's 64 bits (JSON allows any)."""
    return _ENCODER.encode(envelope)


def decode(kind: type[Envelope], data: bytes) -> Envelope:
    """Decode bytes into an envelope of `kind`, every field checked, or raise EnvelopeError saying why not."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"envelope of {len(data)} bytes exceeds the {MAX_ENVELOPE_BYTES}-byte limit")
    try:
        return _DECODERS[kind].decode(data)
    except msgspec.ValidationError as exc:
        raise EnvelopeError(_why(kind, data, exc)) from exc
    except msgspec.DecodeError as exc:
        raise EnvelopeError(f"not a msgpack envelope: {exc}") from exc


def _why(kind: type, data: bytes, exc: msgspec.ValidationError) -> str:
    """The reason an envelope is refused, in the reader's words (only on the error path)."""
    try:
        raw: Any = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError):
        raw = None
    if not isinstance(raw, dict):
        return f"{kind.__name__} must be a map, got {type(raw).__name__}"
    if raw.get("v", WIRE_VERSION) != WIRE_VERSION:
        return f"unsupported wire version {raw.get('v')!r} (this process speaks {WIRE_VERSION})"
    if kind is RequestEnvelope and "kind" in raw and "$.kind" in str(exc):
        return f"unknown request kind {raw['kind']!r}: {exc}"
    return f"malformed {kind.__name__}: {exc}"


def encode_batch(envelopes: list[bytes]) -> bytes:
    """Several encoded envelopes as one value (a reply entry's `keys.BATCH_FIELD`)."""
    return _ENCODER.encode(envelopes)


def decode_batch(data: bytes) -> list[bytes]:
    """The encoded envelopes of a batch, each still to `decode`; EnvelopeError if it is not one."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"batch of {len(data)} bytes exceeds the {MAX_ENVELOPE_BYTES}-byte limit")
    try:
        return _BATCH.decode(data)
    except msgspec.ValidationError as exc:
        raise EnvelopeError(f"a batch must be a list of encoded envelopes: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise EnvelopeError(f"not a msgpack batch: {exc}") from exc
