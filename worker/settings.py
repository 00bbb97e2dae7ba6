"""A worker's settings and their defaults, in one place: `llmfleet worker` builds its options from
these fields (`--max-concurrency` sets `max_concurrency`, with the help given here), the
environment's `LLMFLEET_<OPTION>` reads the same, and the deploy files set only what they change
(tests/test_settings.py checks that none repeats a default). A new setting is one line here.

A field's option is its name less a `_s` suffix, with dashes; a tuple takes a comma-separated
list; a bool is a `--x/--no-x` flag. Fields marked `engine` are vLLM's own engine options, named as
`vllm serve` names them and passed to its `AsyncEngineArgs` when set. `redis_url` comes from the
shared Redis options. Keep this module free of heavy imports: the CLI reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

ENGINES = ("vllm", "scripted")
RUNNERS = ("auto", "generate", "pooling")  # vllm serve's --runner (less `draft`, which serves no requests)
CONVERTS = ("auto", "none", "embed", "classify")  # vllm serve's --convert


def setting(default: Any, help: str, *, kind: type | None = None, engine: bool = False, **extra: Any) -> Any:
    """A field with its option's help; `kind` types an option whose default is None; `engine`: vLLM's."""
    return field(default=default, metadata={"help": help, "kind": kind or type(default), "engine": engine, **extra})


@dataclass(slots=True)
class WorkerSettings:
    model: str = setting("", "Model path or name, as for `vllm serve`.", required=True)
    engine: str = setting("vllm", "vllm, or scripted: a model-free engine that repeats the prompt's words, for tests "
                          "and gateway benchmarks.", choices=ENGINES)
    served_model_name: str | None = setting(None, "The name clients ask for (default: --model).", kind=str)
    redis_url: str = ""
    max_concurrency: int = setting(64, "Requests this worker runs at once (its slots).")
    metrics_port: int = setting(0, "Serve Prometheus metrics, vLLM's `vllm:*` series included, on this port (0: off).")
    claim_idle_s: float = setting(3.0, "Seconds a dead worker's unanswered request waits before it is taken over.")
    migration_limit: int = setting(3, "Times one stream may be taken over by another worker after its worker died "
                                   "mid-stream: continued from the engine's tokens its client was sent (a seeded "
                                   "one run again from its start and joined where its client stood). Past it, or "
                                   "0, such a stream ends with an error.")
    drain_timeout_s: float = setting(30.0, "Seconds a stopping worker (SIGTERM) lets its runs finish; then it hands the "
                                     "streams and the non-streaming requests still running to the model's other "
                                     "workers, if one takes work (a stream goes on where its client stood; a "
                                     "non-streaming request runs again), and finishes only the rest (streams under "
                                     "a structured output or a forced tool call).")
    steal_after_ms: float = setting(10.0, "With a free slot, take the requests that have waited this many milliseconds "
                                    "in another (busy or stopped) worker's own queue.")
    takeover_slots: int = setting(1, "Slots kept for requests taken over from a worker that died or drained: with "
                                  "every slot busy, take up to this many more of them, so that a moved stream goes "
                                  "on ahead of new work instead of waiting for a slot behind it. 0: none.")
    express_slots: int = setting(0, "With every slot busy, start up to this many more requests, only of API keys that "
                                 "have nothing else queued (fair share's express lane). The engine must have room for "
                                 "them (vLLM: --max-num-seqs above --max-concurrency). 0: off.")
    kinds: tuple[str, ...] = setting((), "Comma-separated request kinds to accept (chat, completion, tokenize, "
                                     "detokenize; embed, score, rerank, classify, pooling of a pooling model); "
                                     "default: every kind the engine answers. Gateways queue no other kind for the "
                                     "model while no live worker accepts it.")
    enable_log_requests: bool = setting(False, "Log one line per request at its end (id, tenant, model, tokens, stage "
                                        "times, finish reason) on `llmfleet.requests`, as vllm serve's option.")
    encode_together: bool = setting(False, "An encoder: the requests claimed in one read whose options match go "
                                    "through one call of vLLM's handler, and each waits for the whole call. That "
                                    "saves the worker CPU per request and costs latency: off by default, since "
                                    "64 clients of single inputs got 6-18 % fewer inputs/s with it here "
                                    "(docs/benchmarks.md); on for a worker whose own CPU is what limits it.")
    # vLLM's engine, as `vllm serve` takes it.
    max_model_len: int | None = setting(None, "Context length (prompt plus output) in tokens; default: the model's.",
                                        kind=int, engine=True)
    runner: str = setting("auto", "The kind of work, as vllm serve's option: generate (chat, completions), pooling "
                          "(an encoder: embeddings, score, rerank, classify, pooling), or auto: the model's own.",
                          engine=True, choices=RUNNERS)
    convert: str = setting("auto", "Serve a model as a pooling model of another task, as vllm serve's option: embed "
                           "(embeddings, score, rerank) or classify (classify; score and rerank with one label), none, "
                           "or auto: the model's own.", engine=True, choices=CONVERTS)
    dtype: str = setting("auto", "Weights' and activations' type: auto, float16, bfloat16, float32.", engine=True)
    quantization: str | None = setting(None, "Quantization method of the weights (awq, gptq, fp8, ...), as vllm "
                                       "serve's option; default: from the model's config.", kind=str, engine=True)
    enforce_eager: bool = setting(False, "Run the model eagerly: no CUDA graphs or torch.compile (slower steps, "
                                  "faster start).", engine=True)
    gpu_memory_utilization: float | None = setting(None, "Share of GPU memory vLLM may take (default 0.9).",
                                                   kind=float, engine=True)
    tensor_parallel_size: int = setting(1, "GPUs one model is split across.", engine=True)
    max_num_seqs: int | None = setting(None, "Sequences the engine batches at most per step.", kind=int, engine=True)
    max_logprobs: int = setting(20, "The most logprobs a request may ask for.", engine=True)
    stream_interval: int | None = setting(None, "Tokens per streamed delta after a request's first, as vllm serve's "
                                          "option (default 1: every token as it comes); fewer, larger deltas cost the "
                                          "worker, Redis and the gateway less per token.", kind=int, engine=True,
                                          minimum=1)
    seed: int | None = setting(None, "The engine's random seed.", kind=int, engine=True)
    custom_histogram_buckets: dict | None = setting(None, "Bounds of vLLM's own histograms (`vllm:*`), as vllm serve's "
                                                    "option: a JSON object of bucket family to bounds in seconds or "
                                                    "tokens, e.g. '{\"inter_token_latency\": [0.005, 0.01, 0.02]}'; "
                                                    "default: vLLM's.", kind=dict, engine=True)
    trust_remote_code: bool = setting(False, "Run the model repository's own code (Hugging Face).", engine=True)
    tokenizer: str | None = setting(None, "Tokenizer path or name (default: the model's).", kind=str, engine=True)
    allowed_media_domains: tuple[str, ...] = setting((), "Comma-separated domains the worker may fetch media "
                                                     "(image_url, audio_url, video_url parts) from; default: none, "
                                                     "unlike vllm serve, which fetches from anywhere.", engine=True)
    allowed_local_media_path: str | None = setting(None, "A directory whose files `file:` media URLs may name; "
                                                   "default: none.", kind=str, engine=True)
    # vLLM's request handling, as `vllm serve` takes it.
    chat_template: str | None = setting(None, "Path of a Jinja chat template replacing the model's.", kind=str)
    tool_call_parser: str | None = setting(None, "vLLM's tool call parser for the model (hermes, llama3_json, ...).",
                                           kind=str)
    enable_auto_tool_choice: bool = setting(False, "Let the model call tools on its own (tool_choice auto); needs "
                                            "--tool-call-parser.")
    reasoning_parser: str | None = setting(None, "vLLM's reasoning parser for the model (deepseek_r1, qwen3, ...).",
                                           kind=str)
    enable_prompt_tokens_details: bool = setting(False, "Report the prompt tokens found in the prefix cache "
                                                 "(usage.prompt_tokens_details.cached_tokens), as vllm serve's option.")
    # The scripted engine.
    scripted_tokens_per_second: float = setting(0.0, "Scripted engine: its pace (0: no pause).")
    scripted_first_token_delay: float = setting(0.0, "Scripted engine: seconds before its first token.")
    scripted_loop_stall: float = setting(0.0, "Scripted engine: seconds each request's first token (an encoding: its "
                                         "start) holds the worker's event loop with a blocking call, as a busy "
                                         "engine's input processing can.")
    scripted_prefill_per_token: float = setting(0.0, "Scripted engine: seconds of prefill per prompt token not in its "
                                                "simulated prefix cache (0: no cache, no prefill time).")
    scripted_seconds_per_input: float = setting(0.0, "Scripted engine with --runner pooling: seconds each input "
                                                "costs, paid one request at a time (an engine's compute), so a worker "
                                                "encodes at most 1/this inputs a second (0: no cost).")
    scripted_engine_tokens: bool = setting(True, "Scripted engine: send the engine's tokens with each delta, as vLLM's "
                                           "worker does, so that a takeover continues its streams from them (off: "
                                           "from their text, or replayed).")
    scripted_cache_blocks: int = setting(100_000, "Scripted engine: blocks of 16 tokens its simulated prefix cache "
                                         "holds (the least recently used go first), as a KV cache of that size.",
                                         minimum=1)

    @property
    def name(self) -> str:
        """The name clients ask for."""
        return self.served_model_name or self.model

    def engine_args(self) -> dict[str, Any]:
        """vLLM's engine options that are set, as `AsyncEngineArgs` takes them."""
        args = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("engine")}
        args["allowed_media_domains"] = list(self.allowed_media_domains) or None
        if self.reasoning_parser:  # the engine needs it too: structured outputs start after the reasoning
            args["reasoning_parser"] = self.reasoning_parser
        return {name: value for name, value in args.items() if value is not None}
