"""The status page shows supervision and GPU telemetry, in a real browser: twistd llmproxy
watches its managed host gpu1 over a real sshd on 127.0.0.1, the agent finds a fake
nvidia-smi first on its PATH, and headless chromium (the helpers of test_integration_page)
reads the host's section and the models table: each GPU's figures, a model `loading` while
its engine starts, an engine in a crash loop restarting and then failed with its last exit
and the last lines of its log (inserted as text, never as HTML), and a host whose watch
cannot connect as unreachable.

Skipped when no browser or no sshd can run, unless LLMPROXY_REQUIRE_BROWSER or
LLMPROXY_REQUIRE_SSHD is set: then it fails instead.
"""

from __future__ import annotations

import http.client
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.testing.nvidiasmi import GPU, FakeNvidiaSmi
from tests import sshd as sshd_harness
from tests import test_integration_gpu as gpu
from tests import test_integration_page as page
from tests import test_integration_page_residency as residency_page
from tests import test_integration_supervision as supervision
from tests.procs import Proxy, free_port, wait_until

pytestmark = pytest.mark.integration

driver = page.driver
artifacts = page.artifacts
shows = residency_page.shows

HOSTILE = "<b>x</b> CUDA out of memory & <script>alert(1)</script>"


@pytest.fixture(scope="module")
def proxy(sshd: sshd_harness.SSHD, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """gpu1 with two fake GPUs, engine a (a simulated engine that takes 2 s to start) for
    model ma and engine c for mc (llmproxy.testing.crashengine: 0.3 s after each healthy
    start it says HOSTILE and exits 3); gpu2 on the same sshd, whose agent command
    fails, so its watch never connects."""
    tmp_path = tmp_path_factory.mktemp("supervised")
    smi = FakeNvidiaSmi(tmp_path / "smi")
    smi.gpus([GPU(), gpu.A100])
    doc = gpu.config(sshd, tmp_path, smi)
    host = doc["hosts"][0]
    port = host["url"].rsplit(":", 1)[1]
    slow = " ".join(host["engines"]["a"]["command"][3:])
    host["engines"]["a"]["command"] = [
        "sh", "-c", f"sleep 2; exec {sys.executable} -c "
                    f"'from llmproxy.testing.simengine import main; main()' {slow}"]
    host["engines"]["c"]["command"] = [
        sys.executable, "-m", "llmproxy.testing.crashengine", "--port", port,
        "--crash-after", "0.3", "--say", HOSTILE]
    doc["hosts"].append({"name": "gpu2", "url": f"http://127.0.0.1:{free_port()}",
                         "ssh": sshd.target, "agent": ["false"],
                         "engines": {"z": {"command": ["true"]}}})
    p = Proxy(doc, tmp_path)
    try:
        supervision.watching(p)
        assert wait_until(lambda: p.get_json("/status")["hosts"][0]["engine"]["watch"]["gpus"],
                          timeout=10)
        yield p
    finally:
        p.stop()
        supervision.agent(sshd, tmp_path, "stop", {"grace": 2})


MODEL_STATE = ("const r = document.querySelector('#models [data-model=\"' + arguments[0] + '\"]');"
               "return r ? r.querySelector('td.state').innerText : null")


def test_the_page_shows_each_gpus_figures(driver: Any, proxy: Proxy) -> None:
    """gpu1's section has a row per GPU with its name, memory used of total, utilization,
    temperature and power, and nothing for the power the driver could not read."""
    page.open_page(driver, proxy)
    rows = shows(driver, "gpu1", {"GPU 0": "NVIDIA GeForce RTX 4090", "GPU 1": "A100"},
                 what="gpu1's GPUs")
    assert rows["GPU 0"] == "NVIDIA GeForce RTX 4090 · 1.0 of 24.0 GiB · 37% · 45 °C · 123 W"
    assert rows["GPU 1"] == "NVIDIA A100-SXM4-80GB · 79.1 of 80.0 GiB · 100% · 71 °C", rows


def test_a_host_whose_watch_is_down_shows_as_unreachable(driver: Any, proxy: Proxy) -> None:
    """gpu2's watch cannot start its agent: its section has an `unreachable` badge whose
    tooltip says the watch is down and why, and a Watch row saying so; gpu1's has neither."""
    page.open_page(driver, proxy)
    rows = shows(driver, "gpu2", {"Watch": "down"}, what="gpu2's watch down")
    assert "gpu1" not in rows["Watch"]
    title = driver.execute_script(
        "const b = [...document.querySelectorAll('#hosts [data-host=\"gpu2\"] .host-head .badge')]"
        ".find((e) => e.innerText === 'unreachable' && e.title.startsWith('its watch'));"
        "return b ? b.className + ' | ' + b.title : null")
    assert title and title.startswith("badge bad | its watch session is down: "), title
    assert "Watch" not in residency_page.host_rows(driver, "gpu1")


def test_a_model_whose_engine_starts_shows_loading(driver: Any, proxy: Proxy) -> None:
    """A request for ma starts engine a (2 s): the models table says `loading` for ma
    while it starts and `loaded` once it serves, live from the event stream."""
    mark, loaded_at = page.open_page(driver, proxy)
    page.wait_js(driver, MODEL_STATE, "ma", what="ma in the models table")
    answered: list[int] = []
    asking = threading.Thread(target=lambda: answered.append(
        supervision.post(proxy.port, "ma")[0]), daemon=True)
    asking.start()
    page.wait_until(lambda: driver.execute_script(MODEL_STATE, "ma") == "loading", driver,
                    "ma loading", timeout=3)
    asking.join(30)
    assert answered == [200]
    page.wait_until(lambda: driver.execute_script(MODEL_STATE, "ma") == "loaded", driver,
                    "ma loaded", timeout=3)
    page.not_reloaded(driver, mark, loaded_at)


def test_a_crash_loop_shows_restarting_then_failed_with_its_log_as_text(
        driver: Any, proxy: Proxy, artifacts: Path) -> None:
    """Engine c dies 0.3 s after each healthy start saying HOSTILE: its row says
    `restarting` with its last exit and HOSTILE, then `failed` after the fifth crash; the
    log line shows literally (its `<b>` and `<script>` are text, no element made of them),
    and the events list has the exits; all live, without a reload."""
    mark, loaded_at = page.open_page(driver, proxy)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", '{"model": "mc"}')
    conn.getresponse().read()                   # starts c; it may answer before it dies
    conn.close()
    rows = shows(driver, "gpu1", {"Crashes · c": "restarting"}, what="c restarting",
                 timeout=10)
    assert "last exit status 3" in rows["Crashes · c"] and HOSTILE in rows["Crashes · c"], rows
    rows = shows(driver, "gpu1", {"Crashes · c": "failed"}, what="c failed", timeout=45)
    assert rows["Crashes · c"].startswith("failed 5 crashes in 10 min · last exit status 3"), rows
    tail = driver.execute_script(
        "const r = document.querySelector('#hosts [data-host=\"gpu1\"] [data-engine=\"c\"]');"
        "return [r.querySelector('pre.logtail').textContent,"
        " r.querySelectorAll('b, script').length, r.className]")
    assert tail[0].splitlines()[-2:] == ["loading model", HOSTILE] and tail[1] == 0, tail
    assert "error" in tail[2]
    assert driver.execute_script("return document.querySelectorAll('#events b, #events script')"
                                 ".length") == 0
    page.wait_js(driver, page.LISTED, "engine.exit", HOSTILE + "; failed after 5 crashes",
                 what="the last exit listed", timeout=3)
    page.screenshot(driver, artifacts, "page-supervision-1280x800.png")
    page.not_reloaded(driver, mark, loaded_at)
