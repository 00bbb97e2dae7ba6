"""The compose tier's builds at idle CPU priority (tests/compose/preparation.py, `IdleCgroup`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.compose.preparation import IdleCgroup, _cpu_cgroup


@pytest.mark.skipif(os.geteuid() != 0 or not (IdleCgroup.ROOT / "cgroup.procs").exists(),
                    reason="needs root and a cgroup v1 cpu hierarchy")
def test_the_builds_group_is_idle_holds_this_process_and_is_gone_after() -> None:
    before = _cpu_cgroup()
    idle = IdleCgroup(f"llmfleet-test-idle-{os.getpid()}")
    with idle:
        assert (idle.group / "cpu.idle").read_text().strip() == "1"
        assert _cpu_cgroup() == f"/{idle.name}/tools"
        (idle.group / "containers").mkdir()  # as dockerd makes its --cgroup-parent
    assert _cpu_cgroup() == before
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{idle.name}"))
