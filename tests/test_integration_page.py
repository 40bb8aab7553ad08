"""The status page (`GET /`) in a real browser: Debian's chromium, headless, driven through
selenium, against `twistd llmproxy` and two simulated engines as real processes on 127.0.0.1.
The page must follow the proxy live from /api/events, without a reload.

Skipped when chromium, chromedriver or selenium is missing (bin/install-test-deps installs the
browser as root; selenium is in the test extras), unless LLMPROXY_REQUIRE_BROWSER is set (CI sets
it to 1): then every test fails instead. Screenshots are written under the test's temporary
directory and copied to $LLMPROXY_ARTIFACTS when that is set; their paths are printed.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import needs
from tests.procs import Proxy, SimEngine, free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,800", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync")


def missing() -> str | None:
    """Why no browser can be driven here, or None when it can."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} not found (run bin/install-test-deps as root)"
    return None


REASON = missing()
needs.module("browser", REASON)

pytestmark = pytest.mark.integration


# -- processes ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimEngine, SimEngine]]:
    a = SimEngine(["qwen-up"], "--ctx", "8192")
    b = SimEngine(["mistral-up"])
    yield a, b
    a.stop()
    b.stop()


def config(engines: tuple[SimEngine, SimEngine], **extra: Any) -> dict[str, Any]:
    a, b = engines
    return {
        "hosts": [{"name": "gpu1", "url": a.url}, {"name": "laptop", "url": b.url}],
        "models": {"qwen": {"host": "gpu1", "upstream": "qwen-up", "ctx": 32768},
                   "mistral": {"host": "laptop", "upstream": "mistral-up"}},
        "aliases": {"coder": "qwen"},
        **extra,
    }


@pytest.fixture(scope="module")
def proxy(engines: tuple[SimEngine, SimEngine],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = Proxy(config(engines), tmp_path_factory.mktemp("proxy"))
    yield p
    p.stop()


class Stream(threading.Thread):
    """A slow streamed chat completion through the proxy, read in the background:
    `request_id` once the headers are in, `halfway` and `done` as the body comes."""

    def __init__(self, port: int, model: str = "coder", tokens: int = 20,
                 delay: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.tokens, self.delay = port, model, tokens, delay
        self.ids: queue.Queue[str] = queue.Queue()
        self.halfway = threading.Event()
        self.body = b""
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        body = {"model": self.model, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Sim-Delay": str(self.delay),
                      "X-Sim-Tokens": str(self.tokens)})
        resp = conn.getresponse()
        self.ids.put(resp.getheader("X-Request-Id") or "")
        chunks = []
        while line := resp.readline():
            chunks.append(line)
            if b"tok%d " % (self.tokens // 2) in line:
                self.halfway.set()
        self.body = b"".join(chunks)
        self.ended_at = time.monotonic()
        conn.close()

    def request_id(self) -> str:
        return self.ids.get(timeout=10)


# -- the browser ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("screenshots")
    yield path
    print(f"\nstatus page screenshots: {path}"
          + (f" (copied to {os.environ['LLMPROXY_ARTIFACTS']})"
             if os.environ.get("LLMPROXY_ARTIFACTS") else ""))


def screenshot(driver: Any, artifacts: Path, name: str, *, full: bool = False) -> Path:
    """Save what the window shows (`full`: the whole page at the window's width)."""
    path = artifacts / name
    if full:
        width = driver.execute_script("return window.innerWidth")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
        path.write_bytes(base64.b64decode(shot["data"]))
    else:
        driver.save_screenshot(str(path))
    out = os.environ.get("LLMPROXY_ARTIFACTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)
    print(f"screenshot: {path}")
    return path


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    needs.need("browser", REASON)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.binary_location = CHROMIUM
    service = Service(CHROMEDRIVER)
    d = webdriver.Chrome(service=service, options=options)
    try:
        yield d
    finally:
        try:
            d.quit()
        finally:
            # chromedriver is ours: never leave it behind (quit ends the browser it started)
            process = getattr(service, "process", None)
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)


def set_viewport(driver: Any, width: int, height: int) -> None:
    """Make the page's viewport (not the window) width x height."""
    driver.set_window_size(width, height)
    # headless chromium keeps room for its (invisible) toolbar: add what the viewport lacks
    inner_w, inner_h = driver.execute_script("return [window.innerWidth, window.innerHeight]")
    if (inner_w, inner_h) != (width, height):
        driver.set_window_size(2 * width - inner_w, 2 * height - inner_h)
    wait_js(driver, f"return window.innerWidth === {width} && window.innerHeight === {height}",
            what=f"a {width}x{height} viewport", timeout=5)


def wait_js(driver: Any, script: str, *args: Any, what: str, timeout: float = 5.0) -> Any:
    """Poll `script` in the page until it returns something truthy; its value."""
    return wait_until(lambda: driver.execute_script(script, *args), driver, what, timeout)


def wait_until(check: Callable[[], Any], driver: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            text = driver.execute_script("return document.body.innerText")
            raise AssertionError(f"not within {timeout}s: {what}; the page says:\n{text}")
        time.sleep(0.05)


def text_of(driver: Any, element_id: str) -> str:
    text: str = driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : ''", element_id)
    return text


LIVE = "return document.getElementById('conn').dataset.conn === 'live'"
PRESENT = "return !!document.querySelector(arguments[0])"
ABSENT = "return !document.querySelector(arguments[0])"
LISTED = ("return [...document.querySelectorAll('#events [data-type=\"' + arguments[0] + '\"]')]"
          ".some(e => e.innerText.includes(arguments[1]))")
MARK = "window.__testMark = arguments[0]; return window.llmproxyPage.loadedAt"
MARKED = "return [window.__testMark, window.llmproxyPage.loadedAt]"


def open_page(driver: Any, proxy: Proxy) -> tuple[str, int]:
    """Load the page at 1280x800, wait until it is live and has read /status; mark the
    window (a reload would lose the mark). The mark and the page's load time."""
    set_viewport(driver, 1280, 800)
    driver.get(proxy.url + "/")
    wait_js(driver, LIVE, what="the event stream live")
    wait_js(driver, "return document.getElementById('pid').textContent === arguments[0]",
            str(proxy.pid), what=f"pid {proxy.pid} shown")
    mark = os.urandom(8).hex()
    loaded_at = driver.execute_script(MARK, mark)
    return mark, loaded_at


CSP_VIOLATIONS = """
    const done = arguments[arguments.length - 1];
    const seen = new ReportingObserver(() => {}, {types: ["csp-violation"], buffered: true});
    seen.observe();
    setTimeout(() => done(seen.takeRecords().map((r) => JSON.stringify(r.body))), 100);
"""


def csp_violations(driver: Any) -> list[str]:
    """Every Content-Security-Policy violation the page reported since it loaded."""
    found: list[str] = driver.execute_async_script(CSP_VIOLATIONS)
    return found


def not_reloaded(driver: Any, mark: str, loaded_at: int) -> None:
    assert driver.execute_script(MARKED) == [mark, loaded_at], "the page was reloaded"


# -- the tests ---------------------------------------------------------------------------
def test_page_shows_hosts_models_and_state(driver: Any, proxy: Proxy) -> None:
    """Loaded from the proxy alone (no other origin), the page shows both hosts with
    their roster, the merged models (an alias as such), the process's state and pid,
    and says its event stream is live; nothing of it broke its Content-Security-Policy."""
    open_page(driver, proxy)
    hosts = text_of(driver, "hosts")
    assert "gpu1" in hosts and "laptop" in hosts
    assert "qwen-up" in hosts and "roster ok" in hosts
    wait_js(driver, PRESENT, '#models [data-model="coder"]', what="the models table")
    models = text_of(driver, "models")
    assert "alias of qwen" in models and "32,768" in models and "mistral-up" in models
    assert text_of(driver, "state") == "ready"
    assert text_of(driver, "conn") == "live"
    assert driver.execute_script("return document.getElementById('banner').hidden")
    # every resource came from the proxy itself
    origins = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")
    assert set(origins) <= {proxy.url}, origins
    assert csp_violations(driver) == []


def test_stream_enters_and_leaves_the_in_flight_list_live(
        driver: Any, proxy: Proxy, artifacts: Path) -> None:
    """A slow stream's request id shows in the in-flight list within 1 s of its
    response headers, stays while it streams, and leaves when it ends (its end is
    listed in the events), all from the event stream, without reloading the page."""
    mark, loaded_at = open_page(driver, proxy)
    stream = Stream(proxy.port)
    rid = stream.request_id()
    headers_at = time.monotonic()
    assert rid, "no X-Request-Id"
    row = f'#inflight [data-id="{rid}"]'
    wait_js(driver, PRESENT, row, what=f"{rid} in flight", timeout=1.0)
    assert time.monotonic() - headers_at <= 1.0
    text = driver.execute_script("return document.querySelector(arguments[0]).innerText", row)
    assert "coder" in text and "gpu1" in text
    assert stream.halfway.wait(10)
    assert driver.execute_script(PRESENT, row), "gone before the end"
    screenshot(driver, artifacts, "page-1280x800.png")
    stream.join(15)
    assert stream.body.rstrip().endswith(b"data: [DONE]")
    wait_js(driver, ABSENT, row, what=f"{rid} out of the in-flight list", timeout=2.0)
    assert time.monotonic() - stream.ended_at <= 2.5
    wait_js(driver, LISTED, "request.end", rid, what=f"the end of {rid} in the events",
            timeout=2.0)
    not_reloaded(driver, mark, loaded_at)
    screenshot(driver, artifacts, "page-1280-full.png", full=True)


def test_sighup_reload_shows_in_events_and_models(
        driver: Any, proxy: Proxy, engines: tuple[SimEngine, SimEngine]) -> None:
    """After the config gains an alias and the proxy gets SIGHUP, the reload event
    appears in the page's events list, the last reload says applied, and the models
    table lists the new alias: live, without reloading the page."""
    mark, loaded_at = open_page(driver, proxy)
    proxy.write_config(config(engines, aliases={"coder": "qwen", "fast": "mistral"}))
    proxy.signal(signal.SIGHUP)
    proxy.wait_for(r"reload: applied aliases \(\+fast\)")
    wait_js(driver, LISTED, "reload", "applied", what="the reload event", timeout=3.0)
    wait_js(driver, PRESENT, '#models [data-model="fast"]', what="the new alias", timeout=3.0)
    assert "alias of mistral" in text_of(driver, "models")
    wait_js(driver, "return document.getElementById('last-reload').innerText.includes('applied')",
            what="the last reload's outcome", timeout=3.0)
    not_reloaded(driver, mark, loaded_at)


def test_phone_width_needs_no_horizontal_scrolling(
        driver: Any, proxy: Proxy, artifacts: Path) -> None:
    """At 375 px wide, with a request in flight, the page itself never scrolls
    sideways (its tables scroll inside their own box) and every section is there."""
    open_page(driver, proxy)
    stream = Stream(proxy.port, model="mistral", tokens=10, delay=0.2)
    rid = stream.request_id()
    set_viewport(driver, 375, 800)
    wait_js(driver, PRESENT, f'#inflight [data-id="{rid}"]', what=f"{rid} in flight",
            timeout=2.0)
    widths = driver.execute_script(
        "return [document.documentElement.scrollWidth, window.innerWidth,"
        " document.body.scrollWidth]")
    assert widths[0] <= widths[1] and widths[2] <= widths[1], widths
    for section in ("hosts", "inflight", "models", "lifecycle", "events"):
        visible = driver.execute_script(
            "const r = document.getElementById(arguments[0]).closest('section')"
            ".getBoundingClientRect();"
            "return r.width > 0 && r.left >= 0 && r.right <= window.innerWidth", section)
        assert visible, section
    screenshot(driver, artifacts, "page-375x800.png")
    screenshot(driver, artifacts, "page-375-full.png", full=True)
    stream.join(15)
    set_viewport(driver, 1280, 800)


def test_page_shows_reconnecting_and_follows_a_restarted_proxy(
        driver: Any, engines: tuple[SimEngine, SimEngine], tmp_path: Path,
        artifacts: Path) -> None:
    """When the proxy stops, the page says "reconnecting…" (banner and badge) while
    its EventSource retries; when a new proxy answers on the same port it is live
    again and shows the new process (pid), without reloading the page."""
    port = free_port()
    (tmp_path / "one").mkdir()
    first = Proxy(config(engines, listen=f"127.0.0.1:{port}"), tmp_path / "one")
    try:
        mark, loaded_at = open_page(driver, first)
        assert first.stop() == 0
        wait_js(driver, "return document.getElementById('conn').dataset.conn === 'reconnecting'",
                what="the reconnecting badge", timeout=5.0)
        assert text_of(driver, "conn") == "reconnecting…"
        assert "reconnecting" in text_of(driver, "banner")
        screenshot(driver, artifacts, "page-reconnecting-1280x800.png")
        wait_js(driver, LISTED, "stop", "", what="the stop event listed", timeout=2.0)
    finally:
        first.stop()
    (tmp_path / "two").mkdir()
    second = Proxy(config(engines, listen=f"127.0.0.1:{port}"), tmp_path / "two")
    try:
        wait_js(driver, LIVE, what="live again", timeout=10.0)
        wait_js(driver, "return document.getElementById('pid').textContent === arguments[0]",
                str(second.pid), what=f"the new pid {second.pid}", timeout=5.0)
        assert driver.execute_script("return document.getElementById('banner').hidden")
        not_reloaded(driver, mark, loaded_at)
    finally:
        second.stop()


def test_a_refused_event_stream_is_said_and_the_page_polls_status(
        driver: Any, engines: tuple[SimEngine, SimEngine], tmp_path: Path,
        artifacts: Path) -> None:
    """With max_event_subscribers 1 and that slot held by another client, the page
    says its stream was refused (badge "polling", a banner quoting the proxy's
    reason and saying it re-reads /status), still shows the process, and a stream
    enters its in-flight list through those reads (no event stream); once the slot
    is freed it goes live on its own, without a reload. Everything under its CSP."""
    proxy = Proxy(config(engines, max_event_subscribers=1), tmp_path)
    holder = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    try:
        holder.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert holder.recv(4096).startswith(b"HTTP/1.1 200 ")
        set_viewport(driver, 1280, 800)
        driver.get(proxy.url + "/")
        wait_js(driver, "return document.getElementById('conn').dataset.conn === 'polling'",
                what="the polling badge", timeout=5.0)
        mark = os.urandom(8).hex()
        loaded_at = driver.execute_script(MARK, mark)
        assert text_of(driver, "conn") == "polling"
        banner = text_of(driver, "banner")
        assert "refused this page's event stream" in banner and "max_event_subscribers" in banner
        assert "re-reads /status every 3 s" in banner
        wait_js(driver, "return document.getElementById('pid').textContent === arguments[0]",
                str(proxy.pid), what=f"pid {proxy.pid} shown")
        stream = Stream(proxy.port, tokens=40, delay=0.2)
        rid = stream.request_id()
        wait_js(driver, PRESENT, f'#inflight [data-id="{rid}"]', what=f"{rid} by polling",
                timeout=5.0)
        screenshot(driver, artifacts, "page-refused-1280x800.png")
        holder.close()
        wait_js(driver, LIVE, what="live once the slot is free", timeout=15.0)
        assert driver.execute_script("return document.getElementById('banner').hidden")
        not_reloaded(driver, mark, loaded_at)
        assert csp_violations(driver) == []
        stream.join(15)
    finally:
        holder.close()
        proxy.stop()


def test_token_latency_panel_shows_each_models_figures(driver: Any, proxy: Proxy) -> None:
    """After a stream of 8 tokens 50 ms apart, the Token latency panel (its own
    script, page/tokens.js, read from /metrics) shows the model's time to first
    token, its engine part, a median gap of no less than 50 ms and an output
    rate, without breaking the Content-Security-Policy."""
    stream = Stream(proxy.port, model="coder", tokens=8, delay=0.05)
    stream.join(15)
    assert stream.body.rstrip().endswith(b"data: [DONE]")
    open_page(driver, proxy)
    row = '#tokens [data-model="coder"]'
    wait_js(driver, PRESENT, row, what="the coder row in Token latency", timeout=8)
    figures = driver.execute_script(
        "return Object.assign({}, document.querySelector(arguments[0]).dataset)", row)
    assert int(figures["streams"]) >= 1
    assert 0 < float(figures["engine"]) <= float(figures["ttft"])
    # The tokens come 50 ms apart (or later): the median's bucket ends at 50 ms or above.
    assert float(figures["gap"]) >= 0.05
    assert float(figures["output"]) > 0
    text = driver.execute_script("return document.querySelector(arguments[0]).innerText", row)
    assert " ms" in text and "tok/s" in text
    assert csp_violations(driver) == []
