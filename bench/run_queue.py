"""One client's single-input embeddings: what each process spends per request, and how long it waits for a core.

`vllm serve --runner pooling` and llmfleet (gateway, Redis, one vLLM encoder worker) on the tiny
model as an embedding model, started once (bench.embeddings' servers), measured in alternating
rounds. Per request, for each process: its CPU and its run-queue wait (the time its threads were
runnable but had no core: `/proc/<pid>/task/*/schedstat`'s second field), summed over its
threads; the engine core (with its model runner) as one process beside each server. vLLM's engine
core waits for each step with `sched_yield` in a loop, so it takes whatever core is free, and a
process that wakes beside it may wait.

With `--nice-engine N`, llmfleet runs a third way: its worker's engine core (every thread of the
worker's child processes) at nice N, so that the worker, in the same session and so the same
autogroup, wins a core when it wakes. A probe, not a setting of the product.

    python -m bench.run_queue [--rounds 4] [--requests 400] [--nice-engine 5]

Writes bench/results/run_queue.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

from bench.common import RESULTS, plot_bars, progress, save
from bench.embeddings import measure, vllm_servers

WARM_UP = 40


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            kids.setdefault(parent, []).append(int(stat.parent.name))
    return kids


def _tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    found, todo = [], [pid]
    while todo:
        found.append(pid := todo.pop())
        todo += kids.get(pid, [])
    return found


def _schedstat(pids: list[int]) -> tuple[int, int]:
    """CPU and run-queue wait (ns), summed over every thread of these processes."""
    ran = waited = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                ran, waited = ran + int(run_ns), waited + int(wait_ns)
    return ran, waited


def _processes(pids: dict[str, dict[str, int]]) -> dict[str, dict[str, list[int]]]:
    """Each server's processes by role, found among this process's descendants."""
    kids = _children()
    serve = next(pid for pid in _tree(os.getpid(), kids)
                 if b"vllm.entrypoints.openai.api_server" in Path(f"/proc/{pid}/cmdline").read_bytes())
    fleet = pids["llmfleet"]
    return {"vllm serve": {"API server": [serve], "engine core": _tree(serve, kids)[1:]},
            "llmfleet": {"gateway": [fleet["gateway"]], "redis": [fleet["redis"]], "worker": [fleet["worker"]],
                         "engine core": _tree(fleet["worker"], kids)[1:]}}


def _nice(pids: list[int], value: int) -> None:
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), value)


def run(rounds: int, requests: int, nice_engine: int | None) -> dict:
    from worker.tiny_model import write_tiny_model

    ways = ["vllm serve", "llmfleet"] + ([f"llmfleet, engine at nice {nice_engine}"] if nice_engine is not None else [])
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp, vllm_servers(write_tiny_model(Path(tmp) / "tiny")) as (urls, pids):
        processes = _processes(pids)
        for round_ in range(rounds):
            for way in ways if round_ % 2 == 0 else ways[::-1]:
                server = "vllm serve" if way == "vllm serve" else "llmfleet"
                if server == "llmfleet":
                    _nice(processes["llmfleet"]["engine core"], nice_engine if way != "llmfleet" else 0)
                workload = {"inputs": 1, "concurrency": 1, "requests": WARM_UP}
                asyncio.run(measure(urls[server], workload, seed=10_000 + round_))
                before = {role: _schedstat(p) for role, p in processes[server].items()}
                answered = asyncio.run(measure(urls[server], {**workload, "requests": requests}, seed=round_))
                after = {role: _schedstat(p) for role, p in processes[server].items()}
                runs[way].append({**answered, **{
                    f"{role} {what}": (after[role][i] - before[role][i]) / requests / 1e3
                    for role in processes[server] for i, what in enumerate(("CPU us", "wait us"))}})
                progress("runs", sum(map(len, runs.values())), rounds * len(ways))
    return {"rounds": rounds, "requests": requests, "runs": runs,
            "medians": {way: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for way, rs in runs.items()}}


def table(result: dict) -> str:
    lines = [(f"One client, single inputs, {result['requests']} requests a round, {result['rounds']} rounds; "
              "per request, medians of the rounds (each round's values in the JSON):"), "",
             "| server | inputs/s | p50 ms | process | CPU µs | run-queue wait µs |", "|---|---|---|---|---|---|"]
    for way, median in result["medians"].items():
        roles = [key.removesuffix(" CPU us") for key in median if key.endswith(" CPU us")]
        for i, role in enumerate(roles):
            head = f"| {way} | {median['inputs_per_s']:.1f} | {median['p50_ms']:.2f} |" if i == 0 else "| | | |"
            lines.append(f"{head} {role} | {median[f'{role} CPU us']:,.0f} | {median[f'{role} wait us']:,.0f} |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    medians = result["medians"]

    def beside(way: str, what: str) -> float:  # every process but the engine core
        return sum(v for key, v in medians[way].items() if key.endswith(what) and not key.startswith("engine core"))

    names = list(medians)
    plot_bars(RESULTS / "run_queue.png", names, {
        "inputs/s": [medians[n]["inputs_per_s"] for n in names],
        "CPU beside engine, µs/request": [beside(n, " CPU us") for n in names],
        "waiting for a core, µs/request": [beside(n, " wait us") for n in names]})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--nice-engine", type=int, default=None, help="also run llmfleet with its engine core at this nice")
    args = parser.parse_args(argv)
    return save("run_queue", run(args.rounds, args.requests, args.nice_engine), plot, table)


if __name__ == "__main__":
    main()
