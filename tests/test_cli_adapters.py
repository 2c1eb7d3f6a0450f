"""`loraplex serve`'s adapter list: the demo's, the config file's and --adapter flags, a name given
twice refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import cli
from loraplex.cli import merge_serve_adapters

DEMO = {"reverse": "/demo/reverse", "upper": "/demo/upper"}


def test_merge_keeps_every_source_in_order() -> None:
    merged = merge_serve_adapters(
        DEMO, {"tenant": "/cfg/tenant"}, [("mine", "/x/mine"), ("yours", "/x/yours")]
    )
    assert merged == {**DEMO, "tenant": "/cfg/tenant", "mine": "/x/mine", "yours": "/x/yours"}
    assert list(merged) == ["reverse", "upper", "tenant", "mine", "yours"]
    assert merge_serve_adapters(None, {}, []) == {}
    assert merge_serve_adapters(None, {"a": "/a"}, [("b", "/b")]) == {"a": "/a", "b": "/b"}


@pytest.mark.parametrize(
    ("demo", "config", "flags", "message"),
    [
        (
            DEMO,
            {},
            [("reverse", "/x/rev")],
            "'reverse' is given twice (the demo's adapter and --adapter reverse=/x/rev)",
        ),
        (None, {}, [("x", "/a"), ("x", "/b")], "'x' is given twice (--adapter x=/a and --adapter x=/b)"),
        (
            None,
            {"x": "/a"},
            [("x", "/b")],
            "'x' is given twice (the config file's [adapters] and --adapter x=/b)",
        ),
        (
            DEMO,
            {"upper": "/cfg/up"},
            [],
            "'upper' is given twice (the demo's adapter and the config file's [adapters])",
        ),
    ],
)
def test_merge_refuses_a_name_given_twice(demo, config, flags, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as err:
        merge_serve_adapters(demo, config, flags)
    assert str(err.value) == f"adapter name {message}"


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading the model (or serving) fail the test: the refusal must come first."""
    import loraplex.server.serve as serve

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded before the adapters were checked")

    monkeypatch.setattr(serve, "build_server", refuse)
    monkeypatch.setattr(serve, "run_server", refuse)


@pytest.mark.usefixtures("no_server")
def test_serve_refuses_replacing_a_demo_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--adapter", f"reverse={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert (
        f"adapter name 'reverse' is given twice (the demo's adapter and --adapter reverse={tmp_path})" in err
    )
    assert "loading" not in err


@pytest.mark.usefixtures("no_server")
def test_serve_refuses_duplicate_flags_and_config_collisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", str(tmp_path), "--adapter", "x=/a", "--adapter", "x=/b"]
    assert cli.main(argv) == 2
    assert "adapter name 'x' is given twice (--adapter x=/a and --adapter x=/b)" in capsys.readouterr().err

    config = tmp_path / "serve.toml"
    config.write_text(f'model = "{tmp_path}"\n\n[adapters]\ntenant = "/cfg/tenant"\n')
    assert cli.main(["serve", "--config", str(config), "--adapter", "tenant=/x"]) == 2
    err = capsys.readouterr().err
    assert (
        "adapter name 'tenant' is given twice (the config file's [adapters] and --adapter tenant=/x)" in err
    )


def test_generate_with_an_adapter_larger_than_the_device_budget_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

    rc = cli.main(
        [
            "generate", "--model", str(DEMO_MODEL_DIR), "--adapter-device-bytes", "300000",
            "--adapter", f"reverse={DEMO_ADAPTERS['reverse']}", "--prompt", "abc=", "--max-tokens", "4",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert "error: adapter revision" in err and "more than the whole adapter device budget of 300000" in err
