"""`llmfleet up` runs its worker at the lowest CPU priority, in a session (an autogroup) of its own,
so a CPU engine's busy loop cannot starve the gateway beside it (`llmfleet.lower_priority`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from llmfleet import LOWEST_PRIORITY, Stack, autogroup_of, lower_priority
from tests.procs import free_port, wait_for

pytestmark = pytest.mark.integration


def _autogroup(pid: int) -> tuple[str, int]:
    """The autogroup of process `pid` and its nice value: `/autogroup-42 nice 19`."""
    name, _, nice = autogroup_of(pid).split()
    return name, int(nice)


def _autogroups_work() -> bool:
    """Autogroups are on and this process is in one (not in a CPU cgroup, where they do not apply)."""
    try:
        enabled = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False
    return enabled and bool(autogroup_of(os.getpid()))


def _thread_nices(pid: int) -> dict[int, int]:
    """The nice value of each thread of process `pid` (field 19 of /proc/PID/task/TID/stat)."""
    nices = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        nices[int(task.name)] = int(stat[stat.rindex(")") + 2:].split()[16])
    return nices


def test_the_worker_of_up_runs_in_its_own_session_at_the_lowest_priority(redis_url: str) -> None:
    stack = Stack()
    try:
        worker = stack.spawn("worker", "--model", "low", "--engine", "scripted", "--redis-url", redis_url,
                             "--metrics-port", str(free_port()), lowest_priority=True)
        client = redis.Redis.from_url(redis_url)
        wait_for(lambda: any(f"-{worker.pid}-".encode() in key for key in client.scan_iter(match="llmfleet:worker:*")),
                 30, "the worker to register", interval=0.2)
        assert os.getsid(worker.pid) == worker.pid != os.getsid(0)
        # Every thread, those started after the priority was set included (its metrics server), has nice 19.
        nices = _thread_nices(worker.pid)
        assert len(nices) > 1 and set(nices.values()) == {LOWEST_PRIORITY}, nices
        if not _autogroups_work():
            pytest.skip("no autogroups here (off, or this process is in a CPU cgroup): plain nice is all there is")
        group, nice = _autogroup(worker.pid)
        assert (nice, group != _autogroup(os.getpid())[0]) == (LOWEST_PRIORITY, True)
    finally:
        stack.stop()


def test_lowering_the_priority_of_a_process_that_is_gone_says_so_and_does_not_fail() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert lower_priority(gone.pid).startswith("nice unchanged (No such process)")
