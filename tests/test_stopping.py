"""Bounded stops (`shared.stopping`): a loop that loses its cancel still ends, a task that never
ends is left behind within the bound, and the loss itself, on the Python this runs on."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest

from shared.stopping import CANCEL_AGAIN_S, pause, stop_tasks, within


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 rebuilt wait_for on asyncio.timeout")
async def test_python_3_11_wait_for_loses_a_cancel_that_lands_as_its_future_completes() -> None:
    """The cause of issue #13's hang: redis-py awaits each socket write in `wait_for`, and the write
    is usually done by the time the task wakes, so a cancel landing then is lost (CPython gh-86296)."""
    turns = 0

    async def loop() -> None:
        nonlocal turns
        while turns < 3:
            turns += 1
            written = asyncio.ensure_future(asyncio.sleep(0))
            await written
            if turns == 1:  # the cancel arrives in the turn the write completes
                asyncio.current_task().cancel()
            await asyncio.wait_for(written, 5)

    task = asyncio.create_task(loop())
    await asyncio.wait({task}, timeout=1)
    assert task.done() and not task.cancelled() and turns == 3  # it ran to its end, cancel and all


async def test_stop_tasks_ends_a_loop_that_lost_its_cancel() -> None:
    lost = 0

    async def loop() -> None:  # no stop event: only cancelling it again ends it
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await stop_tasks([task], grace_s=0, cancel_s=5, what="test") == set()
    assert task.cancelled() and lost == 1
    assert time.monotonic() - started < CANCEL_AGAIN_S + 0.5


async def test_stop_tasks_waits_its_grace_for_a_loop_to_end_on_its_stop_event() -> None:
    stop = asyncio.Event()

    async def loop() -> str:
        while not await pause(stop, 10):
            pass
        return "ended"

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    stop.set()
    assert await stop_tasks([task], grace_s=5, cancel_s=5, what="test") == set()
    assert task.result() == "ended"  # not cancelled: it ended by itself


async def test_stop_tasks_leaves_behind_a_task_that_never_ends_and_says_so(caplog) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="shared.stopping"):
        left = await stop_tasks([task], grace_s=0.2, cancel_s=0.6, what="test loops")
    elapsed = time.monotonic() - started
    assert left == {task} and not task.done()
    assert 0.8 <= elapsed < 1.5, elapsed
    assert "test loops: 1 task(s) still running" in caplog.text and "stubborn" in caplog.text
    release.set()
    await task


async def test_within_returns_a_result_or_gives_up_on_time() -> None:
    assert await within(1, asyncio.sleep(0, result="done"), "quick") == "done"
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await within(0.3, asyncio.sleep(30), "slow")
    assert time.monotonic() - started < 1.0
