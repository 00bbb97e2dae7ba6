"""Cache affinity in the pull queue: multi-turn conversations on two workers, sent to the worker
that cached them (`--affinity`, the default) against the plain shared queue (`--no-affinity`).

Workloads, each run with both routings on the same workers, one after the other in one run:

1. multi-turn: CONVERSATIONS conversations of TURNS turns at once, each turn sent when the
   previous one is answered; every conversation starts with the same long system prompt and
   grows by a user message and the answer each turn;
2. no reuse: the same number of requests, each a fresh random prompt of the same length, at
   the same concurrency: affinity has nothing to gain there and must cost nothing.

Each routing gets its own prompts (another system prompt, other words), so what one cached
cannot help the other. Engines: `scripted` (default) simulates a prefix cache, `prefill` seconds
per prompt token not cached on that worker (`--scripted-prefill-per-token`), so the routing's
effect is measured without CPU noise; `vllm` runs two vLLM workers on the tiny model, prefix
caching on (vLLM's default), with `--enable-prompt-tokens-details` for the hit rate.

Measured at the client, streaming: TTFT (to the first content), requests per second, the prefix
cache hit rate (cached prompt tokens / prompt tokens, from usage); from the workers' metrics:
where their requests came from (own stream, shared stream, stolen after waiting on a busy
worker). Goals (issue #15): with reuse, TTFT p50 at least 2x lower than the shared queue; without
reuse, throughput >= 0.98x.

With `--cache-blocks N` the scripted workers' caches hold N blocks of 16 tokens each, as a KV
cache of that size (LRU): a fleet whose cache memory holds each conversation once, but not once
on every worker, which is where a shared queue loses most (every worker caches every
conversation it meets, and evicts what the next turn needs).

    python -m bench.affinity [--engine scripted|vllm] [--quick] [--workers N] [--cache-blocks N] [--stream-interval N]

Writes bench/results/affinity[_vllm].json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import orjson

from bench.common import ENGINE_ARGS, ENGINE_ENV, RESULTS, Stack, percentile, progress, save
from tests.procs import metric_value, start_gateway, start_worker, wait_until_served

MODEL = "affinity-bench"
WORKERS = 2
# Workers have the default --max-concurrency, room for every conversation and more, as a fleet has: with exactly
# as many slots as conversations (16 each, as this benchmark first ran), a slot frees only when a turn ends and the
# conversation's next turn is the request there to take it, so the shared queue itself keeps each conversation on
# its worker (measured: 95% cache hits for the shared queue, 94% with affinity, TTFT p50 1.0x).
# Answers stream 10 tokens a delta (`--stream-interval`, after the first token alone): the same timing, a tenth of
# the events to relay and parse, so the machine's CPU (gateway, workers and this client share two cores) stays out
# of the TTFT that routing makes.
SCRIPTED = {"slots": 64, "prefill_per_token": 0.0001, "tokens_per_second": 200, "stream_interval": 10,
            "system_words": 1500, "user_words": 100, "answer_tokens": 100, "conversations": 32, "turns": 8,
            "think_s": 1.0}
# `--cache-blocks` of the bounded run (`python -m bench`): each worker's half of the conversations at their
# last turn (16 x 8 x 200 words) plus the system prompt is ~1,700 blocks, every conversation ~3,300: room for
# half again a worker's share, not for all of them.
BOUNDED_CACHE_BLOCKS = 2500
# The tiny model's tokenizer makes about 1.6 tokens of a word: a system prompt of about 1,500 tokens.
VLLM = {"slots": 32, "system_words": 950, "user_words": 25, "answer_tokens": 16, "conversations": 16, "turns": 6,
        "think_s": 1.0}
# The benchmarks' engine options, with room for the growing conversations (the tiny model has 4,096 positions).
VLLM_ARGS = [*ENGINE_ARGS[:ENGINE_ARGS.index("--max-model-len")], "--max-model-len", "4096"]
VOCABULARY = Path(__file__).resolve().parent.parent.joinpath("worker", "tiny_model_corpus.txt").read_text().split()


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    ttft, text, usage = None, [], None
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            choices = event.get("choices") or []
            if choices and (content := choices[0].get("delta", {}).get("content")):
                ttft = ttft or time.perf_counter() - started
                text.append(content)
            if event.get("usage") and not choices:
                usage = event["usage"]
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ok": ttft is not None and usage is not None, "ttft_s": ttft, "text": "".join(text),
            "prompt_tokens": (usage or {}).get("prompt_tokens", 0), "cached_tokens": details.get("cached_tokens") or 0}


async def _multi_turn(url: str, shape: dict, seed: int, label: str) -> list[dict]:
    rng = random.Random(seed)
    system = _words(rng, shape["system_words"])
    openings = [_words(rng, shape["user_words"]) for _ in range(shape["conversations"])]
    total = shape["conversations"] * shape["turns"]
    results: list[dict] = []

    async def conversation(client: httpx.AsyncClient, index: int) -> None:
        messages = [{"role": "system", "content": system}]
        local = random.Random(seed * 1000 + index)
        thinking = random.Random(-1 - index)  # the same pauses for either routing, its own draws: the same words
        for turn in range(shape["turns"]):
            if turn and shape["think_s"]:
                await asyncio.sleep(thinking.expovariate(1 / shape["think_s"]))
            user = openings[index] if turn == 0 else _words(local, shape["user_words"])
            messages.append({"role": "user", "content": user})
            result = await _turn(client, url, messages, shape["answer_tokens"])
            results.append(result)
            progress(f"  {label}", len(results), total)
            messages.append({"role": "assistant", "content": result.get("text", "")})

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(conversation(client, i) for i in range(shape["conversations"])))
    return results


async def _no_reuse(url: str, shape: dict, seed: int, label: str) -> list[dict]:
    """As many single-turn requests as the multi-turn workload has turns, at the same concurrency."""
    rng = random.Random(seed)
    total = shape["conversations"] * shape["turns"]
    results: list[dict] = []

    async def sender(client: httpx.AsyncClient) -> None:
        for _ in range(shape["turns"]):
            messages = [{"role": "system", "content": _words(rng, shape["system_words"])},
                        {"role": "user", "content": _words(rng, shape["user_words"])}]
            results.append(await _turn(client, url, messages, shape["answer_tokens"]))
            progress(f"  {label}", len(results), total)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(sender(client) for _ in range(shape["conversations"])))
    return results


def _claims(workers) -> dict[str, float]:
    return {source: sum(metric_value(w.url, "llmfleet_worker_claims_total", model=MODEL, source=source)
                        for w in workers) for source in ("own", "shared", "stolen")}


def _row(workload: str, routing: str, results: list[dict], elapsed: float, claims: dict[str, float]) -> dict:
    done = [r for r in results if r["ok"]]
    ttfts = [r["ttft_s"] * 1000 for r in done]
    prompt = sum(r["prompt_tokens"] for r in done)
    return {
        "workload": workload, "routing": routing, "requests": len(results), "errors": len(results) - len(done),
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "ttft_mean_ms": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "requests_per_s": len(done) / elapsed, "cache_hit": sum(r["cached_tokens"] for r in done) / prompt if prompt else 0,
        "prompt_tokens_mean": prompt / len(done) if done else 0,
        "claims": claims,
    }


async def _measure(redis_url: str, workers, shape: dict) -> list[dict]:
    rows = []
    seed = 1
    for workload, run in (("multi-turn", _multi_turn), ("no reuse", _no_reuse)):
        for routing, flags in (("shared queue", ["--no-affinity"]), ("affinity", [])):
            gateway = start_gateway(redis_url, *flags)
            try:
                wait_until_served(gateway, MODEL, timeout=60)
                before = _claims(workers)
                started = time.perf_counter()
                results = await run(gateway.url, shape, seed, f"{workload}, {routing}")
                elapsed = time.perf_counter() - started
                after = _claims(workers)
            finally:
                gateway.stop()
            seed += 1
            rows.append(_row(workload, routing, results, elapsed, {k: after[k] - before[k] for k in after}))
    return rows


def run(engine: str, quick: bool, count: int = WORKERS, cache_blocks: int | None = None,
        stream_interval: int | None = None, slots: int | None = None) -> dict:
    shape = dict(SCRIPTED if engine == "scripted" else VLLM, cache_blocks=cache_blocks)
    if stream_interval:
        shape["stream_interval"] = stream_interval
    if slots:
        shape["slots"] = slots
    if quick:
        shape.update(conversations=8, turns=4)
    with Stack() as stack:
        if engine == "scripted":
            args = ["--scripted-prefill-per-token", str(shape["prefill_per_token"]), "--scripted-tokens-per-second",
                    str(shape["tokens_per_second"]), "--stream-interval", str(shape["stream_interval"])]
            if cache_blocks:
                args += ["--scripted-cache-blocks", str(cache_blocks)]
            workers = [start_worker(stack.redis.url, MODEL, *args, "--max-concurrency", str(shape["slots"]))
                       for _ in range(count)]
        else:
            from worker.tiny_model import write_tiny_model

            model_dir = write_tiny_model(Path(stack._tmp.name) / "tiny")
            sys.stderr.write(f"starting {count} vLLM workers on the tiny model (about a minute)...\n")
            workers = [start_worker(stack.redis.url, str(model_dir), *VLLM_ARGS, "--enable-prompt-tokens-details",
                                    "--max-concurrency", str(shape["slots"]), engine="vllm", served_name=MODEL,
                                    env=ENGINE_ENV, timeout=300) for _ in range(count)]
        stack.procs += workers
        rows = asyncio.run(_measure(stack.redis.url, workers, shape))
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "engine": engine, "workers": count, "shape": shape,
            "quick": quick, "rows": rows}


def _ratios(result: dict) -> dict[str, float]:
    rows = {(r["workload"], r["routing"]): r for r in result["rows"]}
    reuse_shared, reuse_affinity = rows["multi-turn", "shared queue"], rows["multi-turn", "affinity"]
    fresh_shared, fresh_affinity = rows["no reuse", "shared queue"], rows["no reuse", "affinity"]
    return {"ttft_p50_gain": reuse_shared["ttft_p50_ms"] / reuse_affinity["ttft_p50_ms"],
            "ttft_p99_gain": reuse_shared["ttft_p99_ms"] / reuse_affinity["ttft_p99_ms"],
            "no_reuse_throughput": fresh_affinity["requests_per_s"] / fresh_shared["requests_per_s"]}


def table(result: dict) -> str:
    out = [("| workload | routing | requests | TTFT p50 (ms) | TTFT p99 (ms) | TTFT mean (ms) | requests/s | "
            "prefix cache hits | claimed own / shared / stolen | errors |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["claims"]
        mean = f"{r['ttft_mean_ms']:.1f}" if "ttft_mean_ms" in r else ""  # not in results saved before it
        out.append(f"| {r['workload']} | {r['routing']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | "
                   f"{r['ttft_p99_ms']:.1f} | {mean} | {r['requests_per_s']:.1f} | {r['cache_hit']:.0%} | "
                   f"{c['own']:.0f} / {c['shared']:.0f} / {c['stolen']:.0f} | {r['errors']} |")
    ratios = _ratios(result)
    out += ["", (f"Multi-turn TTFT with affinity: p50 {ratios['ttft_p50_gain']:.1f}x lower, p99 "
                 f"{ratios['ttft_p99_gain']:.1f}x lower (goal: p50 >= 2x). No reuse: throughput "
                 f"{ratios['no_reuse_throughput']:.2f}x the shared queue's (goal: >= 0.98x).")]
    return "\n".join(out)


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = [f"{r['workload']}\n{r['routing']}" for r in rows]
    colors = ["#9aa5b1" if r["routing"] == "shared queue" else "#3b7dd8" for r in rows]
    for ax, key, label in ((axes[0], "ttft_p50_ms", "TTFT p50 (ms)"), (axes[1], "requests_per_s", "requests/s"),
                           (axes[2], "cache_hit", "prefix cache hit rate")):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, fontsize=7)
        ax.set_title(label)
    bounded = f", a cache of {blocks} blocks each" if (blocks := result["shape"].get("cache_blocks")) else ""
    fig.suptitle(f"cache affinity, {result['engine']} engine, {result['workers']} workers{bounded}")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / _name(result["engine"], "png", result["workers"], bool(blocks)), dpi=110)
    plt.close(fig)


def _name(engine: str, suffix: str, workers: int = WORKERS, bounded: bool = False) -> str:
    return (f"affinity{'' if engine == 'scripted' else '_' + engine}{'' if workers == WORKERS else f'_{workers}w'}"
            f"{'_bounded' if bounded else ''}.{suffix}")


def section(results: list[dict]) -> list[str]:
    """docs/benchmarks.md's section (bench.report): one part per engine measured."""
    out = ["", "## 5. Cache affinity (multi-turn conversations, two workers)", "",
           ("`python -m bench.affinity [--engine vllm]`: conversations share a long system prompt and grow by a "
            "user message and its answer each turn, all starting at once; then as many single-turn requests with "
            "fresh random prompts of the same length (no reuse), each sent when the last is answered. A "
            "conversation's user thinks before each later turn (exponential pauses, the same for either routing): "
            "sent the moment the last turn ends, turns keep their order from round to round, and a shared queue's "
            "workers, taking turns at claiming, then hand each conversation back to the same worker by accident "
            "(see the notes below). Each workload runs through a gateway with `--no-affinity` (the shared queue) and one with "
            "affinity (the default), on the same workers, with prompts of their own. TTFT is the client's, "
            "streaming.")]
    for result in results:
        shape = result["shape"]
        blocks = shape.get("cache_blocks")
        size = f"{blocks:,} blocks of 16 tokens per worker" if blocks else "unbounded"
        engine = (f"scripted engine simulating a prefix cache ({size}; "
                  f"{shape['prefill_per_token'] * 1000:.2f} ms of prefill per uncached prompt token, "
                  f"{shape['tokens_per_second']} tokens/s, {shape.get('stream_interval', 1)} a delta)"
                  if result["engine"] == "scripted"
                  else "vLLM on the tiny model, prefix caching on")
        out += ["", f"### {result['engine']}: {engine}", "",
                (f"{shape['conversations']} conversations x {shape['turns']} turns, system prompt of "
                 f"{shape['system_words']} words, {shape['user_words']}-word user turns, {shape['answer_tokens']}-token "
                 f"answers, {result['workers']} workers of {shape['slots']} slots, "
                 f"{shape.get('think_s', 0):g} s mean think time"
                 + (" (**a --quick run**)" if result["quick"] else "") + f"; measured {result['measured_at']}."),
                "", table(result), "",
                f"![cache affinity, {result['engine']}{', bounded cache' if blocks else ''}]"
                f"({_name(result['engine'], 'png', result['workers'], bool(blocks))})",
                "", analysis(result)]
    return out


def analysis(result: dict) -> str:
    rows = {(r["workload"], r["routing"]): r for r in result["rows"]}
    shared, routed = rows["multi-turn", "shared queue"], rows["multi-turn", "affinity"]
    ratios = _ratios(result)
    return (
        f"With reuse, affinity claimed {routed['claims']['own']:.0f} of {routed['requests']} turns from the worker's "
        f"own stream, {routed['claims']['stolen']:.0f} were taken by another worker after waiting "
        "`--steal-after-ms` (10) for a busy one, and the prefix cache hit rate went from "
        f"{shared['cache_hit']:.0%} to {routed['cache_hit']:.0%}: the shared system prompt is cached on both workers "
        "either way, what affinity adds is each conversation's own history. TTFT p50 "
        f"{shared['ttft_p50_ms']:.0f} -> {routed['ttft_p50_ms']:.0f} ms ({ratios['ttft_p50_gain']:.1f}x), throughput "
        f"{routed['requests_per_s'] / shared['requests_per_s']:.2f}x. Without reuse, throughput "
        f"{ratios['no_reuse_throughput']:.2f}x the shared queue's: requests keep their arrival order (a worker "
        "claims the oldest of its own and the shared stream), and an idle worker takes what waits for a busy one."
        + ("" if ratios["ttft_p50_gain"] >= 2 else " The p50 goal (2x) is **missed** in this run.")
        + ("" if ratios["no_reuse_throughput"] >= 0.98 else " The no-reuse goal (0.98x) is **missed** in this run."))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("scripted", "vllm"), default="scripted")
    parser.add_argument("--quick", action="store_true", help="8 conversations of 4 turns")
    parser.add_argument("--workers", type=int, default=WORKERS, help="workers of the model (results named _Nw "
                        "when not the default)")
    parser.add_argument("--cache-blocks", type=int, default=None, help="scripted engine: blocks each worker's "
                        "simulated prefix cache holds (default: unbounded; results named _bounded)")
    parser.add_argument("--stream-interval", type=int, default=None, help="scripted engine: tokens a delta "
                        f"after the first (default {SCRIPTED['stream_interval']}; 1 streams every token)")
    parser.add_argument("--slots", type=int, default=None, help="each worker's --max-concurrency (default: "
                        f"{SCRIPTED['slots']} scripted, {VLLM['slots']} vLLM)")
    args = parser.parse_args(argv)
    name = _name(args.engine, "json", args.workers, bool(args.cache_blocks)).removesuffix(".json")
    return save(name, run(args.engine, args.quick, args.workers, args.cache_blocks, args.stream_interval, args.slots),
                plot, table)


if __name__ == "__main__":
    main()
