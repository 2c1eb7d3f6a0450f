"""`loraplex serve`'s limit flags: one `--max-...` flag per ServerLimits field; a flag given wins
over the config file's `[limits]`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from loraplex.server.limits import ServerLimits


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One `--max-...` flag per ServerLimits field (default: the config file's or the built-in)."""
    group = parser.add_argument_group("request limits (each refusal is a 4xx naming the parameter)")
    defaults = ServerLimits()
    for f in fields(ServerLimits):
        default = getattr(defaults, f.name)
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=None,
            metavar="N",
            help=f"default: {'the context length' if default is None else default}",
        )


def limits_from_args(base: ServerLimits, args: argparse.Namespace) -> ServerLimits:
    return base.with_overrides(**{f.name: getattr(args, f.name, None) for f in fields(ServerLimits)})
