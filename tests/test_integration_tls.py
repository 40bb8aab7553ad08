"""TLS with real processes and certificates made by trustme: https upstreams
verified against a host's CA (a wrong CA or hostname is a 502 that says why),
and the proxy's own TLS listener (the openai SDK over it, a SIGUSR1 upgrade
mid-stream, a renewed certificate picked up on SIGHUP)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.procs import Proxy, SimEngine

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
