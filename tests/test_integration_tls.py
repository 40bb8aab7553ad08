"""TLS with real processes and certificates made by trustme: https upstreams
verified against a host's CA (a wrong CA or hostname is a 502 that says why),
and the proxy's own TLS listener (the openai SDK over it, a SIGUSR1 upgrade
mid-stream, a renewed certificate picked up on SIGHUP)."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme

from tests import procs
from tests.procs import Proxy, SimEngine, kill_if_alive, wait_gone

pytestmark = pytest.mark.integration


def write_cert(ca: trustme.CA, directory: Path, name: str, *hosts: str) -> tuple[Path, Path]:
    """A certificate for `hosts` signed by `ca`: (chain file, key file)."""
    cert = ca.issue_cert(*hosts)
    chain, key = directory / f"{name}.pem", directory / f"{name}.key"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key.write_bytes(cert.private_key_pem.bytes())
    return chain, key


def https_engine(directory: Path, ca: trustme.CA, name: str, *hosts: str) -> SimEngine:
    chain, key = write_cert(ca, directory, name, *hosts)
    return SimEngine(["m-up"], "--tls-cert", str(chain), "--tls-key", str(key),
                     "--delay", "0.01", "--tokens", "3")


def post(proxy: Proxy, model: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(proxy.url + "/v1/chat/completions", method="POST",
                                     data=json.dumps({"model": model, "messages": []}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("tls-upstreams")
    lan_ca, other_ca = trustme.CA(), trustme.CA()
    (d / "lan-ca.pem").write_bytes(lan_ca.cert_pem.bytes())
    (d / "other-ca.pem").write_bytes(other_ca.cert_pem.bytes())
    good = https_engine(d, lan_ca, "good", "localhost", "127.0.0.1")
    misnamed = https_engine(d, lan_ca, "misnamed", "gpu9.lan")
    foreign = https_engine(d, other_ca, "foreign", "localhost", "127.0.0.1")
    yield {"dir": d, "good": good, "misnamed": misnamed, "foreign": foreign}
    for engine in (good, misnamed, foreign):
        engine.stop()


def test_https_upstreams_are_verified(upstreams: dict[str, Any], tmp_path: Path) -> None:
    """The right CA works (by name and by IP address); a wrong CA and a wrong
    hostname are 502s that say which; insecure_skip_verify works and is
    warned about at start."""
    d, good, misnamed, foreign = (upstreams[k] for k in ("dir", "good", "misnamed", "foreign"))
    port, bad_port = good.port, misnamed.port
    hosts = [
        {"name": "byname", "url": f"https://localhost:{port}", "ca_file": str(d / "lan-ca.pem")},
        {"name": "byip", "url": f"https://127.0.0.1:{port}", "ca_file": str(d / "lan-ca.pem")},
        {"name": "wrongca", "url": f"https://localhost:{foreign.port}",
         "ca_file": str(d / "lan-ca.pem")},
        {"name": "wrongname", "url": f"https://127.0.0.1:{bad_port}",
         "ca_file": str(d / "lan-ca.pem")},
        {"name": "skip", "url": foreign.url, "insecure_skip_verify": True},
    ]
    models = {h["name"]: {"host": h["name"], "upstream": "m-up"} for h in hosts}
    proxy = Proxy({"hosts": hosts, "models": models}, tmp_path)
    try:
        proxy.wait_for(r"host skip: insecure_skip_verify is true: its TLS certificate and "
                       r"hostname are NOT verified")
        assert post(proxy, "byname")[0] == 200
        assert post(proxy, "byip")[0] == 200
        assert post(proxy, "skip")[0] == 200
        status, doc = post(proxy, "wrongca")
        assert (status, doc["error"]["message"]) == (502, (
            "upstream wrongca failed: TLS certificate verification failed: certificate verify "
            "failed (not signed by a CA the host's ca_file trusts, or expired)"))
        status, doc = post(proxy, "wrongname")
        assert (status, doc["error"]["message"]) == (502, (
            "upstream wrongname failed: TLS certificate verification failed: hostname "
            "mismatch: the certificate is not for 127.0.0.1"))
    finally:
        proxy.stop()


def peer_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The certificate (DER) the proxy presents to a new connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def get_json(proxy: Proxy, context: ssl.SSLContext, path: str) -> Any:
    with urllib.request.urlopen(proxy.url + path, timeout=5, context=context) as r:
        return json.load(r)


def test_tls_listener_serves_the_sdk_survives_an_upgrade_and_renews_on_sighup(
        tmp_path: Path) -> None:
    """With `tls` the socket speaks https: the openai SDK (trusting the test CA)
    streams through it; a SIGUSR1 upgrade in the middle of that stream neither
    cuts it nor stops the new process from serving https on the inherited
    socket; a certificate renewed on disk serves new connections after a
    SIGHUP, without a restart; a broken one on SIGHUP keeps the old; `llmproxy
    status --ca-file` asks it over https."""
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    write_cert(ca, tmp_path, "proxy", "localhost", "127.0.0.1")
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    engine = SimEngine(["m-up"])
    proxy = Proxy({"tls": {"cert_file": "proxy.pem", "key_file": "proxy.key"},
                   "hosts": [{"name": "gpu1", "url": engine.url}],
                   "models": {"m": {"host": "gpu1", "upstream": "m-up"}}}, tmp_path)
    new_pid = None
    try:
        assert proxy.url.startswith("https://")
        old_pid = get_json(proxy, context, "/status")["pid"]
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=context))
        stream = iter(client.chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Sim-Tokens": "30", "X-Sim-Delay": "0.05"}))
        words = [next(stream).choices[0].delta.content or ""]
        proxy.signal(signal.SIGUSR1)
        new_pid = int(proxy.wait_for(r"upgrade: handed over to pid (\d+)").group(1))
        words += [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        assert "".join(words) == "".join(f"tok{i} " for i in range(30))
        assert get_json(proxy, context, "/status")["pid"] == new_pid != old_pid
        proxy.wait_for(rf"ready: listening on https://127\.0\.0\.1:{proxy.port} \(inherited")

        before = peer_certificate(proxy.port, context)
        write_cert(ca, tmp_path, "proxy", "localhost", "127.0.0.1")     # renewed in place
        os.kill(new_pid, signal.SIGHUP)
        proxy.wait_for(r"reload: applied tls certificate \(renewed\); re-read tls certificate "
                       r".*proxy\.pem \(sha256 [0-9a-f]{16}\)")
        after = peer_certificate(proxy.port, context)
        renewed = ssl.PEM_cert_to_DER_cert((tmp_path / "proxy.pem").read_text())
        assert after == renewed != before
        (tmp_path / "proxy.key").write_text("not a key")
        os.kill(new_pid, signal.SIGHUP)
        proxy.wait_for(r"reload: kept the running config: the tls certificate is invalid: "
                       r"tls\.key_file")
        assert peer_certificate(proxy.port, context) == renewed
        answer = client.chat.completions.create(model="m", messages=[])
        assert answer.choices[0].message.content
        status = subprocess.run(
            [sys.executable, "-m", "llmproxy.cli", "status", "--url",
             f"https://localhost:{proxy.port}", "--ca-file", str(tmp_path / "ca.pem")],
            check=False, capture_output=True, text=True, env=procs.env(), timeout=30)
        assert status.returncode == 0 and f"pid {new_pid}" in status.stdout, status.stderr
    finally:
        proxy.stop()
        if new_pid is not None:       # the successor is not the process Proxy started
            os.kill(new_pid, signal.SIGTERM)
            assert wait_gone(new_pid)
            kill_if_alive(new_pid)
        engine.stop()
