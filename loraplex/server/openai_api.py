"""The OpenAI-compatible data plane: /v1/completions, /v1/chat/completions, /v1/models,
/v1/models/{id}, plus /health and /metrics.

A request passes the door (`guard.py`: key, pending count, body size) before its body is read,
is parsed, validated and tokenized in the worker pool (`prepare.py`), and only then reaches the
engine thread, as token ids. `model` names the base model, an adapter, or `name@revision`; it is
resolved to one immutable revision when the engine admits the request. A path or URL is never
loaded from here.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapters.registry import RetiredAdapterError, UnknownAdapterError
from loraplex.adapters.tiers import AdapterTooLarge, ColdLoadLimited
from loraplex.server.admin_api import add_admin_routes
from loraplex.server.async_engine import AsyncEngine
from loraplex.server.auth import KeyTable, Principal
from loraplex.server.choices import ChoiceRun, collect, run_choices
from loraplex.server.control import ControlService
from loraplex.server.errors import load_failed
from loraplex.server.guard import Guard
from loraplex.server.limits import ServerLimits, TenantQuotas, too_many
from loraplex.server.metrics import ServerMetrics
from loraplex.server.openapi import describe_routes
from loraplex.server.prepare import PreparedRequest, RequestPreparer
from loraplex.server.protocol import APIError
from loraplex.server.render import Renderer
from loraplex.server.tenant_gate import TenantGate


def create_app(
    async_engine: AsyncEngine,
    served_model: str,
    metrics: ServerMetrics,
    keys: KeyTable | None = None,
    limits: ServerLimits | None = None,
    prepare_workers: int = 4,
    control: ControlService | None = None,
) -> FastAPI:
    """`keys`: None or empty, the data plane is open; `control`: the admin API and the tenants'
    quotas (None: neither, as for an app over an engine with no data directory)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="loraplex", docs_url=None, redoc_url=None)
    engine = async_engine.engine
    renderer = Renderer(engine.tokenizer, served_model)
    preparer = RequestPreparer(
        engine.tokenizer, served_model, engine.max_model_len, engine.model_config.vocab_size, limits
    )
    pool = ThreadPoolExecutor(max_workers=prepare_workers, thread_name_prefix="loraplex-prepare")
    app.state.prepare_pool = pool  # shut down with the server (serve.Server.close)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        metrics.refused.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        body = APIError(err.status_code, str(err.detail)).body()
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        # Query and path parameters (the admin API's offset, limit): a 400 naming the first, as
        # bodies get (there is no 422 on this server).
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        body = APIError(400, f"invalid request: {where}: {first.get('msg')}").body()
        return JSONResponse(body, status_code=400)

    async def prepared(request: Request, prepare: Callable[[bytes], PreparedRequest]) -> PreparedRequest:
        body = await request.body()
        return await asyncio.get_running_loop().run_in_executor(pool, prepare, body)

    @app.get("/health")
    async def health() -> JSONResponse:
        # Open to anyone (probes carry no key), so it says nothing but whether the engine runs.
        if not async_engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        # Per-adapter and per-tenant series name adapters and tenants: an admin key sees them all;
        # any other caller only the adapter names its tenant may use and its own tenant.
        principal: Principal = request.state.principal
        names = None
        if principal.role != "admin":
            names = await _on_engine(
                async_engine,
                lambda e: {r.ref.name for r in e.adapters.list() if r.usable_by(principal.tenant)},
            )
        text = metrics.render(names, principal.tenant)
        return Response(text, media_type="text/plain; version=0.0.4")

    def base_entry() -> dict[str, Any]:
        return {
            "id": served_model,
            "object": "model",
            "created": created,
            "owned_by": "loraplex",
            "parent": None,
            "root": served_model,
        }

    def adapter_entry(model_id: str, revision: str) -> dict[str, Any]:
        return {**base_entry(), "id": model_id, "parent": served_model, "revision": revision}

    gate = TenantGate(control.quotas_of if control is not None else lambda _tenant: TenantQuotas())

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        tenant = _tenant(request)
        latest, aliases = await _on_engine(
            async_engine, lambda e: (e.adapters.list_latest(tenant), e.adapters.aliases(tenant))
        )
        entries = [base_entry()] + [adapter_entry(r.ref.name, r.ref.revision) for r in latest]
        entries += [adapter_entry(alias, ref.revision) for alias, ref in aliases.items()]
        return JSONResponse({"object": "list", "data": entries})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        if model_id == served_model:
            return JSONResponse(base_entry())
        tenant = _tenant(request)
        try:
            entry = await _on_engine(async_engine, lambda e: e.adapters.resolve(model_id, tenant))
        except UnknownAdapterError as err:
            raise _not_found(model_id, err) from None
        return JSONResponse(adapter_entry(model_id, entry.ref.revision))

    async def generate(request: Request, prepare: Callable[[bytes], PreparedRequest]) -> Response:
        tenant = _tenant(request)
        leave = gate.enter(tenant)  # the tenant's concurrent-requests quota: 429 at its limit
        request.state.streaming = False
        try:
            return await _respond(async_engine, renderer, request, await prepared(request, prepare), leave)
        finally:
            if not request.state.streaming:
                leave()  # a stream leaves when its last chunk is sent (`_sse`)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, preparer.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, preparer.chat)

    if control is not None:
        add_admin_routes(app, control, limits.max_json_depth)
    describe_routes(app)
    app.add_middleware(
        Guard,
        keys=keys if keys is not None else KeyTable(),
        limits=limits,
        on_refused=lambda status: metrics.refused.labels(str(status)).inc(),
    )
    return app


def _tenant(request: Request) -> str:
    principal: Principal = request.state.principal  # the door put it there
    return principal.tenant


async def _on_engine(async_engine: AsyncEngine, fn: Callable[[Any], Any]) -> Any:
    return await asyncio.wrap_future(async_engine.call(fn))


def _not_found(model: str, err: Exception) -> APIError:
    code = "model_retired" if isinstance(err, RetiredAdapterError) else "model_not_found"
    return APIError(404, f"model {model!r} not found: {err}", param="model", code=code)


async def _respond(
    async_engine: AsyncEngine,
    renderer: Renderer,
    request: Request,
    prepared: PreparedRequest,
    leave: Callable[[], None],
) -> Response:
    request_id = ("chatcmpl-" if prepared.chat else "cmpl-") + uuid.uuid4().hex
    runs = prepared.runs
    try:
        streams = await run_choices(
            async_engine,
            request_id,
            runs,
            prepared.adapter,
            _tenant(request),
            prepared.cache_salt,
            prepared.priority,
            prepared.deadline_s,
        )
    except UnknownAdapterError as err:
        raise _not_found(prepared.model, err) from None
    except ValueError as err:
        raise APIError(400, str(err)) from None
    except ColdLoadLimited as err:  # the adapter's tenant is over its cold-load rate, and refuses
        raise too_many(str(err), max(1, math.ceil(err.retry_after_s))) from None
    except AdapterTooLarge as err:  # no retry can help: a 4xx, which clients do not retry
        raise APIError(400, str(err), code="adapter_exceeds_device_budget") from None
    if prepared.stream:
        chunks = renderer.stream(
            request_id, prepared.model, runs, streams, prepared.chat, prepared.include_usage
        )
        request.state.streaming = True
        body = _sse(chunks, async_engine, request_id, runs, leave)
        # A stream whose client left before its first chunk is never iterated, so its `finally`
        # never runs: the tenant's slot is also given back when the generator is collected.
        weakref.finalize(body, leave)
        return StreamingResponse(body, media_type="text/event-stream")
    finals = await collect(async_engine, request, request_id, runs, streams)
    if finals is None:
        return Response(status_code=499)  # client went away; its requests are aborted
    error = next((f.error for f in finals if f.error is not None), None)
    if error is not None:  # the engine ended a choice itself (its adapter could not be loaded)
        raise load_failed(error)
    return JSONResponse(renderer.full(request_id, prepared.model, runs, finals, prepared.chat))


async def _sse(
    chunks: AsyncIterator[dict[str, Any]],
    async_engine: AsyncEngine,
    request_id: str,
    runs: list[ChoiceRun],
    leave: Callable[[], None],
) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, allow_nan=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        leave()
        # Runs on normal completion too; aborting a finished request is a no-op.
        for run in runs:
            async_engine.abort(run.request_id(request_id))
