"""What carrying one message of replies costs Redis and the reading gateway: a reply stream or a channel.

A worker writes one message per engine step for each gateway (the envelopes of all its requests
bound there). Two ways for the gateway to get it, each measured alone, in processes of their own:

- **stream**: the worker XADDs an entry to the gateway's reply stream; the gateway waits in an
  XREAD BLOCK and, once one comes back, sends the next (the reply router before the nineteenth
  pass, through `shared.redis_direct.DirectConnection`, as it did);
- **channel**: the worker PUBLISHes it to the gateway's channel; the gateway's subscription
  (`shared.redis_direct.Subscription`) reads it as it comes, sending nothing.

The worker writes `--rate` messages a second of `--bytes` each (about eight streams' deltas) for
`--seconds`; per message, the CPU (`/proc/<pid>/stat`) of Redis, the gateway and the worker, over the
middle of the run, in alternating rounds, medians kept. Nothing else of llmfleet runs: the
difference is the transport's alone.

    python -m bench.reply_transport [--rounds 4] [--seconds 12] [--rate 120,500] [--bytes 1600]

Writes bench/results/reply_transport.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from bench.common import RESULTS, plot_bars, progress, save

KINDS = ("stream", "channel")
STREAM, CHANNEL = "bench:replies", "bench:channel"


async def _gateway(port: int, kind: str, seconds: float) -> None:
    import redis.asyncio as aioredis

    from shared.redis_direct import DirectConnection, Subscription

    client = aioredis.Redis(port=port)
    received = 0
    if kind == "channel":
        def count(_message: bytes) -> None:
            nonlocal received
            received += 1
        subscription = await Subscription.open(client, CHANNEL, count)
        await asyncio.sleep(seconds)
        await subscription.close()
    else:
        direct = DirectConnection(client)
        last = (await client.xadd(STREAM, {b"hello": b"1"})).decode()
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            [reply] = await direct.execute([("XREAD", "COUNT", 1000, "BLOCK", 1000, "STREAMS", STREAM, last)])
            if reply:
                entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
                received += len(entries)
                last = entries[-1][0]
        await direct.close()
    print(received, flush=True)


async def _worker(port: int, kind: str, seconds: float, rate: float, size: int) -> None:
    import redis.asyncio as aioredis

    from shared.redis_direct import DirectConnection

    direct = DirectConnection(aioredis.Redis(port=port))
    payload = b"x" * size
    command = ("PUBLISH", CHANNEL, payload) if kind == "channel" else (
        "XADD", STREAM, "MAXLEN", "~", 100_000, "*", "b", payload)
    await asyncio.sleep(1.0)  # the gateway is reading by then
    due = time.monotonic()
    ends = due + seconds
    while due < ends:
        await direct.execute([command])
        due += 1 / rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
    await direct.close()


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one(kind: str, rate: float, size: int, seconds: float) -> dict[str, float]:
    """Per message, µs of CPU of Redis, the gateway and the worker, over the run's middle."""
    from llmfleet import find_redis_server
    from tests.procs import free_port

    port = free_port()
    redis_server = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no"],
                                    stdout=subprocess.DEVNULL, start_new_session=True)
    here = [sys.executable, "-m", "bench.reply_transport"]
    try:
        time.sleep(0.5)
        gateway = subprocess.Popen([*here, "--role", "gateway", "--port", str(port), "--kind", kind,
                                    "--seconds", str(seconds + 2)], stdout=subprocess.PIPE, start_new_session=True)
        worker = subprocess.Popen([*here, "--role", "worker", "--port", str(port), "--kind", kind, "--seconds",
                                   str(seconds), "--rate", str(rate), "--bytes", str(size)], start_new_session=True)
        pids = {"redis": redis_server.pid, "gateway": gateway.pid, "worker": worker.pid}
        time.sleep(2.0)  # started, and a second of messages
        before = {name: _cpu_s(pid) for name, pid in pids.items()}
        window = seconds - 2.0
        time.sleep(window)
        after = {name: _cpu_s(pid) for name, pid in pids.items()}
        worker.wait(30)
        received = int(gateway.communicate(timeout=30)[0].split()[-1])
        assert received >= rate * (seconds - 1), f"the gateway got {received} messages"
    finally:
        redis_server.terminate()
        redis_server.wait(10)
    return {name: (after[name] - before[name]) / (window * rate) * 1e6 for name in pids}


def run(rounds: int, seconds: float, rates: list[float], size: int) -> dict:
    samples: dict[str, dict[str, list[dict[str, float]]]] = {str(rate): {kind: [] for kind in KINDS} for rate in rates}
    total, done = rounds * len(rates) * len(KINDS), 0
    for round_ in range(rounds):
        for rate in rates:
            for kind in KINDS if round_ % 2 == 0 else KINDS[::-1]:
                samples[str(rate)][kind].append(_one(kind, rate, size, seconds))
                done += 1
                progress("reply transport", done, total)
    medians = {rate: {kind: {name: statistics.median(s[name] for s in runs) for name in runs[0]}
                      for kind, runs in kinds.items()} for rate, kinds in samples.items()}
    return {"rounds": rounds, "seconds": seconds, "bytes": size, "samples": samples, "medians": medians}


def table(result: dict) -> str:
    lines = ["| messages/s | carried by | CPU µs per message: Redis / gateway / worker | Redis + gateway |",
             "|---|---|---|---|"]
    for rate, kinds in result["medians"].items():
        for kind, cpu in kinds.items():
            lines.append(f"| {float(rate):.0f} | {kind} | {cpu['redis']:.1f} / {cpu['gateway']:.1f} / "
                         f"{cpu['worker']:.1f} | {cpu['redis'] + cpu['gateway']:.1f} |")
    return "\n".join(lines) + (f"\n\nMessages of {result['bytes']} bytes; medians of {result['rounds']} alternating "
                               f"rounds of {result['seconds']:.0f} s.")


def plot(result: dict) -> None:
    names = [f"{kind} @{float(rate):.0f}/s" for rate in result["medians"] for kind in KINDS]
    cells = [result["medians"][rate][kind] for rate in result["medians"] for kind in KINDS]
    plot_bars(RESULTS / "reply_transport.png", names, {
        "Redis µs/message": [c["redis"] for c in cells], "gateway µs/message": [c["gateway"] for c in cells],
        "worker µs/message": [c["worker"] for c in cells]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--rate", default="120,500", help="comma-separated messages per second")
    parser.add_argument("--bytes", type=int, default=1600)
    parser.add_argument("--role", choices=("gateway", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        import uvloop

        uvloop.install()
        asyncio.run(_gateway(args.port, args.kind, args.seconds) if args.role == "gateway"
                    else _worker(args.port, args.kind, args.seconds, float(args.rate), args.bytes))
        return
    rates = [float(rate) for rate in args.rate.split(",")]
    save("reply_transport", run(args.rounds, args.seconds, rates, args.bytes), plot, table)


if __name__ == "__main__":
    main()
