"""Stops that end: the loops of a gateway or worker, and their stop, whatever Redis does.

Each long-running loop watches a stop event and ends at its next turn once it is set; a stop
sets the event, waits a little for the loops to end, then cancels them, and after a bounded
wait logs what is left and goes on. A shutdown never waits on Redis forever.

Why an event and not cancellation alone: on Python 3.11, `asyncio.wait_for` loses a cancel that
lands in the loop turn where the future it waits on completes (CPython gh-86296, fixed in 3.12
by building `wait_for` on `asyncio.timeout`). redis-py wraps every socket write of a command in
`wait_for(..., socket_timeout)`, and a write usually completes at once, so a task cancelled right
after it sends a command carries on as if nothing happened: a `while True` loop never ends, and
whoever waits for it hangs. A loop that checks its stop event still ends at its next turn, and
`stop_tasks` cancels again until the task ends or the bound is spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Collection
from typing import TypeVar

log = logging.getLogger(__name__)

CANCEL_AGAIN_S = 0.5  # a cancel can be lost (see above): repeat it this often
CANCEL_WITHIN_S = 1.0  # how long `within` waits for its cancelled task before leaving it behind

T = TypeVar("T")


async def pause(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, less if `stop` is set meanwhile; return whether it is set."""
    if not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await stop.wait()
    return stop.is_set()


async def stop_tasks(tasks: Collection[asyncio.Task], *, grace_s: float, cancel_s: float,
                     what: str) -> set[asyncio.Task]:
    """Wait up to `grace_s` for `tasks` to end (their stop event is set), then cancel the rest,
    again every CANCEL_AGAIN_S, for up to `cancel_s`. Returns, and logs, the tasks still running:
    they are left behind rather than waited for."""
    pending = {task for task in tasks if not task.done()}
    if pending and grace_s > 0:
        _done, pending = await asyncio.wait(pending, timeout=grace_s)
    deadline = time.monotonic() + cancel_s
    while pending and (left := deadline - time.monotonic()) > 0:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=min(CANCEL_AGAIN_S, left))
    if pending:
        log.error("%s: %d task(s) still running %.1fs after the stop, left behind: %s", what, len(pending),
                  grace_s + cancel_s, ", ".join(sorted(task.get_name() for task in pending)))
    return pending


async def within(seconds: float, awaitable: Awaitable[T], what: str) -> T:
    """`awaitable`'s result, or TimeoutError after `seconds`. It runs as a task of its own, which
    `stop_tasks` cancels (again, should a cancel be lost) and leaves behind if it does not end:
    unlike `asyncio.timeout`, whose one cancel redis-py can lose, this bound holds."""
    task = asyncio.ensure_future(awaitable)
    try:
        left = await stop_tasks([task], grace_s=seconds, cancel_s=CANCEL_WITHIN_S, what=what)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if left or task.cancelled():
        raise TimeoutError(f"{what}: not done within {seconds:.1f}s")
    return task.result()
