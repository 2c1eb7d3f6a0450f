"""The admin API under /admin/v1: register, list, show, alias and retire adapters; tenants; keys;
the audit log. The door (`guard.py`) lets only admin keys in (401 without a valid key, 403 with a
data key). Bodies are read and validated as on the data plane (400 naming the field, never 422).

Writes run on the control service's one writer thread and reads on worker threads, never on the
event loop or the engine's step thread: a registration fetches, hashes and converts an adapter for
as long as that takes while generation goes on; only the finished, verified weights reach the
engine thread, as one command.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from loraplex.engine.engine import Engine
from loraplex.server.admin_ops import AdminOps
from loraplex.server.auth import Principal
from loraplex.server.body_json import parse_json_body
from loraplex.server.control import ControlService
from loraplex.server.errors import APIError
from loraplex.server.prepare import parse_model

PREFIX = "/admin/v1"
_STRICT = ConfigDict(extra="forbid", strict=True)
_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")


class RegisterAdapter(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=128)
    source: str = Field(max_length=4096, description="a local path under an allowed root, http(s) or s3 URL")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    tenant: str | None = Field(default=None, description="default: the caller's tenant")
    visibility: Literal["private", "shared"] = "private"


class SetAlias(BaseModel):
    model_config = _STRICT
    target: str = Field(max_length=256, description="name@revision (a unique revision prefix)")


class CreateTenant(BaseModel):
    model_config = _STRICT
    name: str = Field(max_length=128)
    quotas: dict[str, int | None] = Field(default_factory=dict)
    # residency limits (`adapters/tenant_residency.py` checks them and names a bad field)
    residency: dict[str, Any] = Field(default_factory=dict)


class CreateKey(BaseModel):
    model_config = _STRICT
    role: Literal["data", "admin"] = "data"
    tenant: str | None = Field(default=None, description="default: the caller's tenant")
    label: str = Field(default="", max_length=256)


def residency_report(engine: Engine) -> dict[str, Any]:
    """Each tier's numbers and which adapter revisions are where (by name@revision)."""
    names: dict[str, list[str]] = {}
    for entry in engine.adapters.list():
        names.setdefault(entry.ref.revision, []).append(entry.ref.name)
    where = {
        tier: [{"revision": r, "names": sorted(names.get(r, []))} for r in revisions]
        for tier, revisions in engine.tiers.where().items()
    }
    return {"tiers": engine.tiers.stats(), "adapters": where, "tenants": engine.tiers.tenants()}


def add_admin_routes(app: FastAPI, control: ControlService, max_json_depth: int) -> None:
    ops = AdminOps(control)

    async def body(request: Request, model: type[_M]) -> _M:
        return parse_model(await request.body(), model, max_json_depth)

    async def write(fn: Callable[[], _T]) -> _T:
        return await asyncio.wrap_future(control.writer.submit(fn))

    async def read(fn: Callable[[], _T]) -> _T:
        return await asyncio.to_thread(fn)

    def who(request: Request) -> Principal:
        principal: Principal = request.state.principal  # set by the door, which checked the role
        return principal

    @app.post(f"{PREFIX}/adapters")
    async def register_adapter(request: Request) -> JSONResponse:
        req = await body(request, RegisterAdapter)
        p = who(request)
        out = await write(
            lambda: ops.register(p, req.name, req.source, req.sha256, req.tenant, req.visibility)
        )
        return JSONResponse(out, status_code=201 if out["created"] else 200)

    @app.get(f"{PREFIX}/adapters")
    async def list_adapters(include_retired: bool = False) -> JSONResponse:
        return JSONResponse({"data": await read(lambda: ops.adapters(include_retired))})

    @app.get(f"{PREFIX}/residency")
    async def residency() -> JSONResponse:
        # The tiers change on the engine thread: read them there, between steps.
        return JSONResponse(await read(lambda: control.on_engine(residency_report)))

    @app.get(f"{PREFIX}/adapters/{{name}}")
    async def show_adapter(name: str) -> JSONResponse:
        return JSONResponse(await read(lambda: ops.adapter(name)))

    @app.delete(f"{PREFIX}/adapters/{{name}}@{{revision}}")
    async def retire_adapter(request: Request, name: str, revision: str) -> JSONResponse:
        p = who(request)
        return JSONResponse(await write(lambda: ops.retire(p, name, revision)))

    @app.put(f"{PREFIX}/aliases/{{alias:path}}")
    async def set_alias(request: Request, alias: str) -> JSONResponse:
        req = await body(request, SetAlias)
        p = who(request)
        return JSONResponse(await write(lambda: ops.alias(p, alias, req.target)))

    @app.post(f"{PREFIX}/tenants")
    async def create_tenant(request: Request) -> JSONResponse:
        req = await body(request, CreateTenant)
        p = who(request)
        out = await write(lambda: ops.create_tenant(p, req.name, req.quotas, req.residency))
        return JSONResponse(out, status_code=201)

    @app.patch(f"{PREFIX}/tenants/{{name}}/residency")
    async def set_residency(request: Request, name: str) -> JSONResponse:
        update = parse_json_body(await request.body(), max_json_depth)
        if not isinstance(update, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(update).__name__}")
        p = who(request)
        return JSONResponse(await write(lambda: ops.set_residency(p, name, update)))

    @app.get(f"{PREFIX}/tenants")
    async def list_tenants() -> JSONResponse:
        return JSONResponse({"data": await read(ops.tenants)})

    @app.post(f"{PREFIX}/keys")
    async def create_key(request: Request) -> JSONResponse:
        req = await body(request, CreateKey)
        p = who(request)
        out: dict[str, Any] = await write(lambda: ops.create_key(p, req.role, req.tenant, req.label))
        return JSONResponse(out, status_code=201)

    @app.get(f"{PREFIX}/keys")
    async def list_keys() -> JSONResponse:
        return JSONResponse({"data": await read(ops.keys)})

    @app.delete(f"{PREFIX}/keys/{{key_id}}")
    async def revoke_key(request: Request, key_id: str) -> JSONResponse:
        p = who(request)
        return JSONResponse(await write(lambda: ops.revoke_key(p, key_id)))

    @app.get(f"{PREFIX}/audit")
    async def audit(offset: int = 0, limit: int = 100) -> JSONResponse:
        return JSONResponse(await read(lambda: ops.audit(offset, limit)))
