"""The Redis client of a gateway or worker process: one bounded pool, connections named after it.

- A bounded, blocking pool: a burst of requests waits for a free connection instead of opening
  thousands, or failing with redis-py's "Too many connections".
- Connections carry the process's name (`CLIENT LIST` tells whose each one is).
- Both processes run on uvloop, which reports a write to a socket the server has just closed as
  `RuntimeError: ... the handler is closed` (MagicStack/uvloop#506), where asyncio's own loop
  gives an `OSError`. redis-py turns only the latter into a `ConnectionError`, so a Redis restart
  could escape every `except RedisError` and fail an answer that was already complete. The pool's
  connections read the uvloop error as the `ConnectionError` it is.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError


class _ClosedSocketIsConnectionError:
    async def send_packed_command(self, command, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:
            if "handler is closed" not in str(exc):
                raise
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc


def connect(url: str, *, max_connections: int, wait_s: float, client_name: str) -> aioredis.Redis:
    """A client on a pool of at most `max_connections`; a command waits `wait_s` for one."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s,
                                                    socket_connect_timeout=2, health_check_interval=10,
                                                    client_name=client_name)
    base = pool.connection_class  # by the URL's scheme: TCP, TLS or a unix socket
    pool.connection_class = type(base.__name__, (_ClosedSocketIsConnectionError, base), {})
    return aioredis.Redis.from_pool(pool)
