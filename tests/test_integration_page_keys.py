"""The status page's Keys panel, in a real browser: twistd llmproxy with a keys file
(public_status, so the page opens without a key) whose key alice has rpm 3 and a tpm,
bob has no limit; after two requests of alice the panel shows what is left of her
minute (1 of 3), her tokens, bob's `no limit`; once alice is refused, her refusals.
A proxy without keys shows no Keys panel.

Skipped when no browser can run, unless LLMPROXY_REQUIRE_BROWSER is set: then it fails.
"""

from __future__ import annotations

import hashlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import test_integration_page as page
from tests.procs import Proxy

pytestmark = pytest.mark.integration

driver = page.driver
engines = page.engines

KEY_ROWS = ("return [...document.querySelectorAll('#keys tbody tr')]"
            ".map((r) => [r.dataset.key, r.innerText])")


def post(proxy: Proxy, secret: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}),
                 {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


@pytest.fixture
def keyed(engines: Any, tmp_path: Path) -> Iterator[Proxy]:
    digest = {n: hashlib.sha256(f"sk-{n}".encode()).hexdigest() for n in ("alice", "bob")}
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [
        {"name": "alice", "sha256": digest["alice"], "rpm": 3, "tpm": 100000,
         "priority": "high"},
        {"name": "bob", "sha256": digest["bob"]}]}))
    p = Proxy(page.config(engines, keys_file=str(tmp_path / "keys.json"), public_status=True),
              tmp_path)
    yield p
    p.stop()


def rows(driver: Any, want: str) -> dict[str, str]:
    found = page.wait_js(driver, "const rows = (" + KEY_ROWS[len("return "):] + ");"
                         "return rows.some((r) => r[1].includes(arguments[0])) ? rows : null",
                         want, what=f"a key row with {want!r}", timeout=15)
    return {name: text for name, text in found}


def test_the_keys_panel_shows_use_against_limits(driver: Any, keyed: Proxy) -> None:
    assert [post(keyed, "sk-alice") for _ in range(2)] == [200, 200]
    page.open_page(driver, keyed)
    shown = rows(driver, "1 left")
    assert "1 left" in shown["alice"] and "of 3" in shown["alice"] and "high" in shown["alice"]
    assert "of 100000" in shown["alice"]
    assert "no limit" in shown["bob"]
    assert post(keyed, "sk-alice") == 200
    assert post(keyed, "sk-alice") == 429
    driver.refresh()
    shown = rows(driver, "0 left")
    assert shown["alice"].rstrip().endswith("1")      # refused once (the last column)


def test_no_keys_no_panel(driver: Any, engines: Any, tmp_path: Path) -> None:
    p = Proxy(page.config(engines), tmp_path)
    try:
        page.open_page(driver, p)
        assert driver.execute_script("return document.getElementById('keys-panel').hidden")
    finally:
        p.stop()
