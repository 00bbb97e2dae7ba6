"""The one msgpack codec for everything that crosses Redis.

Decoding is bounded: an envelope (or a batch of them) larger than `MAX_ENVELOPE_BYTES`, or one
that is not valid msgpack, raises `EnvelopeError` and never reaches the code that would act on it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack

from shared.envelopes import CancelNotice, ChunkEnvelope, RequestEnvelope, WorkerInfo
from shared.errors import EnvelopeError

MAX_ENVELOPE_BYTES = 8 * 1024 * 1024

Envelope = TypeVar("Envelope", RequestEnvelope, ChunkEnvelope, CancelNotice, WorkerInfo)


def encode(envelope: RequestEnvelope | ChunkEnvelope | CancelNotice | WorkerInfo) -> bytes:
    return msgpack.packb(envelope.to_wire(), use_bin_type=True)


def decode(kind: type[Envelope], data: bytes) -> Envelope:
    """Decode bytes into an envelope of `kind`, or raise EnvelopeError saying why not."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"envelope of {len(data)} bytes exceeds the {MAX_ENVELOPE_BYTES}-byte limit")
    try:
        raw: Any = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise EnvelopeError(f"not a msgpack envelope: {exc}") from exc
    return kind.from_wire(raw)


def encode_batch(envelopes: list[bytes]) -> bytes:
    """Several encoded envelopes as one value (a reply entry's `keys.BATCH_FIELD`)."""
    return msgpack.packb(envelopes, use_bin_type=True)


def decode_batch(data: bytes) -> list[bytes]:
    """The encoded envelopes of a batch, each still to `decode`; EnvelopeError if it is not one."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"batch of {len(data)} bytes exceeds the {MAX_ENVELOPE_BYTES}-byte limit")
    try:
        raw: Any = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise EnvelopeError(f"not a msgpack batch: {exc}") from exc
    if not isinstance(raw, list) or not all(isinstance(item, bytes) for item in raw):
        raise EnvelopeError("a batch must be a list of encoded envelopes")
    return raw
