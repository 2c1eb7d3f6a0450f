"""The OpenAPI schema says what the server really does: the routes read their bodies themselves
(parsing and validation run in the worker pool, see `prepare.py`), so the request schemas come from
the protocol models here, and every route lists the error statuses it can answer with, each with
OpenAI's error body. There is no 422: validation errors are 400s."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from loraplex.server.admin_api import CreateKey, CreateTenant, RegisterAdapter, SetAlias
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

_REF = "#/components/schemas/{model}"

_ERRORS = {
    400: "Invalid request: malformed JSON, a wrong type, a non-finite number, a value out of range, "
    "a prompt that cannot fit the context, an unsupported parameter",
    401: "No valid API key (when keys are configured)",
    403: "Not allowed for this key: the admin API needs an admin key; a tenant's quota (rank, count)",
    404: "Unknown (or retired) model, adapter, revision, alias, tenant or key",
    409: "Conflicts with what exists: a name of another tenant's, an alias, a tenant, a retired revision",
    413: "Request body or prompt over the server's limit",
    429: "Too many pending requests; retry after the Retry-After header's seconds",
}

# path -> method -> (request model or None, error statuses)
_ROUTES: dict[str, dict[str, tuple[type[BaseModel] | None, tuple[int, ...]]]] = {
    "/v1/completions": {"post": (CompletionRequest, (400, 401, 404, 413, 429))},
    "/v1/chat/completions": {"post": (ChatCompletionRequest, (400, 401, 404, 413, 429))},
    "/v1/models": {"get": (None, (401,))},
    "/v1/models/{model_id}": {"get": (None, (401, 404))},
    "/metrics": {"get": (None, (401,))},
    "/health": {"get": (None, ())},
    "/admin/v1/adapters": {
        "post": (RegisterAdapter, (400, 401, 403, 404, 409, 413)),
        "get": (None, (401, 403)),
    },
    "/admin/v1/adapters/{name}": {"get": (None, (401, 403, 404))},
    "/admin/v1/adapters/{name}@{revision}": {"delete": (None, (401, 403, 404, 409))},
    "/admin/v1/aliases/{alias}": {"put": (SetAlias, (400, 401, 403, 404, 409))},
    "/admin/v1/tenants": {"post": (CreateTenant, (400, 401, 403, 409)), "get": (None, (401, 403))},
    "/admin/v1/keys": {"post": (CreateKey, (400, 401, 403, 404)), "get": (None, (401, 403))},
    "/admin/v1/keys/{key_id}": {"delete": (None, (401, 403, 404))},
    "/admin/v1/audit": {"get": (None, (400, 401, 403))},
    "/admin/v1/residency": {"get": (None, (401, 403))},
}


def describe_routes(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ErrorResponse,
        RegisterAdapter,
        SetAlias,
        CreateTenant,
        CreateKey,
    ):
        _add_schema(components, model)
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            request_model, errors = _ROUTES.get(path, {}).get(method, (None, ()))
            if request_model is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(model=request_model.__name__)}}
                    },
                }
            responses = {k: v for k, v in op.get("responses", {}).items() if k != "422"}
            for status in errors:
                responses[str(status)] = {
                    "description": _ERRORS[status],
                    "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
                }
            op["responses"] = responses
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


def _add_schema(components: dict[str, Any], model: type[BaseModel]) -> None:
    body = model.model_json_schema(ref_template=_REF)
    for name, sub in body.pop("$defs", {}).items():
        components[name] = sub
    components[model.__name__] = body
