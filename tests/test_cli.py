"""Tests for llmproxy.cli: the `llmproxy` console script and its `check` subcommand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmproxy.cli import main
from llmproxy.config.parse import LISTEN_ERROR

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "etc" / "hosts.example.json"


def write(tmp_path: Path, obj: object) -> str:
    """`obj` written as JSON to a file under tmp_path; its path."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_check_good(capsys: pytest.CaptureFixture[str]) -> None:
    """A valid config exits 0 and prints `ok: PATH: <summary>` to stdout, nothing to stderr."""
    assert main(["check", "-c", str(EXAMPLE)]) == 0
    out, err = capsys.readouterr()
    assert out == (
        f"ok: {EXAMPLE}: 2 hosts (1 managed), 3 models, 1 alias, listen 127.0.0.1:8080\n"
    )
    assert err == ""


def test_check_long_option(capsys: pytest.CaptureFixture[str]) -> None:
    """--config works like -c."""
    assert main(["check", "--config", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {EXAMPLE}: 2 hosts")


def test_check_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An invalid config exits 78 (EX_CONFIG) and prints every error, naming its field,
    then a count."""
    path = write(
        tmp_path,
        {
            "listen": "nowhere",
            "hosts": [
                {"name": "gpu1", "url": "http://10.0.0.5:8081", "engines": {"big": {}}},
                {"name": "gpu1", "url": "http://10.0.0.6"},
            ],
            "models": {"qwen": {"host": "gpu9"}},
        },
    )
    assert main(["check", "-c", path]) == 78
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"listen: {LISTEN_ERROR}",
        "hosts[0].ssh: required when engines are given",
        "hosts[0].engines.big.command: required",
        "hosts[1].name: duplicate of hosts[0]",
        "models.qwen.host: no host named 'gpu9'",
        f"llmproxy check: {path}: 5 errors",
    ]


def test_check_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A single error is counted in the singular."""
    path = write(tmp_path, {"hosts": [{"name": "h", "url": "http://h"}], "colour": "blue"})
    assert main(["check", "-c", path]) == 78
    assert capsys.readouterr().err.splitlines() == [
        "colour: unknown key",
        f"llmproxy check: {path}: 1 error",
    ]


def test_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing file exits 78 with the OS reason, not a traceback."""
    path = str(tmp_path / "nope.json")
    assert main(["check", "-c", path]) == 78
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: cannot read: No such file or directory",
        f"llmproxy check: {path}: 1 error",
    ]


def test_check_invalid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file that is not JSON exits 78 saying where the JSON breaks."""
    path = tmp_path / "hosts.json"
    path.write_text('{"hosts": [')
    assert main(["check", "-c", str(path)]) == 78
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: not valid JSON: line 1 column 12: Expecting value",
        f"llmproxy check: {path}: 1 error",
    ]


@pytest.mark.parametrize("argv", [[], ["check"], ["frobnicate"], ["check", "-c"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Missing subcommands, unknown ones and missing options are argparse usage errors (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: llmproxy" in capsys.readouterr().err


def test_subprocess_does_not_import_reactor(tmp_path: Path) -> None:
    """`python -m llmproxy.cli check` exits with check's status and never imports the reactor."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, "-m", "llmproxy.cli", "check", "-c", str(EXAMPLE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (ok.returncode, ok.stderr) == (0, "")
    assert ok.stdout.startswith(f"ok: {EXAMPLE}: ")
    bad = subprocess.run(
        [sys.executable, "-m", "llmproxy.cli", "check", "-c", str(tmp_path / "nope.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 78
    assert "cannot read" in bad.stderr
    probe = (
        "import sys\n"
        "from llmproxy.cli import main\n"
        f"status = main(['check', '-c', {str(EXAMPLE)!r}])\n"
        "assert status == 0, status\n"
        "loaded = [m for m in ('twisted.internet.reactor', 'treq') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr


def test_help_names_the_server_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`llmproxy --help` says the proxy itself is `twistd llmproxy`; every --timeout
    says its default."""
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "twistd llmproxy -c hosts.json" in " ".join(capsys.readouterr().out.split())
    for command, default in [(["reload"], 60), (["status"], 10), (["upgrade"], 180),
                             (["cordon"], 600), (["engine"], 600), (["logs"], 60)]:
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert f"default: {default})" in " ".join(capsys.readouterr().out.split()), command
