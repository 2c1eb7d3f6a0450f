"""The server's door, in front of every route (a plain ASGI middleware, so it runs before any
body is read or parsed):

1. API keys: with keys configured, every route but `/health` needs one, and a request without a
   valid key gets its 401 before a byte of its body is read. The admin API (`/admin/`) needs an
   admin key: any other caller (a data key, or anyone when no keys are configured) gets a 403,
   again before its body is read.
2. Pending requests: generation requests between their head and their answer's end are bounded;
   one more is a 429 with Retry-After, again before its body is read.
3. Body size: a declared Content-Length over the limit is a 413 at once; a chunked body is
   counted as it arrives and refused the moment it passes the limit.

The body is then handed to the route whole; later `receive` calls (disconnect polling) go to the
client's connection as usual.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from loraplex.server.auth import ANONYMOUS, KeyTable
from loraplex.server.limits import ServerLimits, too_large, too_many
from loraplex.server.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # load balancers' probes carry no key
ADMIN_PREFIX = "/admin/"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        keys: KeyTable,
        limits: ServerLimits,
        on_refused: Callable[[int], None] = lambda status: None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.limits = limits
        self.on_refused = on_refused
        self.pending = 0  # generation requests inside the app (one event loop: no lock needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        principal = (
            ANONYMOUS if path in OPEN_PATHS else self.keys.authenticate(_header(scope, b"authorization"))
        )
        if principal is None:
            await self._refuse(
                scope,
                receive,
                send,
                APIError(
                    401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key"
                ),
            )
            return
        if path.startswith(ADMIN_PREFIX) and principal.role != "admin":
            await self._refuse(
                scope,
                receive,
                send,
                APIError(
                    403,
                    "the admin API needs an admin key; this key is a data-plane key"
                    if self.keys
                    else "the admin API needs an admin key, and this server has none configured",
                    type_="permission_error",
                    code="admin_key_required",
                ),
            )
            return
        scope.setdefault("state", {})["principal"] = principal  # for the routes (tenants, roles)
        generation = path in GENERATION_PATHS and scope["method"] == "POST"
        if generation and self.pending >= self.limits.max_pending_requests:
            limit = self.limits.max_pending_requests
            await self._refuse(
                scope, receive, send, too_many(f"the server has {limit} requests pending; retry")
            )
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # A generation request counts as pending from its head on: a client trickling its body
        # in holds a connection as surely as one waiting for tokens.
        if generation:
            self.pending += 1
        try:
            try:
                body = await self._read_body(scope, receive)
            except APIError as err:
                await self._refuse(scope, receive, send, err)
                return
            if body is None:
                return  # the client went away while sending
            await self.app(scope, _replay(body, receive), send)
        finally:
            if generation:
                self.pending -= 1

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.limits.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise APIError(400, "the Content-Length header is not a number") from None
                if declared > limit:
                    raise too_large(f"the request body has {declared} bytes; the limit is {limit}")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(f"the request body is over the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
        self.on_refused(err.status)
        response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
