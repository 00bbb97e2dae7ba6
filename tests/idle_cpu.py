"""Running on idle CPU only: how `make test` starts the vLLM tier's engines beside its first phase.

An engine's start is ~35 CPU-seconds of imports, and the first phase leaves about half of the two
cores idle. `nice -n 19` is not enough to hand the engines only that half: the kernel schedules
each session (autogroup) as a whole, so niced engines in `make`'s session still take their
session's full share from every other session, and a test's worker started at the lowest priority
in a session of its own (tests/test_up_priority.py) waited 30 s for CPU without getting it. A CPU
cgroup marked idle (`cpu.idle`, Linux 5.15+; else the smallest weight) is scheduled below every
session: what runs in it gets only the CPU nothing else wants.

`enter()` moves this process, and so everything it starts from then on, into such a group;
`leave()` moves every process in it back to the root group. Without a writable CPU cgroup (not
root, or no cpu controller) it falls back to `nice 19` for this process, which cannot be undone
without privilege: the tier then stays low among its own processes alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NAME = "llmfleet-idle-cpu"
# cgroup v1's cpu hierarchy, then v2's unified one: (root, the weight setting, its smallest value), for
# kernels without `cpu.idle`.
HIERARCHIES = [(Path("/sys/fs/cgroup/cpu"), "cpu.shares", "2"), (Path("/sys/fs/cgroup"), "cpu.weight", "1")]


def _writable_root() -> tuple[Path, str, str] | None:
    for root, weight, lowest in HIERARCHIES:
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        if weight == "cpu.weight" and "cpu" not in _read(root / "cgroup.subtree_control").split():
            continue  # a v2 hierarchy without the cpu controller for its groups
        return root, weight, lowest
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class IdleCpu:
    def __init__(self):
        self.group: Path | None = None
        self.root: Path | None = None

    def enter(self) -> str:
        """Move this process into the idle group; says how it runs now."""
        found = _writable_root()
        if found is not None:
            root, weight, lowest = found
            group = root / NAME
            try:
                group.mkdir(exist_ok=True)
                if (group / "cpu.idle").exists():
                    (group / "cpu.idle").write_text("1")
                else:
                    (group / weight).write_text(lowest)
                (group / "cgroup.procs").write_text(str(os.getpid()))
                self.group, self.root = group, root
                return f"in the idle CPU cgroup {group}"
            except OSError:
                pass
        os.nice(19)
        return "at nice 19 (no writable CPU cgroup)"

    def leave(self) -> None:
        """Every process of the group back to the root group, the group removed."""
        if self.group is None:
            return
        for _ in range(100):  # a process may fork while they move
            pids = _read(self.group / "cgroup.procs").split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):  # it ended meanwhile
                    (self.root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.group.rmdir()
        self.group = None
