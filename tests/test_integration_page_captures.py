"""The page's Captures panel (llmproxy/observe/page/captures.js) in headless chromium,
against twistd llmproxy with capture on over two simulated engines (the harness of
test_integration_page: gpu1 serves qwen, laptop serves mistral): a request's capture
appears in the panel live (no reload), opens with its redacted heads and both bodies,
and replays to another model with both answers side by side; with capture off, the
panel says so. Nothing of it breaks the page's Content-Security-Policy.

Skipped when no browser can run, unless LLMPROXY_REQUIRE_BROWSER is set: then it fails.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import test_integration_page as page
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

driver = page.driver
artifacts = page.artifacts
engines = page.engines

TEXT = "return (document.getElementById(arguments[0]) || {}).innerText || ''"


def text(driver: Any, id: str) -> str:
    found: str = driver.execute_script(TEXT, id)
    return found


@pytest.fixture
def capturing(engines: tuple[SimEngine, SimEngine], tmp_path: Path) -> Iterator[Proxy]:
    proxy = Proxy(page.config(engines, capture={"redact": ["$.user"]}), tmp_path)
    yield proxy
    proxy.stop()


def chat(proxy: Proxy, model: str) -> str:
    body = {"model": model, "stream": True, "user": "erin",
            "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-page-secret",
                 "X-Sim-Tokens": "4", "X-Sim-Delay": "0"})
    with urllib.request.urlopen(request, timeout=10) as r:
        r.read()
        return str(r.headers["x-request-id"])


def test_a_capture_shows_live_opens_redacted_and_replays_to_another_model(
        driver: Any, capturing: Proxy, artifacts: Path) -> None:
    """A streamed request for qwen appears in the Captures panel while the page stays
    open (its row: model, host gpu1, 200 completed); clicking it shows its request
    with Authorization and `user` redacted and the answer's events; replaying it to
    mistral shows the captured answer from gpu1 and the new one from laptop side by
    side, each with its status and timings."""
    mark, loaded_at = page.open_page(driver, capturing)
    page.wait_js(driver, "return !!document.getElementById('captures-note')",
                 what="the Captures panel")
    id = chat(capturing, "qwen")
    row = f'#captures tr[data-id="{id}"]'
    page.wait_js(driver, page.PRESENT, row, what=f"{id} in the Captures panel", timeout=5)
    cells = driver.execute_script("return [...document.querySelector(arguments[0]).cells]"
                                  ".map(c => c.innerText)", row)
    assert cells[0] == id and cells[2] == "qwen" and cells[3] == "gpu1", cells
    assert cells[5] == "200 completed", cells
    driver.execute_script("document.querySelector(arguments[0]).click()", row)
    page.wait_js(driver, "return !!document.getElementById('capture-request')",
                 what="the capture opened")
    request = text(driver, "capture-request")
    assert "authorization: [redacted]" in request and '"user": "[redacted]"' in request
    assert "sk-page-secret" not in request and "erin" not in request
    assert "tok0" in text(driver, "capture-answer")
    page.wait_js(driver, "return document.querySelectorAll('#replay-model option').length >= 2",
                 what="the models to replay to")
    driver.execute_script("const s = document.getElementById('replay-model');"
                          "s.value = 'mistral'; document.getElementById('replay-go').click()")
    page.wait_js(driver, "return !!document.getElementById('replay-replayed')",
                 what="the replayed answer", timeout=10)
    captured, replayed = text(driver, "replay-captured"), text(driver, "replay-replayed")
    assert f"captured {id}" in captured and "qwen on gpu1 · 200 · ttfb " in captured
    assert "mistral on laptop · 200 · ttfb " in replayed and "took " in replayed
    assert "tok0 tok1 tok2 tok3" in captured and "tok0 tok1 tok2 tok3" in replayed
    page.screenshot(driver, artifacts, "page-captures.png", full=True)
    page.not_reloaded(driver, mark, loaded_at)
    assert page.csp_violations(driver) == []


def test_with_capture_off_the_panel_says_so(driver: Any, engines: tuple[SimEngine, SimEngine],
                                            tmp_path: Path) -> None:
    """Without a `capture` block the panel lists nothing and says capture is off."""
    proxy = Proxy(page.config(engines), tmp_path)
    try:
        page.open_page(driver, proxy)
        page.wait_js(driver, "return (document.getElementById('captures-note') || {})"
                     ".innerText === arguments[0]",
                     'Capture is off: add a "capture" block to the config.',
                     what="capture said off")
        assert driver.execute_script("return document.getElementById('captures').hidden")
    finally:
        proxy.stop()
