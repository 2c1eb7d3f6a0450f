"""A tenant's residency limits as the registry stores them (a JSON object in the tenants table) and
as the engine enforces them (`eviction.TenantLimits`): parsing with errors that name the field,
merging a partial update, and the stored form. No torch and no database here.

Stored keys are `TenantLimits`' fields; an absent key is that field's default (no limit, priority
1). Only keys that differ from the default are stored, so a record stays readable by eye.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from loraplex.adapters.eviction import InvalidLimit, TenantLimits

_FIELDS = {f.name: f for f in fields(TenantLimits)}
_DEFAULTS = TenantLimits()
# Each field's JSON type: integers (bytes, counts), a number (priority) or a word.
_INTEGER = {
    "guaranteed_bytes",
    "guaranteed_adapters",
    "device_budget_bytes",
    "cold_load_bytes_per_minute",
    "cold_load_burst_bytes",
}


def limits_from_record(raw: Mapping[str, Any]) -> TenantLimits:
    """The limits a stored (or requested) record describes; InvalidLimit names the bad field."""
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise InvalidLimit(
            unknown[0], f"unknown residency limit {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})"
        )
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            continue  # absent: the default
        if name in _INTEGER:
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidLimit(
                    name, f"{name} must be an integer number of bytes or adapters, got {value!r}"
                )
        elif name == "priority":
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidLimit(name, f"priority must be a number, got {value!r}")
            value = float(value)
        elif not isinstance(value, str):
            raise InvalidLimit(name, f"{name} must be a string, got {value!r}")
        values[name] = value
    return TenantLimits(**values)


def merged(current: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`current` with `update` applied: a given value replaces, a null resets the field to its
    default. Validated as a whole (a guarantee over a budget is caught either way round)."""
    out = {**current, **update}
    return record_of(limits_from_record(out))


def record_of(limits: TenantLimits) -> dict[str, Any]:
    """The stored form: the fields that differ from the defaults."""
    return {
        name: getattr(limits, name) for name in _FIELDS if getattr(limits, name) != getattr(_DEFAULTS, name)
    }


def effective(limits: TenantLimits) -> dict[str, Any]:
    """Every field, defaults included (for reports)."""
    return {name: getattr(limits, name) for name in _FIELDS}


def guarantee_overcommit(limits: Mapping[str, TenantLimits], budget_bytes: int) -> str | None:
    """Why the tenants' guaranteed device bytes together cannot all hold in a device pool of
    `budget_bytes` (naming each guaranteeing tenant, the sum and the budget); None when they fit.
    Each guarantee is checked against the budget alone elsewhere; only their sum can promise the
    same bytes twice. (Guaranteed adapter counts are not summed: an adapter's size is not known
    until it is loaded.)"""
    guaranteed = {name: lim.guaranteed_bytes for name, lim in sorted(limits.items()) if lim.guaranteed_bytes}
    total = sum(guaranteed.values())
    if total <= budget_bytes:
        return None
    each = ", ".join(f"{name} {value}" for name, value in guaranteed.items())
    return (
        f"the tenants' guaranteed device bytes sum to {total} ({each}), over the adapter "
        f"device budget of {budget_bytes} bytes"
    )
