"""Which media a worker may fetch for a request: none from the network unless its operator said so.

`vllm serve` fetches the URL of every image, audio or video content part from any domain unless
`--allowed-media-domains` is given, which lets any client make the server fetch any address it
can reach (an internal service, a cloud metadata endpoint). A worker runs inside the fleet's
network, so it is closed by default: it passes `--allowed-media-domains` and
`--allowed-local-media-path` to vLLM, which enforces them, and with no domains allowed it
refuses a request naming an http(s) media URL before vLLM could fetch it. `data:` URLs and
inline audio are not fetched; `file:` URLs are vLLM's to refuse (it reads none without
`--allowed-local-media-path`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from shared.errors import InvalidRequest

# The keys of a content part that name a URL, or an object holding one under "url" (vLLM's parts
# and their shorthand forms: {"type": "image_url", "image_url": {"url": ...}}, {"image_url": "..."}).
_URL_KEYS = frozenset({"url", "image_url", "audio_url", "video_url", "file_url"})
_FETCHED_SCHEMES = frozenset({"http", "https"})


def check_media_urls(body: dict[str, Any], allowed_domains: list[str] | None) -> None:
    """Refuse a chat request that would make the worker fetch a media URL, unless domains are
    allowed (then vLLM checks each URL against them)."""
    if allowed_domains:
        return
    for url in _media_urls(body):
        if urlsplit(url.strip()).scheme.lower() in _FETCHED_SCHEMES:
            raise InvalidRequest("This worker fetches no media from URLs: its operator allowed no domains "
                                 "(worker option --allowed-media-domains). Send the media inline, as a data: URL.",
                                 param="messages")


def _media_urls(body: dict[str, Any]) -> Iterator[str]:
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                yield from _urls_in(part)


def _urls_in(value: Any) -> Iterator[str]:
    if not isinstance(value, dict):
        return
    for key, inner in value.items():
        if key in _URL_KEYS and isinstance(inner, str):
            yield inner
        elif isinstance(inner, dict):
            yield from _urls_in(inner)
