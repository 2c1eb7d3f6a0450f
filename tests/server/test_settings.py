"""Config files for `loraplex serve`: values become defaults, flags on the command line win."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.cli import build_parser
from loraplex.config_cli import engine_config_from_args, engine_defaults_from_mapping
from loraplex.server.serve import load_settings_file


def test_toml_settings_and_flag_precedence(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(
        'model = "/m"\nport = 9001\napi_keys = ["k"]\n'
        '[adapters]\nsql = "/a/sql"\n'
        '[engine]\ndtype = "bfloat16"\nmax_num_seqs = 7\nmax_lora_rank = 32\n'
        "[engine.cache]\nblock_size = 32\n"
    )
    settings = load_settings_file(path)
    assert settings.model == "/m" and settings.port == 9001 and settings.adapters == {"sql": "/a/sql"}
    parser = build_parser()
    args = parser.parse_args(["serve"])
    engine_defaults_from_mapping(args.subparser, settings.engine)
    config = engine_config_from_args("/m", parser.parse_args(["serve", "--max-num-seqs", "9"]))
    assert config.dtype == "bfloat16" and config.lora.max_rank == 32 and config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 9  # the flag wins over the file


def test_bad_settings_files_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("modle = 1\n")
    with pytest.raises(ValueError, match="modle"):
        load_settings_file(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="cannot parse"):
        load_settings_file(broken)
    parser = build_parser()
    with pytest.raises(ValueError, match="max_num_seq"):
        engine_defaults_from_mapping(parser.parse_args(["serve"]).subparser, {"max_num_seq": 3})


def test_limits_from_config_file_and_flags(tmp_path: Path) -> None:
    from loraplex.server.limits import ServerLimits
    from loraplex.server.limits_cli import limits_from_args

    path = tmp_path / "server.toml"
    path.write_text("[limits]\nmax_body_bytes = 4096\nmax_pending_requests = 7\n")
    settings = load_settings_file(path)
    assert settings.limits == ServerLimits(max_body_bytes=4096, max_pending_requests=7)
    args = build_parser().parse_args(["serve", "--max-pending-requests", "9", "--max-stop-strings", "4"])
    limits = limits_from_args(settings.limits, args)
    assert (limits.max_body_bytes, limits.max_pending_requests, limits.max_stop_strings) == (4096, 9, 4)
    path.write_text("[limits]\nmax_body_byte = 4096\n")
    with pytest.raises(ValueError, match="max_body_byte"):
        load_settings_file(path)
    path.write_text("[limits]\nmax_body_bytes = 0\n")
    with pytest.raises(ValueError, match="max_body_bytes"):
        load_settings_file(path)


def test_flags_take_each_settings_type() -> None:
    """int, float and str settings arrive as their own types (a float flag once arrived as a string
    and failed the config's range check with a TypeError)."""
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--policy", "adaptive", "--locality-top-share", "0.25", "--locality-window-ms", "80"]
    )
    sched = engine_config_from_args("/m", args).scheduler
    assert sched.locality_top_share == 0.25 and isinstance(sched.locality_top_share, float)
    assert sched.locality_window_ms == 80 and sched.policy == "adaptive"
    with pytest.raises(ValueError, match="locality_top_share"):
        engine_config_from_args("/m", parser.parse_args(["serve", "--locality-top-share", "1.5"]))
