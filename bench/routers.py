"""llmfleet against the Rust routers: `vllm bench serve` through each, in one run.

What users who outgrow one `vllm serve` put in front of it: vLLM's own `vllm-router` and SGLang's
`sglang-router` (both Rust, both from PyPI, each installed on first use into a venv of its own
under ~/.cache/llmfleet, so neither can disturb this project's dependencies; default options,
one worker URL). Four servers, all up at once and measured back to back, each round in another
order, so the machine's drift hits each alike; the rounds are spread over `--starts` sets of fresh
processes, `vllm serve` started first in one and llmfleet first in the next (a server started
later answered faster here):

- `vllm serve` alone: the baseline;
- `vllm-router` in front of that same `vllm serve`;
- `sglang-router` in front of it too;
- llmfleet: one gateway, Redis, one vLLM worker (its own engine, with the same options).

The load is vLLM's own client (`vllm bench serve`, random dataset, 128 tokens in and out,
`--ignore-eos`) at each concurrency, `--rounds` times per server (the median is kept).
CPU per output token beside the engine: every process of a server but vLLM's engine core (the
API server; the router; llmfleet's gateway, Redis and worker process), per token generated, over
the benchmark itself (and, beside it, over the whole client call, whose first ~8 s are the client
starting), also as a ratio to `vllm serve`'s API server's; and what each spends idle. A router's
row is its own process plus the `vllm serve` API server behind it. Beside the client's inter-token
latency, its engine's (vLLM's own histogram, timed at each engine step, read off /metrics before and
after each run): the client's tail less the engine's is what the path after the engine adds.

    python -m bench.routers [--quick] [--rounds N] [--starts N] [--concurrency 1,8,32,64,128]

Writes bench/results/routers.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import ENGINE_ARGS, ENGINE_ENV, RESULTS, cpu_seconds, plot_bars, progress, save
from bench.engine_path import Backends, bench_serve, start_vllm_serve, vllm_cli_env
from tests.procs import Proc, free_port, spawn, wait_until_answers
from worker.publisher import COALESCE_MOST_S

CACHE = Path.home() / ".cache" / "llmfleet"
ROUTERS = {"vllm-router": "vllm-router==0.1.17", "sglang-router": "sglang-router==0.3.2"}
LAUNCH = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}
METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_engine_itl_ms",
           "p99_engine_itl_ms")
TOKENS = 128
# The engine's own inter-token latency (vLLM's `vllm:inter_token_latency_seconds`, timed by its engine core
# at each step), in 1 ms buckets: beside the client's, it says how much of a tail the engine's steps make
# and how much the path after it adds.
ITL_BUCKETS_S = [round(0.001 * i, 3) for i in range(1, 151)] + [0.2, 0.3, 0.5, 1.0, 2.0]
ENGINE_ITL = ("--custom-histogram-buckets", json.dumps({"inter_token_latency": ITL_BUCKETS_S}))


def ensure_router(name: str) -> Path | str:
    """The router's venv python, installing it on first use; a reason string if it cannot be had."""
    requirement = ROUTERS[name]
    venv = CACHE / f"{name}-venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-m", "pip", "show", "-q", requirement.split("==")[0]],
                                          capture_output=True, check=False).returncode == 0:
        return python
    sys.stderr.write(f"installing {requirement} into {venv} (first use)...\n")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], check=True, capture_output=True,
                       timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        output = getattr(exc, "stderr", b"") or b""
        return f"`pip install {requirement}` failed: {output.decode(errors='replace')[-300:]}"
    return python


def start_router(name: str, python: Path, upstream: str) -> Proc:
    port = free_port()
    # Each on a port of its own for its Prometheus exporter too: both default to the same one.
    proc = spawn(name, [str(python), "-m", LAUNCH[name], "--host", "127.0.0.1", "--port", str(port),
                        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                        "--worker-urls", upstream], {})
    proc.url = f"http://127.0.0.1:{port}"
    return proc


class Servers(Backends):
    """vllm serve, the routers in front of it and llmfleet, all started; stopped on exit by PID."""

    def start_all(self, model_dir: Path, env: dict, fleet_first: bool = False) -> dict[str, str]:
        """Every server's URL; llmfleet's engine starts after `vllm serve`'s, or with `fleet_first` before it
        (a server started later answered faster here: docs/benchmarks.md, "Fourteenth pass")."""
        first = "llmfleet" if fleet_first else "vllm serve"
        sys.stderr.write(f"starting vllm serve and an llmfleet vLLM worker on the tiny model, {first} first "
                         "(about a minute)...\n")
        urls: dict[str, str] = {}
        self.frontends, self.engine_metrics, self.skipped = {}, {}, {}
        if fleet_first:
            worker = self._start_llmfleet("llmfleet", model_dir, urls, engine_args=ENGINE_ITL)
        serve = self._own(start_vllm_serve(model_dir, env, *ENGINE_ITL))
        urls["vllm serve"] = serve.url
        self.frontends["vllm serve"] = [serve.pid]
        if not fleet_first:
            worker = self._start_llmfleet("llmfleet", model_dir, urls, engine_args=ENGINE_ITL)
        self.engine_metrics.update({"vllm serve": serve.url, "llmfleet": worker.url})  # each engine's /metrics
        wait_until_answers(serve, "/v1/models", 600)
        for name in ROUTERS:
            python = ensure_router(name)
            if isinstance(python, str):
                self.skipped[name] = python
                continue
            router = self._own(start_router(name, python, serve.url))
            try:
                wait_until_answers(router, "/v1/models", 120)
            except (TimeoutError, RuntimeError) as exc:
                self.skipped[name] = f"did not start: {exc}; log tail: {router.log()[-300:]}"
                continue
            urls[name] = router.url
            self.frontends[name] = [serve.pid, router.pid]
            self.engine_metrics[name] = serve.url
        return urls


def run(concurrencies: list[int], rounds: int, starts: int = 2) -> dict:
    """`rounds` runs per server and concurrency, spread over `starts` sets of fresh processes: the first
    with `vllm serve` started before llmfleet, the next after it, and so on; each round in another order
    of the servers. The medians of all the runs are kept."""
    from worker.tiny_model import write_tiny_model

    runs: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    cpu: dict[tuple[int, str], float] = collections.defaultdict(float)
    cpu_call: dict[tuple[int, str], float] = collections.defaultdict(float)  # with the client's start (idle)
    tokens: dict[tuple[int, str], int] = collections.defaultdict(int)
    idle: dict[str, float] = {}
    skipped: dict[str, str] = {}
    done = 0
    with tempfile.TemporaryDirectory(prefix="routers-") as scratch, vllm_cli_env() as env:
        model_dir = write_tiny_model(Path(scratch) / "tiny")
        for start in range(starts):
            start_rounds = rounds // starts + (start < rounds % starts)
            if not start_rounds:
                continue
            with Servers() as servers:
                urls = servers.start_all(model_dir, env, fleet_first=start % 2 == 1)
                skipped.update(servers.skipped)
                for url in urls.values():  # warm-up: first requests pay one-off costs (caches, connections)
                    bench_serve(url, model_dir, {"input": TOKENS, "output": 16, "concurrency": 4, "prompts": 8}, env,
                                Path(scratch) / "warmup.json")
                # Idle, after the warm-up and after the last benchmark: the lowest reading is kept (an engine's
                # own work after its start, or a neighbour's, can land in one window).
                _keep_lowest(idle, _idle_cpu(servers.frontends))
                names = sorted(urls)
                steps = len(concurrencies) * rounds * len(names)
                for concurrency in concurrencies:
                    case = {"input": TOKENS, "output": TOKENS, "concurrency": concurrency,
                            "prompts": max(16, 4 * concurrency)}
                    for round_ in range(start_rounds):  # back to back, each round in another order
                        shift = (start + round_) % len(names)
                        for name in names[shift:] + names[:shift]:
                            itl_before = engine_itl_buckets(servers.engine_metrics[name])
                            result = bench_serve(urls[name], model_dir, case, env, Path(scratch) / f"{done}.json",
                                                 watch=servers.frontends[name])
                            itl = engine_itl_buckets(servers.engine_metrics[name], minus=itl_before)
                            result["p50_engine_itl_ms"] = 1000 * histogram_quantile(itl, 0.50)
                            result["p99_engine_itl_ms"] = 1000 * histogram_quantile(itl, 0.99)
                            key = (concurrency, name)
                            cpu[key] += result["watched_cpu_s"]
                            cpu_call[key] += result["watched_cpu_s_call"]
                            tokens[key] += result["completed"] * TOKENS
                            # --ignore-eos: every request is exactly TOKENS long, whatever a proxy's stream reports.
                            runs[key].append({**{m: result[m] for m in METRICS},
                                              "output_throughput": result["completed"] * TOKENS / result["duration"],
                                              "failed": result["failed"]})
                            done += 1
                            progress("routers (vllm bench serve runs)", done, steps)
                _keep_lowest(idle, _idle_cpu(servers.frontends))
    order = ["vllm serve", *ROUTERS, "llmfleet"]
    rows = [{"server": name, "concurrency": concurrency,
             **{m: statistics.median(r[m] for r in runs[concurrency, name]) for m in METRICS},
             "runs": len(runs[concurrency, name]), "failed": sum(r["failed"] for r in runs[concurrency, name]),
             "cpu_ms_per_token": 1000 * cpu[concurrency, name] / max(1, tokens[concurrency, name]),
             "cpu_ms_per_token_call": 1000 * cpu_call[concurrency, name] / max(1, tokens[concurrency, name]),
             "idle_cpu_ms_per_s": idle[name]}
            for concurrency in concurrencies for name in order if (concurrency, name) in runs]
    _add_ratios(rows)
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "engine_args": ENGINE_ARGS, "engine_env": ENGINE_ENV,
            "rounds": rounds, "starts": starts, "rows": rows, "skipped": skipped, "routers": ROUTERS}


def _keep_lowest(lowest: dict[str, float], reading: dict[str, float]) -> None:
    for name, value in reading.items():
        lowest[name] = min(value, lowest.get(name, value))


def engine_itl_buckets(url: str, minus: list[tuple[float, float]] | None = None) -> list[tuple[float, float]]:
    """The engine's inter-token latency histogram on a server's /metrics, as (upper bound, cumulative
    count) pairs; less `minus`, an earlier reading, for what came between."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name == "vllm:inter_token_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):  # one series per engine: summed
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
    counts = sorted(buckets.items())
    if minus:
        earlier = dict(minus)
        counts = [(bound, count - earlier.get(bound, 0.0)) for bound, count in counts]
    return counts


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a cumulative histogram, interpolated within its bucket, as Prometheus's
    `histogram_quantile` does; NaN without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _idle_cpu(frontends: dict[str, list[int]], seconds: float = 10.0) -> dict[str, float]:
    """What each server's processes beside the engine spend idle, in CPU ms a second: all servers
    idle together (after their warm-up, and after the last benchmark)."""
    time.sleep(2)
    before = {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in frontends.items()}
    time.sleep(seconds)
    return {name: 1000 * (sum(cpu_seconds(pid) for pid in pids) - before[name]) / seconds
            for name, pids in frontends.items()}


def _add_ratios(rows: list[dict]) -> None:
    """Each row against vllm serve's at its concurrency, and llmfleet's against the best router's."""
    serve = {r["concurrency"]: r for r in rows if r["server"] == "vllm serve"}
    for row in rows:
        base = serve[row["concurrency"]]
        row["throughput_ratio"] = row["output_throughput"] / base["output_throughput"]
        row["cpu_ratio"] = row["cpu_ms_per_token"] / base["cpu_ms_per_token"]
        row["p99_itl_over_serve_ms"] = row["p99_itl_ms"] - base["p99_itl_ms"]
        row["p99_after_engine_ms"] = row["p99_itl_ms"] - row["p99_engine_itl_ms"]  # what the path adds
    for row in rows:
        if row["server"] != "llmfleet":
            continue
        routers = [r for r in rows if r["server"] in ROUTERS and r["concurrency"] == row["concurrency"]]
        if routers:
            row["vs_best_router"] = {
                "throughput": row["output_throughput"] / max(r["output_throughput"] for r in routers),
                "cpu_per_token": row["cpu_ms_per_token"] / min(r["cpu_ms_per_token"] for r in routers),
                "cpu_per_token_call": row["cpu_ms_per_token_call"] / min(r["cpu_ms_per_token_call"] for r in routers),
                "p99_ttft": row["p99_ttft_ms"] / min(r["p99_ttft_ms"] for r in routers)}


def table(result: dict) -> str:
    lines = ["| concurrency | server | output tok/s | vs vllm serve | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "its engine's ITL p50 / p99 ms | CPU ms/token beside the engine | vs vllm serve's API server | "
             "the same over the whole call |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        engine = (f"{row['p50_engine_itl_ms']:.1f} / {row['p99_engine_itl_ms']:.1f}"
                  if "p99_engine_itl_ms" in row else "-")
        lines.append(f"| {row['concurrency']} | {row['server']} | {row['output_throughput']:.0f} | "
                     f"{row['throughput_ratio']:.2f}x | {row['p50_ttft_ms']:.0f} / {row['p99_ttft_ms']:.0f} | "
                     f"{row['p50_itl_ms']:.1f} / {row['p99_itl_ms']:.1f} | {engine} | {row['cpu_ms_per_token']:.3f} | "
                     f"{row['cpu_ratio']:.2f}x | {row['cpu_ms_per_token_call']:.3f} |")
    idle = {row["server"]: row["idle_cpu_ms_per_s"] for row in result["rows"]}
    lines += ["", "CPU beside the engine while idle, ms a second: " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in idle.items()) + ".",
        "CPU per token counts the benchmark itself, from the client's first request to its result; "
        "the whole call adds the ~8 s the client spends starting, when a server only idles.",
        "Its engine's ITL is vLLM's own (`vllm:inter_token_latency_seconds`, timed by the engine core at each step, "
        "per token), that of the `vllm serve` behind a router; the client's ITL is per SSE event. The client's p99 "
        "less its engine's is what the path after the engine adds to the tail."]
    against = [row for row in result["rows"] if "vs_best_router" in row]
    if against:
        lines += ["", "llmfleet against the best router at each concurrency (targets: throughput ≥ 0.95x, CPU per "
                      "token ≤ 1.05x, TTFT p99 ≤ 1.00x), and its ITL p99 against vllm serve's (bound: "
                      f"{COALESCE_MOST_S * 1000:g} ms, the publisher's longest pause); beside it, the tail each adds "
                      "after its engine (ITL p99 less its engine's):", "",
                  "| concurrency | throughput | CPU per token | (whole call) | TTFT p99 | ITL p99 − vllm serve's | "
                  "after the engine: llmfleet / vllm serve |", "|---|---|---|---|---|---|---|"]
        serve = {r["concurrency"]: r for r in result["rows"] if r["server"] == "vllm serve"}
        for row in against:
            best = row["vs_best_router"]
            after = " / ".join(f"{r.get('p99_after_engine_ms', math.nan):+.1f} ms"
                               for r in (row, serve[row["concurrency"]]))
            lines.append(f"| {row['concurrency']} | {best['throughput']:.2f}x | {best['cpu_per_token']:.2f}x | "
                         f"{best['cpu_per_token_call']:.2f}x | {best['p99_ttft']:.2f}x | "
                         f"{row.get('p99_itl_over_serve_ms', math.nan):+.1f} ms | {after} |")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"\n{name}: not measured: {why}")
    return "\n".join(lines)


def section(result: dict) -> list[str]:
    """This part's section of docs/benchmarks.md."""
    return ["", "## Against the Rust routers: vllm-router and sglang-router in front of vllm serve", "",
            (f"`python -m bench.routers`: `vllm bench serve` ({TOKENS} tokens in and out, `--ignore-eos`) against "
             f"`vllm serve` alone, {', '.join(result['routers'].values())} in front of it (default options), and "
             f"llmfleet (gateway, Redis, one vLLM worker), alternating, median of {result['rounds']} runs per server "
             f"and concurrency over {result.get('starts', 1)} sets of processes started in alternating orders. "
             "CPU per token counts every process beside the engine core."), "", table(result), "",
            "![routers](routers.png)"]


def plot(result: dict) -> None:
    names = list(dict.fromkeys(row["server"] for row in result["rows"]))
    panels = {}
    for concurrency in sorted({row["concurrency"] for row in result["rows"]}):
        by_name = {row["server"]: row for row in result["rows"] if row["concurrency"] == concurrency}
        panels[f"CPU ms/token, c={concurrency}"] = [by_name[name]["cpu_ms_per_token"] for name in names]
    plot_bars(RESULTS / "routers.png", names, panels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: concurrency 8 and 64, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5, help="runs per server and concurrency (the median is kept)")
    parser.add_argument("--concurrency", default="1,8,32,64,128", help="comma-separated concurrencies")
    parser.add_argument("--starts", type=int, default=2,
                        help="sets of fresh processes the rounds are spread over, started in alternating orders")
    args = parser.parse_args(argv)
    concurrencies = [8, 64] if args.quick else [int(c) for c in args.concurrency.split(",")]
    return save("routers", run(concurrencies, 2 if args.quick else args.rounds, args.starts), plot, table)


if __name__ == "__main__":
    main()
