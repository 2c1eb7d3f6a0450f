"""What one client may ask of the data plane, and the status codes of each refusal.

Every limit is configuration (`[limits]` in the server's config file, or a `--max-...` flag of
`loraplex serve`). The refusals use one set of codes that the per-tenant quotas reuse:

    400 a malformed or invalid request        413 too large (body bytes, prompt tokens)
    401 no valid API key                      429 too many (pending requests), with Retry-After
    403 not allowed for this key              404 unknown model
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from loraplex.server.errors import APIError

MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 2 * MIB  # request body, Content-Length or chunked
    max_prompt_tokens: int | None = None  # per prompt; None: the context length
    max_sequences_per_request: int = 128  # prompts x n
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logprobs: int = 20  # logprobs / top_logprobs
    max_pending_requests: int = 1024  # HTTP generation requests admitted and not yet answered
    max_json_depth: int = 32  # nesting of the request body's JSON

    def __post_init__(self) -> None:
        _check_positive(self, "limit", optional={"max_prompt_tokens"})

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> ServerLimits:
        """From a config file's `[limits]` table; unknown keys are an error naming them."""
        return cls(**_known(cls, raw, "limits"))

    def with_overrides(self, **values: int | None) -> ServerLimits:
        """These limits with the given ones replaced (None leaves a limit as it is)."""
        kept = {f.name: getattr(self, f.name) for f in fields(self)}
        kept.update({k: v for k, v in values.items() if v is not None})
        return ServerLimits(**kept)


def too_large(message: str, param: str | None = None) -> APIError:
    return APIError(413, message, param=param, code="request_too_large")


def too_many(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(
        429,
        message,
        type_="rate_limit_error",
        code="too_many_requests",
        headers={"Retry-After": str(retry_after_s)},
    )


def check_count(value: int, limit: int, what: str, param: str) -> None:
    """A request-shaped count (stop strings, logprobs, sequences) over its limit is a 400 that names
    the parameter, as OpenAI answers an out-of-range parameter."""
    if value > limit:
        raise APIError(400, f"{what} is {value}; the server's limit is {limit}", param=param)


@dataclass(frozen=True)
class TenantQuotas:
    """What one tenant may hold and use (stored in the registry's tenants table; None: no quota),
    enforced by the control plane and the door. Its residency limits (device budget, guarantees,
    priority, cold-load rate) are a record of their own (`adapters/tenant_residency.py`)."""

    max_adapters: int | None = None  # registered revisions (not retired)
    max_rank: int | None = None
    max_adapter_bytes: int | None = None  # total bytes of the tenant's registered adapters
    max_concurrent_requests: int | None = None

    def __post_init__(self) -> None:
        _check_positive(self, "quota", optional={f.name for f in fields(self)})

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> TenantQuotas:
        return cls(**_known(cls, raw, "quotas"))

    def check_registration(self, tenant: str, adapters_after: int, rank: int, bytes_after: int) -> None:
        """Refuse a registration that would take `tenant` past a quota (403 not allowed, 413 size)."""
        if self.max_adapters is not None and adapters_after > self.max_adapters:
            raise forbidden(f"tenant {tenant!r} may register at most {self.max_adapters} adapters")
        if self.max_rank is not None and rank > self.max_rank:
            raise forbidden(
                f"tenant {tenant!r} may register ranks up to {self.max_rank}; this adapter has {rank}"
            )
        if self.max_adapter_bytes is not None and bytes_after > self.max_adapter_bytes:
            raise too_large(
                f"tenant {tenant!r} may hold {self.max_adapter_bytes} bytes of adapters; this one would "
                f"bring it to {bytes_after}"
            )

    def check_concurrency(self, tenant: str, running: int) -> None:
        """Refuse a request past the tenant's concurrent requests (429 with Retry-After)."""
        if self.max_concurrent_requests is not None and running >= self.max_concurrent_requests:
            raise too_many(f"tenant {tenant!r} has {running} requests running, its limit; retry")


def forbidden(message: str) -> APIError:
    return APIError(403, message, type_="permission_error", code="quota_exceeded")


def _check_positive(settings: Any, what: str, optional: set[str]) -> None:  # noqa: ANN401
    """Every field a positive integer; those named in `optional` may also be None."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if value is None and f.name in optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            absent = " or absent" if f.name in optional else ""
            raise ValueError(f"{what} {f.name} must be a positive integer{absent}, got {value!r}")


def _known(cls: Any, raw: dict[str, Any], what: str) -> dict[str, Any]:  # noqa: ANN401
    """`raw` if every key is a field of `cls`; else a ValueError naming the unknown ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return raw
