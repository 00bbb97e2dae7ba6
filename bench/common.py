"""Shared pieces of the benchmarks: a stack of real processes, percentiles, progress lines."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

from tests.procs import Proc, start_gateway, start_redis, start_worker, wait_until_served

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of sorted-or-not `values`."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[rank]


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

    def __enter__(self) -> Stack:
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
        self.worker = start_worker(self.redis.url, str(model_dir), "--max-model-len", "2048", "--enforce-eager",
                                   "--dtype", "float32", engine="vllm", served_name=model,
                                   env={"VLLM_CPU_KVCACHE_SPACE": "2"}, timeout=300)
        self.procs.append(self.worker)
        gateway = start_gateway(self.redis.url)
        self.procs.append(gateway)
        self.gateway_url = gateway.url
        wait_until_served(gateway, model)
        return model

    def worker_log(self) -> str:
        return self.worker.log() if self.worker else ""
