"""Queue position and ETA with a real proxy and managed engines over real sshd: a
streaming client waiting behind a switch hears `: queued 1st for gpu1, about N s`
and then its stream; a non-streamed one gets X-LLMProxy-Queue-Wait; /status shows
the host's queue with positions and ETAs; the status page shows it in headless
chromium (skipped without a browser unless LLMPROXY_REQUIRE_BROWSER is set)."""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent.state import records
from tests import sshd as sshd_harness
from tests import test_integration_page as page
from tests import test_integration_page_residency as residency_page
from tests.managed import managed_config, managed_host, sim_command
from tests.procs import ROOT, Proxy, free_port, wait_until

pytestmark = pytest.mark.integration

driver = page.driver      # the browser of test_integration_page, set up once for this module

COMMENT = re.compile(rb": queued (\d+)(st|nd|rd|th) for gpu1, (about (\d+) s|wait unknown)")


def config(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, Any]:
    port = free_port()
    host = managed_host(sshd, tmp_path, port, {
        "a": {"command": sim_command(port, "ma"), "start_timeout_seconds": 20},
        "b": {"command": sim_command(port, "mb"), "start_timeout_seconds": 20},
    }, min_engine_seconds=0)
    return managed_config(sshd, tmp_path, [host], {"ma": {"host": "gpu1", "engine": "a"},
                                                   "mb": {"host": "gpu1", "engine": "b"}})


def stop_engine(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
             "--state-dir", str(tmp_path / "agent"), "stop", "--host", "gpu1", input="")


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    """The response (its body read) of a chat completion for `model`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}),
        {"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    response.data = response.read()
    conn.close()
    return response


def queue_updates(port: int, after: int) -> list[dict[str, Any]]:
    """The queue.update events /api/events replays after event `after`, up to the one
    that says the queue is empty."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/api/events", headers={"Last-Event-ID": str(after)})
    response = conn.getresponse()
    found: list[dict[str, Any]] = []
    kind = ""
    try:
        while not found or found[-1]["waiters"]:
            line = response.fp.readline()
            assert line, "the event stream ended"
            if line.startswith(b"event: "):
                kind = line[7:].strip().decode()
            elif line.startswith(b"data: ") and kind == "queue.update":
                found.append(json.loads(line[6:]))
    finally:
        conn.close()
    return found


def test_a_client_waiting_behind_a_switch_hears_its_position_and_eta(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """Behind a 4 s stream on engine a, a streaming request for b (1st in the queue)
    and a plain one (2nd) wait for the switch: /status lists both by position with an
    ETA (b's declared start_timeout 20 s until measured, so at least that); the
    streaming client's keep-alive comments say `queued 1st for gpu1, about N s` before
    its stream, which ends with [DONE]; the plain one's answer carries
    X-LLMProxy-Queue-Wait, the seconds it waited (> 0), and one served at once says 0;
    /api/events has queue.update events with the positions, the last one empty."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    assert records  # the agent's state module is importable (stop_engine relies on it)
    try:
        first = post(proxy.port, "ma")
        assert first.status == 200
        assert float(first.getheader("x-llmproxy-queue-wait")) > 0   # a's start
        results: dict[str, Any] = {}

        def run(name: str, model: str, stream: bool, **headers: str) -> threading.Thread:
            def go() -> None:
                results[name] = post(proxy.port, model, stream, **headers)
            thread = threading.Thread(target=go)
            thread.start()
            return thread

        def status_host() -> Any:
            return proxy.get_json("/status")["hosts"][0]

        before = proxy.get_json("/status")["last_event_id"]
        threads = [run("a", "ma", True, **{"X-Sim-Delay": "0.2", "X-Sim-Tokens": "20"})]
        assert wait_until(lambda: status_host()["capacity"]["in_flight"] == 1)
        threads.append(run("b", "mb", True))
        assert wait_until(lambda: len(status_host()["queue"]) == 1)
        threads.append(run("plain", "mb", False))
        assert wait_until(lambda: len(status_host()["queue"]) == 2)
        queue = status_host()["queue"]
        assert [(w["position"], w["engine"], w["priority"]) for w in queue] == [
            (1, "b", "normal"), (2, "b", "normal")]
        assert all(w["eta_seconds"] is not None and w["eta_seconds"] >= 0 for w in queue)
        assert queue[0]["eta_seconds"] >= 15   # a's remaining stream, then b's start
        assert "client" not in json.dumps(queue)
        for t in threads:
            t.join(60)
        assert results["a"].data.rstrip().endswith(b"[DONE]")
        streamed = results["b"].data
        comments = COMMENT.findall(streamed)
        assert comments, streamed[:400]
        assert comments[0][0] == b"1" and comments[0][1] == b"st"
        assert streamed.index(b": queued") < streamed.index(b"data:")
        assert streamed.rstrip().endswith(b"[DONE]")
        waited = results["plain"]
        assert waited.status == 200
        assert float(waited.getheader("x-llmproxy-queue-wait")) > 1.0
        assert proxy.get_json("/status")["hosts"][0]["queue"] == []
        assert post(proxy.port, "mb").getheader("x-llmproxy-queue-wait") == "0.000"
        updates = queue_updates(proxy.port, before)
        assert [[w["position"] for w in u["waiters"]] for u in updates][:2] == [[1], [1, 2]]
        assert updates[-1]["waiters"] == []
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def test_the_page_shows_a_hosts_queue_with_position_and_eta(
        sshd: sshd_harness.SSHD, driver: Any, tmp_path: Path) -> None:
    """In headless chromium: while a request for b waits behind a stream on a, the
    page's gpu1 section has a Queue row reading `1st · b · normal · waited N s · ETA
    about M s`, without a reload; it goes once the queue is empty."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        assert post(proxy.port, "ma").status == 200
        mark, loaded_at = page.open_page(driver, proxy)
        results: dict[str, Any] = {}

        def go(name: str, model: str, stream: bool, **headers: str) -> threading.Thread:
            def run() -> None:
                results[name] = post(proxy.port, model, stream, **headers)
            thread = threading.Thread(target=run)
            thread.start()
            return thread

        threads = [go("a", "ma", True, **{"X-Sim-Delay": "0.2", "X-Sim-Tokens": "20"})]
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["capacity"][
            "in_flight"] == 1)
        threads.append(go("b", "mb", False))
        rows = residency_page.shows(driver, "gpu1", {"Queue": "ETA about"},
                                    what="gpu1's queue with an ETA", timeout=5.0)
        assert re.fullmatch(r"1st · b · normal · waited \d+ s · ETA about \d+ s",
                            rows["Queue"].strip()), rows
        for t in threads:
            t.join(60)
        assert results["b"].status == 200
        page.wait_until(lambda: "Queue" not in residency_page.host_rows(driver, "gpu1"),
                        driver, "the queue row gone", 5.0)
        page.not_reloaded(driver, mark, loaded_at)
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)
