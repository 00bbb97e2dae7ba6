"""Where a stream's time and CPU go beside one engine: vllm serve against llmfleet, by stage.

Starts `vllm serve` and llmfleet (Redis, one vLLM worker, a gateway) on the tiny model with the same
engine options, and runs the same `vllm bench serve` workload (128 -> 128 tokens) against each in
alternating rounds. Per run, beside the client's throughput, TTFT and ITL:

- each engine's own figures, from its `/metrics` (means over the run): vLLM's inter-token latency
  (timed by its engine core at each step) and time to first token, this one's p50 and p99 too (in
  5 ms buckets), timed from the request's arrival at the engine's client (`vllm serve`'s API
  server, llmfleet's worker): beside the client's, what of a first token's tail the engine makes;
- llmfleet's stages, from its own metrics (means): the queue (gateway arrival to the worker's
  claim), the wait for the request's lease, the worker's time to first token, what the oldest
  reply of a worker's write waited for it (per write, not per first token), the relay (a
  worker's write to the gateway's read), the gateway's time to first token and the gaps between
  its token events;
- CPU ms per output token of each process beside the engine (vllm serve's API server; llmfleet's
  worker, gateway and Redis), over the client's whole call (its ~8 s start, when servers idle,
  included);
- Redis's commands per second during llmfleet's run.

    python -m bench.engine_stages [--concurrency 8] [--prompts 96] [--rounds 2]

Writes bench/results/engine_stages.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis as redis_client
from prometheus_client.parser import text_string_to_metric_families

from bench.common import RESULTS, cpu_seconds
from bench.engine_path import Backends, bench_serve, start_vllm_serve, vllm_cli_env
from bench.routers import histogram_quantile
from tests.procs import wait_until_answers

ENGINE_TTFT = "vllm:time_to_first_token_seconds"  # its quantiles too, from these buckets:
TTFT_BUCKETS_S = [round(0.005 * i, 3) for i in range(1, 301)] + [2.0, 3.0, 5.0, 10.0]
ENGINE_BUCKETS = ("--custom-histogram-buckets", json.dumps({"time_to_first_token": TTFT_BUCKETS_S}))
# (label, metric, where): the histograms whose means a run reports, in ms.
MEANS = [
    ("engine ITL", "vllm:inter_token_latency_seconds", "engine"),
    ("engine TTFT", ENGINE_TTFT, "engine"),
    ("queue", "llmfleet_worker_queue_seconds", "worker"),
    ("lease wait", "llmfleet_worker_lease_wait_seconds", "worker"),
    ("worker TTFT", "llmfleet_worker_time_to_first_token_seconds", "worker"),
    ("publish wait", "llmfleet_worker_publish_wait_seconds", "worker"),
    ("relay", "llmfleet_gateway_relay_seconds", "gateway"),
    ("gateway TTFT", "llmfleet_gateway_time_to_first_token_seconds", "gateway"),
    ("gateway event gap", "llmfleet_gateway_inter_token_seconds", "gateway"),
]
_TTFT_BUCKET = f"{ENGINE_TTFT}_bucket"


def _sums(url: str) -> dict[str, float]:
    """Every histogram's _sum and _count on `url`'s /metrics, summed over its labels, and the engine's
    time-to-first-token buckets (as `_bucket:<bound>`)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            name = sample.name
            if name == _TTFT_BUCKET:
                name = f"{name}:{sample.labels['le']}"
            elif not name.endswith(("_sum", "_count")):
                continue
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def _engine_ttft_buckets(before: dict[str, float], after: dict[str, float]) -> list[tuple[float, float]]:
    """The engine's time-to-first-token histogram between two `_sums`: (upper bound, cumulative count)."""
    prefix = f"{_TTFT_BUCKET}:"
    return sorted((float(name.removeprefix(prefix)), count - before.get(name, 0.0))
                  for name, count in after.items() if name.startswith(prefix))


def _scrape(sources: dict[str, str]) -> dict[str, dict[str, float]]:
    """`_sums` of each source, each URL read once (a vLLM worker serves its engine's metrics and its own)."""
    read = {url: _sums(url) for url in set(sources.values())}
    return {where: read[url] for where, url in sources.items()}


def _mean_ms(before: dict[str, float], after: dict[str, float], metric: str) -> float | None:
    count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
    if count <= 0:
        return None
    return 1000 * (after[f"{metric}_sum"] - before.get(f"{metric}_sum", 0.0)) / count


def measure(name: str, url: str, sources: dict[str, str], pids: dict[str, int], store: redis_client.Redis | None,
            model_dir: Path, workload: dict, env: dict, out: Path) -> dict:
    """One `vllm bench serve` run against `url`: the client's figures, the stages' means, CPU per token."""
    before = _scrape(sources)
    cpu = {proc: cpu_seconds(pid) for proc, pid in pids.items()}
    if store is not None:
        store.config_resetstat()
    started = time.monotonic()
    result = bench_serve(url, model_dir, workload, env, out)
    elapsed = time.monotonic() - started
    tokens = result["completed"] * workload["output"]
    row = {"server": name, "output_tok_s": result["output_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
           "ttft_p99_ms": result["p99_ttft_ms"], "itl_p50_ms": result["median_itl_ms"],
           "itl_p99_ms": result["p99_itl_ms"],
           "cpu_ms_per_token": {proc: 1000 * (cpu_seconds(pid) - cpu[proc]) / tokens for proc, pid in pids.items()}}
    after = _scrape(sources)
    ttft = _engine_ttft_buckets(before["engine"], after["engine"])
    row["engine_ttft_p50_ms"], row["engine_ttft_p99_ms"] = (1000 * histogram_quantile(ttft, q) for q in (0.5, 0.99))
    row["means_ms"] = {label: _mean_ms(before[where], after[where], metric)
                       for label, metric, where in MEANS if where in sources}
    if store is not None:
        row["redis_commands_per_s"] = {name.removeprefix("cmdstat_"): stats["calls"] / elapsed
                                       for name, stats in store.info("commandstats").items()
                                       if name not in ("cmdstat_config|resetstat", "cmdstat_info")}
    return row


class Pair(Backends):
    """`vllm serve` and llmfleet (Redis, one vLLM worker, one gateway), each engine with the first
    token's finer buckets; stopped on exit by PID."""

    def start_pair(self, model_dir: Path, env: dict) -> dict[str, tuple]:
        """Each server's URL, its /metrics sources, the PIDs beside its engine, and its Redis (or None)."""
        sys.stderr.write("starting vllm serve and an llmfleet vLLM worker on the tiny model (about a minute)...\n")
        self.frontends: dict[str, list[int]] = {}
        serve = self._own(start_vllm_serve(model_dir, env, *ENGINE_BUCKETS))
        urls: dict[str, str] = {}
        worker = self._start_llmfleet("llmfleet", model_dir, urls, engine_args=ENGINE_BUCKETS)
        wait_until_answers(serve, "/v1/models", 600)
        worker_pid, gateway_pid, redis_pid = self.frontends["llmfleet"]
        return {
            "vllm serve": (serve.url, {"engine": serve.url}, {"api server": serve.pid}, None),
            "llmfleet": (urls["llmfleet"], {"engine": worker.url, "worker": worker.url, "gateway": urls["llmfleet"]},
                         {"worker": worker_pid, "gateway": gateway_pid, "redis": redis_pid},
                         redis_client.Redis.from_url(worker.extra["redis_url"])),
        }


def run(concurrency: int, prompts: int, rounds: int) -> dict:
    from worker.tiny_model import write_tiny_model

    workload = {"input": 128, "output": 128, "concurrency": concurrency, "prompts": prompts}
    rows = []
    with tempfile.TemporaryDirectory(prefix="engine-stages-") as scratch, vllm_cli_env() as env, Pair() as pair:
        scratch = Path(scratch)
        model_dir = write_tiny_model(scratch / "tiny")
        servers = pair.start_pair(model_dir, env)
        for url, *_ in servers.values():  # warm-up: first requests pay one-off costs
            bench_serve(url, model_dir, {"input": 128, "output": 16, "concurrency": 4, "prompts": 8}, env,
                        scratch / "warmup.json")
        for done in range(rounds):
            order = list(servers) if done % 2 == 0 else list(reversed(servers))
            for name in order:
                url, sources, pids, store_client = servers[name]
                row = measure(name, url, sources, pids, store_client, model_dir, workload, env,
                              scratch / f"{done}-{name.replace(' ', '_')}.json")
                row["round"] = done
                rows.append(row)
                sys.stderr.write(f"round {done + 1}/{rounds}, {name}: {row['output_tok_s']:.0f} tok/s\n")
    return {"workload": workload, "rounds": rounds, "runs": rows}


def _cell(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def table(result: dict) -> str:
    labels = [label for label, *_ in MEANS]
    lines = ["| round | server | output tok/s | TTFT p50 / p99 ms | engine TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             + " | ".join(f"{label} ms" for label in labels) + " | CPU ms/token beside the engine |",
             "|" + "---|" * (7 + len(labels))]
    for row in result["runs"]:
        cpu = ", ".join(f"{proc} {value:.3f}" for proc, value in row["cpu_ms_per_token"].items())
        lines.append(f"| {row['round'] + 1} | {row['server']} | {row['output_tok_s']:,.0f} | "
                     f"{row['ttft_p50_ms']:.1f} / {row['ttft_p99_ms']:.1f} | "
                     f"{row['engine_ttft_p50_ms']:.1f} / {row['engine_ttft_p99_ms']:.1f} | {row['itl_p50_ms']:.2f} / "
                     f"{row['itl_p99_ms']:.2f} | " + " | ".join(_cell(row["means_ms"].get(label), 2) for label in labels)
                     + f" | {cpu} |")
    fleet = [row for row in result["runs"] if "redis_commands_per_s" in row]
    if fleet:
        names = sorted({name for row in fleet for name in row["redis_commands_per_s"]},
                       key=lambda name: -statistics.median(row["redis_commands_per_s"].get(name, 0) for row in fleet))
        lines.append("\nRedis commands a second during llmfleet's runs (median): " + ", ".join(
            f"{name} {statistics.median(row['redis_commands_per_s'].get(name, 0) for row in fleet):.1f}"
            for name in names[:12]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    result = run(args.concurrency, args.prompts, args.rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_stages.json").write_text(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
