"""bench.run_queue reads each process's CPU and run-queue wait from /proc, its children included."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.run_queue import _children, _schedstat, _tree, table


def test_a_child_is_found_and_its_cpu_counted() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        assert child.pid in _tree(os.getpid(), _children())
        first, _ = _schedstat([child.pid])
        time.sleep(0.3)
        second, _ = _schedstat([child.pid])
        assert second > first  # it spins, so its CPU grows
    finally:
        child.kill()
        child.wait()


def test_the_table_has_a_row_per_process() -> None:
    medians = {"vllm serve": {"inputs_per_s": 80.0, "p50_ms": 12.0, "API server CPU us": 4000.0,
                              "API server wait us": 2000.0, "engine core CPU us": 20000.0, "engine core wait us": 4000.0}}
    rows = table({"requests": 400, "rounds": 4, "medians": medians}).splitlines()
    assert rows[-2] == "| vllm serve | 80.0 | 12.00 | API server | 4,000 | 2,000 |"
    assert rows[-1] == "| | | | engine core | 20,000 | 4,000 |"
