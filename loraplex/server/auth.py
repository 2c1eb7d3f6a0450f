"""Data-plane API keys. With none configured, any bearer token (or none) is accepted."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from loraplex.server.protocol import APIError


def api_key_checker(keys: frozenset[str]) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest keeps the comparison time independent of how much of a key matched
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip(), k) for k in keys):
            raise APIError(
                401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key"
            )

    return check
