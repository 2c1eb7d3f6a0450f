"""The error every refusal raises, rendered as OpenAI's error JSON (no server dependencies, so the
CLI can import the limits without FastAPI or pydantic)."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def load_failed(why: str) -> APIError:
    """A request the engine ended itself because its adapter could not be loaded (the store lost
    the revision, or the load raised): a server-side failure, which a retry may get past."""
    return APIError(503, why, type_="server_error", code="adapter_load_failed")
