"""llmproxy's modes in the bench (bench/proxies.py): each llmproxy target gets its
mode in its environment, explicitly, and its /status must confirm it, or the run
stops before measuring the wrong path."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cli, proxies
from bench.proxies import Mode, mismatch, mode_of, proxy_env, speedups_off_notes
from bench.targets import Process, StartError, Target, start_engine
from llmproxy import speedups

ON = {"enabled": True, "active": ["sendnow", "site"], "off": {}}
REF = {"enabled": False, "active": [], "off": {"sendnow": "LLMPROXY_SPEEDUPS=0",
                                               "site": "LLMPROXY_SPEEDUPS=0"}}


def test_the_variables_are_llmproxys() -> None:
    assert proxies.SWITCH == speedups.SWITCH == "LLMPROXY_SPEEDUPS"
    assert proxies.OFF == speedups.OFF == "LLMPROXY_SPEEDUPS_OFF"


def test_each_target_name_asks_for_its_mode() -> None:
    assert mode_of("llmproxy") == Mode(speedups=True, off=())
    assert mode_of("llmproxy-reference") == Mode(speedups=False)
    assert mode_of("llmproxy-without-sendnow") == Mode(off=("sendnow",))
    assert mode_of("llmproxy-capture") == Mode(capture=True)
    assert mode_of("llmproxy-reference-capture") == Mode(speedups=False, capture=True)
    assert Mode(capture=True).describe() == "speedups on (LLMPROXY_SPEEDUPS=1), capture on"
    for other in ("direct", "nginx", "twisted", "llmproxy-without-", "llmproxy-without-a b",
                  "nginx-capture", "direct-capture"):
        assert mode_of(other) is None, other


def test_the_environment_sets_the_mode_whatever_the_bench_inherited() -> None:
    """The switch is always set (1 for llmproxy, 0 for the reference), and
    LLMPROXY_SPEEDUPS_OFF holds exactly the speedups the target leaves off."""
    inherited = {"LLMPROXY_SPEEDUPS": "0", "LLMPROXY_SPEEDUPS_OFF": "site", "HOME": "/root"}
    on = proxy_env(Mode(), inherited)
    assert on["LLMPROXY_SPEEDUPS"] == "1" and "LLMPROXY_SPEEDUPS_OFF" not in on
    assert on["HOME"] == "/root"
    reference = proxy_env(Mode(speedups=False), {"LLMPROXY_SPEEDUPS": "1"})
    assert reference["LLMPROXY_SPEEDUPS"] == "0" and "LLMPROXY_SPEEDUPS_OFF" not in reference
    without = proxy_env(Mode(off=("sendnow",)), inherited)
    assert without["LLMPROXY_SPEEDUPS"] == "1"
    assert without["LLMPROXY_SPEEDUPS_OFF"] == "sendnow"
    assert inherited["LLMPROXY_SPEEDUPS"] == "0"          # the bench's own left alone
    assert proxy_env(Mode())["PYTHONPATH"].startswith(str(cli.ROOT))


def test_a_status_that_confirms_the_mode_passes() -> None:
    assert mismatch("llmproxy", Mode(), {"speedups": ON}) is None
    assert mismatch("llmproxy", Mode(), {"speedups": {**ON, "off": {"x": "guard"}}}) is None
    assert mismatch("llmproxy-reference", Mode(False), {"speedups": REF}) is None
    without = {"enabled": True, "active": ["site"],
               "off": {"sendnow": "LLMPROXY_SPEEDUPS_OFF names it"}}
    assert mismatch("llmproxy-without-sendnow", Mode(off=("sendnow",)),
                    {"speedups": without}) is None


@pytest.mark.parametrize(("name", "mode", "found", "said"), [
    ("llmproxy-reference", Mode(False), ON,
     "llmproxy-reference was started with LLMPROXY_SPEEDUPS=0 but its /status says "
     "speedups.enabled is true: it would measure the wrong path"),
    ("llmproxy", Mode(), REF,
     "llmproxy was started with LLMPROXY_SPEEDUPS=1 but its /status says speedups.enabled "
     "is false"),
    ("llmproxy-reference", Mode(False), {**REF, "active": ["site"]},
     "runs the reference path but its /status lists speedups active: site"),
    ("llmproxy-without-sendnow", Mode(off=("sendnow",)), ON,
     "started with LLMPROXY_SPEEDUPS_OFF=sendnow but its /status lists sendnow active"),
    ("llmproxy-without-nosuch", Mode(off=("nosuch",)), ON,
     "llmproxy has no speedup named 'nosuch' (it has: sendnow, site)"),
    ("llmproxy-without-nosuch", Mode(off=("nosuch",)), {"enabled": True},
     "no speedup named 'nosuch' (it has: none)"),
    ("llmproxy", Mode(), None, "its /status has no speedups.enabled"),
    ("llmproxy", Mode(), {"enabled": "yes"}, "its /status has no speedups.enabled"),
])
def test_a_status_that_says_another_mode_is_refused_by_name(
        name: str, mode: Mode, found: Any, said: str) -> None:
    why = mismatch(name, mode, {} if found is None else {"speedups": found})
    assert why is not None and said in why, why


def test_speedups_a_guard_turned_off_are_noted_for_the_speedups_targets() -> None:
    guarded = {"enabled": True, "active": ["site"], "off": {"sendnow": "Twisted changed"}}
    assert speedups_off_notes(Target("llmproxy", 1, speedups=guarded)) == [
        "llmproxy: speedup sendnow is off: Twisted changed"]
    assert speedups_off_notes(Target("llmproxy-without-sendnow", 1, speedups=guarded)) == []
    assert speedups_off_notes(Target("llmproxy-reference", 1, speedups=REF)) == []


def test_every_llmproxy_target_is_started_in_its_mode(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """start_targets starts each llmproxy target by its name, the others as before,
    each process kept to be stopped; a guard's note reaches stderr."""
    started: list[str] = []
    engine = Process("engine", None, tmp_path / "engine.log")  # type: ignore[arg-type]

    def fake_proxy(workdir: Path, engine_port: int, name: str) -> Target:
        started.append(name)
        doc = {"enabled": True, "active": [], "off": {"sendnow": "Twisted changed"}}
        return Target(name, 2000 + len(started), speedups=doc)

    monkeypatch.setattr(cli, "start_engine", lambda workdir: (engine, 1999))
    monkeypatch.setattr(cli, "start_llmproxy", fake_proxy)
    processes: list[Process] = []
    wanted = ["direct", "llmproxy", "llmproxy-reference", "llmproxy-without-sendnow"]
    targets = cli.start_targets(wanted, tmp_path, None, processes)
    assert started == wanted[1:]
    assert list(targets) == wanted and processes == [engine]
    assert all(t.engine is engine for t in targets.values())
    assert "llmproxy: speedup sendnow is off: Twisted changed" in capsys.readouterr().err
    info = cli.meta(targets, quick=True)
    assert set(info["speedups"]) == set(wanted[1:])


FAKE_TWISTD = '''\
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
LIE = {lie!r}
names = ["sendnow", "site"]
enabled = LIE or os.environ.get("LLMPROXY_SPEEDUPS", "1") != "0"
unwanted = [n for n in os.environ.get("LLMPROXY_SPEEDUPS_OFF", "").split(",") if n]
off = {{n: "off" for n in names if not enabled or n in unwanted}}
doc = {{"speedups": {{"enabled": enabled, "active": [n for n in names if n not in off],
                     "off": off, "seen": {{k: os.environ.get(k) for k in
                     ("LLMPROXY_SPEEDUPS", "LLMPROXY_SPEEDUPS_OFF")}},
                     "argv": sys.argv[1:]}}}}
class Status(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(doc).encode()
        self.send_response(200 if self.path == "/status" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = HTTPServer(("127.0.0.1", 0), Status)
open("fake.pid", "w").write(str(os.getpid()))
print(f"ready: listening on http://127.0.0.1:{{server.server_port}}", flush=True)
server.serve_forever()
'''


def _fake_twistd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lie: bool) -> None:
    script = tmp_path / "twistd"
    script.write_text(f"#!{sys.executable}\n" + FAKE_TWISTD.format(lie=lie))
    script.chmod(0o755)
    monkeypatch.setattr(proxies, "twistd_path", lambda: script)
    # What the bench itself was started with must not decide a target's mode.
    monkeypatch.setenv("LLMPROXY_SPEEDUPS", "0")
    monkeypatch.setenv("LLMPROXY_SPEEDUPS_OFF", "site")


@pytest.mark.integration
def test_the_child_really_gets_its_mode(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Started through start_llmproxy, a stand-in twistd sees LLMPROXY_SPEEDUPS=1 (and
    no LLMPROXY_SPEEDUPS_OFF) as llmproxy, =0 as llmproxy-reference, and the named
    speedup as llmproxy-without-NAME, whatever the bench inherited."""
    _fake_twistd(tmp_path, monkeypatch, lie=False)
    seen = {}
    for name in ("llmproxy", "llmproxy-reference", "llmproxy-without-sendnow"):
        target = proxies.start_llmproxy(tmp_path, 1, name)
        assert target.process is not None
        target.process.stop()
        assert target.speedups is not None
        seen[name] = target.speedups["seen"]
        assert target.speedups["argv"][-3:] == ["llmproxy", "-c", str(tmp_path / f"{name}.json")]
    assert seen == {
        "llmproxy": {"LLMPROXY_SPEEDUPS": "1", "LLMPROXY_SPEEDUPS_OFF": None},
        "llmproxy-reference": {"LLMPROXY_SPEEDUPS": "0", "LLMPROXY_SPEEDUPS_OFF": None},
        "llmproxy-without-sendnow": {"LLMPROXY_SPEEDUPS": "1",
                                     "LLMPROXY_SPEEDUPS_OFF": "sendnow"}}


def test_with_capture_every_llmproxy_target_starts_with_capture_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--capture: start_targets asks each llmproxy target for its mode with capture on."""
    modes: dict[str, Mode] = {}
    engine = Process("engine", None, tmp_path / "engine.log")  # type: ignore[arg-type]

    def fake_proxy(workdir: Path, engine_port: int, name: str, mode: Mode) -> Target:
        modes[name] = mode
        return Target(name, 2000 + len(modes), speedups={"enabled": mode.speedups})

    monkeypatch.setattr(cli, "start_engine", lambda workdir: (engine, 1999))
    monkeypatch.setattr(cli, "start_llmproxy", fake_proxy)
    cli.start_targets(["direct", "llmproxy", "llmproxy-reference"], tmp_path, None, [],
                      capture=True)
    assert modes == {"llmproxy": Mode(capture=True),
                     "llmproxy-reference": Mode(speedups=False, capture=True)}
    assert cli.parse_args(["--capture"]).capture is True
    assert cli.parse_args(["--targets", "llmproxy-capture"]).targets == ["llmproxy-capture"]


@pytest.mark.integration
def test_a_capture_target_whose_capture_is_off_stops_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llmproxy-capture whose /api/captures does not say capture is on: StartError, and
    the process is stopped."""
    _fake_twistd(tmp_path, monkeypatch, lie=False)
    with pytest.raises(StartError, match=r"says it is off"):
        proxies.start_llmproxy(tmp_path, 1, "llmproxy-capture")
    pid = int((tmp_path / "fake.pid").read_text())
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.integration
def test_a_proxy_in_the_wrong_mode_stops_the_run(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A llmproxy-reference whose /status says its speedups are on: StartError,
    saying so, and the process is stopped (the run then exits 2 without a figure)."""
    _fake_twistd(tmp_path, monkeypatch, lie=True)
    with pytest.raises(StartError, match=r"speedups\.enabled is true: it would measure"):
        proxies.start_llmproxy(tmp_path, 1, "llmproxy-reference")
    pid = int((tmp_path / "fake.pid").read_text())
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.integration
def test_the_real_llmproxy_reports_the_mode_it_was_started_in(tmp_path: Path) -> None:
    """twistd llmproxy from this checkout, in front of the bench engine: /status says
    speedups on for `llmproxy`, off for `llmproxy-reference`, and `llmproxy-capture`
    starts with capture on; a speedup name it does not have is refused."""
    processes: list[Process] = []
    try:
        engine, engine_port = start_engine(tmp_path)
        processes.append(engine)
        for name, enabled in (("llmproxy", True), ("llmproxy-reference", False),
                              ("llmproxy-capture", True)):   # its /api/captures: on
            target = proxies.start_llmproxy(tmp_path, engine_port, name)
            assert target.process is not None
            processes.append(target.process)
            assert target.speedups is not None
            assert target.speedups["enabled"] is enabled
        with pytest.raises(StartError, match="no speedup named 'nosuch'"):
            proxies.start_llmproxy(tmp_path, engine_port, "llmproxy-without-nosuch")
    finally:
        for process in processes:
            process.stop()
