"""Which proxy a command asks (issue 45, item 4): the one --url names, else the
one the -c file's `listen` names, else the documented default; a -c file that
cannot be read, is not JSON or has no usable `listen` is a usage error (exit 2)
naming the file and suggesting --url, and nothing is asked."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from llmproxy.cli import main

# Every command that asks a running proxy.
COMMANDS = [["reload"], ["status"], ["upgrade"], ["cordon", "gpu1"], ["uncordon", "gpu1"],
            ["engine", "gpu1", "stop"], ["logs", "gpu1"]]


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs the command opened (each refused, as if nothing listened)."""
    urls: list[str] = []

    def urlopen(request: Any, *args: Any, **kwargs: Any) -> Any:
        urls.append(request.full_url if isinstance(request, urllib.request.Request)
                    else str(request))
        raise urllib.error.URLError("refused")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return urls


def bad_files(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Each kind of -c file that names no proxy: its path and what the error says of it."""
    out = {"missing": (str(tmp_path / "nope.json"), "cannot read: No such file or directory")}
    for name, text, says in [("notjson", '{"hosts": [', "not valid JSON"),
                             ("array", "[]", "not a JSON object"),
                             ("badlisten", '{"listen": "gpu-box:80"}', "listen: not a host:port"),
                             ("numlisten", '{"listen": 8093}', "listen: not a host:port")]:
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        out[name] = (str(path), says)
    return out


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("kind", ["missing", "notjson", "array", "badlisten", "numlisten"])
def test_a_file_that_names_no_proxy_is_a_usage_error(
        command: list[str], kind: str, tmp_path: Path, asked: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2, the file named with what is wrong with it, --url suggested, and no
    request sent anywhere (before, the default 127.0.0.1:8080 was asked)."""
    path, says = bad_files(tmp_path)[kind]
    assert main([*command, "-c", path]) == 2
    err = capsys.readouterr().err
    assert f"llmproxy {command[0]}: {path}: {says}" in err
    assert "--url URL" in err
    assert asked == []


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_url_wins_over_the_file(command: list[str], tmp_path: Path, asked: list[str]) -> None:
    """With --url the -c file is not read at all: a missing one changes nothing."""
    main([*command, "-c", str(tmp_path / "nope.json"), "--url", "http://127.0.0.9:9/"])
    assert asked and all(url.startswith("http://127.0.0.9:9/") for url in asked)


@pytest.mark.parametrize(("listen", "tls", "url"), [
    ("127.0.0.1:8093", False, "http://127.0.0.1:8093"),
    ("localhost:8093", False, "http://127.0.0.1:8093"),
    ("0.0.0.0:8093", True, "https://127.0.0.1:8093"),
    ("[::]:8093", False, "http://[::1]:8093"),
    ("[::1]:8093", False, "http://[::1]:8093"),
    (None, False, "http://127.0.0.1:8080"),
])
def test_the_files_listen_names_the_proxy(listen: str | None, tls: bool, url: str,
                                          tmp_path: Path, asked: list[str]) -> None:
    """The file's `listen` (a wildcard as its loopback, localhost as 127.0.0.1; the
    proxy's default when it has none) and `tls` give the URL asked, even when the
    rest of the file does not validate."""
    doc: dict[str, Any] = {"hosts": "not a list"}
    if listen is not None:
        doc["listen"] = listen
    if tls:
        doc["tls"] = {}
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(doc))
    assert main(["status", "-c", str(path)]) == 2     # refused: nothing listens
    assert asked == [url + "/status"]
