"""`llmproxy capture list|show|replay` against twistd llmproxy with capture on, in
front of two simulated engines (gpu1 serves m, gpu2 serves m2): the listing and one
capture as the commands print them, and a replay to the same model, to another model
on another host, and to a model named on its host, with both answers side by side."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ROOT, Proxy, SimEngine, env

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Proxy]:
    """The proxy with capture on, over gpu1 (m) and gpu2 (m2)."""
    one, other = SimEngine(["m"]), SimEngine(["m2"])
    proxy = None
    try:
        proxy = Proxy({"hosts": [{"name": "gpu1", "url": one.url},
                                 {"name": "gpu2", "url": other.url}],
                       "capture": {"redact": ["$.user"]}}, tmp_path)
        yield proxy
    finally:
        if proxy is not None:
            proxy.stop()
        one.stop()
        other.stop()


def ask(proxy: Proxy, body: dict[str, object]) -> str:
    request = urllib.request.Request(proxy.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer sk-never-kept",
                                              "X-Sim-Tokens": "3"})
    with urllib.request.urlopen(request, timeout=10) as r:
        r.read()
        return str(r.headers["x-request-id"])


def test_list_show_and_replay_to_another_model_and_host(two: Proxy) -> None:
    """`list` shows the capture's id, status, model and host; `show` its redacted
    heads and both bodies; `replay` sends it again (here, to m2 on gpu2: the
    replayed column says so, with its status and timings, beside the captured
    answer from gpu1), `--host gpu1` asks for gpu1/m; an unknown id is exit 1."""
    id = ask(two, {"model": "m", "user": "dave", "messages": [{"role": "user",
                                                                "content": "hello"}]})
    listed = cli("capture", "list", "--url", two.url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(id))
    assert row.split()[3:5] == ["200", "completed"] and " m " in row and " gpu1 " in row
    assert "1 kept in" in listed.stdout
    shown = cli("capture", "show", id, "--url", two.url)
    assert shown.returncode == 0, shown.stderr
    assert "authorization: [redacted]" in shown.stdout and "sk-never-kept" not in shown.stdout
    assert '"user": "[redacted]"' in shown.stdout and "tok0" in shown.stdout
    again = cli("capture", "replay", id, "--model", "m2", "--url", two.url)
    assert again.returncode == 0, again.stderr
    assert "redacted" in again.stderr            # it says what it sends as redacted
    lines = again.stdout.splitlines()
    assert lines[0].startswith(f"captured {id}") and "| replayed " in lines[0]
    assert "model m on gpu1" in lines[1] and "model m2 on gpu2" in lines[1]
    assert lines[2].count("status 200, ttfb ") == 2
    assert "tok0 tok1 tok2" in again.stdout
    pinned = cli("capture", "replay", id, "--host", "gpu1", "--json", "--url", two.url)
    assert pinned.returncode == 0, pinned.stderr
    doc = json.loads(pinned.stdout)
    assert doc["replayed"]["model"] == "gpu1/m" and doc["replayed"]["host"] == "gpu1"
    assert doc["replayed"]["status"] == 200 and doc["captured"]["id"] == id
    missing = cli("capture", "show", "nope-1", "--url", two.url)
    assert missing.returncode == 1 and "404" in missing.stderr
