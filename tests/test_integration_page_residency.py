"""The status page shows a budgeted host's residency, in a real browser: twistd llmproxy
drives llmproxy-agent over a real sshd on 127.0.0.1 (the harness of
test_integration_residency), two simulated engines run there at once, and headless chromium
(the helpers of test_integration_page) reads the host's section: the memory in use of the
host's `memory_gb`, and one row per resident engine with its state, memory and requests in
flight, following a stream live.

Skipped when no browser or no sshd can run, unless LLMPROXY_REQUIRE_BROWSER or
LLMPROXY_REQUIRE_SSHD is set: then it fails instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from llmproxy.testing.nvidiasmi import FakeNvidiaSmi
from tests import sshd as sshd_harness
from tests import test_integration_page as page
from tests import test_integration_residency as residency
from tests.procs import ROOT, Proxy

pytestmark = pytest.mark.integration

# The fixtures of the modules this one borrows from, each set up once for this module.
driver = page.driver
artifacts = page.artifacts

ROWS = """
    const host = document.querySelector('#hosts article[data-host="' + arguments[0] + '"]');
    if (!host) return null;
    return [...host.querySelectorAll('.kv-row')].map(
        (r) => [r.querySelector('dt').innerText, r.querySelector('dd').innerText]);
"""


def host_rows(driver: Any, host: str) -> dict[str, str]:
    """The host's section on the page: each row's label -> its text."""
    rows = driver.execute_script(ROWS, host)
    return dict(rows or [])


def shows(driver: Any, host: str, want: dict[str, str], what: str,
          timeout: float = 5.0) -> dict[str, str]:
    """Wait until each row `label` of the host's section contains `want[label]`."""
    def check() -> dict[str, str] | None:
        rows = host_rows(driver, host)
        return rows if all(text in rows.get(label, "") for label, text in want.items()) \
            else None
    found: dict[str, str] = page.wait_until(check, driver, what, timeout)
    return found


def test_the_page_shows_a_budgeted_hosts_residency(
        sshd: sshd_harness.SSHD, driver: Any, artifacts: Path, tmp_path: Path) -> None:
    """Engines a and b (4 GB each) started by a request each on gpu1 (memory_gb 10): the
    page's gpu1 section says "2 engines loaded" and "8 of 10 GB in use", lists a and b as
    loaded, 4 GB each, nothing in flight, and not c (not running); a stream on b then shows
    in b's row alone while it runs, and leaves it when it ends, without a reload."""
    gb = residency.GB
    proxy = Proxy(residency.config(sshd, tmp_path, "abc", 10), tmp_path)
    try:
        assert residency.answered(proxy.port, "ma")
        assert residency.answered(proxy.port, "mb")
        mark, loaded_at = page.open_page(driver, proxy)
        idle = f"{gb} GB · 0 requests in flight"
        rows = shows(driver, "gpu1", {"Memory": f"{2 * gb} of 10 GB in use",
                                      "· a": "loaded", "· b": "loaded"},
                     what="gpu1's memory and both engines loaded")
        assert rows["Memory"] == f"{2 * gb} of 10 GB in use", rows
        for name in ("a", "b"):
            assert rows[f"· {name}"].startswith(f"loaded {idle}"), rows
            assert " · for " in rows[f"· {name}"], rows       # since when it is loaded
        assert "· c" not in rows, rows
        assert rows["Engine"] == "2 engines loaded", rows   # not the last started alone
        # the state badge is a badge, toned as loaded
        tones = driver.execute_script(
            "return [...document.querySelectorAll('#hosts article[data-host=\"gpu1\"] .kv-row')]"
            ".filter((r) => r.querySelector('dt').innerText.startsWith('· '))"
            ".map((r) => r.querySelector('dd .badge')?.className ?? null)")
        assert tones == ["badge ok", "badge ok"], tones
        page.screenshot(driver, artifacts, "page-residency-1280x800.png")

        stream = residency.long_stream(proxy.port, "mb", tokens=20, delay=0.1)
        rows = shows(driver, "gpu1", {"· b": f"{gb} GB · 1 request in flight"},
                     what="the stream in b's row", timeout=3.0)
        assert idle in rows["· a"], rows
        assert rows["Memory"] == f"{2 * gb} of 10 GB in use", rows
        residency.whole(stream, 20, proxy)
        shows(driver, "gpu1", {"· b": idle}, what="b idle again", timeout=3.0)
        page.not_reloaded(driver, mark, loaded_at)
    finally:
        proxy.stop()
        residency.stop_engines(sshd, tmp_path)


def test_the_page_shows_declared_and_measured_memory_side_by_side(
        sshd: sshd_harness.SSHD, driver: Any, artifacts: Path, tmp_path: Path) -> None:
    """Engine a (memory_gb 4) measured at 6 GiB by the fake nvidia-smi on the agent's PATH:
    its row says it counts 6 GB, measured 6 beside declared 4, without a reload."""
    smi = FakeNvidiaSmi(tmp_path / "smi")
    doc = residency.config(sshd, tmp_path, "ab", 10)
    path = f"{smi.directory}{os.pathsep}/usr/local/bin:/usr/bin:/bin"
    doc["hosts"][0]["agent"] = ["env", f"PATH={path}", f"PYTHONPATH={ROOT}", sys.executable,
                                "-m", "llmproxy.agent", "--state-dir", str(tmp_path / "agent")]
    proxy = Proxy(doc, tmp_path)
    try:
        assert residency.answered(proxy.port, "ma")
        mark, loaded_at = page.open_page(driver, proxy)
        shows(driver, "gpu1", {"· a": f"loaded {residency.GB} GB · 0 requests"},
              what="a loaded, not measured")
        smi.apps({residency.agent_status(sshd, tmp_path)["a"]["engine_pid"]: 6 * 1024})
        # An idle engine's memory is sampled every TELEMETRY_SECONDS (10), and the page
        # re-reads /status every 10 s while it watches a host: up to 20 s, and a margin.
        rows = shows(driver, "gpu1", {"· a": "6 GB (measured 6, declared 4) · 0 requests"},
                     what="a's measured figure beside its declared one", timeout=30.0)
        assert rows["Memory"] == "6 of 10 GB in use", rows
        page.not_reloaded(driver, mark, loaded_at)
    finally:
        proxy.stop()
        residency.stop_engines(sshd, tmp_path)
