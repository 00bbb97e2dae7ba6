"""Routes about the fleet itself: models served, cancels, health, readiness, metrics, version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from gateway import tenancy
from gateway.api.openai.protocol import CancelRequest
from gateway.fleet.registry import ModelView
from gateway.http.auth import current_key
from gateway.http.errors import error_body, json_response
from gateway.http.json_body import JSONRoute
from shared import keys
from shared.envelopes import KINDS
from shared.errors import ModelNotFound, NotFound

router = APIRouter(route_class=JSONRoute)


@router.post("/v1/cancel")
async def cancel(body: CancelRequest, request: Request) -> Response:
    """Cancel the caller's runs (another tenant's are never found: `cancelled: 0`, or a 404 for a
    session that is not the caller's)."""
    fleet = request.app.state.fleet
    tenant = tenancy.current().name
    if body.cancel_id is not None:
        count = await fleet.cancels.cancel_group(keys.cancel_group(tenant, cancel_id=body.cancel_id), early=True)
    elif body.session_id is not None:
        if await fleet.sessions.info(body.session_id) is None:
            raise NotFound(f"Session '{body.session_id}' not found.", param="session_id")
        count = await fleet.cancels.cancel_group(keys.cancel_group(tenant, session_id=body.session_id), early=False)
    else:
        count = await fleet.cancels.cancel_run(body.request_id, tenant)
    return json_response({"cancelled": count})


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    models = _visible_models(request)
    data = [_model_card(view) for view in sorted(models.values(), key=lambda v: v.name)]
    return json_response({"object": "list", "data": data})


@router.get("/v1/models/{model:path}")  # ids such as Qwen/Qwen3-0.6B hold a slash
async def retrieve_model(model: str, request: Request) -> Response:
    """One model as /v1/models lists it (the OpenAI SDK's `models.retrieve`); a model the caller's key
    may not use is a 404, as one that does not exist (the same words as a generation request's)."""
    view = _visible_models(request).get(model)
    if view is not None:
        return json_response(_model_card(view))
    use = current_key()
    if use is not None and use.key.models:
        raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it.", param="model",
                            code="model_not_found")
    raise ModelNotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _visible_models(request: Request) -> dict[str, ModelView]:
    """The models live workers serve now, those the caller's key may use alone."""
    models = request.app.state.fleet.registry.models
    use = current_key()
    if use is not None and use.key.models:
        models = {name: view for name, view in models.items() if name in use.key.models}
    return models


def _model_card(view: ModelView) -> dict:
    """vLLM's model card, and what the model's live workers serve (`kinds`: chat, completion,
    tokenize, detokenize for a generation model; embed, score, rerank, classify, pooling for an encoder)."""
    served = {kind for w in view.workers for kind in w.kinds}
    return {"id": view.name, "object": "model", "created": int(min(w.started for w in view.workers)),
            "owned_by": "llmfleet", "root": view.name, "parent": None, "max_model_len": view.max_model_len,
            "permission": [], "kinds": [kind for kind in KINDS if kind in served]}


@router.get("/fleet/load")
async def fleet_load(request: Request, model: str) -> Response:
    """A model's requests in the fleet, waiting and running, as of the last refresh (every 0.5 s): what
    KEDA's metrics-api trigger scales workers on. It counts what the model's request stream alone
    does not: requests sent to a worker's own stream for its cache (shared/affinity.py)."""
    registry = request.app.state.fleet.registry
    load = registry.load.get(model)
    if load is None:
        return json_response(error_body(f"The model `{model}` does not exist.", 404, param="model"), 404)
    view = registry.models.get(model)
    return json_response({"model": model, "requests": load.waiting + load.running, "waiting": load.waiting,
                          "running": load.running, "workers": len(view.workers) if view else 0,
                          "slots": view.capacity if view else 0})


@router.get("/load")
async def server_load(request: Request) -> Response:
    """`vllm serve`'s load figure, for routers that pick the least loaded replica: the requests this
    gateway follows now (the fleet's queue is `/fleet/load`)."""
    return json_response({"server_load": request.app.state.fleet.router.open_requests})


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/ready")
async def ready(request: Request) -> Response:
    if await request.app.state.fleet.ready():
        return json_response({"status": "ready"})
    return json_response(error_body("Not ready: Redis is unreachable or the gateway is draining", 503), 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> Response:
    try:
        return json_response({"version": package_version("llmfleet")})
    except PackageNotFoundError:
        return json_response({"version": "0.0.0+local"})
