"""`llmproxy cordon`, `uncordon` and `engine` against a stand-in proxy (a tiny
HTTP server on 127.0.0.1 answering what the admin endpoints answer): what each
asks, what it prints, and its exit status (0 done, 1 refused or failed, 2 could
not ask)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from llmproxy.cli import main
from tests.procs import free_port


class StandIn(HTTPServer):
    """Answers each POST with the next canned (status, doc); records the paths."""

    def __init__(self, answers: list[tuple[int, dict[str, Any]]]) -> None:
        self.answers = answers
        self.paths: list[str] = []
        self.authorizations: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                server.paths.append(self.path)
                server.authorizations.append(self.headers.get("Authorization"))
                status, doc = server.answers.pop(0)
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn([])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_cordon_and_uncordon_ask_the_admin_endpoints(stand_in: StandIn,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """cordon exits 0 printing what runs there; uncordon 0; a refusal 1 with its reason."""
    stand_in.answers = [(200, {"outcome": "cordoned", "in_flight": 2, "queued": 1}),
                        (200, {"outcome": "uncordoned"}),
                        (404, {"outcome": "failed", "reason": "no host named 'gpu9'"})]
    assert main(["cordon", "gpu1", "--url", stand_in.url]) == 0
    assert main(["uncordon", "gpu1", "--url", stand_in.url]) == 0
    assert main(["cordon", "gpu9", "--url", stand_in.url]) == 1
    out, err = capsys.readouterr()
    assert out == "cordoned gpu1: 2 in flight, 1 queued\nuncordoned gpu1\n"
    assert err == "llmproxy cordon: no host named 'gpu9'\n"
    assert stand_in.paths == ["/admin/cordon?host=gpu1", "/admin/uncordon?host=gpu1",
                              "/admin/cordon?host=gpu9"]


def test_engine_exits_0_when_done_and_1_with_the_agents_reason(
        stand_in: StandIn, capsys: pytest.CaptureFixture[str]) -> None:
    """engine HOST start ENGINE / stop: 0 when done, 1 with the reason when failed."""
    stand_in.answers = [(200, {"outcome": "done", "running": "big"}),
                        (409, {"outcome": "failed", "reason": "switching host gpu1 to "
                               "engine big failed: big exited with status 1"})]
    assert main(["engine", "gpu1", "start", "big", "--url", stand_in.url]) == 0
    assert main(["engine", "gpu1", "stop", "--url", stand_in.url]) == 1
    out, err = capsys.readouterr()
    assert out == "gpu1: started big; running: big\n"
    assert err == ("llmproxy engine: switching host gpu1 to engine big failed: big exited "
                   "with status 1\n")
    assert stand_in.paths == ["/admin/engine?host=gpu1&op=start&engine=big",
                              "/admin/engine?host=gpu1&op=stop"]


@pytest.mark.parametrize("argv", [["cordon", "gpu1"], ["uncordon", "gpu1"],
                                  ["engine", "gpu1", "stop"]])
def test_a_proxy_that_cannot_be_asked_is_exit_2(argv: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens: exit 2 saying it cannot reach the proxy."""
    assert main([*argv, "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach http://127.0.0.1:" in capsys.readouterr().err


def test_engine_start_needs_an_engine() -> None:
    """A usage error (exit 2) before anything is asked; `stop ENGINE` is not one
    (it asks, and an unreachable proxy is exit 2 too, with its message)."""
    with pytest.raises(SystemExit) as info:
        main(["engine", "gpu1", "start", "--url", "http://127.0.0.1:1"])
    assert info.value.code == 2
    assert main(["engine", "gpu1", "stop", "big", "--url", "http://127.0.0.1:1",
                 "--timeout", "1"]) == 2


def test_status_text_shows_slots_and_cordons() -> None:
    """`llmproxy status` says a host's slots in use and its cordon."""
    from llmproxy.cli.status import describe_status

    doc = {"version": "x", "state": "ready", "hosts": [
        {"name": "gpu1", "url": "http://a", "roster": {"generation": 1, "models": ["m"],
                                                       "fetched_seconds_ago": 1},
         "capacity": {"in_flight": 2, "max_concurrent": 2, "queued": 3, "cordoned": True}}]}
    assert ("  gpu1  http://a  1 model(s), read 1s ago; 2 of 2 slots, 3 queued; cordoned"
            in describe_status(doc, "http://p").splitlines())


def test_the_host_commands_send_the_key(stand_in: StandIn, tmp_path: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """cordon, uncordon and engine send the key of --key-file (else
    $LLMPROXY_KEY), as reload and upgrade do: with keys on, they need one."""
    key_file = tmp_path / "key"
    key_file.write_text("sk-admin\n")
    monkeypatch.setenv("LLMPROXY_KEY", "sk-env")
    stand_in.answers = [(200, {"outcome": "cordoned", "in_flight": 0, "queued": 0}),
                        (200, {"outcome": "uncordoned"}),
                        (200, {"outcome": "done", "running": "a"})]
    assert main(["cordon", "gpu1", "--url", stand_in.url, "--key-file", str(key_file)]) == 0
    assert main(["uncordon", "gpu1", "--url", stand_in.url]) == 0
    assert main(["engine", "gpu1", "start", "a", "--url", stand_in.url]) == 0
    assert stand_in.authorizations == ["Bearer sk-admin", "Bearer sk-env", "Bearer sk-env"]
