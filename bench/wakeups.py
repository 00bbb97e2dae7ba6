"""What one client's request costs each process of llmfleet: times it ran, CPU, Redis commands.

At one client a request crosses three processes (gateway, Redis, worker) that sleep between its
hops. On this machine (a virtual machine) a process is charged run time for each wake-up, more
the longer it slept, whatever it then does (docs/benchmarks.md, "Fifteenth pass"; the bench first
measures that price: one process, 200 sleeps of 1, 10 and 100 ms). So what a request costs beside
the engine at low load is mostly its wake-ups; their count is what a change can lower, and it is
steadier from run to run than the CPU they are charged. Two loads, one client each, on the
scripted engine, paced so that each hop finds the next process asleep:

- **embed**: an embedding of one input, the encoder taking `--encode-ms` per input (5 ms);
- **stream**: a chat stream of 64 tokens at `--tokens-per-second` (200: 5 ms a token, a step of
  a larger model than the tiny one; the tiny model's steps here, 2.5-3.5 ms at c=1, are about the
  worker's least pause between writes, 2 ms, which uvloop's millisecond timers round).

llmfleet at `--before REF` runs beside this tree, each with its own Redis, workers and gateway,
in alternating rounds. Per request (per token for the stream), for each process: the times its
threads ran (`/proc/<pid>/task/*/schedstat`'s run count: wake-ups, and the rare preemption),
its CPU (the same file's run time), and the commands Redis served (`INFO commandstats`). And
with no request at all (each round, every process of both fleets idle together), the same a second.

    python -m bench.wakeups [--before REF] [--rounds 3] [--seconds 6] [--encode-ms 5] [--tokens-per-second 200]

Writes bench/results/wakeups.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import redis
import uvloop

from bench.common import plot_bars, progress, save, source_tree
from bench.loadgen import Target, closed_loop, summarize
from tests.procs import start_gateway, start_redis, start_worker, wait_until_served

EMBED_MODEL, CHAT_MODEL = "wake-embed", "wake-chat"
STREAM_TOKENS = 64
LOADS = {
    "embed": ("/v1/embeddings", {"model": EMBED_MODEL, "input": "the sea is calm tonight",
                                 "encoding_format": "base64"}),
    "stream": ("/v1/chat/completions", {"model": CHAT_MODEL, "stream": True, "max_tokens": STREAM_TOKENS,
                                        "messages": [{"role": "user", "content": "one two three four"}]}),
}
PROCESSES = ("gateway", "worker", "redis")


def thread_stats(pid: int) -> tuple[float, int]:
    """A process's CPU seconds and the times its threads ran, summed over its threads."""
    seconds, runs = 0.0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            run_ns, _waited_ns, timeslices = (Path(task) / "schedstat").read_text().split()
            seconds += int(run_ns) / 1e9
            runs += int(timeslices)
    return seconds, runs


@contextlib.contextmanager
def fleet(encode_ms: float, tokens_per_second: float, source: str | None):
    """Redis, a scripted encoder, a scripted chat worker and a gateway (from `source`, a tree of
    an older commit, if given): the gateway's URL, Redis's client and each load's pids."""
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else None
    procs = []
    try:
        procs.append(store := start_redis())
        procs.append(encoder := start_worker(store.url, EMBED_MODEL, "--runner", "pooling",
                                             "--scripted-seconds-per-input", str(encode_ms / 1000), env=env))
        procs.append(chat := start_worker(store.url, CHAT_MODEL, "--scripted-tokens-per-second", str(tokens_per_second),
                                          env=env))
        procs.append(gateway := start_gateway(store.url, env=env))
        for model in (EMBED_MODEL, CHAT_MODEL):
            wait_until_served(gateway, model, timeout=30)
        pids = {"embed": {"gateway": gateway.pid, "worker": encoder.pid, "redis": store.pid},
                "stream": {"gateway": gateway.pid, "worker": chat.pid, "redis": store.pid},
                "idle": {"gateway": gateway.pid, "encoder worker": encoder.pid, "chat worker": chat.pid,
                         "redis": store.pid}}
        yield gateway.url, redis.Redis.from_url(store.url), pids
    finally:
        for proc in reversed(procs):
            proc.stop()


def measure(url: str, store: redis.Redis, pids: dict[str, int], load: str, seconds: float) -> dict:
    """One client for `seconds`: requests/s, and per request each process's runs and CPU µs, and Redis's commands."""
    path, body = LOADS[load]
    target = Target(url, path, body, timeout=30)
    uvloop.run(closed_loop(target, 1, 0.5))  # its connection and the processes' caches warm
    store.config_resetstat()
    before = {name: thread_stats(pid) for name, pid in pids.items()}
    results, elapsed = uvloop.run(closed_loop(target, 1, seconds))
    after = {name: thread_stats(pid) for name, pid in pids.items()}
    commands = sum(stats["calls"] for name, stats in store.info("commandstats").items()
                   if name not in ("cmdstat_config", "cmdstat_info"))
    summary = summarize(results, elapsed, STREAM_TOKENS if load == "stream" else None)
    if summary["errors"]:
        raise RuntimeError(f"{url} {load}: {summary['first_errors']}")
    requests = summary["requests"]
    row = {"requests_per_s": summary["requests_per_s"], "redis_commands": commands / requests}
    for name in pids:
        row[f"{name}_runs"] = (after[name][1] - before[name][1]) / requests
        row[f"{name}_cpu_us"] = (after[name][0] - before[name][0]) / requests * 1e6
    return row


def wake_price(sleeps: int = 200) -> dict[str, dict[str, float]]:
    """What this process is charged per wake-up after sleeping 1, 10 and 100 ms (its schedstat run time
    per sleep, µs, median), and how late each sleep ends (µs, median)."""
    price = {}
    for asleep in (0.001, 0.01, 0.1):
        charged, late = [], []
        for _ in range(sleeps if asleep < 0.1 else sleeps // 10):
            ran, started = thread_stats(os.getpid())[0], time.perf_counter()
            time.sleep(asleep)
            late.append((time.perf_counter() - started - asleep) * 1e6)
            charged.append((thread_stats(os.getpid())[0] - ran) * 1e6)
        price[f"{asleep * 1000:g} ms"] = {"charged_us": statistics.median(charged), "late_us": statistics.median(late)}
    return price


def idle(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """What each process spends with no request at all: the times it ran, and its run time (ms), a second."""
    before = {name: thread_stats(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    after = {name: thread_stats(pid) for name, pid in pids.items()}
    return {**{f"{name}_runs": (after[name][1] - before[name][1]) / seconds for name in pids},
            **{f"{name}_cpu_ms": (after[name][0] - before[name][0]) / seconds * 1000 for name in pids}}


def run(before: str | None, rounds: int, seconds: float, encode_ms: float, tokens_per_second: float) -> dict:
    sides = ["llmfleet"] + [f"llmfleet at {before}"] * bool(before)
    measured: dict[tuple[str, str], list[dict]] = {(load, side): [] for load in LOADS for side in sides}
    idling: dict[str, list[dict]] = {side: [] for side in sides}
    price = wake_price()  # before any fleet runs: the machine alone
    with contextlib.ExitStack() as stack:
        fleets = {side: stack.enter_context(fleet(encode_ms, tokens_per_second, None if side == "llmfleet"
                                                  else stack.enter_context(source_tree(before))))
                  for side in sides}
        steps, done = rounds * (len(LOADS) + 1) * len(sides), 0
        for round_ in range(rounds):
            for side in sides:  # all idle together
                idling[side].append(idle(fleets[side][2]["idle"], seconds))
                done += 1
                progress("wakeups", done, steps)
            for load in LOADS:
                for side in sides[round_ % len(sides):] + sides[:round_ % len(sides)]:  # each round in another order
                    url, store, pids = fleets[side]
                    measured[load, side].append(measure(url, store, pids[load], load, seconds))
                    done += 1
                    progress("wakeups", done, steps)
    rows = [{"load": load, "server": side, "rounds": len(runs),
             **{key: statistics.median(run[key] for run in runs) for key in runs[0]},
             "requests_per_s_each": [run["requests_per_s"] for run in runs]}
            for (load, side), runs in measured.items()]
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "before": before, "encode_ms": encode_ms,
            "stream_tokens": STREAM_TOKENS, "tokens_per_second": tokens_per_second, "wake_price": price, "rows": rows,
            "idle": {side: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                     for side, runs in idling.items()}}


def table(result: dict) -> str:
    price = result.get("wake_price", {})
    lines = ["What one wake-up is charged here, after sleeping " + ", ".join(
        f"{asleep}: {figures['charged_us']:.0f} µs (the sleep {figures['late_us']:.0f} µs late)"
        for asleep, figures in price.items()) + ".", ""] if price else []
    lines += ["| load | server | requests/s | runs per request: gateway / worker / Redis | CPU µs per request: "
              "gateway / worker / Redis | Redis commands per request |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        runs = " / ".join(f"{row[f'{name}_runs']:.2f}" for name in PROCESSES)
        cpu = " / ".join(f"{row[f'{name}_cpu_us']:.0f}" for name in PROCESSES)
        each = ", ".join(f"{value:.1f}" for value in row.get("requests_per_s_each", []))
        lines.append(f"| {row['load']} | {row['server']} | {row['requests_per_s']:.1f} ({each}) | {runs} | {cpu} | "
                     f"{row['redis_commands']:.2f} |")
    lines.append(f"\nOne client; embed: one input, {result['encode_ms']:g} ms to encode it; stream: "
                 f"{result['stream_tokens']} tokens at {result['tokens_per_second']:g} tokens/s (divide by "
                 f"{result['stream_tokens']} for a token's). Medians of {result['rows'][0]['rounds']} alternating "
                 "rounds; requests/s of each round in brackets.")
    lines += ["", "| idle | times run a second: gateway / encoder worker / chat worker / Redis | "
                  "run time ms a second |", "|---|---|---|"]
    names = ("gateway", "encoder worker", "chat worker", "redis")
    for side, idled in result.get("idle", {}).items():
        runs = " / ".join(f"{idled[f'{name}_runs']:.1f}" for name in names)
        cpu = " / ".join(f"{idled[f'{name}_cpu_ms']:.1f}" for name in names)
        lines.append(f"| {side} | {runs} | {cpu} |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    """Per load and process, the times it ran per request (per token, for the stream), each server a bar."""
    from bench.common import RESULTS

    servers = list(dict.fromkeys(row["server"] for row in result["rows"]))
    per = {"embed": ("request", 1), "stream": ("token", result["stream_tokens"])}
    panels = {}
    for load, (unit, divisor) in per.items():
        rows = {row["server"]: row for row in result["rows"] if row["load"] == load}
        for name in PROCESSES:
            panels[f"{load}: {name} runs/{unit}"] = [rows[server][f"{name}_runs"] / divisor for server in servers]
    plot_bars(RESULTS / "wakeups.png", servers, panels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="also measure llmfleet as of this git revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="each load's window per round")
    parser.add_argument("--encode-ms", type=float, default=5.0, help="the scripted encoder's time per input")
    parser.add_argument("--tokens-per-second", type=float, default=200.0, help="the scripted stream's pace")
    args = parser.parse_args(argv)
    return save("wakeups", run(args.before, args.rounds, args.seconds, args.encode_ms, args.tokens_per_second),
                plot, table)


if __name__ == "__main__":
    main()
