"""Admin actions refuse what another web site's page may send, against a real
`twistd -n llmproxy` (plain and over its TLS listener) with raw http.client
requests on 127.0.0.1: a cross-site POST to each admin path is 403 and changes
nothing, a rebound Host is 403, while the proxy's own origin and the `llmproxy`
commands still act; and the page is served with its security headers."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.procs import Proxy, SimEngine, env, free_port

pytestmark = pytest.mark.integration

ADMIN = ("/admin/cordon?host=gpu1", "/admin/uncordon?host=gpu1",
         "/admin/engine?host=gpu1&op=stop", "/admin/reload", "/admin/upgrade")


def config(engine: SimEngine, workdir: Path, **extra: Any) -> dict[str, Any]:
    # a port of its own: `llmproxy cordon -c hosts.json` finds the proxy there
    return {"listen": f"127.0.0.1:{free_port()}", "runtime_dir": str(workdir / "run"),
            "hosts": [{"name": "gpu1", "url": engine.url}],
            "models": {"m": {"host": "gpu1"}}, "server_names": ["proxy.test"], **extra}


@pytest.fixture(scope="module")
def proxy(engine: SimEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    workdir = tmp_path_factory.mktemp("proxy")
    p = Proxy(config(engine, workdir), workdir)
    yield p
    p.stop()


def ask(proxy: Proxy, method: str, path: str, headers: dict[str, str],
        context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], Any]:
    """One request carrying exactly these headers (Host 127.0.0.1:PORT unless given)."""
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10,
                                           context=context)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    for name, value in {"Host": f"127.0.0.1:{proxy.port}", **headers}.items():
        conn.putheader(name, value)
    conn.putheader("Content-Length", "0")
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    kind = resp.getheader("content-type") or ""
    return resp.status, dict(resp.getheaders()), json.loads(body) if "json" in kind else body


def cordoned(proxy: Proxy, context: ssl.SSLContext | None = None) -> bool:
    status, _, doc = ask(proxy, "GET", "/status", {}, context)
    assert status == 200
    return bool(doc["hosts"][0]["capacity"]["cordoned"])


def llmproxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_cross_site_post_to_each_admin_path_is_refused_and_changes_nothing(
        proxy: Proxy) -> None:
    """With `Origin: http://evil.example`, every admin path answers 403
    cross_site_request naming the action, each refusal is logged, and then
    /status shows no cordon, no reload, no upgrade, the same pid, ready."""
    for path in ADMIN:
        status, _, doc = ask(proxy, "POST", path, {"Origin": "http://evil.example"})
        assert status == 403, (path, doc)
        assert doc["error"]["code"] == "cross_site_request"
        assert doc["error"]["message"].startswith(f"POST {path.split('?')[0]} refused: Origin")
        proxy.wait_for(rf"refused POST {path.split('?')[0]} from 127\.0\.0\.1: Origin "
                       r"'http://evil\.example'")
    _, _, doc = ask(proxy, "GET", "/status", {})
    assert doc["hosts"][0]["capacity"]["cordoned"] is False
    assert doc["config"]["generation"] == 1 and doc["config"]["last_reload"] is None
    assert doc["last_upgrade"] is None and doc["successor_pid"] is None
    assert doc["pid"] == proxy.pid and doc["state"] == "ready"


def test_a_cross_site_fetch_and_a_rebound_host_are_refused(proxy: Proxy) -> None:
    """Sec-Fetch-Site: cross-site (a no-cors fetch sends no Origin to a GET but
    this header to all) is 403; `Host: evil.example` without a key (DNS
    rebinding) is 403 host_not_allowed; the host stays uncordoned."""
    status, _, doc = ask(proxy, "POST", ADMIN[0], {"Sec-Fetch-Site": "cross-site"})
    assert (status, doc["error"]["code"]) == (403, "cross_site_request")
    status, _, doc = ask(proxy, "POST", ADMIN[0], {"Host": f"evil.example:{proxy.port}",
                                                   "Origin": f"http://evil.example:{proxy.port}",
                                                   "Sec-Fetch-Site": "same-origin"})
    assert (status, doc["error"]["code"]) == (403, "host_not_allowed")
    assert "server_names" in doc["error"]["message"]
    assert not cordoned(proxy)


def test_the_own_origin_a_server_name_and_the_command_still_act(proxy: Proxy) -> None:
    """A same-origin POST (Origin http://127.0.0.1:PORT, Sec-Fetch-Site:
    same-origin) cordons; Host proxy.test (listed in server_names) uncordons;
    `llmproxy cordon gpu1 -c hosts.json` exits 0 and cordons, `uncordon` undoes it."""
    status, _, doc = ask(proxy, "POST", ADMIN[0], {"Origin": f"http://127.0.0.1:{proxy.port}",
                                                   "Sec-Fetch-Site": "same-origin"})
    assert (status, doc["outcome"]) == (200, "cordoned") and cordoned(proxy)
    status, _, doc = ask(proxy, "POST", ADMIN[1], {"Host": f"proxy.test:{proxy.port}"})
    assert (status, doc["outcome"]) == (200, "uncordoned") and not cordoned(proxy)
    done = llmproxy("cordon", "gpu1", "-c", str(proxy.config_path))
    assert done.returncode == 0, done.stderr
    assert cordoned(proxy)
    assert llmproxy("uncordon", "gpu1", "--url", proxy.url).returncode == 0
    assert not cordoned(proxy)


def test_the_page_is_served_with_its_security_headers(proxy: Proxy) -> None:
    """`/` and its assets from the real process carry the CSP (no inline code, no
    framing), nosniff and X-Frame-Options: DENY."""
    for path in ("/", "/page/app.js", "/page/style.css"):
        status, headers, _ = ask(proxy, "GET", path, {})
        headers = {k.lower(): v for k, v in headers.items()}
        assert status == 200
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert "script-src 'self';" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["x-frame-options"] == "DENY"


def test_over_the_tls_listener_the_own_origin_is_https(engine: SimEngine,
                                                      tmp_path: Path) -> None:
    """Behind `tls`, the proxy's own origin is https://127.0.0.1:PORT: that one
    cordons, the same host and port over http:// is another origin (403), and
    `llmproxy reload --url https://... --ca-file` still acts (exit 0: applied)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "chain.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    (tmp_path / "key.pem").write_bytes(cert.private_key_pem.bytes())
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    proxy = Proxy(config(engine, tmp_path, tls={"cert_file": "chain.pem",
                                               "key_file": "key.pem"}), tmp_path)
    try:
        assert proxy.url.startswith("https://")
        status, _, doc = ask(proxy, "POST", ADMIN[0],
                             {"Origin": f"http://127.0.0.1:{proxy.port}"}, context)
        assert (status, doc["error"]["code"]) == (403, "cross_site_request")
        assert f"https://127.0.0.1:{proxy.port}" in doc["error"]["message"]
        assert not cordoned(proxy, context)
        status, _, doc = ask(proxy, "POST", ADMIN[0],
                             {"Origin": f"https://127.0.0.1:{proxy.port}"}, context)
        assert (status, doc["outcome"]) == (200, "cordoned")
        assert cordoned(proxy, context)
        done = llmproxy("reload", "--url", proxy.url, "--ca-file", str(tmp_path / "ca.pem"))
        assert done.returncode == 0, done.stderr
        _, _, doc = ask(proxy, "GET", "/status", {}, context)
        assert doc["config"]["last_reload"]["outcome"] == "applied"
    finally:
        proxy.stop()
