"""The OpenAI-compatible data plane: /v1/completions, /v1/chat/completions, /v1/models, plus
/health and /metrics.

`model` names the base model, an adapter, or `name@revision`; it is resolved to one immutable
revision when the engine admits the request. A path or URL is never loaded from here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapters.registry import UnknownAdapterError
from loraplex.server.async_engine import AsyncEngine
from loraplex.server.auth import api_key_checker
from loraplex.server.choices import ChoiceRun, collect, run_choices
from loraplex.server.metrics import ServerMetrics
from loraplex.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from loraplex.server.render import Renderer


def create_app(
    async_engine: AsyncEngine,
    served_model: str,
    metrics: ServerMetrics,
    api_keys: frozenset[str] = frozenset(),
) -> FastAPI:
    app = FastAPI(title="loraplex", docs_url=None, redoc_url=None)
    engine = async_engine.engine
    auth = Depends(api_key_checker(api_keys))
    renderer = Renderer(engine.tokenizer, served_model)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(APIError(400, "malformed JSON body").body(), status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}"
        return JSONResponse(APIError(400, message, param=where or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.alive:
            return JSONResponse({"status": "error", "detail": repr(async_engine.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> JSONResponse:
        entries = [
            {
                "id": served_model,
                "object": "model",
                "created": created,
                "owned_by": "loraplex",
                "parent": None,
                "root": served_model,
            }
        ]
        for rev in await _on_engine(async_engine, lambda e: e.adapters.list_latest()):
            entries.append(
                {
                    "id": rev.ref.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "loraplex",
                    "parent": served_model,
                    "root": served_model,
                    "revision": rev.ref.revision,
                }
            )
        return JSONResponse({"object": "list", "data": entries})

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = body.prompts()
        logprobs = body.logprobs
        runs = [
            ChoiceRun(
                index=p_i * body.n + j,
                prompt=prompt,
                params=body.sampling_params(16, logprobs, choice=p_i * body.n + j),
            )
            for p_i, prompt in enumerate(prompts)
            for j in range(body.n)
        ]
        return await _respond(async_engine, renderer, request, body, runs, chat=False)

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        logprobs = body.chat_logprobs()
        prompt = renderer.chat_prompt(body.messages)
        runs = [
            ChoiceRun(
                index=j, prompt=prompt, params=body.sampling_params(engine.max_model_len, logprobs, choice=j)
            )
            for j in range(body.n)
        ]
        return await _respond(async_engine, renderer, request, body, runs, chat=True)

    return app


async def _on_engine(async_engine: AsyncEngine, fn):  # noqa: ANN001, ANN202
    import asyncio

    return await asyncio.wrap_future(async_engine.call(fn))


def _adapter_spec(model: str, served_model: str) -> str | None:
    return None if model == served_model else model


async def _respond(
    async_engine: AsyncEngine,
    renderer: Renderer,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    runs: list[ChoiceRun],
    chat: bool,
) -> Response:
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    adapter = _adapter_spec(body.model, renderer.served_model)
    try:
        streams = await run_choices(async_engine, request_id, runs, adapter)
    except UnknownAdapterError as err:
        raise APIError(
            404, f"model {body.model!r} not found: {err}", param="model", code="model_not_found"
        ) from None
    except ValueError as err:
        raise APIError(400, str(err)) from None
    if body.stream:
        include_usage = body.stream_options.include_usage if body.stream_options else True
        chunks = renderer.stream(request_id, body.model, runs, streams, chat, include_usage)
        return StreamingResponse(_sse(chunks, async_engine, request_id, runs), media_type="text/event-stream")
    finals = await collect(async_engine, request, request_id, runs, streams)
    if finals is None:
        return Response(status_code=499)  # client went away; its requests are aborted
    return JSONResponse(renderer.full(request_id, body.model, runs, finals, chat))


async def _sse(
    chunks: AsyncIterator[dict], async_engine: AsyncEngine, request_id: str, runs: list[ChoiceRun]
) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        # Runs on normal completion too; aborting a finished request is a no-op.
        for run in runs:
            async_engine.abort(run.request_id(request_id))
