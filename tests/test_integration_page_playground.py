"""The page's playground in a real browser (headless chromium through selenium) against
`twistd llmproxy` and simulated engines as real processes on 127.0.0.1, on both paths:
a streamed answer appears token by token, Stop cancels the request at the engine, the
timings are shown, and a key typed into the page is sent but never stored.

Skipped when no browser can run, unless LLMPROXY_REQUIRE_BROWSER is set: then it fails.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import test_integration_page as page
from tests.procs import Proxy, SimEngine

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("on_both_paths")]

driver = page.driver
artifacts = page.artifacts
TOKENS = 24          # the quick engine's answer: tok0 ... tok23
SLOW_TOKENS = 400    # the slow engine's: far more than a test waits for


@pytest.fixture(scope="module")
def quick_and_slow() -> Iterator[tuple[SimEngine, SimEngine]]:
    quick = SimEngine(["qwen-up"], "--delay", "0.08", "--tokens", str(TOKENS))
    slow = SimEngine(["slow-up"], "--delay", "0.1", "--tokens", str(SLOW_TOKENS))
    yield quick, slow
    quick.stop()
    slow.stop()


def config(engines: tuple[SimEngine, SimEngine], **extra: Any) -> dict[str, Any]:
    quick, slow = engines
    return {"hosts": [{"name": "gpu1", "url": quick.url}, {"name": "laptop", "url": slow.url}],
            "models": {"qwen": {"host": "gpu1", "upstream": "qwen-up"},
                       "slow": {"host": "laptop", "upstream": "slow-up"}},
            **extra}


@pytest.fixture
def playground_proxy(quick_and_slow: tuple[SimEngine, SimEngine],
                     tmp_path: Path) -> Iterator[Proxy]:
    p = Proxy(config(quick_and_slow), tmp_path)
    yield p
    p.stop()


ANSWER = ("return [...document.querySelectorAll('#pg-log .pg-msg[data-role=\"assistant\"]')]"
          ".map((m) => [m.dataset.state, m.querySelector('.pg-text').textContent])")
STORED = """return [localStorage.length, sessionStorage.length, document.cookie,
                    location.href]"""


def open_playground(driver: Any, proxy: Proxy, model: str) -> None:
    page.open_page(driver, proxy)
    page.wait_js(driver, "return [...document.getElementById('pg-model').options]"
                 ".some((o) => o.value === arguments[0])", model,
                 what=f"{model} in the playground's model list")
    driver.execute_script("const s = document.getElementById('pg-model');"
                          "s.value = arguments[0]; s.dispatchEvent(new Event('change'))", model)


def ask(driver: Any, text: str) -> None:
    driver.find_element("id", "pg-input").send_keys(text)
    driver.find_element("id", "pg-send").click()


def last_answer(driver: Any) -> tuple[str, str]:
    answers = driver.execute_script(ANSWER)
    assert answers, "no answer in the playground"
    state, text = answers[-1]
    return state, text


def watch_answer(driver: Any, until: str, timeout: float = 15.0) -> list[str]:
    """Every distinct text the last answer showed until its state is `until`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        state, text = last_answer(driver)
        if not seen or seen[-1] != text:
            seen.append(text)
        if state == until:
            return seen
        assert time.monotonic() < deadline, f"answer still {state!r}: {text!r}"
        time.sleep(0.02)


def stats(driver: Any) -> dict[str, str]:
    found: dict[str, str] = driver.execute_script(
        "return Object.fromEntries(['pg-ttft', 'pg-tokens', 'pg-rate', 'pg-outcome']"
        ".map((id) => [id, document.getElementById(id).textContent]))")
    return found


def test_a_streamed_answer_appears_token_by_token(driver: Any, playground_proxy: Proxy,
                                                  artifacts: Path) -> None:
    """The model list shows each model's state and host; a question's answer grows in
    the page while the engine streams it (many intermediate texts, each a prefix of the
    next), ends as the engine's whole answer, and the time to first token, the token
    count and the rate are shown; nothing broke the page's CSP."""
    open_playground(driver, playground_proxy, "qwen")
    option = driver.execute_script(
        "return document.getElementById('pg-model').selectedOptions[0].textContent")
    assert "loaded" in option and "gpu1" in option
    assert page.text_of(driver, "pg-model-state") == "loaded"
    assert page.text_of(driver, "pg-auth") == "keys are off: no key needed"
    assert not driver.find_element("id", "pg-key").is_displayed()
    ask(driver, "hi <b>there</b>")
    seen = watch_answer(driver, "done")
    final = seen[-1]
    assert final == "".join(f"tok{i} " for i in range(TOKENS)), final
    growing = [t for t in seen if t]
    assert len(growing) >= 5, f"the answer came in {len(growing)} steps: {growing}"
    assert all(b.startswith(a) for a, b in itertools.pairwise(growing)), growing
    shown = stats(driver)
    assert shown["pg-outcome"] == "done"
    assert shown["pg-tokens"] == str(TOKENS)
    assert shown["pg-ttft"].endswith(" s") and float(shown["pg-ttft"].split()[0]) > 0
    assert shown["pg-rate"].endswith(" tokens/s") and float(shown["pg-rate"].split()[0]) > 0
    # the question is shown as text: no element was made of it
    user = driver.execute_script("const m = document.querySelector('#pg-log [data-role=\"user\"]"
                                 " .pg-text'); return [m.textContent, m.children.length]")
    assert user == ["hi <b>there</b>", 0]
    assert page.csp_violations(driver) == []
    driver.execute_script("document.getElementById('playground').scrollIntoView()")
    page.screenshot(driver, artifacts, "playground-1280x800.png")


def test_stop_cancels_the_request_at_the_engine(
        driver: Any, playground_proxy: Proxy, quick_and_slow: tuple[SimEngine, SimEngine]) -> None:
    """Stop, pressed while the slow engine streams, ends the answer as `stopped` with
    the text received so far, and the engine sees its client go (its record's outcome is
    `client-gone`) within seconds, long before its answer would have ended."""
    slow = quick_and_slow[1]
    before = len(slow.requests())
    open_playground(driver, playground_proxy, "slow")
    ask(driver, "tell me everything")
    page.wait_js(driver, "const t = [...document.querySelectorAll('#pg-log .pg-text')].pop();"
                 "return t && t.textContent.includes('tok3')", what="a few tokens", timeout=10)
    assert page.text_of(driver, "pg-outcome") == "streaming"
    driver.find_element("id", "pg-stop").click()
    text = watch_answer(driver, "stopped", timeout=5)[-1]
    assert "tok3" in text
    deadline = time.monotonic() + 5
    while True:
        mine = slow.requests()[before:]
        if mine and mine[-1].get("outcome") == "client-gone":
            break
        assert time.monotonic() < deadline, f"the engine did not see the client go: {mine}"
        time.sleep(0.05)
    assert len(mine) == 1
    assert mine[0]["chunks_sent"] < SLOW_TOKENS / 4
    assert page.text_of(driver, "pg-outcome") == "stopped"
    assert driver.find_element("id", "pg-send").is_enabled()
    assert not driver.find_element("id", "pg-stop").is_enabled()


@pytest.fixture
def keyed_playground(quick_and_slow: tuple[SimEngine, SimEngine],
                     tmp_path: Path) -> Iterator[Proxy]:
    digest = hashlib.sha256(b"sk-alice-secret").hexdigest()
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [
        {"name": "alice", "sha256": digest, "models": ["qwen"]}]}))
    p = Proxy(config(quick_and_slow, keys_file=str(tmp_path / "keys.json"), public_status=True),
              tmp_path)
    yield p
    p.stop()


def test_a_typed_key_is_used_and_never_stored(driver: Any, keyed_playground: Proxy) -> None:
    """With keys on and a public page (opened without a key), the playground says it needs
    a key and a question without one is refused (401, shown); a key typed into the page
    lists the models it may use and its question is answered, counted for that key; and
    neither local nor session storage, a cookie nor the URL holds anything of it."""
    page.open_page(driver, keyed_playground)
    page.wait_js(driver, "return document.getElementById('pg-auth').textContent"
                 ".includes('needs a key')", what="the playground asking for a key")
    driver.find_element("id", "pg-input").send_keys("hi")
    driver.execute_script("const s = document.getElementById('pg-model');"
                          "s.replaceChildren(new Option('qwen', 'qwen')); s.value = 'qwen'")
    driver.find_element("id", "pg-send").click()
    page.wait_js(driver, "return document.getElementById('pg-outcome').textContent === 'failed'",
                 what="the keyless question refused")
    assert "401" in page.text_of(driver, "pg-note")
    key = driver.find_element("id", "pg-key")
    key.send_keys("sk-alice-secret")
    driver.execute_script("document.getElementById('pg-key').dispatchEvent(new Event('change'))")
    page.wait_js(driver, "return [...document.getElementById('pg-model').options]"
                 ".map((o) => o.value).join() === 'qwen'",
                 what="the key's models (qwen alone)")
    assert "typed here" in page.text_of(driver, "pg-auth")
    ask(driver, "hi again")
    watch_answer(driver, "done")
    assert page.text_of(driver, "pg-tokens") == str(TOKENS)
    per_key = keyed_playground.get_json("/status")["access"]["per_key"]
    alice = {k["name"]: k for k in per_key}["alice"]
    assert alice["completion_tokens"] == TOKENS      # the answer was counted for alice
    stored, session, cookie, href = driver.execute_script(STORED)
    assert (stored, session, cookie) == (0, 0, "")
    assert "sk-alice" not in href
    databases = driver.execute_async_script(
        "const done = arguments[0]; indexedDB.databases().then((d) => done(d.length))")
    assert databases == 0



@pytest.fixture
def admin_only(quick_and_slow: tuple[SimEngine, SimEngine], tmp_path: Path) -> Iterator[Proxy]:
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [
        {"name": "root", "sha256": hashlib.sha256(b"sk-root").hexdigest(), "admin": True},
        {"name": "bob", "sha256": hashlib.sha256(b"sk-bob").hexdigest()}]}))
    p = Proxy(config(quick_and_slow, keys_file=str(tmp_path / "keys.json")), tmp_path)
    yield p
    p.stop()


def completion_tokens(proxy: Proxy) -> dict[str, int]:
    """Each key's completion tokens, from /status (read with the admin key)."""
    request = urllib.request.Request(proxy.url + "/status",
                                     headers={"Authorization": "Bearer sk-root"})
    with urllib.request.urlopen(request, timeout=5) as r:
        per_key = json.load(r)["access"]["per_key"]
    return {k["name"]: k.get("completion_tokens", 0) for k in per_key}


def test_the_admin_key_that_opened_the_page_is_used(driver: Any, admin_only: Proxy) -> None:
    """With keys on and the page needing an admin key, a page opened with that key as its
    HTTP Basic password (here in the URL, http://op:KEY@host/) is live (its event stream,
    /status and /metrics read) and its playground's questions go with that key, sent by the
    browser; a key typed into the panel replaces it."""
    page.set_viewport(driver, 1280, 800)
    driver.get(f"http://op:sk-root@127.0.0.1:{admin_only.port}/")
    page.wait_js(driver, page.LIVE, what="the event stream live")
    page.wait_js(driver, "return document.getElementById('pid').textContent === arguments[0]",
                 str(admin_only.pid), what="the status read")
    assert "admin key this page was opened with" in page.text_of(driver, "pg-auth")
    page.wait_js(driver, "return [...document.getElementById('pg-model').options]"
                 ".some((o) => o.value === 'qwen')", what="qwen in the model list")
    driver.execute_script("document.getElementById('pg-model').value = 'qwen'")
    ask(driver, "hi")
    watch_answer(driver, "done")
    assert completion_tokens(admin_only) == {"root": TOKENS, "bob": 0}
    driver.execute_script("window.llmproxyTokens.refresh()")     # the page's /metrics read
    page.wait_js(driver, "return document.querySelectorAll('#tokens tbody tr').length > 0",
                 what="the token latency panel filled from /metrics")
    driver.find_element("id", "pg-key").send_keys("sk-bob")
    driver.execute_script("document.getElementById('pg-key').dispatchEvent(new Event('change'))")
    page.wait_js(driver, "return document.getElementById('pg-auth').textContent"
                 ".includes('typed here')", what="the typed key in use")
    driver.execute_script("document.getElementById('pg-model').value = 'qwen'")
    ask(driver, "and again")
    page.wait_js(driver, "return document.querySelectorAll('#pg-log [data-state=\"done\"]')"
                 ".length === 2", what="the second answer", timeout=15)
    assert completion_tokens(admin_only) == {"root": TOKENS, "bob": TOKENS}
