"""Who a request is for: the tenant its API key names, and the priority it was given.

The front door (key checking) sets it once per request; what comes after (fair share between
tenants, usage counting) reads it. A gateway without keys serves one anonymous tenant.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Literal

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")  # served in this order


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str = ""  # the key's name; "" when keys are off (one anonymous tenant)
    priority: Priority = "normal"
    max_tokens: int = 0  # the key's ceiling on a request's output tokens (0: none but the gateway's)


ANONYMOUS = Tenant()
_current: contextvars.ContextVar[Tenant] = contextvars.ContextVar("llmfleet_tenant", default=ANONYMOUS)


def current() -> Tenant:
    return _current.get()


def set_current(tenant: Tenant) -> None:
    """The request being served is `tenant`'s (a context variable: tasks it starts inherit it)."""
    _current.set(tenant)
