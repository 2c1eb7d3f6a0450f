"""`loraplex` command line: generate from the terminal, build the tiny smoke-test model, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraplex.cli_admin import register as register_admin
from loraplex.config_cli import add_engine_args, engine_config_from_args, engine_defaults_from_mapping
from loraplex.server.limits_cli import add_limit_args, limits_from_args

DEFAULT_TINY_DIR = Path.home() / ".cache" / "loraplex" / "tiny-llama"


def _parse_adapter(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--adapter takes NAME=DIR, got {value!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplex", description="Serve many LoRA adapters on one base model."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a prompt (or a file of prompts) in the terminal")
    gen.add_argument(
        "--model", help=f"Hugging Face model directory (default: the tiny model in {DEFAULT_TINY_DIR})"
    )
    gen.add_argument(
        "--adapter",
        action="append",
        type=_parse_adapter,
        default=[],
        metavar="NAME=DIR",
        help="register a PEFT adapter directory under NAME (repeatable)",
    )
    gen.add_argument(
        "--use",
        metavar="ADAPTER",
        help="adapter for the prompts: NAME or NAME@REVISION (default: "
        "the one --adapter if exactly one is given, else the base model)",
    )
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", type=Path, help="a file with one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    add_engine_args(gen)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible server (default: the demo model and its adapters)"
    )
    serve.add_argument("--config", type=Path, help="TOML or JSON file with server and engine settings")
    serve.add_argument("--model", help="Hugging Face model directory (default: the bundled demo model)")
    serve.add_argument(
        "--adapter",
        action="append",
        type=_parse_adapter,
        default=[],
        metavar="NAME=DIR",
        help="serve a PEFT adapter directory as model NAME (repeatable)",
    )
    serve.add_argument("--host", default=None, help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default: 8000)")
    serve.add_argument("--served-model-name", default=None, help="the base model's name in the API")
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted bearer token (repeatable; "
        "also LORAPLEX_API_KEYS=a,b); none configured: any token is accepted",
    )
    serve.add_argument(
        "--prepare-workers",
        type=int,
        default=None,
        metavar="N",
        help="threads that parse, validate and tokenize requests (default: 4)",
    )
    for flag, what in (("adapters", "adapter names"), ("tenants", "tenants")):
        serve.add_argument(
            f"--metrics-max-{flag}",
            type=int,
            default=None,
            metavar="N",
            help=f"at most N {what} get per-request metric series of their own; the rest are "
            "counted under _other (default: 64)",
        )
    serve.add_argument(
        "--metrics-min-requests",
        type=int,
        default=None,
        metavar="N",
        help="an adapter or tenant takes one of those series slots once it has sent N requests (default: 1)",
    )
    serve.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="registry, adapter store and writer lock (default: LORAPLEX_DATA_DIR, else "
        "~/.local/share/loraplex)",
    )
    serve.add_argument(
        "--allow-source-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a local directory the admin API may register adapters from (repeatable)",
    )
    serve.add_argument(
        "--allow-source-host",
        action="append",
        default=[],
        metavar="HOST",
        help="an http(s) host (host:port off 80/443) the admin API may fetch adapters from (repeatable)",
    )
    add_limit_args(serve)
    add_engine_args(serve)
    serve.set_defaults(subparser=serve)  # a config file's engine settings become this parser's defaults

    register_admin(sub)  # adapters, tenants, keys

    tiny = sub.add_parser("build-tiny-model", help="write a tiny random Llama + character tokenizer")
    tiny.add_argument("path", type=Path, nargs="?", default=DEFAULT_TINY_DIR)

    try:
        from loraplex.bench.cli import register as register_bench
    except ImportError:  # benchmarks are optional parts of the tree
        pass
    else:
        register_bench(sub)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from loraplex.llm import LLM
    from loraplex.types import SamplingParams

    model_dir = args.model
    if model_dir is None:
        model_dir = str(_ensure_tiny_model())
    if args.prompts_file is not None:
        prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    else:
        prompts = [args.prompt if args.prompt is not None else "Hello, world"]
    print(f"loading {model_dir} ...", file=sys.stderr)
    llm = LLM.from_config(engine_config_from_args(model_dir, args), progress=True)
    for name, path in args.adapter:
        ref = llm.register_adapter(name, path)
        print(f"registered adapter {ref}", file=sys.stderr)
    use = args.use or (args.adapter[0][0] if len(args.adapter) == 1 else None)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    for prompt, out in zip(prompts, llm.generate(prompts, params, adapters=use), strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "adapter": str(out.adapter) if out.adapter else None,
                        "finish_reason": out.finish_reason,
                    }
                )
            )
        else:
            print(f"[{out.adapter or 'base'}] {prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0


def _ensure_tiny_model() -> Path:
    from loraplex.demo.tiny_model import build_tiny_model

    if not (DEFAULT_TINY_DIR / "config.json").is_file():
        print(f"building the tiny model in {DEFAULT_TINY_DIR} ...", file=sys.stderr)
        build_tiny_model(DEFAULT_TINY_DIR)
    return DEFAULT_TINY_DIR


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from loraplex.adapters.data_dir import default_data_dir
    from loraplex.server.serve import ServerSettings, build_server, load_settings_file, run_server

    settings = load_settings_file(args.config) if args.config else ServerSettings()
    if settings.engine:
        engine_defaults_from_mapping(args.subparser, settings.engine)
        args = parser.parse_args(args.argv)
    if args.model:
        settings.model, settings.adapters = args.model, {}
    demo = None
    if settings.model is None:
        from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

        settings.model = str(DEMO_MODEL_DIR)
        demo = {k: str(v) for k, v in DEMO_ADAPTERS.items()}
    # Before anything loads: a name collision is a usage error, not a minute of loading and then one.
    settings.adapters = merge_serve_adapters(demo, settings.adapters, args.adapter)
    settings.host = args.host or settings.host
    settings.port = args.port or settings.port
    settings.served_model_name = args.served_model_name or settings.served_model_name
    settings.api_keys = [*settings.api_keys, *args.api_key]
    settings.limits = limits_from_args(settings.limits, args)
    settings.prepare_workers = args.prepare_workers or settings.prepare_workers
    for name in ("metrics_max_adapters", "metrics_max_tenants", "metrics_min_requests"):
        if getattr(args, name) is not None:  # 0 is a cap too (everything under _other)
            setattr(settings, name, getattr(args, name))
    settings.data_dir = args.data_dir or settings.data_dir or str(default_data_dir())
    settings.source_roots = [*settings.source_roots, *args.allow_source_root]
    settings.source_hosts = [*settings.source_hosts, *args.allow_source_host]
    print(f"loading {settings.model} ...", file=sys.stderr)
    server = build_server(settings, engine_config_from_args(settings.model, args))
    run_server(server, settings.host, settings.port)
    return 0


def merge_serve_adapters(
    demo: Mapping[str, str] | None, config: Mapping[str, str], flags: Sequence[tuple[str, str]]
) -> dict[str, str]:
    """The adapters `serve` registers, name -> directory: the demo model's (when it is served), the
    config file's `[adapters]`, then each `--adapter NAME=DIR`. A name given twice raises ValueError
    naming both sources: one silently replacing the other would serve weights nobody asked for
    under a name clients already use."""
    merged: dict[str, str] = {}
    source: dict[str, str] = {}
    entries = [(name, path, "the demo's adapter") for name, path in (demo or {}).items()]
    entries += [(name, path, "the config file's [adapters]") for name, path in config.items()]
    entries += [(name, path, f"--adapter {name}={path}") for name, path in flags]
    for name, path, where in entries:
        if name in merged:
            raise ValueError(f"adapter name {name!r} is given twice ({source[name]} and {where})")
        merged[name], source[name] = path, where
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # re-parsed by serve after a config file sets defaults
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args, parser)
        if args.command == "build-tiny-model":
            from loraplex.demo.tiny_model import build_tiny_model

            print(build_tiny_model(args.path))
            return 0
        if hasattr(args, "run"):
            return int(args.run(args) or 0)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # an adapter that cannot be loaded is the user's to fix, too
        from loraplex.adapters.tiers import AdapterLoadError

        if not isinstance(err, AdapterLoadError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
