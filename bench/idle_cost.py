"""What an idle fleet costs Redis: one gateway and N idle scripted workers, no requests.

Counts the commands Redis serves (`INFO commandstats`, after `CONFIG RESETSTAT`) and the
redis-server's CPU over a window, once the processes have settled: the background every worker
and gateway adds before any request arrives (heartbeats, registry reads, claim and steal loops).

    python -m bench.idle_cost [--workers 4] [--seconds 10]

Prints the commands per second, by command, and Redis's share of a core.
"""

from __future__ import annotations

import argparse
import time

from bench.common import Stack
from bench.redis_capacity import idle_load, measure
from shared import redis_pool
from tests.procs import start_gateway, start_worker, wait_until_served

MODEL = "idle"


def run(workers: int, seconds: float) -> dict:
    with Stack() as stack:
        stack.procs += [start_worker(stack.redis.url, MODEL) for _ in range(workers)]
        gateway = start_gateway(stack.redis.url)
        stack.procs.append(gateway)
        wait_until_served(gateway, MODEL)
        time.sleep(3)  # past the first heartbeats and registry reads
        window = measure(redis_pool.connect_sync(stack.redis.url), {"redis": stack.redis.pid}, idle_load(seconds))
    calls = {name.removeprefix("calls:"): value / window.seconds for name, value in window.counters.items()
             if name.startswith("calls:")}
    return {"workers": workers, "commands_per_s": sum(calls.values()),
            "redis_core_share": window.counters["cpu_us:redis"] / 1e6 / window.seconds,
            "by_command": dict(sorted(calls.items(), key=lambda item: -item[1]))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args(argv)
    result = run(args.workers, args.seconds)
    print(f"{result['workers']} idle workers and a gateway: {result['commands_per_s']:.0f} commands/s, "
          f"Redis {result['redis_core_share']:.2%} of a core")
    print("| command | per second |\n|---|---|")
    for name, rate in result["by_command"].items():
        print(f"| {name} | {rate:.1f} |")
    return result


if __name__ == "__main__":
    main()
