"""The takeover doorbell: request entries named for a worker with room to claim at once.

A request whose worker is gone (its gateway found it so, `gateway/fleet/registry.py`) or gave it
up (a draining worker's hand-over) waits, pending in its stream, for another worker. Its lease
released first, its entry named here (`keys.takeover_doorbell`) is claimed within milliseconds by
a worker waiting on the list (`worker/consumer.py`, `_take_over_rung`), instead of at the next
reclaim sweep, seconds later. Each is rung once, by whoever gave it up or found its worker
gone; one never popped is left to the sweeps when the list expires.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared import keys


async def ring(redis, model: str, entries: Iterable[tuple[str, str]]) -> None:
    """Name the request entries (stream, entry id) of `model` on its takeover doorbell."""
    named = [f"{stream} {entry_id}" for stream, entry_id in entries if stream and entry_id]
    if not named:
        return
    doorbell = keys.takeover_doorbell(model)
    await (redis.pipeline(transaction=False).rpush(doorbell, *named)
           .ltrim(doorbell, -keys.TAKEOVER_DOORBELL_MAX, -1)
           .expire(doorbell, keys.TAKEOVER_DOORBELL_TTL_S).execute())
