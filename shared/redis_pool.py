"""The Redis client of a gateway or worker process: one bounded pool, connections named after it.

`--redis-url` names one of three topologies; `parse_url` is the one place that reads it:

- `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS) or `unix://...`: one server.
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]`: the primary
  that the Sentinels name. Every new connection asks them where it is, so after a failover the
  pool's connections, dropped with the old primary, come back on the new one. Sentinels with a
  password of their own: `?sentinel_password=...`.
- `redis+cluster://[[user]:password@]host:port[,host:port...]`: a Redis Cluster, discovered from
  the nodes listed. Each command and script of llmfleet names keys of one hash slot
  (`shared.keys`); the cancel channel's PUBLISH reaches the subscribers of every node.

TLS (`rediss://`) checks the server's certificate against the system's CAs, or against the CA
file in `?ssl_ca_certs=/path` (`--redis-ca-file`, `with_ca_file`). The password and user name
of the URL are those of the data nodes, an ACL user or `requirepass`.

Whatever the topology, the client keeps the same manners:

- A bounded, blocking pool: a burst of requests waits for a free connection instead of opening
  thousands, or failing with redis-py's "Too many connections". (redis-py's cluster client fails
  at once when a node's connections are all busy; there a command waits for a permit instead.)
- Connections carry the process's name (`CLIENT LIST` tells whose each one is).
- Both processes run on uvloop, which reports a write to a socket the server has just closed as
  `RuntimeError: ... the handler is closed` (MagicStack/uvloop#506), where asyncio's own loop
  gives an `OSError`. redis-py turns only the latter into a `ConnectionError`, so a Redis restart
  could escape every `except RedisError` and fail an answer that was already complete. The pool's
  connections read the uvloop error as the `ConnectionError` it is. (redis-py 8.2 also looks at the
  transport before each write, and raises a `ConnectionError` itself if it is already closing.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.cluster
import redis.sentinel
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import parse_url as parse_server_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import ConnectionError as RedisConnectionError

SERVER_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
_DEFAULT_PORT = {SENTINEL_SCHEME: 26379, CLUSTER_SCHEME: 6379}
_OPTIONS = {SENTINEL_SCHEME: {"sentinel_password"}, CLUSTER_SCHEME: set()}  # known URL query options
CLUSTER_PUBSUB_CONNECTIONS = 4  # per node, beyond the permits: a subscription holds its connection


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What a `--redis-url` names."""
    topology: str  # "server", "sentinel" or "cluster"
    url: str
    nodes: tuple[tuple[str, int], ...] = ()  # the sentinels, or the cluster nodes to start from
    service_name: str = ""  # sentinel: the name of the monitored primary
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def parse_url(url: str) -> RedisTarget:
    """Read a `--redis-url`; a ValueError says what is wrong with it."""
    scheme = url.partition("://")[0].lower()
    if scheme in SERVER_SCHEMES:
        parse_server_url(url)  # redis-py's own reading, for its errors
        return RedisTarget("server", url)
    if scheme not in _DEFAULT_PORT:
        raise ValueError(f"unsupported Redis URL scheme {scheme!r} in {redacted(url)}: use one of "
                         f"{', '.join(s + '://' for s in (*SERVER_SCHEMES, SENTINEL_SCHEME, CLUSTER_SCHEME))}")
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = tuple(_host_port(node, _DEFAULT_PORT[scheme], url) for node in hosts.split(","))
    options = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    if unknown := set(options) - _OPTIONS[scheme]:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))} in {redacted(url)}")
    path = [unquote(p) for p in parts.path.split("/") if p]
    common = {"nodes": nodes, "username": unquote(username) or None, "password": unquote(password) or None}
    if scheme == CLUSTER_SCHEME:
        if path:
            raise ValueError(f"a Redis Cluster has only database 0: drop the path of {redacted(url)}")
        return RedisTarget("cluster", url, **common)
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"a Sentinel URL ends in /service_name or /service_name/db: {redacted(url)}")
    return RedisTarget("sentinel", url, service_name=path[0], db=int(path[1]) if len(path) == 2 else 0,
                       sentinel_password=options.get("sentinel_password"), **common)


def _host_port(node: str, default_port: int, url: str) -> tuple[str, int]:
    host, colon, port = node.rpartition(":") if not node.endswith("]") else (node, "", "")
    if not colon:
        host, port = node, str(default_port)
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {node!r} in {redacted(url)}")
    return host, int(port)


def redacted(url: str) -> str:
    """The URL without its password, for error messages."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, _, userinfo = head.partition("://")
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{tail}"


def with_ca_file(url: str, ca_file: str | None) -> str:
    """`url` with `ca_file` as the CA that the server's TLS certificate must chain to."""
    if not ca_file:
        return url
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        raise ValueError(f"a Redis CA file needs a rediss:// URL (TLS), not {redacted(url)}")
    if "ssl_ca_certs" in parse_qs(parts.query):
        raise ValueError("the Redis URL names a CA file (ssl_ca_certs) already")
    option = f"ssl_ca_certs={quote(ca_file, safe='/')}"
    return parts._replace(query=f"{parts.query}&{option}" if parts.query else option).geturl()


def connect(url: str, *, max_connections: int, wait_s: float,
            client_name: str) -> aioredis.Redis | RedisCluster:
    """A client on a pool of at most `max_connections`; a command waits `wait_s` for one."""
    target = parse_url(url)
    options = {"socket_connect_timeout": 2, "health_check_interval": 10, "client_name": client_name}
    if target.topology == "cluster":
        return _BoundedCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                               permits=max_connections, wait_s=wait_s, username=target.username,
                               password=target.password,
                               max_connections=max_connections + CLUSTER_PUBSUB_CONNECTIONS, **options)
    if target.topology == "sentinel":
        sentinels = Sentinel(target.nodes, sentinel_kwargs={
            "socket_connect_timeout": 2, "socket_timeout": 2, "password": target.sentinel_password,
            "client_name": client_name})
        return sentinels.master_for(target.service_name, connection_pool_class=_BlockingSentinelPool,
                                    connection_class=_closed_socket_is_connection_error(SentinelManagedConnection),
                                    max_connections=max_connections, timeout=wait_s, db=target.db,
                                    username=target.username, password=target.password, **options)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s,
                                                    **options)
    pool.connection_class = _closed_socket_is_connection_error(pool.connection_class)  # TCP, TLS or unix
    return aioredis.Redis.from_pool(pool)


def connect_sync(url: str, socket_timeout: float | None = None) -> redis.Redis | redis.RedisCluster:
    """A plain synchronous client on the same URL, for tools, tests and a worker's lease thread."""
    target = parse_url(url)
    if target.topology == "cluster":
        return redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in target.nodes],
                                  username=target.username, password=target.password, socket_connect_timeout=2,
                                  socket_timeout=socket_timeout)
    if target.topology == "sentinel":
        sentinels = redis.sentinel.Sentinel(target.nodes, sentinel_kwargs={
            "socket_connect_timeout": 2, "socket_timeout": 2, "password": target.sentinel_password})
        return sentinels.master_for(target.service_name, db=target.db, username=target.username,
                                    password=target.password, socket_connect_timeout=2, socket_timeout=socket_timeout)
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=socket_timeout)


def pipelines_run_in_order(client: aioredis.Redis | RedisCluster) -> bool:
    """Whether a pipeline's commands run one after another, as sent: on one server they do; a
    cluster runs each node's share at once, so a later command can land before an earlier one."""
    return not isinstance(client, RedisCluster)


class _ClosedSocketIsConnectionError:
    async def send_packed_command(self, command, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:
            if "handler is closed" not in str(exc):
                raise
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc


@functools.cache
def _closed_socket_is_connection_error(base: type) -> type:
    return type(base.__name__, (_ClosedSocketIsConnectionError, base), {})


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections to whichever node is primary now), bounded and blocking."""


_holding_permit = contextvars.ContextVar("holding_permit", default=False)


class _BoundedCluster(RedisCluster):
    """A cluster client whose commands and pipelines wait up to `wait_s` for one of `permits`.

    Each node allows `permits` connections (plus a few for subscriptions), and a command or
    pipeline holds one connection per node it reaches: with a permit each, no node runs out.
    """

    def __init__(self, *, permits: int, wait_s: float, **kwargs):
        super().__init__(**kwargs)
        self._permits = asyncio.Semaphore(permits)
        self._wait_s = wait_s
        fixed = _closed_socket_is_connection_error(self.connection_kwargs["connection_class"])
        self.connection_kwargs["connection_class"] = fixed  # for the nodes it discovers
        for node in self.startup_nodes:
            node.connection_class = fixed

    @contextlib.asynccontextmanager
    async def permit(self):
        if _holding_permit.get():  # a redirected command of a pipeline: its permit covers it
            yield
            return
        try:
            await asyncio.wait_for(self._permits.acquire(), self._wait_s)
        except TimeoutError as exc:
            raise RedisConnectionError("No connection available.") from exc
        token = _holding_permit.set(True)
        try:
            yield
        finally:
            _holding_permit.reset(token)
            self._permits.release()

    async def execute_command(self, *args, **kwargs):
        async with self.permit():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None) -> ClusterPipeline:
        return _BoundedClusterPipeline(self, transaction)


class _BoundedClusterPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True):
        async with self.cluster_client.permit():
            return await super().execute(raise_on_error, allow_redirections)
