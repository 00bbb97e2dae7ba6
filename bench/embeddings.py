"""Embeddings: llmfleet's encoder workers against `vllm serve --runner pooling`, in one run.

Two parts, each on fresh processes:

- **vllm**: the tiny model as an embedding model (`--runner pooling --convert embed`, the engine
  options of every benchmark) behind `vllm serve`, and behind llmfleet (Redis, a gateway, one
  vLLM encoder worker), both up at once and measured workload by workload, back to back, each
  workload `--rounds` times on each of `--starts` sets of fresh processes (vllm serve started
  first, then last: a server started later answers faster here; the median of all is kept):
  inputs per second, request latency p50 and p99, and the gateway's CPU per input (llmfleet's
  cost beside the engine). Workloads: 1 and 64 inputs per request, 1 to 64 concurrent clients.
- **scripted**: how the fleet spreads work over its workers, with the scripted encoder given a
  fixed cost per input (`--scripted-seconds-per-input`): one worker, then two, the same load (two
  CPU engines would share this machine's two cores, which measures the machine). Two loads: many
  clients' requests of 64 inputs, and one request of 10,000 inputs, which the gateway serves in
  parts of 256 (`--encoder-part-inputs`), and, as the baseline, whole (`--encoder-part-inputs 0`).

- **vllm-split** (not run by default): the large request on one real vLLM encoder worker, then
  two, for the record (two CPU engines share this machine's two cores).

    python -m bench.embeddings [--quick] [--rounds N] [--only vllm,scripted,vllm-split] [--before REF]

`--before REF` runs llmfleet as of that git revision beside this tree's, in the same rounds (each
round in another order, each set of processes started in another order), with each one's CPU per
input of worker, gateway and Redis.

Writes bench/results/embeddings.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import uvloop

from bench.common import (
    ENGINE_ARGS,
    ENGINE_ENV,
    RESULTS,
    cpu_seconds,
    percentile,
    plot_bars,
    progress,
    save,
    source_tree,
)
from bench.loadgen import Target
from tests.procs import (
    free_port,
    spawn,
    start_gateway,
    start_redis,
    start_worker,
    wait_until_answers,
    wait_until_served,
)

MODEL = "tiny-embed"
POOLING = ["--runner", "pooling", "--convert", "embed"]
WORDS = "the sea is calm tonight a tide of words rolls over stones and sand under a pale moon".split()
SCRIPTED_COST_S = 0.002  # per input: one scripted worker encodes 500 inputs a second
LARGE_INPUTS = 10_000  # the one large request's (an indexing job's)
PART_INPUTS = 256


def workloads(quick: bool) -> list[dict]:
    """(inputs per request, concurrent clients, requests) of each workload."""
    shapes = [(1, 1), (1, 64), (64, 1), (64, 8)] if quick else [(1, 1), (1, 8), (1, 64), (64, 1), (64, 8), (64, 64)]
    return [{"inputs": inputs, "concurrency": clients, "requests": max(32, 2 * clients) if inputs == 64
             else max(256, 32 * clients)} for inputs, clients in shapes]


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(32)) for _ in range(count)]


async def measure(url: str, workload: dict, seed: int, use_httpx: bool = False) -> dict:
    """Send the workload's requests from its concurrent clients; inputs/s and latency percentiles.

    The clients are bench.loadgen's lean HTTP connections (httptools, prebuilt requests): the load
    generator shares the two cores with the servers, and httpx's own cost per request grows with
    its concurrent requests (`use_httpx`, kept to show it: docs/benchmarks.md)."""
    bodies = [{"model": MODEL, "input": texts(workload["inputs"], seed * 100_000 + i), "encoding_format": "base64"}
              for i in range(workload["requests"])]
    latencies: list[float] = []
    target = Target(url, "/v1/embeddings", bodies[0], timeout=600)
    pending = iter(bodies if use_httpx else [target.request_for(body) for body in bodies])

    async def lean_client() -> None:
        connection = None
        for request in pending:
            result, connection = await target.send(connection, request)
            if not result.ok or len(orjson.loads(result.body)["data"]) != workload["inputs"]:
                raise RuntimeError(f"{url}: {result.error or result.body[:200]!r}")
            latencies.append(result.latency)
        if connection is not None:
            connection.close()

    async def httpx_client(http: httpx.AsyncClient) -> None:
        for body in pending:
            started = time.perf_counter()
            answer = await http.post(f"{url}/v1/embeddings", json=body)
            answer.raise_for_status()
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=workload["concurrency"])
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(httpx_client(http) if use_httpx else lean_client()
                               for _ in range(workload["concurrency"])))
        took = time.perf_counter() - started
    return {"inputs_per_s": workload["requests"] * workload["inputs"] / took,
            "p50_ms": percentile(latencies, 50) * 1000, "p99_ms": percentile(latencies, 99) * 1000}


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _fleet(model_dir: Path, procs: list, source: str | None = None) -> tuple[str, dict[str, int]]:
    """Redis, one vLLM encoder worker and a gateway (from `source`, a tree of an older commit, if
    given), their processes added to `procs`: the gateway's URL and the pids to read CPU from."""
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else {}
    redis = start_redis()
    procs.append(redis)
    worker = start_worker(redis.url, str(model_dir), *ENGINE_ARGS, *POOLING, engine="vllm", served_name=MODEL,
                          env={**ENGINE_ENV, **env}, timeout=300)
    procs.append(worker)
    gateway = start_gateway(redis.url, env=env or None)
    procs.append(gateway)
    wait_until_served(gateway, MODEL, timeout=60)
    return gateway.url, {"gateway": gateway.pid, "worker": worker.pid, "redis": redis.pid}


@contextlib.contextmanager
def vllm_servers(model_dir: Path, before: str | None = None, fleet_first: bool = False):
    """{"vllm serve": url, "llmfleet": url[, "llmfleet at REF": url]} and the pids of each llmfleet's
    gateway, worker and Redis; every process stopped on exit. They start in that order, or in its reverse."""
    procs = []
    try:
        with contextlib.ExitStack() as trees:
            urls, pids = {}, {}

            def fleets() -> None:
                names = ["llmfleet"] + [f"llmfleet at {before}"] * bool(before)
                for name in reversed(names) if fleet_first else names:  # the reverse order: theirs too
                    source = None if name == "llmfleet" else trees.enter_context(source_tree(before))
                    urls[name], pids[name] = _fleet(model_dir, procs, source)

            if fleet_first:
                fleets()
            port = free_port()
            serve = spawn("vllm-serve-embed", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                               str(model_dir), "--served-model-name", MODEL, "--host", "127.0.0.1",
                                               "--port", str(port), *ENGINE_ARGS, *POOLING], ENGINE_ENV)
            serve.url = urls["vllm serve"] = f"http://127.0.0.1:{port}"
            procs.append(serve)
            if not fleet_first:
                fleets()
            wait_until_answers(serve, "/health", 300)
            yield urls, pids
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=60)


def run_vllm(quick: bool, rounds: int, use_httpx: bool = False, before: str | None = None,
             starts: int = 2) -> list[dict]:
    """Every workload on every server, `rounds` times on each of `starts` sets of processes: the
    first started in the order vllm serve, llmfleet, llmfleet at REF, the next in its reverse, and
    so on. On this machine a server started later answered faster than the same server started
    before it (docs/benchmarks.md, "Fourteenth pass"), so each goes last as often as first; medians
    of all the rounds."""
    from worker.tiny_model import write_tiny_model

    cases = workloads(quick)
    runs: list[dict[str, list[dict]]] = [collections.defaultdict(list) for _ in cases]
    cpu: list[dict[str, dict[str, float]]] = [collections.defaultdict(lambda: collections.defaultdict(float))
                                              for _ in cases]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "tiny")
        for start in range(starts):
            first = "llmfleet" if start % 2 else "vllm serve"
            sys.stderr.write(f"starting vllm serve and llmfleet on the tiny model, {first} first (about a minute)...\n")
            with vllm_servers(model_dir, before, fleet_first=start % 2 == 1) as (urls, pids):
                for url in urls.values():  # warm the engines up
                    uvloop.run(measure(url, {"inputs": 8, "concurrency": 4, "requests": 8}, 0))
                names = sorted(urls)
                for index, workload in enumerate(cases):
                    for round_ in range(rounds):  # back to back, each round in another order: drift hits all alike
                        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                            before_cpu = {process: cpu_seconds(pid) for process, pid in pids.get(name, {}).items()}
                            runs[index][name].append(uvloop.run(measure(urls[name], workload, round_, use_httpx)))
                            for process, pid in pids.get(name, {}).items():
                                cpu[index][name][process] += cpu_seconds(pid) - before_cpu[process]
                    progress("embeddings (vllm)", start * len(cases) + index + 1, starts * len(cases))
    rows = []
    for workload, results, used in zip(cases, runs, cpu, strict=True):
        inputs = starts * rounds * workload["requests"] * workload["inputs"]
        row = {**workload, **{name: _median(measured) for name, measured in results.items()},
               "cpu_us_per_input": {name: {process: seconds / inputs * 1e6 for process, seconds in spent.items()}
                                    for name, spent in used.items()}}
        row["gateway_cpu_us_per_input"] = row["cpu_us_per_input"]["llmfleet"]["gateway"]
        for name in results:
            if name.startswith("llmfleet"):
                row[f"ratio {name}"] = row[name]["inputs_per_s"] / row["vllm serve"]["inputs_per_s"]
        row["ratio"] = row["ratio llmfleet"]
        rows.append(row)
    return rows


def run_scripted(quick: bool, rounds: int) -> dict:
    """Inputs per second of one scripted encoder worker, then two, under the same loads: many
    clients, and one large request (in parts, and whole)."""
    workload = {"inputs": 64, "concurrency": 16, "requests": 32 if quick else 96}
    large = {"inputs": LARGE_INPUTS // 5 if quick else LARGE_INPUTS, "concurrency": 1, "requests": 1}
    result = {"seconds_per_input": SCRIPTED_COST_S, **workload, "large_inputs": large["inputs"],
              "part_inputs": PART_INPUTS}
    for workers in (1, 2):
        procs = []
        try:
            redis = start_redis()
            procs.append(redis)
            procs += [start_worker(redis.url, MODEL, "--runner", "pooling", "--scripted-seconds-per-input",
                                   str(SCRIPTED_COST_S)) for _ in range(workers)]
            parted, whole = (start_gateway(redis.url, "--max-encoder-inputs", str(large["inputs"]),
                                           "--encoder-part-inputs", str(part)) for part in (PART_INPUTS, 0))
            procs += [parted, whole]
            for gateway in (parted, whole):
                wait_until_served(gateway, MODEL)
            name = f"{workers} worker{'s' * (workers > 1)}"
            result[name] = _median([uvloop.run(measure(parted.url, workload, seed)) for seed in range(rounds)])
            result[f"{name}, one large request"] = _median([uvloop.run(measure(parted.url, large, seed))
                                                            for seed in range(rounds)])
            result[f"{name}, one large request whole"] = _median([uvloop.run(measure(whole.url, large, seed))
                                                                  for seed in range(rounds)])
        finally:
            for proc in reversed(procs):
                proc.stop()
        progress("embeddings (scripted)", workers, 2)
    rate = {name: value["inputs_per_s"] for name, value in result.items() if isinstance(value, dict)}
    result["speedup"] = rate["2 workers"] / rate["1 worker"]
    result["large_speedup"] = rate["2 workers, one large request"] / rate["1 worker, one large request"]
    result["large_whole_speedup"] = rate["2 workers, one large request whole"] / rate["1 worker, one large request"]
    return result


def run_vllm_split(quick: bool, rounds: int) -> dict:
    """For the record: one large request in parts on one real vLLM encoder worker, then on two. Two
    CPU engines share this machine's two cores, so this measures the cores more than the spreading
    (the scripted part measures that); it shows that parts reach both engines and come back whole."""
    from worker.tiny_model import write_tiny_model

    large = {"inputs": 512 if quick else 2048, "concurrency": 1, "requests": 1}
    result = {"large_inputs": large["inputs"], "part_inputs": PART_INPUTS}
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "tiny"))
        try:
            redis = start_redis()
            gateway = start_gateway(redis.url, "--max-encoder-inputs", str(large["inputs"]),
                                    "--encoder-part-inputs", str(PART_INPUTS))
            procs += [redis, gateway]
            for workers in (1, 2):
                sys.stderr.write(f"starting vLLM encoder worker {workers} of 2 (about a minute)...\n")
                procs.append(start_worker(redis.url, model_dir, *ENGINE_ARGS, *POOLING, engine="vllm",
                                          served_name=MODEL, env=ENGINE_ENV, timeout=300))
                wait_until_served(gateway, MODEL, timeout=60)
                uvloop.run(measure(gateway.url, {"inputs": 2 * PART_INPUTS, "concurrency": 1, "requests": 1}, 0))
                name = f"{workers} worker{'s' * (workers > 1)}"
                result[name] = _median([uvloop.run(measure(gateway.url, large, seed)) for seed in range(rounds)])
                progress("embeddings (vllm split)", workers, 2)
        finally:
            for proc in reversed(procs):
                proc.stop(timeout=60)
    result["speedup"] = result["2 workers"]["inputs_per_s"] / result["1 worker"]["inputs_per_s"]
    return result


def table(result: dict) -> str:
    lines = []
    if result.get("vllm"):
        lines += ["| inputs/request | clients | vllm serve inputs/s | llmfleet inputs/s | ratio | p50 ms (vllm / "
                  "llmfleet) | p99 ms (vllm / llmfleet) | gateway CPU µs/input |", "|---|---|---|---|---|---|---|---|"]
        for row in result["vllm"]:
            theirs, ours = row["vllm serve"], row["llmfleet"]
            lines.append(f"| {row['inputs']} | {row['concurrency']} | {theirs['inputs_per_s']:.0f} | "
                         f"{ours['inputs_per_s']:.0f} | {row['ratio']:.2f}x | {theirs['p50_ms']:.0f} / "
                         f"{ours['p50_ms']:.0f} | {theirs['p99_ms']:.0f} / {ours['p99_ms']:.0f} | "
                         f"{row['gateway_cpu_us_per_input']:.0f} |")
        if before := next((name for name in result["vllm"][0] if name.startswith("llmfleet at ")), None):
            lines += ["", f"Against {before}, in the same rounds (CPU µs per input: worker / gateway / Redis):", "",
                      f"| inputs/request | clients | llmfleet inputs/s | {before} inputs/s | ratio to vllm serve "
                      f"(llmfleet / {before}) | llmfleet CPU | {before} CPU |", "|---|---|---|---|---|---|---|"]
            for row in result["vllm"]:
                cpu = {name: " / ".join(f"{row['cpu_us_per_input'][name][process]:.0f}"
                                        for process in ("worker", "gateway", "redis")) for name in ("llmfleet", before)}
                lines.append(f"| {row['inputs']} | {row['concurrency']} | {row['llmfleet']['inputs_per_s']:.0f} | "
                             f"{row[before]['inputs_per_s']:.0f} | {row['ratio']:.2f}x / {row['ratio ' + before]:.2f}x "
                             f"| {cpu['llmfleet']} | {cpu[before]} |")
    if scripted := result.get("scripted"):
        lines += ["", f"Scripted encoder, {scripted['seconds_per_input'] * 1000:g} ms per input, "
                      f"{scripted['concurrency']} clients of {scripted['inputs']} inputs: "
                      f"1 worker {scripted['1 worker']['inputs_per_s']:.0f} inputs/s, 2 workers "
                      f"{scripted['2 workers']['inputs_per_s']:.0f} inputs/s ({scripted['speedup']:.2f}x).", "",
                  f"One request of {scripted['large_inputs']:,} inputs (the same cost per input), served in parts of "
                  f"{scripted['part_inputs']}: 1 worker {scripted['1 worker, one large request']['inputs_per_s']:.0f} "
                  f"inputs/s, 2 workers {scripted['2 workers, one large request']['inputs_per_s']:.0f} inputs/s "
                  f"({scripted['large_speedup']:.2f}x); the same request whole on 2 workers "
                  f"{scripted['2 workers, one large request whole']['inputs_per_s']:.0f} inputs/s "
                  f"({scripted['large_whole_speedup']:.2f}x: one worker takes it all)."]
    if split := result.get("vllm_split"):
        lines += ["", f"Real vLLM encoder workers (for the record: two CPU engines share the two cores), one request "
                      f"of {split['large_inputs']:,} inputs in parts of {split['part_inputs']}: 1 worker "
                      f"{split['1 worker']['inputs_per_s']:.0f} inputs/s, 2 workers "
                      f"{split['2 workers']['inputs_per_s']:.0f} inputs/s ({split['speedup']:.2f}x)."]
    return "\n".join(lines)


def section(result: dict) -> list[str]:
    """This part's section of docs/benchmarks.md."""
    return ["", "## Embeddings: encoder workers against `vllm serve --runner pooling`", "",
            ("`python -m bench.embeddings`: the tiny model as an embedding model (`--runner pooling --convert embed`) "
             "behind `vllm serve` and behind llmfleet (gateway, Redis, one vLLM encoder worker), measured back to "
             "back, median of the rounds; base64 answers (the openai SDK's default). Gateway CPU per input is "
             "llmfleet's own cost beside the engine."), "", table(result), "", "![embeddings](embeddings.png)"]


def plot(result: dict) -> None:
    if not result.get("vllm"):
        return
    names = [name for name in result["vllm"][0] if name == "vllm serve" or name.startswith("llmfleet")]
    panels = {f"inputs/s, {row['inputs']} in x {row['concurrency']} clients": [row[name]["inputs_per_s"]
                                                                              for name in names]
              for row in result["vllm"]}
    plot_bars(RESULTS / "embeddings.png", names, panels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer workloads and requests")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each workload (the median is kept)")
    parser.add_argument("--only", default="vllm,scripted", help="the parts to run: vllm, scripted, vllm-split")
    parser.add_argument("--starts", type=int, default=2,
                        help="sets of fresh processes for the vllm part, vllm serve started first, then last")
    parser.add_argument("--before", metavar="REF",
                        help="the vllm part also runs llmfleet as of this git revision, in the same rounds")
    parser.add_argument("--httpx", action="store_true",
                        help="the vllm part's clients on httpx instead of the lean load generator (to compare)")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    result = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "starts": args.starts,
              "client": "httpx" if args.httpx else "lean",
              "vllm": run_vllm(args.quick, args.rounds, args.httpx, args.before, args.starts) if "vllm" in parts
              else [],
              "scripted": run_scripted(args.quick, args.rounds) if "scripted" in parts else None,
              "vllm_split": run_vllm_split(args.quick, args.rounds) if "vllm-split" in parts else None}
    return save("embeddings", result, plot, table)


if __name__ == "__main__":
    main()
