"""Relay throughput of one gateway process, against a bare SSE server measured in the same run.

Both serve the same 16-token chat streams to the same load (concurrent SSE clients on
loopback, `bench.loadgen`). The baseline is uvicorn streaming the tokens itself: no Redis, no
worker, so it is the floor of HTTP + SSE cost on this machine. llmfleet adds the queue:
gateway → Redis → scripted worker (no pacing) → Redis → gateway. The ratio is what the queue
costs. With `--before REF`, llmfleet as of git revision REF runs too (its own Redis, worker and
gateway from `git archive REF`): before/after figures of a hot-path change, from one run.
`--rounds N` measures every server N times, before and after in alternating order, and gives
each figure's median (with the rounds' own values in the JSON): on shared cores one round's
req/s moves by ±20%, more than most single changes.

    python -m bench.relay_throughput [--seconds 15] [--concurrency 64] [--before REF] [--rounds N] [--keys] [--greedy]

`--greedy` sends `temperature: 0`: streams a takeover can replay, whose gateway keeps what it
sent (gateway/fleet/replay.py); against `--before` a revision without that, what keeping it costs.

`--keys` adds llmfleet with managed keys required (`--require-keys`) and a key whose rpm and tpm
are checked on every request and never reached: what the front door costs (with `--before`, for
that revision too).

Writes bench/results/relay_throughput.json and .png and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from typing import Self

import httpx
import uvloop

from bench.common import RESULTS, cpu_seconds, plot_bars, save, source_tree
from bench.loadgen import Target, closed_loop, summarize
from tests.procs import (
    Proc,
    free_port,
    spawn,
    start_gateway,
    start_redis,
    start_worker,
    wait_for,
    wait_until_answers,
    wait_until_served,
)

TOKENS = 16
MODEL = "relay"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": TOKENS,
        "stream": True}


def measure(name: str, url: str, pid: int, seconds: float, concurrency: int,
            headers: dict[str, str] | None = None) -> dict:
    """Closed-loop load on one server; rates, TTFT and the server process's CPU per request."""
    sys.stderr.write(f"  {name}: {seconds:.0f}s at concurrency {concurrency}...\n")
    target = Target(url, "/v1/chat/completions", BODY, headers=headers)
    uvloop.run(closed_loop(target, concurrency, 1.0))  # warm-up: connections, first-request costs
    cpu_before = cpu_seconds(pid)
    results, elapsed = uvloop.run(closed_loop(target, concurrency, seconds))
    cpu = cpu_seconds(pid) - cpu_before
    summary = summarize(results, elapsed, expected_tokens=TOKENS)
    summary.update(name=name, concurrency=concurrency,
                   server_cpu_ms_per_request=1000 * cpu / max(summary["requests"], 1),
                   server_cpu_ms_per_token=1000 * cpu / max(summary["tokens"], 1),
                   server_cpu_share=cpu / elapsed)
    return summary


class Fleet:
    """Redis, one scripted worker (unpaced unless `worker_args` say otherwise) and one gateway; from
    this tree or from `source`."""

    headers: dict[str, str] | None = None  # what each request presents

    def __init__(self, source: str | None = None, *gateway_args: str, worker_args: tuple[str, ...] = ()):
        env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else None
        self.redis = start_redis()
        self.procs: list[Proc] = [self.redis]
        try:
            self.procs.append(start_worker(self.redis.url, MODEL, "--max-concurrency", "20000",
                                           *worker_args, env=env))
            self.gateway = start_gateway(self.redis.url, *gateway_args, env=env)
            self.procs.append(self.gateway)
            self._ready()
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> None:
        wait_until_served(self.gateway, MODEL)

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def pid(self) -> int:
        return self.gateway.pid

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class KeyedFleet(Fleet):
    """The same, with managed keys required (`--require-keys`) and one key whose limits are checked
    on every request and never reached: the front door's cost."""

    def __init__(self, source: str | None = None):
        super().__init__(source, "--require-keys")

    def _ready(self) -> None:
        secret = subprocess.run(
            [sys.executable, "-m", "llmfleet", "keys", "create", "--name", "bench", "--rpm", "100000000", "--tpm",
             "1000000000000", "--redis-url", self.redis.url], capture_output=True, text=True, check=True,
            timeout=60).stdout.strip().splitlines()[-1]
        self.headers = {"Authorization": f"Bearer {secret}"}
        wait_for(lambda: httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=5).json().get("data"),
                 30, "the model to be listed")


@contextlib.contextmanager
def baseline_server():
    port = free_port()
    proc = spawn("baseline-sse", [sys.executable, "-m", "bench.baseline_sse", str(port)])
    try:
        proc.url = f"http://127.0.0.1:{port}"
        wait_until_answers(proc, "/health", 20)
        yield proc
    finally:
        proc.stop()


def run(seconds: float, concurrency: int, before: str | None = None, rounds: int = 1, keyed: bool = False) -> dict:
    with contextlib.ExitStack() as stack:
        servers = [("baseline: bare SSE server", baseline_server)]
        if before:
            source = stack.enter_context(source_tree(before))
            servers.append((f"llmfleet before ({before})", lambda: Fleet(source)))
        servers.append(("llmfleet: gateway + Redis + worker", Fleet))
        if keyed:
            servers.append(("llmfleet with a managed key (--require-keys, rpm and tpm checked)", KeyedFleet))
            if before:
                servers.append((f"llmfleet before ({before}) with a managed key", lambda: KeyedFleet(source)))
        samples: dict[str, list[dict]] = {name: [] for name, _ in servers}
        for i in range(rounds):
            llmfleets = servers[1:] if i % 2 == 0 else servers[:0:-1]  # before and after take turns going first
            for name, start in [servers[0], *llmfleets]:
                with start() as server:
                    samples[name].append(measure(name, server.url, server.pid, seconds, concurrency,
                                                 getattr(server, "headers", None)))
    rows = [_median(samples[name]) for name, _ in servers]
    for row in rows:
        row["ratio_to_baseline"] = row["requests_per_s"] / rows[0]["requests_per_s"]
    return {"tokens_per_stream": TOKENS, "concurrency": concurrency, "seconds": seconds, "before": before,
            "rounds": rounds, "measured_at": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}


def _median(samples: list[dict]) -> dict:
    """One server's rounds as one row: the median of each figure, and the rounds themselves."""
    row = dict(samples[0])
    for key, value in row.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            row[key] = statistics.median(sample[key] for sample in samples)
    row["errors"] = sum(sample["errors"] for sample in samples)
    if len(samples) > 1:
        row["rounds"] = samples
    return row


def table(result: dict) -> str:
    lines = [("| server | req/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | server CPU ms/req | server CPU ms/token "
              "| errors | req/s ratio |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['requests_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['ttft_p50_ms']:.1f} "
                     f"| {r['ttft_p99_ms']:.1f} | {r['server_cpu_ms_per_request']:.2f} | "
                     f"{r['server_cpu_ms_per_request'] / result['tokens_per_stream']:.3f} | {r['errors']} | "
                     f"{r['ratio_to_baseline']:.2f} |")
    if result.get("rounds", 1) > 1:
        lines.append(f"\nMedians of {result['rounds']} rounds; each round's req/s and server CPU ms/request:")
        lines += [f"- {r['name']}: " + ", ".join(f"{x['requests_per_s']:.0f} ({x['server_cpu_ms_per_request']:.2f})"
                                                 for x in r["rounds"]) for r in result["rows"]]
    return "\n".join(lines)


def plot(result: dict) -> None:
    names = [r["name"].split(":")[0] for r in result["rows"]]
    plot_bars(RESULTS / "relay_throughput.png", names, {
        "requests/s": [r["requests_per_s"] for r in result["rows"]],
        "server CPU ms/request": [r["server_cpu_ms_per_request"] for r in result["rows"]],
        "TTFT p99 (ms)": [r["ttft_p99_ms"] for r in result["rows"]],
    })


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--before", help="also measure llmfleet as of this git revision")
    parser.add_argument("--rounds", type=int, default=1, help="measure each server this many times; medians")
    parser.add_argument("--keys", action="store_true", help="also llmfleet with managed keys required")
    parser.add_argument("--greedy", action="store_true", help="greedy streams (temperature 0), which replay exactly")
    args = parser.parse_args(argv)
    if args.greedy:
        BODY["temperature"] = 0
    return save("relay_throughput", run(args.seconds, args.concurrency, args.before, args.rounds, args.keys), plot,
                table)


if __name__ == "__main__":
    main()
