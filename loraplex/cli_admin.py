"""`loraplex adapters|tenants|keys ...`: the control plane from the command line.

With `--url` a command talks to that server's admin API (an admin key from `--key` or
LORAPLEX_ADMIN_KEY); without it, it works on the registry in `--data-dir` (default: the per-user
data directory), which it may only change while no server holds that directory. Answers are the
admin API's JSON. `adapters list --url` without an admin key lists what the server's data plane
serves (`/v1/models`, with `--api-key`), as it always has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from loraplex.admin_client import AdminError, HttpAdmin, OfflineAdmin


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server (default: work offline on --data-dir)")
    parser.add_argument("--key", default=None, help="admin key for --url (default: LORAPLEX_ADMIN_KEY)")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="offline: the data directory (default: the per-user one)"
    )


def _quota(value: str) -> tuple[str, int]:
    key, sep, number = value.partition("=")
    if not sep or not number.isdigit():
        raise argparse.ArgumentTypeError(f"--quota takes NAME=INTEGER, got {value!r}")
    return key, int(number)


def register(sub: Any) -> None:  # noqa: ANN401  (argparse's private subparsers type)
    adapters = sub.add_parser("adapters", help="register, list, show, alias and retire adapters")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)
    reg = asub.add_parser("register", help="fetch, verify and register an adapter revision")
    reg.add_argument("name")
    reg.add_argument("source", help="a directory (under the server's allowed roots), http(s) or s3 URL")
    reg.add_argument("--sha256", default=None, help="expected sha256 of adapter_model.safetensors")
    reg.add_argument("--tenant", default=None)
    reg.add_argument("--visibility", choices=("private", "shared"), default=None)
    reg.add_argument("--model", default=None, help="offline: the base model directory (default: the demo's)")
    listing = asub.add_parser(
        "list", help="list registered adapters (or, --url without a key, served models)"
    )
    listing.add_argument("--all", action="store_true", help="include retired revisions")
    listing.add_argument("--api-key", default=None, help="data-plane key for the /v1/models listing")
    show = asub.add_parser("show", help="one adapter: every revision, manifest, provenance, aliases")
    show.add_argument("name")
    alias = asub.add_parser("alias", help="point an alias at name@revision")
    alias.add_argument("alias")
    alias.add_argument("target", help="name@revision")
    retire = asub.add_parser("retire", help="retire name@revision (in-flight requests finish first)")
    retire.add_argument("spec", metavar="NAME@REVISION")

    tenants = sub.add_parser("tenants", help="create and list tenants")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True)
    create = tsub.add_parser("create", help="a new tenant with its quotas")
    create.add_argument("name")
    create.add_argument("--quota", action="append", type=_quota, default=[], metavar="NAME=N")
    tlist = tsub.add_parser("list", help="tenants, their quotas and residency limits")
    tres = tsub.add_parser(
        "residency",
        help="change a tenant's residency limits (the others stay; a running server applies them at once)",
    )
    tres.add_argument("name")
    tres.add_argument("--priority", type=float, help="weighs its adapters' keep value (default 1)")
    tres.add_argument("--guaranteed-bytes", type=int, help="device bytes other tenants cannot evict")
    tres.add_argument("--guaranteed-adapters", type=int, help="resident adapters other tenants cannot evict")
    tres.add_argument("--device-budget-bytes", type=int, help="most device bytes its adapters may hold")
    tres.add_argument(
        "--cold-load-bytes-per-minute", type=int, help="bytes loaded onto the device per minute"
    )
    tres.add_argument(
        "--cold-load-burst-bytes", type=int, help="the rate's bucket (default: a minute's worth)"
    )
    tres.add_argument(
        "--cold-load-over-rate",
        choices=("wait", "refuse"),
        help="a request over the rate waits or gets a 429",
    )
    tres.add_argument(
        "--reset", action="append", default=[], metavar="FIELD", help="return a limit to its default"
    )

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    kcreate = ksub.add_parser("create", help="a new key; its token is printed once")
    kcreate.add_argument("--admin", action="store_true", help="an admin key (default: a data-plane key)")
    kcreate.add_argument("--tenant", default=None)
    kcreate.add_argument("--label", default="")
    klist = ksub.add_parser("list", help="live keys (by key id; tokens are never stored)")
    revoke = ksub.add_parser("revoke", help="revoke a key by its key id")
    revoke.add_argument("key_id")

    for parser in (reg, listing, show, alias, retire, create, tlist, tres, kcreate, klist, revoke):
        _common(parser)
        parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("LORAPLEX_ADMIN_KEY")
    if args.command == "adapters" and args.adapters_command == "list" and args.url and not key:
        return _list_served(args.url, args.api_key)
    try:
        if args.url:
            admin: HttpAdmin | OfflineAdmin = HttpAdmin(args.url, key)
        else:
            from loraplex.adapters.data_dir import default_data_dir

            admin = OfflineAdmin(args.data_dir or default_data_dir(), getattr(args, "model", None))
        out = _dispatch(admin, args)
    except AdminError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2, default=str))
    for warning in out.get("warnings", []) if isinstance(out, dict) else []:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _dispatch(admin: HttpAdmin | OfflineAdmin, args: argparse.Namespace) -> Any:  # noqa: ANN401
    if args.command == "adapters":
        cmd = args.adapters_command
        if cmd == "register":
            fields = {"sha256": args.sha256, "tenant": args.tenant, "visibility": args.visibility}
            return admin.register(args.name, args.source, **fields)
        if cmd == "list":
            return admin.adapters(args.all)
        if cmd == "show":
            return admin.adapter(args.name)
        if cmd == "alias":
            return admin.alias(args.alias, args.target)
        return admin.retire(args.spec)
    if args.command == "tenants":
        if args.tenants_command == "create":
            return admin.create_tenant(args.name, dict(args.quota))
        if args.tenants_command == "residency":
            return admin.set_residency(args.name, _residency_update(args))
        return admin.tenants()
    if args.keys_command == "create":
        return admin.create_key("admin" if args.admin else "data", args.tenant, args.label)
    if args.keys_command == "list":
        return admin.keys()
    return admin.revoke_key(args.key_id)


_RESIDENCY_FLAGS = (
    "priority",
    "guaranteed_bytes",
    "guaranteed_adapters",
    "device_budget_bytes",
    "cold_load_bytes_per_minute",
    "cold_load_burst_bytes",
    "cold_load_over_rate",
)


def _residency_update(args: argparse.Namespace) -> dict[str, Any]:
    """The limits named on the command line; `--reset FIELD` sends null (the default)."""
    update: dict[str, Any] = {f: None for f in args.reset}
    update.update({f: getattr(args, f) for f in _RESIDENCY_FLAGS if getattr(args, f) is not None})
    return update


def _list_served(url: str, api_key: str | None) -> int:
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            models = json.load(resp)["data"]
    except OSError as err:
        print(f"error: cannot reach a loraplex server at {url}: {err}", file=sys.stderr)
        return 1
    for m in models:
        kind = "base" if m.get("parent") is None else f"adapter of {m['parent']}, revision {m['revision']}"
        print(f"{m['id']}\t{kind}")
    return 0
