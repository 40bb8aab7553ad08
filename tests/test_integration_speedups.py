"""A real proxy says which speedups it runs: in its start-up log, `/status` and
`/metrics`, with LLMPROXY_SPEEDUPS on and off; and it answers the same in both."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from llmproxy import speedups
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration


def _complete(proxy: Proxy) -> dict[str, object]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200
        doc: dict[str, object] = json.load(r)
        return doc


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_proxy_reports_its_speedups(engine: SimEngine, tmp_path: Path, switch: str) -> None:
    """With the switch on, every speedup whose guard passes is active (all of
    them, on the pinned Twisted); with LLMPROXY_SPEEDUPS=0 none is, each named
    off with the switch as its reason. The log, /status and /metrics agree, and
    a completion is answered either way."""
    proxy = Proxy({"hosts": [{"name": "gpu1", "url": engine.url}]}, tmp_path,
                  extra_env={"LLMPROXY_SPEEDUPS": switch})
    try:
        names = [s.name for s in speedups.known()]
        status = proxy.get_json("/status")["speedups"]
        if switch == "1":
            assert status == {"enabled": True, "active": names, "off": {}}
            proxy.wait_for("speedups: on: " + ", ".join(names))
        else:
            assert status == {"enabled": False, "active": [],
                              "off": {name: "LLMPROXY_SPEEDUPS=0" for name in names}}
            proxy.wait_for(r"speedups: off \(LLMPROXY_SPEEDUPS=0\): the reference path alone")
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        for name in names:
            assert f'llmproxy_speedup_active{{speedup="{name}"}} {switch}.0' in metrics
        assert _complete(proxy)["object"] == "chat.completion"
    finally:
        proxy.stop()
