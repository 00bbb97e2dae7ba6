"""What a 404 for a path no route has says: what the client most likely meant, and what to do.

"Not Found" alone leaves a newcomer guessing whether the server, the path or the client is wrong.
The usual causes each get their own answer:

- a path `vllm serve` has and llmfleet does not (audio, scale-out ...): say so, and
  name what it serves;
- /v1 twice (`/v1/v1/chat/completions`): the client's base_url already ends in /v1;
- /v1 missing (`/chat/completions` where `/v1/chat/completions` exists): the base_url lacks it.

The error's shape is the family's of the path the client meant (`meant_path`): a doubled /v1 in
front of /v1/messages is an Anthropic client's mistake, answered in Anthropic's shape.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Match

SERVED = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/messages (Anthropic), "
          "POST /v1/embeddings, /v2/embed, /score, /rerank, /classify and /pooling (of pooling models) and GET /v1/models")
WHERE_LISTED = "README's Endpoints section lists them all, as does GET /openapi.json"

_SPEECH = " (yet): its workers serve text generation, not speech models"
_SCALE_OUT = " (yet): it is one of vllm serve's scale-out endpoints (--enable-scale-out)"
_ENGINE_CONTROL = " (yet): engine control is the workers' business, not the gateway's"

# Paths `vllm serve` 0.32 has, by default or when enabled, that llmfleet does not serve, and why
# (or what to use instead), as vllm serve 0.32 lists its routes at start-up and in its /openapi.json.
NOT_SERVED: dict[str, str] = {
    **dict.fromkeys(("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/realtime"), _SPEECH),
    **dict.fromkeys(("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                     "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                     "/inference/v1/generate", "/inference/v1/abort_requests", "/scale_elastic_ep",
                     "/is_scaling_elastic_ep"), _SCALE_OUT),
    **dict.fromkeys(("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/stop_profile",
                     "/server_info", "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/sleep",
                     "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused", "/collective_rpc"),
                    _ENGINE_CONTROL),
    **dict.fromkeys(("/v1/systemone", "/generative_scoring", "/kv_event_sources", "/tokenizer_info"), " (yet)"),
    "/ping": "; for health checks use GET /health (the process is alive) or GET /ready (it can take requests)",
    "/v1/chat/completions/batch": " (yet); send one POST /v1/chat/completions per conversation",
}

_DOUBLED = "/v1/v1"


def meant_path(path: str) -> str:
    """The path without a doubled /v1: the one whose family shapes the error."""
    if path == _DOUBLED or path.startswith(_DOUBLED + "/"):
        return path[len("/v1"):]
    return path


def explain(request: Request) -> str:
    """The message of the 404 for a request whose path no route has."""
    method, path = request.method, request.url.path
    origin = str(request.base_url).rstrip("/")
    meant = meant_path(path)
    if meant != path:
        return _doubled_prefix(method, path, meant, origin)
    if path in NOT_SERVED:
        return f"llmfleet does not serve {method} {path}{NOT_SERVED[path]}. It serves {SERVED}; {WHERE_LISTED}."
    if not path.startswith("/v1/") and _has_route(request, "/v1" + path):
        sdk = ('the Anthropic SDK adds /v1 itself: base_url="{origin}"' if path.startswith("/messages")
               else 'with the OpenAI SDK, base_url="{origin}/v1"').format(origin=origin)
        return f"There is no {method} {path}: the API's paths start with /v1 ({method} /v1{path}); {sdk}."
    return f"There is no {method} {path} on llmfleet. It serves {SERVED}; {WHERE_LISTED}."


def _doubled_prefix(method: str, path: str, meant: str, origin: str) -> str:
    said = f"{method} {path} has /v1 twice"
    if meant.startswith("/v1/messages"):
        return (f"{said}: the Anthropic SDK adds /v1/messages itself, so its base_url is the server's address "
                f'without /v1 (base_url="{origin}"). The full path is {method} {meant}.')
    return (f"{said}: the client's base_url already ends in /v1, and the path adds it again. With "
            f'base_url="{origin}/v1", request paths go without /v1 (/chat/completions, /models: the OpenAI SDK\'s '
            f"way). The full path is {method} {meant}.")


def _has_route(request: Request, path: str) -> bool:
    scope = {**request.scope, "path": path}
    return any(route.matches(scope)[0] != Match.NONE for route in request.app.routes)
