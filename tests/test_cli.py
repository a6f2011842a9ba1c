"""The ``trio-mlx`` command as a person meets it: help, version and start-up failures."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_mlx_http._cli import build_parser, main

ROOT = Path(__file__).parent.parent

#: Generous: a failing start-up imports MLX and exits; on a loaded 2-core box that is seconds.
TIMEOUT = 120

HEAVY = ("mlx", "mlx_lm", "trio", "quart", "quart_trio", "hypercorn", "numpy", "transformers")


def _trio_mlx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trio_mlx_http", *args]
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (["--help"], set()),
        (["serve", "--help"], set()),
        (["generate", "--help"], set()),
        (["--version"], {"trio"}),  # the engine package's __init__, never MLX
    ],
)
def test_help_and_version_import_neither_mlx_nor_the_web_stack(
    args: list[str], allowed: set[str]
) -> None:
    script = (
        "import sys\n"
        "from trio_mlx_http._cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        f"print('LOADED', sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    ).stdout
    loaded = set(eval(out.split("LOADED ", 1)[1]))
    assert loaded <= allowed, out


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_states_every_default(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    target: argparse.ArgumentParser = sub.choices[command]  # type: ignore[index]
    formatter = target._get_formatter()
    checked = 0
    for action in target._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS):
            continue
        if action.default is False:  # a switch: off unless given
            continue
        entry = formatter._expand_help(action)
        assert "default:" in entry, (action.option_strings, entry)
        checked += 1
    assert checked >= 5
    text = " ".join(target.format_help().split())
    assert "(default: 8080)" in text if command == "serve" else "(default: 512)" in text


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _assert_short_error(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 3, result.stderr
    errors = [line for line in lines if line.startswith("trio-mlx: error: ")]
    assert len(errors) == 1, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "told"),
    [
        (
            ["serve", "--port", "abc"],
            "trio-mlx serve: error: argument --port: invalid int value: 'abc'",
        ),
        (["serve", "--bogus"], "trio-mlx serve: error: unrecognized arguments: --bogus"),
        (["generate"], "trio-mlx generate: error: the following arguments are required: prompt"),
        (["generate", "Hi", "--port", "1"], "trio-mlx generate: error: unrecognized arguments"),
        (["bogus"], "trio-mlx: error: argument COMMAND: invalid choice: 'bogus'"),
    ],
)
def test_an_argument_mistake_is_told_in_two_lines_with_where_help_is(
    args: list[str], told: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    command = told.split(": error:", 1)[0]
    assert out == ""
    assert err.splitlines()[0].startswith(told), err
    assert err.splitlines()[1:] == [f"Run '{command} --help' for the options."]


def test_the_real_command_tells_a_bad_port_in_two_lines() -> None:
    result = _trio_mlx("serve", "--port", "abc")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "trio-mlx serve: error: argument --port: invalid int value: 'abc'",
        "Run 'trio-mlx serve --help' for the options.",
    ]


def test_a_missing_model_folder_is_told_in_two_lines() -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--model", "/nonexistent/m")
    _assert_short_error(result, "'/nonexistent/m' not found", "--model takes a local folder")


def test_an_empty_model_folder_is_told_in_two_lines(tmp_path: Path) -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--model", str(tmp_path))
    _assert_short_error(result, "has no config.json", "--model takes")


def test_a_missing_adapter_is_named_as_the_adapter(tmp_path: Path) -> None:
    missing = tmp_path / "no-adapter"
    result = _trio_mlx("generate", "--no-fast-blas", "--adapter-path", str(missing), "Hi")
    _assert_short_error(result, f"adapter '{missing}' not found", "--adapter-path takes")
    assert "model" not in result.stderr.splitlines()[-2]


def test_a_hub_id_without_network_says_how_to_get_the_model(tmp_path: Path) -> None:
    # Offline and an empty cache: the Hub is never contacted.
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = _trio_mlx(
        "serve", "--no-fast-blas", "--port", "0", "--model", "mlx-community/absent", env=env
    )
    _assert_short_error(
        result, "cannot fetch model mlx-community/absent from Hugging Face", "hf download"
    )


def test_a_busy_port_fails_before_the_model_loads(busy_port: int) -> None:
    # The model does not exist either: the port is checked first, so the port is what is told.
    result = _trio_mlx(
        "serve", "--no-fast-blas", "--port", str(busy_port), "--model", "/nonexistent/m"
    )
    _assert_short_error(result, f"port {busy_port} on 127.0.0.1 is already in use", "--port")
    assert "not found" not in result.stderr


def test_an_out_of_range_engine_flag_is_named() -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--max-batch", "0")
    _assert_short_error(result, "max_batch", "check --max-batch")


def test_a_bad_environment_setting_names_the_variable_not_a_flag() -> None:
    env = {"TRIO_MLX_CUDA_POOL_GIB": "lots"}
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", env=env)
    _assert_short_error(
        result,
        "TRIO_MLX_CUDA_POOL_GIB must be a whole number of GiB",
        "check the environment variable TRIO_MLX_CUDA_POOL_GIB",
    )


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    result = _trio_mlx(
        "serve", "--no-fast-blas", "--port", "0", "--debug", "--model", str(tmp_path)
    )
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-2].startswith("trio-mlx: error: ")


def test_the_readme_configuration_table_names_every_flag() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("serve", "generate"):
        target: argparse.ArgumentParser = sub.choices[command]  # type: ignore[index]
        for action in target._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"`{option}`" in section, f"README's Configuration lacks {option}"


def test_a_prefill_budget_below_one_is_named() -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--prefill-budget", "0")
    _assert_short_error(result, "prefill_budget", "check --prefill-budget")


def test_a_long_prompt_chunk_below_one_is_named() -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--long-prompt-chunk", "0")
    _assert_short_error(result, "long_prompt_chunk", "check --long-prompt-chunk")


def test_a_prefill_stall_of_one_or_less_is_named() -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--prefill-stall", "1")
    _assert_short_error(result, "prefill_stall", "check --prefill-stall")


def test_prompt_cache_disk_flags_reach_the_engine(tmp_path: Path) -> None:
    from trio_mlx_http._server.run import _engine_settings

    args = build_parser().parse_args(
        ["serve", "--prompt-cache-dir", str(tmp_path), "--prompt-cache-disk-bytes", "2G"]
    )
    settings = _engine_settings(args)
    assert settings.prompt_cache_dir == str(tmp_path)
    assert settings.prompt_cache_disk_bytes == 2 * 1024**3
    assert _engine_settings(build_parser().parse_args(["serve"])).prompt_cache_dir is None


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_at_start_up_not_taken_as_no_authentication(
    key: str,
) -> None:
    result = _trio_mlx("serve", "--no-fast-blas", "--port", "0", env={"TRIO_MLX_API_KEY": key})
    _assert_short_error(result, "TRIO_MLX_API_KEY", "set but empty")
    assert result.returncode == 2
    flag = _trio_mlx("serve", "--no-fast-blas", "--port", "0", "--api-key", key)
    _assert_short_error(flag, "--api-key", "set but empty")


def test_settings_refuse_an_empty_api_key() -> None:
    from trio_mlx_http._settings import Settings

    with pytest.raises(ValueError, match="api_key must not be empty"):
        Settings(api_key="")
    assert Settings(api_key=None).api_key is None
