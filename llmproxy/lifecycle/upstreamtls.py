"""TLS to https upstreams: each host's own trust, always verified.

A host with an https url is verified against its `ca_file` (a LAN CA; the
system's roots without one), certificate and hostname (or IP address) alike,
by Twisted's `optionsForClientTLS` with `service-identity`; it may present a
client certificate (`client_cert_file`, `client_key_file`).
`insecure_skip_verify: true` turns verification off for that host only, as an
explicit choice that is logged as a warning at every start. A failed
verification fails the request before its headers: a 502 that names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from OpenSSL import SSL
from twisted.internet import ssl
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.logger import Logger
from twisted.web.client import BrowserLikePolicyForHTTPS
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from llmproxy.config import ConfigError, HostConfig
from llmproxy.config.files import read_bytes

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


@implementer(IOpenSSLClientConnectionCreator)
@dataclass(frozen=True)
class _Unverified:
    """TLS without any verification (insecure_skip_verify), SNI still sent."""

    hostname: bytes

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        context = SSL.Context(SSL.TLS_CLIENT_METHOD)
        context.set_verify(SSL.VERIFY_NONE, lambda *args: True)
        connection = SSL.Connection(context, None)
        connection.set_app_data(tlsProtocol)
        connection.set_tlsext_host_name(self.hostname)
        connection.set_connect_state()
        return connection


def _creator(host: HostConfig, index: int, hostname: str) -> Any:
    """The connection creator for one https host; ConfigError naming the field."""
    where = f"hosts[{index}]"
    if host.insecure_skip_verify:
        return _Unverified(hostname.encode("idna"))
    trust: Any = None
    if host.ca_file is not None:
        pems = _PEM_CERT.findall(read_bytes(host.ca_file, f"{where}.ca_file"))
        if not pems:
            raise ConfigError([f"{where}.ca_file: no PEM certificate in {host.ca_file}"])
        try:
            trust = ssl.trustRootFromCertificates([ssl.Certificate.loadPEM(p) for p in pems])
        except Exception as e:  # pyOpenSSL raises several kinds for a bad PEM
            raise ConfigError([f"{where}.ca_file: not a PEM certificate: {e}"]) from None
    client = None
    if host.client_cert_file is not None and host.client_key_file is not None:
        pem = (read_bytes(host.client_cert_file, f"{where}.client_cert_file") + b"\n"
               + read_bytes(host.client_key_file, f"{where}.client_key_file"))
        try:
            client = ssl.PrivateCertificate.loadPEM(pem)
        except Exception as e:
            raise ConfigError([f"{where}.client_cert_file: not a PEM certificate and key "
                               f"that match: {e}"]) from None
    return ssl.optionsForClientTLS(hostname, trustRoot=trust, clientCertificate=client)


@implementer(IPolicyForHTTPS)
class HostTLSPolicy:
    """The engine client's TLS policy: a host's own settings for its netloc, the
    system's browser-like verification for anything else."""

    log = Logger()

    def __init__(self, hosts: tuple[HostConfig, ...]) -> None:
        self._by_netloc: dict[tuple[bytes, int], Any] = {}
        self.insecure: list[str] = []
        first: dict[tuple[bytes, int], tuple[int, tuple[Any, ...]]] = {}
        for i, host in enumerate(hosts):
            parts = urlsplit(host.url)
            if parts.scheme != "https" or parts.hostname is None:
                continue
            key = (parts.hostname.encode("idna").lower(), parts.port or 443)
            settings = (host.ca_file, host.client_cert_file, host.client_key_file,
                        host.insecure_skip_verify)
            if key in first and first[key][1] != settings:
                # One netloc, one TLS policy (and one pool of connections).
                raise ConfigError([f"hosts[{i}].url: same host and port as "
                                   f"hosts[{first[key][0]}] with other TLS settings"])
            first.setdefault(key, (i, settings))
            self._by_netloc[key] = _creator(host, i, parts.hostname)
            if host.insecure_skip_verify:
                self.insecure.append(host.name)
        self._default = BrowserLikePolicyForHTTPS()

    def trust_own_socket(self, url: str) -> None:
        """`url` is this process's own listening socket, handed to an upgrade's
        successor: requests re-sent there reach the successor over https with
        our certificate, whose names need not include the loopback address.
        The kernel guarantees who answers (the socket is the one this process
        bound or inherited; nobody else can hold it), so it is not verified."""
        parts = urlsplit(url)
        if parts.scheme == "https" and parts.hostname is not None:
            host = parts.hostname.encode("idna").lower()
            self._by_netloc[(host, parts.port or 443)] = _Unverified(host)

    def warn(self) -> None:
        """The warning every start logs for each host that is not verified."""
        for name in self.insecure:
            self.log.warn("host {host}: insecure_skip_verify is true: its TLS certificate and "
                          "hostname are NOT verified", host=name)

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        found = self._by_netloc.get((hostname.lower(), port))
        return found if found is not None else self._default.creatorForNetloc(hostname, port)
