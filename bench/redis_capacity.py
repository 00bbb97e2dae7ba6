"""Redis's cost per request and per output token, and how much one Redis primary carries.

One gateway and one scripted worker (no pacing) on their own redis-server, as in
`bench.relay_throughput`, serve two workloads of chat streams: 16 tokens and 256 tokens each.
Around every measured load Redis's counters start from zero (`CONFIG RESETSTAT`) and are read
at its end: `INFO commandstats` (calls and µs per command), `INFO stats` (bytes in and out), and
the redis-server process's CPU seconds (/proc). A window with no load, measured first, gives the
fleet's own background rate (heartbeats, the registry, the steal loop), which is taken off every
loaded window. Each figure per request is then `a + b × tokens`: the two workloads are two
equations in the two unknowns, a (per request) and b (per output token). Unpaced, the worker's
publisher sends a stream's tokens in a few writes; a third workload, the long streams paced (a
worker stepping as an engine does), writes every few tokens, and the three workloads split each
figure three ways: per request, per reply write (XADD) and per token.

A short `MONITOR` sample of each workload (outside the measured windows: MONITOR costs Redis
work of its own) tells the commands sent by clients from those a Lua script runs, and which
cluster slot each command's key lives in (`shared/keys.py`): the model's, the request's, the
gateway's reply stream, the worker heartbeats, or the cancel channel that a cluster broadcasts.

Then `redis-benchmark` measures a fresh redis-server's own limits on this machine for the
commands the fleet uses, with and without pipelining, at a few client counts; the redis-server's
CPU per operation there predicts the fleet's Redis CPU per request from its command mix, which
is checked against the measured one. The capacity model: requests/s and tokens/s of one primary
at 100% and 70% of a core, the gateways and workers that feeds, and what Redis Cluster sharding
by model adds.

    python -m bench.redis_capacity [--seconds 10] [--concurrency 64] [--long-tokens 256]
        [--paced-tokens-per-s 50] [--clients 1,16,64] [--engine-tokens-per-s 3313] [--quick]

Progress on stderr; a markdown table on stdout; bench/results/redis_capacity.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis
import uvloop

from bench.common import RESULTS, cpu_seconds, plot_bars, save
from bench.loadgen import Target, closed_loop, summarize
from bench.relay_throughput import MODEL, Fleet
from bench.report import _commit
from shared import keys
from tests.procs import (
    LOG_DIR,
    start_gateway,
    start_redis,
    start_redis_cluster,
    start_worker,
    wait_for,
    wait_until_served,
)

SHORT_TOKENS = 16
# The figures split three ways (per request, per reply write, per token) when the paced workload runs.
WRITE_FIGURES = ("cpu_us:redis", "cpu_us:redis_rusage", "calls", "usec", "net_in", "net_out")
SAFE_SHARE = 0.70  # of a core: headroom for bursts, persistence forks and replication
REDIS_BENCHMARK = "/usr/bin/redis-benchmark"
IGNORED_COMMANDS = {"info", "config|resetstat", "monitor", "echo"}  # this tool's own
# What one vLLM worker produced on this machine (docs/benchmarks.md, run of 2026-11-21: vllm serve,
# tiny model, concurrency 64); a GPU worker makes far more, so the workers fed are also given per
# 10k tokens/s of engine.
DEFAULT_ENGINE_TOKENS_PER_S = 3313


def progress(message: str) -> None:
    sys.stderr.write(f"[redis_capacity {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


# --- Redis's counters --------------------------------------------------------------------------

def command_stats(info: dict) -> dict[str, tuple[int, int]]:
    """`INFO commandstats` as parsed by redis-py -> {command: (calls, usec)}, lower case.

    Commands a Lua script runs are counted on their own lines too, and their time is also
    inside the script's EVALSHA: summing usec over commands counts it twice."""
    stats = {}
    for name, fields in info.items():
        command = name.removeprefix("cmdstat_").lower()
        if command not in IGNORED_COMMANDS:
            stats[command] = (int(fields["calls"]), int(fields["usec"]))
    return stats


def counters(client: redis.Redis, pids: dict[str, int]) -> dict[str, float]:
    """Every figure of one window as a flat {name: value}: calls:CMD, usec:CMD, the totals,
    bytes in and out, and the CPU µs of each process in `pids`."""
    stats = client.info("stats")
    flat: dict[str, float] = {"net_in": stats["total_net_input_bytes"], "net_out": stats["total_net_output_bytes"]}
    for command, (calls, usec) in command_stats(client.info("commandstats")).items():
        flat[f"calls:{command}"], flat[f"usec:{command}"] = calls, usec
    flat["calls"] = sum(v for k, v in flat.items() if k.startswith("calls:"))
    flat["usec"] = sum(v for k, v in flat.items() if k.startswith("usec:"))
    flat |= cpu_now(client, pids)
    return flat


def cpu_now(client: redis.Redis, pids: dict[str, int]) -> dict[str, float]:
    """CPU µs used so far by each process in `pids` (/proc, in clock ticks of 10 ms), and by Redis as
    it reports itself (`INFO cpu`, getrusage: µs), a finer cross-check of the first."""
    cpu = client.info("cpu")
    return {f"cpu_us:{name}": 1e6 * cpu_seconds(pid) for name, pid in pids.items()} | {
        "cpu_us:redis_rusage": 1e6 * (cpu["used_cpu_user"] + cpu["used_cpu_sys"])}


@dataclass
class Window:
    """One measured stretch: its length, what the load got done, and Redis's counters over it."""
    seconds: float
    requests: int
    tokens: int
    counters: dict[str, float]
    load: dict | None = None

    def per_request(self, idle: Window | None) -> dict[str, float]:
        """Each counter per request, less the background rate of `idle` over this window's length."""
        return {name: (value - self.seconds * idle_rate(idle, name)) / max(self.requests, 1)
                for name, value in self.counters.items()}


def idle_rate(idle: Window | None, name: str) -> float:
    return idle.counters.get(name, 0.0) / idle.seconds if idle else 0.0


def measure(client: redis.Redis, pids: dict[str, int], run_load) -> Window:
    """Counters from zero, `run_load()` -> (requests, tokens, load summary), the counters read."""
    client.config_resetstat()
    cpu_before = cpu_now(client, pids)
    started = time.monotonic()
    requests, tokens, load = run_load()
    elapsed = time.monotonic() - started
    flat = counters(client, pids)
    for name, before in cpu_before.items():
        flat[name] -= before
    return Window(elapsed, requests, tokens, flat, load)


def fit(short: dict[str, float], long: dict[str, float], short_tokens: int, long_tokens: int) -> dict[str, tuple]:
    """Per request figures of two workloads -> {name: (per request, per output token)}.

    Two workloads, two unknowns: x = a + b × tokens, so b = (x_long - x_short) / (t_long - t_short)
    and a = x_short - b × t_short. A counter only one workload has counts as 0 in the other."""
    fitted = {}
    for name in sorted(short.keys() | long.keys()):
        x_short, x_long = short.get(name, 0.0), long.get(name, 0.0)
        per_token = (x_long - x_short) / (long_tokens - short_tokens)
        fitted[name] = (x_short - per_token * short_tokens, per_token)
    return fitted


def fit_writes(streams: list[dict], names: list[str]) -> dict[str, tuple]:
    """Three workloads, three unknowns: x = a + w × reply writes + b × tokens, per request, where the
    reply writes are the worker's top-level XADDs (MONITOR; the enqueue's XADD runs in a script).
    Unpaced streams reach the worker's publisher all at once and go out in a few writes; paced ones
    in a write every few tokens: that tells a write's cost from a token's."""
    matrix = [[1.0, s["top"].get("xadd", 0.0), s["tokens"]] for s in streams]
    return {name: solve3(matrix, [s["per_request"][name] for s in streams]) for name in names}


def solve3(matrix: list[list[float]], values: list[float]) -> tuple[float, float, float]:
    """x with matrix · x = values, for a 3 × 3 matrix (Cramer's rule)."""
    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    whole = det(matrix)
    columns = [[[values[r] if c == k else matrix[r][c] for c in range(3)] for r in range(3)] for k in range(3)]
    return tuple(det(m) / whole for m in columns)


# --- MONITOR: script calls and key slots --------------------------------------------------------

# The slot that a key's hash tag puts it in, by the name's second part (shared/keys.py).
SLOT_CLASSES = {
    "requests": "model", "affinity": "model", "dead-letter": "model", "model": "model", "queue": "model",
    "turns": "model", "bound": "model",
    "run": "request", "cancelled": "request", "lease": "request", "streamed": "request",
    "cancel-id": "request", "cancel-early": "request",
    "replies": "gateway", "worker": "workers", "cancel": "broadcast",
}
_MONITOR_LINE = re.compile(r'^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$')
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def slot_class(arguments: list[str]) -> str:
    """The slot class of a command's first llmfleet key (or channel): model, request, gateway,
    workers, broadcast, or none."""
    for argument in arguments[1:]:
        if argument.startswith("llmfleet:"):
            return SLOT_CLASSES.get(argument.split(":")[1].split("{")[0], "other")
    return "none"


def classify_monitor(lines, roles: dict[str, str] | None = None) -> Counter:
    """`redis-cli MONITOR` lines -> counts: top:CMD (sent by a client), lua:CMD (run by a script),
    slot:CLASS (top-level commands by the slot of their key), and with `roles` (client address ->
    gateway or worker) role:ROLE:CMD."""
    counts: Counter = Counter()
    for line in lines:
        match = _MONITOR_LINE.match(line)
        if not match:
            continue
        arguments = _QUOTED.findall(match.group(2))
        if not arguments or arguments[0].lower() in IGNORED_COMMANDS:
            continue
        command, client = arguments[0].lower(), match.group(1)
        if client == "lua":
            counts[f"lua:{command}"] += 1
            continue
        counts[f"top:{command}"] += 1
        counts[f"slot:{slot_class(arguments)}"] += 1
        if roles is not None:
            counts[f"role:{roles.get(client, 'other')}:{command}"] += 1
    return counts


def client_roles(client: redis.Redis) -> dict[str, str]:
    """Each connected client's address -> gateway or worker, by the names they give their connections
    (shared/redis_pool.py: `gateway-<id>` and the worker id)."""
    return {c["addr"]: "gateway" if c["name"].startswith("gateway-") else "worker" if c["name"] else "other"
            for c in client.client_list()}


def monitor_sample(client: redis.Redis, run_load, roles: bool = False) -> tuple[Counter, tuple]:
    """Counts of the commands `run_load()` made Redis run (`classify_monitor`), and what it returned."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    path = LOG_DIR / f"redis-capacity-monitor-{time.time_ns()}.log"
    with monitored(client, path):
        returned = run_load()
    try:
        with path.open(errors="replace") as lines:
            return classify_monitor(lines, client_roles(client) if roles else None), returned
    finally:
        path.unlink()


@contextlib.contextmanager
def monitored(client: redis.Redis, path: Path):
    """`redis-cli MONITOR` writing to `path` while the block runs; stopped by its PID once a marker
    sent after the block has reached it (so has every command before it)."""
    port = client.connection_pool.connection_kwargs["port"]
    with path.open("wb") as out:
        monitor = subprocess.Popen(["redis-cli", "-p", str(port), "MONITOR"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: path.read_bytes().startswith(b"OK"), 10, "MONITOR to be attached")
        yield
        marker = f"redis-capacity-end-{time.time_ns()}"
        client.echo(marker)
        wait_for(lambda: marker.encode() in path.read_bytes()[-4096:], 30, "MONITOR to catch up")
    finally:
        monitor.terminate()
        monitor.wait(10)


# --- the fleet under load -----------------------------------------------------------------------

def chat_body(tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": tokens,
            "stream": True}


def closed_load(url: str, tokens: int, concurrency: int, seconds: float):
    """A `run_load` for `measure`: closed-loop streams of `tokens` tokens."""
    def run_load():
        results, elapsed = uvloop.run(closed_loop(Target(url, "/v1/chat/completions", chat_body(tokens)),
                                                  concurrency, seconds))
        summary = summarize(results, elapsed, expected_tokens=tokens)
        return summary["requests"] + summary["errors"], summary["tokens"], summary
    return run_load


def idle_load(seconds: float):
    def run_load():
        time.sleep(seconds)
        return 0, 0, None
    return run_load


@dataclass
class Workload:
    label: str
    tokens: int
    concurrency: int
    worker_args: tuple[str, ...] = ()


def measure_fleet(workloads: list[Workload], seconds: float, idle_seconds: float, monitor_seconds: float) -> dict:
    """On one fleet per kind of worker: the idle window (first fleet), then each workload's warm-up,
    measured window and MONITOR sample."""
    idle, measured = None, {}
    for worker_args in dict.fromkeys(w.worker_args for w in workloads):
        with Fleet(worker_args=worker_args) as fleet:
            client = redis.Redis.from_url(fleet.redis.url)
            pids = {"redis": fleet.redis.pid, "gateway": fleet.gateway.pid, "worker": fleet.procs[1].pid}
            if idle is None:
                progress(f"idle window, {idle_seconds:.0f}s (the fleet's background commands), and its MONITOR sample")
                idle = measure(client, pids, idle_load(idle_seconds))
                counts, _ = monitor_sample(client, idle_load(idle_seconds), roles=True)
                idle.load = {name: n / idle_seconds for name, n in counts.items()}  # commands/s by client
            for workload in (w for w in workloads if w.worker_args == worker_args):
                measured[workload.label] = measure_workload(client, pids, fleet, workload, seconds, monitor_seconds,
                                                            idle.load)
    return {"idle": idle, "workloads": measured}


def measure_workload(client: redis.Redis, pids: dict[str, int], fleet: Fleet, workload: Workload, seconds: float,
                     monitor_seconds: float, idle_monitor: dict[str, float]) -> dict:
    """The workload's window, and its MONITOR sample per request, less the idle sample's rates."""
    progress(f"{workload.label}: warm-up 1s, then {seconds:.0f}s at concurrency {workload.concurrency}")
    closed_load(fleet.url, workload.tokens, workload.concurrency, 1.0)()
    window = measure(client, pids, closed_load(fleet.url, workload.tokens, workload.concurrency, seconds))
    load = window.load
    progress(f"  {load['requests_per_s']:.0f} req/s, {load['tokens_per_s']:.0f} tokens/s, "
             f"{load['errors']} errors; Redis {window.counters['cpu_us:redis'] / 1e6 / window.seconds:.0%} of a core")
    progress(f"  MONITOR sample, {monitor_seconds:.0f}s")
    counts, (sampled, _tokens, sample) = monitor_sample(
        client, closed_load(fleet.url, workload.tokens, workload.concurrency, monitor_seconds), roles=True)
    per_request = {name: (counts.get(name, 0) - idle_monitor.get(name, 0.0) * sample["seconds"]) / max(sampled, 1)
                   for name in counts.keys() | idle_monitor.keys()}
    return {"window": window, "monitor": per_request, "monitor_requests": sampled}


def redis_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


# --- a Redis Cluster: the model checked -----------------------------------------------------------

@contextlib.contextmanager
def cluster_fleet(primaries: int):
    """A Redis Cluster of `primaries` nodes, one scripted worker (unpaced) and one gateway on it."""
    cluster = start_redis_cluster(primaries)
    procs = []
    try:
        procs.append(start_worker(cluster.url, MODEL, "--max-concurrency", "20000"))
        procs.append(start_gateway(cluster.url))
        wait_until_served(procs[1], MODEL)
        yield cluster, procs[1], procs[0]
    finally:
        for proc in reversed(procs):
            proc.stop()
        cluster.stop()


def node_slots(client: redis.Redis) -> dict[str, bool]:
    """Whether this node holds the model's keys, the gateway's reply stream, the worker heartbeats
    (SCAN sees only a node's own keys)."""
    patterns = {"model": keys.request_stream(MODEL), "gateway": keys.reply_stream("*"),
                "workers": keys.WORKER_KEY_PATTERN}
    return {name: any(True for _ in client.scan_iter(match=pattern, count=1000)) for name, pattern in patterns.items()}


def measure_cluster(primaries: int, tokens: int, concurrency: int, seconds: float, idle_seconds: float) -> dict:
    """The unpaced workload on a cluster: each node's Redis CPU and commands per request, the idle
    rate of each node taken off, and which slots each node holds."""
    with cluster_fleet(primaries) as (cluster, gateway, _worker):
        clients = [redis.Redis(host="127.0.0.1", port=node_port(node)) for node in cluster.nodes]
        progress(f"cluster of {primaries}: idle window, {idle_seconds:.0f}s")
        idle = measure_nodes(clients, cluster.nodes, idle_load(idle_seconds))
        progress(f"cluster of {primaries}: {tokens}-token streams, warm-up 1s, then {seconds:.0f}s "
                 f"at concurrency {concurrency}")
        closed_load(gateway.url, tokens, concurrency, 1.0)()
        loaded = measure_nodes(clients, cluster.nodes, closed_load(gateway.url, tokens, concurrency, seconds))
        load = loaded[0].load
        progress(f"  {load['requests_per_s']:.0f} req/s, {load['errors']} errors")
        nodes = [{"slots": node_slots(client), "idle_per_s": {k: v / i.seconds for k, v in i.counters.items()},
                  "per_request": w.per_request(i), "busy": w.counters["cpu_us:redis"] / 1e6 / w.seconds}
                 for client, i, w in zip(clients, idle, loaded, strict=True)]
        return {"primaries": primaries, "tokens": tokens, "load": load, "nodes": nodes}


def node_port(node) -> int:
    """A cluster node's port, from its command line (tests.procs starts each with `--port N`)."""
    return int(node.popen.args[node.popen.args.index("--port") + 1])


def measure_nodes(clients: list[redis.Redis], nodes, run_load) -> list[Window]:
    """`measure` on every node at once: all counters reset, one load, each node's read."""
    for client in clients:
        client.config_resetstat()
    before = [cpu_now(client, {"redis": node.pid}) for client, node in zip(clients, nodes, strict=True)]
    started = time.monotonic()
    requests, tokens, load = run_load()
    elapsed = time.monotonic() - started
    windows = []
    for client, node, cpu_before in zip(clients, nodes, before, strict=True):
        flat = counters(client, {"redis": node.pid})
        for name, value in cpu_before.items():
            flat[name] -= value
        windows.append(Window(elapsed, requests, tokens, flat, load))
    return windows


def predicted_nodes(single: dict, measured: dict) -> list[float]:
    """Each node's Redis CPU µs per request by the cluster model: the single server's cost, split by
    the slot shares of the top-level commands (MONITOR), a class on the node that holds its slot,
    the requests' own slots spread evenly."""
    shares, cpu = single["cluster"]["slot_share"], single["per_request"]["cpu_us:redis"]
    n = measured["primaries"]
    return [cpu * (shares.get("request", 0.0) / n + shares.get("none", 0.0) / n + shares.get("broadcast", 0.0)
                   + sum(shares.get(name, 0.0) for name, here in node["slots"].items() if here))
            for node in measured["nodes"]]


# --- redis-benchmark ----------------------------------------------------------------------------

VALUE_64 = "v" * 64
VALUE_200 = "v" * 200  # about a reply entry of a short stream
SCRIPT = "redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) return 1"  # a small script, as the fleet's


def benchmark_commands(sha: str) -> dict[str, list[str]]:
    """The commands the fleet sends most, shaped as it sends them (shared/keys.py)."""
    return {
        "PING": ["PING"],
        "SET": ["SET", "llmfleet:run:{__rand_int__}", VALUE_64, "EX", "600"],
        "XADD": ["XADD", "llmfleet:replies:{bench}", "MAXLEN", "~", "100000", "*", "e", VALUE_200],
        "XREADGROUP": ["XREADGROUP", "GROUP", "workers", "bench", "COUNT", "1", "STREAMS",
                       "llmfleet:requests:{bench}", ">"],
        "PUBLISH": ["PUBLISH", "llmfleet:cancel", VALUE_64],
        "EVALSHA": ["EVALSHA", sha, "1", "llmfleet:cancel-id:{__rand_int__}", VALUE_64, "600"],
    }


def redis_benchmark(port: int, command: list[str], requests: int, clients: int, pipeline: int) -> float:
    """One redis-benchmark run; its requests/s."""
    completed = subprocess.run(
        [REDIS_BENCHMARK, "-p", str(port), "-n", str(requests), "-c", str(clients), "-P", str(pipeline),
         "-r", "100000", "--csv", *command], capture_output=True, text=True, check=True, timeout=300)
    return parse_benchmark_csv(completed.stdout)


def parse_benchmark_csv(output: str) -> float:
    """redis-benchmark --csv's requests/s (the "rps" column of its one result line)."""
    header, row = output.strip().splitlines()[-2:]
    names, values = (re.findall(r'"([^"]*)"', line) for line in (header, row))
    return float(dict(zip(names, values, strict=True))["rps"])


def measure_benchmark(base_requests: int, clients_list: list[int], pipelines: list[int]) -> list[dict]:
    """Each command at each client count and pipeline depth against a fresh redis-server: ops/s, and
    the server's CPU µs per operation and share of a core."""
    redis_proc = start_redis()
    subscriber = None
    try:
        port = redis_port(redis_proc.url)
        client = redis.Redis.from_url(redis_proc.url)
        sha = client.script_load(SCRIPT)
        client.xgroup_create("llmfleet:requests:{bench}", "workers", id="0", mkstream=True)
        # One subscriber on the cancel channel, as each worker is.
        subscriber = subprocess.Popen(["redis-cli", "-p", str(port), "SUBSCRIBE", "llmfleet:cancel"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = []
        for name, command in benchmark_commands(sha).items():
            for pipeline in pipelines:
                for clients in clients_list:
                    requests = base_requests * pipeline
                    if name == "XREADGROUP":  # one entry to claim per read: filled first, not measured
                        redis_benchmark(port, ["XADD", "llmfleet:requests:{bench}", "*", "e", VALUE_200], requests,
                                        16, 16)
                    rows.append(benchmark_row(redis_proc.pid, port, name, command, requests, clients, pipeline))
        return rows
    finally:
        if subscriber is not None:
            subscriber.terminate()
            subscriber.wait(10)
        redis_proc.stop()


def benchmark_row(pid: int, port: int, name: str, command: list[str], requests: int, clients: int,
                  pipeline: int) -> dict:
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    ops = redis_benchmark(port, command, requests, clients, pipeline)
    cpu, elapsed = cpu_seconds(pid) - cpu_before, time.monotonic() - started
    row = {"command": name, "clients": clients, "pipeline": pipeline, "requests": requests, "ops_per_s": ops,
           "redis_cpu_us_per_op": 1e6 * cpu / requests, "redis_cpu_share": cpu / elapsed}
    progress(f"  redis-benchmark {name} -c {clients} -P {pipeline}: {ops:,.0f} ops/s, "
             f"{row['redis_cpu_us_per_op']:.2f} µs CPU/op, Redis {row['redis_cpu_share']:.0%} of a core")
    return row


# --- the model ----------------------------------------------------------------------------------

# A fleet command without a benchmark of its own is priced as the benchmarked command most like it.
PRICED_AS = {"xadd": "XADD", "xreadgroup": "XREADGROUP", "xread": "XREADGROUP", "publish": "PUBLISH",
             "evalsha": "EVALSHA", "eval": "EVALSHA", "fcall": "EVALSHA"}


def predicted_cpu_per_request(top_commands: dict[str, float], benchmark: list[dict], clients: int,
                              pipeline: int) -> float:
    """Redis CPU µs per request priced from redis-benchmark: top-level commands per request × the
    benchmarked CPU per op of the command like each (SET for any command not benchmarked)."""
    price = {r["command"]: r["redis_cpu_us_per_op"] for r in benchmark
             if r["clients"] == clients and r["pipeline"] == pipeline}
    return sum(n * price[PRICED_AS.get(command, "SET")] for command, n in top_commands.items())


def case(label: str, tokens: int, per_request: dict[str, float], monitor: dict[str, float]) -> dict:
    """One kind of stream the model is worked out for: its counters per request, and its top-level
    commands per request by command and by slot class (MONITOR)."""
    return {"label": label, "tokens": tokens, "per_request": per_request, "monitor": monitor,
            "top": {k.removeprefix("top:"): v for k, v in monitor.items() if k.startswith("top:")},
            "slots": {k.removeprefix("slot:"): v for k, v in monitor.items() if k.startswith("slot:")}}


def extrapolated(fitted: dict[str, tuple], fitted_monitor: dict[str, tuple], tokens: int) -> dict:
    """A case of `tokens`-token streams from the fit: a + b × tokens for every figure."""
    return case(f"{tokens}-token streams (from the fit)", tokens,
                {name: a + b * tokens for name, (a, b) in fitted.items()},
                {name: a + b * tokens for name, (a, b) in fitted_monitor.items()})


def background(idle: dict) -> dict[str, float]:
    """The idle Redis CPU µs per second of one gateway and of one worker: the idle window's Redis CPU
    split by the share of each one's commands in the idle MONITOR sample."""
    by_role = Counter()
    for name, rate in idle["by_client"].items():
        by_role[name.split(":")[1]] += rate
    total = sum(by_role.values()) or 1.0
    return {role: idle["per_s"]["cpu_us:redis"] * by_role[role] / total for role in ("gateway", "worker")}


def capacity(stream: dict, idle_us: dict[str, float], engine_tokens_per_s: float) -> dict:
    """What one Redis primary carries of `stream`: requests/s and tokens/s at 100% and at 70% of a
    core; at 70% with the background of the gateways and workers it feeds (an engine worker each
    `engine_tokens_per_s` tokens/s, a gateway each core's worth of its CPU per request, each charged
    its idle Redis CPU, `background`); and the gateways and workers that feeds (`fed`)."""
    tokens, cpu_us = stream["tokens"], stream["per_request"]["cpu_us:redis"]
    background_us = (tokens * idle_us["worker"] / engine_tokens_per_s
                     + stream["per_request"]["cpu_us:gateway"] / 1e6 * idle_us["gateway"])  # per request
    rates = {"requests_per_s_100": 1e6 / cpu_us, "requests_per_s_70": SAFE_SHARE * 1e6 / cpu_us,
             "requests_per_s_70_background": SAFE_SHARE * 1e6 / (cpu_us + background_us)}
    return {"redis_cpu_us_per_request": cpu_us, "background_us_per_request": background_us, **rates,
            **{name.replace("requests", "tokens"): value * tokens for name, value in rates.items()},
            **fed(stream, rates["requests_per_s_70"], engine_tokens_per_s)}


def fed(stream: dict, requests_per_s: float, engine_tokens_per_s: float) -> dict:
    """Gateways and workers that `requests_per_s` of `stream` keeps busy: gateways at their measured
    CPU per request, a core each; scripted workers at their measured CPU per token (the worker's own
    Python and Redis side, no engine), a core each; engine workers at `engine_tokens_per_s` each."""
    tokens, p = stream["tokens"], stream["per_request"]
    return {"gateway_cpu_us_per_request": p["cpu_us:gateway"], "gateways": requests_per_s * p["cpu_us:gateway"] / 1e6,
            "worker_cpu_us_per_token": p["cpu_us:worker"] / tokens,
            "scripted_workers": requests_per_s * p["cpu_us:worker"] / 1e6,
            "engine_workers": requests_per_s * tokens / engine_tokens_per_s}


def cluster(stream: dict, nodes_list: list[int]) -> dict:
    """Redis Cluster with N primaries and at least N models of equal traffic, one model's keys per
    node: the Redis CPU of a request split by its top-level commands' slots (an equal cost per
    command: what redis-benchmark shows of this size of command). The model's slot, the requests'
    slots and the gateways' reply streams spread over the nodes; a PUBLISH reaches every node (each
    pays it); the worker heartbeats' slot is background, not per request. One model alone never gets
    more than one node for its own slot's share."""
    slots, cpu = stream["slots"], stream["per_request"]["cpu_us:redis"]
    total = sum(slots.values()) or 1.0
    broadcast = cpu * slots.get("broadcast", 0.0) / total
    model_slot = cpu * slots.get("model", 0.0) / total
    rows = []
    for nodes in nodes_list:
        node_cpu = (cpu - broadcast) / nodes + broadcast  # on each node, per request of the whole fleet
        rows.append({"nodes": nodes, "requests_per_s": SAFE_SHARE * 1e6 / node_cpu,
                     "tokens_per_s": SAFE_SHARE * 1e6 / node_cpu * stream["tokens"]})
    return {"slot_share": {name: n / total for name, n in slots.items()}, "broadcast_cpu_us": broadcast,
            "model_slot_cpu_us": model_slot,
            "one_model_requests_per_s": SAFE_SHARE * 1e6 / model_slot if model_slot > 0 else None, "rows": rows}


def workloads_of(long_tokens: int, concurrency: int, paced_tokens_per_s: float, paced_concurrency: int) -> list:
    workloads = [Workload(f"{SHORT_TOKENS}-token streams", SHORT_TOKENS, concurrency),
                 Workload(f"{long_tokens}-token streams", long_tokens, concurrency)]
    if paced_tokens_per_s:
        workloads.append(Workload(f"{long_tokens}-token streams paced at {paced_tokens_per_s:g} tokens/s",
                                  long_tokens, paced_concurrency,
                                  ("--scripted-tokens-per-second", str(paced_tokens_per_s))))
    return workloads


def run(args: argparse.Namespace) -> dict:
    workloads = workloads_of(args.long_tokens, args.concurrency, args.paced_tokens_per_s, args.paced_concurrency)
    fleet = measure_fleet(workloads, args.seconds, args.idle_seconds, args.monitor_seconds)
    on_cluster = None
    if args.cluster:
        on_cluster = measure_cluster(args.cluster, SHORT_TOKENS, args.concurrency, args.seconds, args.idle_seconds)
    progress("redis-benchmark against a fresh redis-server")
    clients = [int(c) for c in args.clients.split(",")]
    benchmark = measure_benchmark(args.bench_requests, clients, [1, 16])
    idle, measured = fleet["idle"], fleet["workloads"]
    idle_record = {"seconds": idle.seconds, "per_s": {k: v / idle.seconds for k, v in idle.counters.items()},
                   "by_client": {k: v for k, v in idle.load.items() if k.startswith("role:")}}
    idle_record["background_us_per_s"] = idle_us = background(idle_record)
    streams = [case(w.label, w.tokens, measured[w.label]["window"].per_request(idle), measured[w.label]["monitor"])
               for w in workloads]
    short, long = streams[0], streams[1]
    fitted = fit(short["per_request"], long["per_request"], SHORT_TOKENS, args.long_tokens)
    monitor = [measured[w.label]["monitor"] for w in workloads[:2]]
    fitted_monitor = fit(*monitor, SHORT_TOKENS, args.long_tokens)
    writes = {}
    if len(streams) == 3:
        writes = {name: dict(zip(("per_request", "per_reply_write", "per_token"), abc, strict=True))
                  for name, abc in fit_writes(streams, list(WRITE_FIGURES)).items()}
    streams.append(extrapolated(fitted, fitted_monitor, args.fit_tokens))
    for stream in streams:
        stream["capacity"] = capacity(stream, idle_us, args.engine_tokens_per_s)
        stream["cluster"] = cluster(stream, [1, 3, 6, 12])
        stream["checks"] = [{"clients": c, "pipeline": p, "top_commands_per_request": sum(stream["top"].values()),
                             "predicted_cpu_us": predicted_cpu_per_request(stream["top"], benchmark, c, p)}
                            for p in (1, 16) for c in clients]
    return {
        "measured_at": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(), "seconds": args.seconds,
        "concurrency": args.concurrency, "workload_tokens": [SHORT_TOKENS, args.long_tokens],
        "safe_share": SAFE_SHARE, "engine_tokens_per_s": args.engine_tokens_per_s,
        "idle": idle_record, "fit_writes": writes,
        "windows": {w.label: window_record(w, measured[w.label]) for w in workloads},
        "fit": {name: {"per_request": a, "per_token": b} for name, (a, b) in fitted.items()},
        "fit_monitor": {name: {"per_request": a, "per_token": b} for name, (a, b) in fitted_monitor.items()},
        "streams": streams, "benchmark": benchmark,
        "cluster_check": on_cluster and {**on_cluster, "predicted_cpu_us": predicted_nodes(streams[0], on_cluster)},
    }


def window_record(workload: Workload, measured: dict) -> dict:
    window = measured["window"]
    return {"concurrency": workload.concurrency, "load": window.load, "seconds": window.seconds,
            "requests": window.requests, "tokens": window.tokens, "counters": window.counters,
            "monitor_requests": measured["monitor_requests"]}


# --- output -------------------------------------------------------------------------------------

def table(result: dict) -> str:
    return "\n\n".join([cost_table(result), fit_table(result), roles_table(result), writes_table(result),
                        idle_line(result),
                        benchmark_table(result),
                        check_table(result), capacity_table(result), cluster_table(result),
                        cluster_check_table(result)])


def cost_table(result: dict) -> str:
    lines = [f"Redis per request ({result['seconds']:.0f}s windows; the idle rate taken off)", "",
             ("| workload | conc. | req/s | tokens/s | Redis CPU | Redis CPU µs/req (rusage) | commands/req | "
             "top-level/req | commandstats µs/req | bytes in/req | bytes out/req | gateway CPU µs/req | "
             "worker CPU µs/req |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stream in result["streams"]:
        p, window = stream["per_request"], result["windows"].get(stream["label"])
        measured = (f"{window['concurrency']} | {window['load']['requests_per_s']:.0f} | "
                    f"{window['load']['tokens_per_s']:.0f} | "
                    f"{window['counters']['cpu_us:redis'] / 1e6 / window['seconds']:.0%}") if window else " | | | "
        lines.append(f"| {stream['label']} | {measured} | {p['cpu_us:redis']:.1f} ({p['cpu_us:redis_rusage']:.1f}) | "
                     f"{p['calls']:.2f} | {sum(stream['top'].values()):.2f} | {p['usec']:.1f} | {p['net_in']:.0f} | "
                     f"{p['net_out']:.0f} | {p['cpu_us:gateway']:.0f} | {p['cpu_us:worker']:.0f} |")
    return "\n".join(lines)


def fit_table(result: dict) -> str:
    fitted = result["fit"]
    short, long = result["workload_tokens"]
    lines = [f"Fit x = a + b × tokens from the {short}- and {long}-token workloads (two equations, two unknowns)", "",
             "| figure | a: per request | b: per output token |", "|---|---|---|"]
    for name in ("cpu_us:redis", "cpu_us:redis_rusage", "calls", "usec", "net_in", "net_out", "cpu_us:gateway",
                 "cpu_us:worker"):
        lines.append(f"| {name} | {fitted[name]['per_request']:.3f} | {fitted[name]['per_token']:.4f} |")
    lines += ["", "| command (commandstats, script calls included) | calls/req | calls/token | µs/req | µs/token |",
              "|---|---|---|---|---|"]
    for name in sorted(n for n in fitted if n.startswith("calls:")):
        command = name.removeprefix("calls:")
        lines.append(f"| {command} | {fitted[name]['per_request']:.3f} | {fitted[name]['per_token']:.4f} | "
                     f"{fitted['usec:' + command]['per_request']:.2f} | {fitted['usec:' + command]['per_token']:.4f} |")
    return "\n".join(lines)


def roles_table(result: dict) -> str:
    """Top-level commands per request by the client that sent them (MONITOR samples)."""
    streams = result["streams"][:-1]  # the measured ones
    names = sorted({k for s in streams for k in s["monitor"] if k.startswith("role:")})
    lines = ["Top-level commands per request by sender (MONITOR samples; script calls are inside EVALSHA)", "",
             "| sender:command | " + " | ".join(s["label"] for s in streams) + " |", "|---|" + "---|" * len(streams)]
    for name in names:
        values = [s["monitor"].get(name, 0.0) for s in streams]
        if max(values) >= 0.01:
            lines.append(f"| {name.removeprefix('role:')} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    lua = ", ".join(f"{k.removeprefix('lua:')} {v:.2f}" for k, v in sorted(streams[0]["monitor"].items())
                    if k.startswith("lua:") and v >= 0.01)
    return "\n".join([*lines, "", f"Run by scripts, per request ({streams[0]['label']}): {lua}"])


def writes_table(result: dict) -> str:
    if not result["fit_writes"]:
        return "(no paced workload: no split by reply writes)"
    lines = ["Fit x = a + w × reply writes + b × tokens from all three workloads (three equations, three unknowns)",
             "", "| figure | a: per request | w: per reply write (XADD) | b: per output token |", "|---|---|---|---|"]
    for name, f in result["fit_writes"].items():
        lines.append(f"| {name} | {f['per_request']:.3f} | {f['per_reply_write']:.3f} | {f['per_token']:.4f} |")
    writes = ", ".join(f"{s['label']} {s['top'].get('xadd', 0):.2f}" for s in result["streams"][:3])
    return "\n".join([*lines, "", f"Reply writes (top-level XADDs) per request: {writes}"])


def idle_line(result: dict) -> str:
    per_s = result["idle"]["per_s"]
    commands = ", ".join(f"{k.removeprefix('calls:')} {v:.1f}" for k, v in sorted(per_s.items(), key=lambda kv: -kv[1])
                         if k.startswith("calls:") and v >= 0.5)
    by_client = ", ".join(f"{k.removeprefix('role:')} {v:.1f}" for k, v in
                          sorted(result["idle"]["by_client"].items(), key=lambda kv: -kv[1]) if v >= 0.5)
    idle_us = result["idle"]["background_us_per_s"]
    return (f"Idle ({result['idle']['seconds']:.0f}s, one gateway and one worker): {per_s['calls']:.0f} commands/s "
            f"({commands}); Redis CPU {per_s['cpu_us:redis'] / 1e4:.2f}% of a core "
            f"(rusage {per_s['cpu_us:redis_rusage'] / 1e4:.2f}%). By client, commands/s (MONITOR): {by_client}. "
            f"Background charged: a gateway {idle_us['gateway'] / 1e4:.2f}%, a worker {idle_us['worker'] / 1e4:.2f}% "
            "of a Redis core")


def benchmark_table(result: dict) -> str:
    rows = result["benchmark"]
    configs = sorted({(r["pipeline"], r["clients"]) for r in rows})
    lines = ["redis-benchmark, fresh redis-server: ops/s (Redis CPU µs per op; Redis share of a core)", "",
             "| command | " + " | ".join(f"-c {c} -P {p}" for p, c in configs) + " |",
             "|---|" + "---|" * len(configs)]
    for command in dict.fromkeys(r["command"] for r in rows):
        cells = {(r["pipeline"], r["clients"]): r for r in rows if r["command"] == command}
        lines.append(f"| {command} | " + " | ".join(
            f"{cells[k]['ops_per_s']:,.0f} ({cells[k]['redis_cpu_us_per_op']:.2f}; {cells[k]['redis_cpu_share']:.0%})"
            for k in configs) + " |")
    return "\n".join(lines)


def check_table(result: dict) -> str:
    configs = [(c["clients"], c["pipeline"]) for c in result["streams"][0]["checks"]]
    lines = [("The model checked: Redis CPU µs per request, measured against the top-level commands priced at "
             "redis-benchmark's CPU per op"), "",
             "| stream | measured | " + " | ".join(f"-c {c} -P {p}" for c, p in configs) + " |",
             "|---|---|" + "---|" * len(configs)]
    for stream in result["streams"]:
        lines.append(f"| {stream['label']} | {stream['per_request']['cpu_us:redis']:.1f} | "
                     + " | ".join(f"{c['predicted_cpu_us']:.1f}" for c in stream["checks"]) + " |")
    return "\n".join(lines)


def capacity_table(result: dict) -> str:
    lines = [f"One Redis primary, one core (engine workers at {result['engine_tokens_per_s']:g} tokens/s each)", "",
             ("| stream | Redis CPU µs/req | req/s at 100% | tokens/s at 100% | req/s at 70% | tokens/s at 70% | "
             "req/s at 70% with background | gateways fed (70%) | scripted workers fed | engine workers fed |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for stream in result["streams"]:
        c = stream["capacity"]
        lines.append(f"| {stream['label']} | {c['redis_cpu_us_per_request']:.1f} | {c['requests_per_s_100']:,.0f} | "
                     f"{c['tokens_per_s_100']:,.0f} | {c['requests_per_s_70']:,.0f} | {c['tokens_per_s_70']:,.0f} | "
                     f"{c['requests_per_s_70_background']:,.0f} | {c['gateways']:.1f} | {c['scripted_workers']:.1f} | "
                     f"{c['engine_workers']:.1f} |")
    return "\n".join(lines)


def cluster_table(result: dict) -> str:
    nodes = [r["nodes"] for r in result["streams"][0]["cluster"]["rows"]]
    lines = ["Redis Cluster, at least as many models as primaries, 70% of a core each: req/s (tokens/s)", "",
             "| stream | " + " | ".join(f"{n} primar{'y' if n == 1 else 'ies'}" for n in nodes)
             + " | one model alone | commands by slot: model / request / gateway / broadcast |",
             "|---|" + "---|" * (len(nodes) + 2)]
    for stream in result["streams"]:
        c = stream["cluster"]
        share = c["slot_share"]
        one = f"{c['one_model_requests_per_s']:,.0f}" if c["one_model_requests_per_s"] else "-"
        lines.append(f"| {stream['label']} | " + " | ".join(f"{r['requests_per_s']:,.0f} ({r['tokens_per_s']:,.0f})"
                                                              for r in c["rows"])
                     + f" | {one} | " + " / ".join(f"{share.get(k, 0):.0%}"
                                                   for k in ("model", "request", "gateway", "broadcast")) + " |")
    return "\n".join(lines)


def cluster_check_table(result: dict) -> str:
    check = result.get("cluster_check")
    if not check:
        return "(no Redis Cluster run: --cluster N)"
    single = result["streams"][0]["per_request"]
    lines = [(f"The cluster model checked: {check['tokens']}-token streams on {check['primaries']} primaries, "
             f"{check['load']['requests_per_s']:.0f} req/s ({check['load']['errors']} errors); Redis CPU µs "
             f"per request by node, against the single server's {single['cpu_us:redis']:.1f} split by slot"), "",
             "| node | holds | busy | commands/req | Redis CPU µs/req (rusage) | predicted |",
             "|---|---|---|---|---|---|"]
    for i, (node, predicted) in enumerate(zip(check["nodes"], check["predicted_cpu_us"], strict=True)):
        holds = ", ".join(name for name, here in node["slots"].items() if here) or "requests only"
        lines.append(f"| {i} | {holds} | {node['busy']:.0%} | {node['per_request']['calls']:.2f} | "
                     f"{node['per_request']['cpu_us:redis']:.1f} ({node['per_request']['cpu_us:redis_rusage']:.1f}) | "
                     f"{predicted:.1f} |")
    total, rusage, calls = (sum(node["per_request"][name] for node in check["nodes"])
                            for name in ("cpu_us:redis", "cpu_us:redis_rusage", "calls"))
    lines.append(f"| all | | | {calls:.2f} | {total:.1f} ({rusage:.1f}) | {single['cpu_us:redis']:.1f} (one server) |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    streams = result["streams"]
    plot_bars(RESULTS / "redis_capacity.png", [s["label"].replace(" streams", "") for s in streams], {
        "Redis CPU µs/request": [s["per_request"]["cpu_us:redis"] for s in streams],
        "Redis commands/request": [s["per_request"]["calls"] for s in streams],
        "Redis bytes/request (in+out)": [s["per_request"]["net_in"] + s["per_request"]["net_out"] for s in streams],
        "req/s one Redis carries (70%)": [s["capacity"]["requests_per_s_70"] for s in streams],
    })


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10, help="each workload's measured window")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=256, help="tokens per stream of the second workload")
    parser.add_argument("--paced-tokens-per-s", type=float, default=50,
                        help="a third workload: the long streams, each paced at this rate (0: none)")
    parser.add_argument("--paced-concurrency", type=int, default=128)
    parser.add_argument("--fit-tokens", type=int, default=1024, help="the fit's figures for streams this long too")
    parser.add_argument("--idle-seconds", type=float, default=5)
    parser.add_argument("--monitor-seconds", type=float, default=2)
    parser.add_argument("--bench-requests", type=int, default=50_000,
                        help="redis-benchmark requests per run (× the pipeline depth)")
    parser.add_argument("--clients", default="1,16,64", help="redis-benchmark client counts")
    parser.add_argument("--engine-tokens-per-s", type=float, default=DEFAULT_ENGINE_TOKENS_PER_S,
                        help="one engine worker's output tokens/s, for the workers fed")
    parser.add_argument("--cluster", type=int, default=0,
                        help="also run the short workload on a Redis Cluster of this many primaries (0: no)")
    parser.add_argument("--quick", action="store_true", help="smoke run: short windows, few benchmark requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.idle_seconds, args.monitor_seconds, args.bench_requests = 2, 2, 1, 5_000
    return save("redis_capacity", run(args), plot, table)


if __name__ == "__main__":
    main()
