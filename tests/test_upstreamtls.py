"""The upstream TLS policy built from the config: each https host's own trust,
bad files refused at start naming the field, and one policy per netloc."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trustme

from llmproxy.config import ConfigError, parse_config
from llmproxy.core.failures import describe
from llmproxy.lifecycle.upstreamtls import HostTLSPolicy


def hosts(*extra: dict[str, Any]) -> Any:
    return parse_config({"hosts": [{"name": f"h{i}", **h} for i, h in enumerate(extra)]}).hosts


def test_each_https_host_gets_its_own_creator(tmp_path: Path) -> None:
    """A host with ca_file (and a client certificate) gets a creator of its own;
    http hosts and unknown netlocs fall back to browser-like verification."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client = ca.issue_cert("proxy.lan")
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "c.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "c.key"))
    policy = HostTLSPolicy(hosts(
        {"url": "https://gpu1.lan:8443", "ca_file": str(tmp_path / "ca.pem"),
         "client_cert_file": str(tmp_path / "c.pem"), "client_key_file": str(tmp_path / "c.key")},
        {"url": "http://10.0.0.5:8081"}))
    own = policy.creatorForNetloc(b"GPU1.lan", 8443)
    assert own is policy._by_netloc[(b"gpu1.lan", 8443)]
    assert policy.creatorForNetloc(b"other.lan", 443) is not own
    assert policy.insecure == []


@pytest.mark.parametrize("host, error", [
    ({"url": "https://a:1", "ca_file": "/nonexistent/ca.pem"},
     "hosts[0].ca_file: cannot read /nonexistent/ca.pem: No such file or directory"),
    ({"url": "https://a:1", "ca_file": "EMPTY"}, "hosts[0].ca_file: no PEM certificate in EMPTY"),
])
def test_bad_tls_files_are_config_errors(host: dict[str, Any], error: str, tmp_path: Path) -> None:
    """A CA file that cannot be read or holds no certificate stops the start."""
    if host.get("ca_file") == "EMPTY":
        (tmp_path / "empty.pem").write_text("nothing here")
        host = {**host, "ca_file": str(tmp_path / "empty.pem")}
        error = error.replace("EMPTY", str(tmp_path / "empty.pem"))
    with pytest.raises(ConfigError) as info:
        HostTLSPolicy(hosts(host))
    assert info.value.errors == (error,)


def test_one_netloc_one_tls_policy() -> None:
    """Two hosts on one host:port with different TLS settings cannot be told
    apart by the connection pool: refused, naming the second."""
    with pytest.raises(ConfigError) as info:
        HostTLSPolicy(hosts({"url": "https://a:1/x", "insecure_skip_verify": True},
                            {"url": "https://a:1/y"}))
    assert info.value.errors == ("hosts[1].url: same host and port as hosts[0] with other "
                                 "TLS settings",)


def test_insecure_hosts_are_listed_for_the_start_warning() -> None:
    """insecure_skip_verify hosts are remembered so every start warns about them."""
    policy = HostTLSPolicy(hosts({"url": "https://a:1", "insecure_skip_verify": True}))
    assert policy.insecure == ["h0"]


def test_tls_failures_are_described_in_words() -> None:
    """A chain that does not verify and a certificate for another name each
    read as what they are (they end up in a 502's message)."""
    from ipaddress import IPv4Address

    from OpenSSL import SSL
    from service_identity import VerificationError
    from service_identity.hazmat import DNS_ID, DNSMismatch, IPAddress_ID, IPAddressMismatch

    chain = SSL.Error([("SSL routines", "", "certificate verify failed")])
    assert describe(chain).startswith("TLS certificate verification failed: certificate verify")
    name = VerificationError(errors=[DNSMismatch(mismatched_id=DNS_ID("gpu1.lan"))])
    assert describe(name).endswith("hostname mismatch: the certificate is not for gpu1.lan")
    ip = VerificationError(errors=[IPAddressMismatch(
        mismatched_id=IPAddress_ID(str(IPv4Address("10.0.0.5"))))])
    assert describe(ip).endswith("the certificate is not for 10.0.0.5")
