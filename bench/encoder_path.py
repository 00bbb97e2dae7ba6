"""An encoder worker's own path: vLLM's whole embedding handler against `_PlainEmbedding`, one engine.

One `VLLMPoolingAdapter` (the worker's vLLM encoder) on the tiny model as an embedding model, in
this process, with no gateway or Redis around it: the same single-text requests go through
`adapter.encode` with the plain path on, then off (vLLM's whole handler, as before it), in
alternating rounds, so that the machine's drift and the engine's state hit both alike. Per path:
requests a second, wall time and this process's CPU per request (the engine core and its model
runner are processes of their own, so the CPU is the worker's side alone), at 1 and 16 concurrent
callers; medians of the rounds.

Both paths ran in one process on one engine because a run of several stacks on this machine found
each started later answering faster (docs/benchmarks.md, "Fourteenth pass").

    python -m bench.encoder_path [--rounds N] [--requests N]

Writes bench/results/encoder_path.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ENGINE_ENV, RESULTS, plot_bars, progress, save
from shared.envelopes import RequestEnvelope

MODEL = "tiny-embed"
WORDS = "the sea is calm tonight a tide of words rolls over stones and sand under a pale moon".split()
PATHS = ("vLLM's handler", "plain path")
CALLERS = (1, 16)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(adapter, plain, texts: list[str], callers: int, tag: str) -> dict:
    """`len(texts)` requests from `callers` concurrent callers, through `plain` (or the handler if None)."""
    adapter._plain = plain
    pending = iter(enumerate(texts))

    async def caller() -> None:
        for i, text in pending:
            answer = await adapter.encode(RequestEnvelope(
                request_id=f"{tag}-{i}", model=MODEL, kind="embed", reply_to="-", arrival=time.time(),
                body={"model": MODEL, "input": text, "encoding_format": "base64"}))
            if not answer.pooled:
                raise RuntimeError(f"no vector: {answer.error}")

    started, cpu = time.perf_counter(), _cpu()
    await asyncio.gather(*(caller() for _ in range(callers)))
    wall, cpu = time.perf_counter() - started, _cpu() - cpu
    return {"requests_per_s": len(texts) / wall, "wall_us": wall / len(texts) * 1e6 * callers,
            "cpu_us": cpu / len(texts) * 1e6}


async def run(rounds: int, requests: int) -> dict:
    from vllm import AsyncEngineArgs

    from worker.adapters.vllm_pooling import VLLMPoolingAdapter
    from worker.tiny_model import write_tiny_model

    rng = random.Random(7)
    texts = [" ".join(rng.choice(WORDS) for _ in range(32)) for _ in range(requests)]
    with tempfile.TemporaryDirectory() as tmp:
        sys.stderr.write("starting the tiny model as an embedding model in this process (about half a minute)...\n")
        adapter = VLLMPoolingAdapter(AsyncEngineArgs(
            model=str(write_tiny_model(Path(tmp) / "tiny")), runner="pooling", convert="embed", dtype="float32",
            enforce_eager=True, max_model_len=2048), MODEL)
        await adapter.start()
        try:
            plain = adapter._plain
            if plain is None:
                raise RuntimeError("the encoder has no plain path for this model")
            checks = []
            for path in (None, plain):  # both answer alike: the same bytes, the same usage
                await _measure(adapter, path, texts[:32], 4, "warm")  # and leaves `path` on
                checks.append(await adapter.encode(RequestEnvelope(
                    request_id=f"check-{path is None}", model=MODEL, kind="embed", reply_to="-", arrival=time.time(),
                    body={"model": MODEL, "input": texts[0]})))
            if checks[0].pooled[0].data != checks[1].pooled[0].data or checks[0].usage != checks[1].usage:
                raise RuntimeError("the two paths answered differently")
            samples = {(callers, name): [] for callers in CALLERS for name in PATHS}
            steps, done = rounds * len(CALLERS) * len(PATHS), 0
            for round_ in range(rounds):
                for callers in CALLERS:
                    order = PATHS if round_ % 2 == 0 else PATHS[::-1]  # each goes first in every other round
                    for name in order:
                        samples[callers, name].append(await _measure(
                            adapter, plain if name == "plain path" else None, texts, callers, f"{round_}-{callers}"))
                        done += 1
                        progress("encoder path", done, steps)
        finally:
            await adapter.shutdown()
    rows = []
    for callers in CALLERS:
        row = {"callers": callers}
        for name in PATHS:
            runs = samples[callers, name]
            row[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            row[name]["cpu_us_range"] = [min(run["cpu_us"] for run in runs), max(run["cpu_us"] for run in runs)]
        rows.append(row)
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "rounds": rounds, "requests": requests, "rows": rows}


def table(result: dict) -> str:
    lines = ["| callers | path | requests/s | wall µs a request | worker CPU µs a request (median, range) |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        for name in PATHS:
            cell = row[name]
            low, high = cell["cpu_us_range"]
            lines.append(f"| {row['callers']} | {name} | {cell['requests_per_s']:.0f} | {cell['wall_us']:.0f} | "
                         f"{cell['cpu_us']:.0f} ({low:.0f}-{high:.0f}) |")
    return "\n".join(lines)


def plot(result: dict) -> None:
    panels = {}
    for row in result["rows"]:
        panels[f"requests/s, {row['callers']} caller(s)"] = [row[name]["requests_per_s"] for name in PATHS]
        panels[f"CPU µs/request, {row['callers']} caller(s)"] = [row[name]["cpu_us"] for name in PATHS]
    plot_bars(RESULTS / "encoder_path.png", list(PATHS), panels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each path and caller count (medians kept)")
    parser.add_argument("--requests", type=int, default=400, help="requests of each measurement")
    args = parser.parse_args(argv)
    for name, value in {**ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}.items():  # the engine's, and its log's
        os.environ.setdefault(name, value)
    return save("encoder_path", asyncio.run(run(args.rounds, args.requests)), plot, table)


if __name__ == "__main__":
    main()
