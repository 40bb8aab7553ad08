"""https on the listening socket, bound or inherited: the Site's factory wrapped
in Twisted's `TLSMemoryBIOFactory`, whose connections take the certificate in
force when they start. SIGHUP re-reads the certificate and key (a reloadable
part): a renewed certificate serves every new connection without a restart,
and connections already open keep theirs. A socket handed over in an upgrade
is wrapped again by the new process from the same config.

ALPN offers `h2` and `http/1.1` (http/1.1 alone without the h2 package, or
when the HTTP/2 connection cannot be bounded: llmproxy.compat.h2limits): a
client that chooses h2 gets Twisted's HTTP/2 (negotiation.py); one that says
nothing gets HTTP/1.1. Plain TCP listeners are HTTP/1.1 only."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from OpenSSL import SSL, crypto
from twisted.internet import ssl
from twisted.internet.interfaces import IOpenSSLServerConnectionCreator, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web.server import Site
from zope.interface import implementer

from llmproxy.compat.goaway import available as http2_available
from llmproxy.config import Config, ConfigError, TLSConfig
from llmproxy.config.files import read_bytes
from llmproxy.lifecycle.negotiation import NegotiatingFactory
from llmproxy.lifecycle.reload import Staged


def alpn(http2: bool = True) -> list[bytes]:
    """The protocols the listener offers, preferred first (h2 if `http2` and
    it can be served)."""
    return [b"h2", b"http/1.1"] if http2 and http2_available() else [b"http/1.1"]


def load_context(tls: TLSConfig, protocols: list[bytes]) -> tuple[SSL.Context, str]:
    """The server context for the certificate chain and key files, and a
    fingerprint of the leaf; ConfigError naming the field if they are bad."""
    chain = read_bytes(tls.cert_file, "tls.cert_file")
    key = read_bytes(tls.key_file, "tls.key_file")
    pems = [b"-----BEGIN CERTIFICATE-----" + part
            for part in chain.split(b"-----BEGIN CERTIFICATE-----")[1:]]
    if not pems:
        raise ConfigError([f"tls.cert_file: no PEM certificate in {tls.cert_file}"])
    try:
        certs = [ssl.Certificate.loadPEM(pem) for pem in pems]
    except Exception as e:  # pyOpenSSL raises several kinds for a bad PEM
        raise ConfigError([f"tls.cert_file: not a PEM certificate: {e}"]) from None
    try:
        private = ssl.KeyPair.load(key, crypto.FILETYPE_PEM)
        options = ssl.CertificateOptions(
            privateKey=private.original.to_cryptography_key(),
            certificate=certs[0].original.to_cryptography(),
            extraCertChain=[c.original.to_cryptography() for c in certs[1:]],
            acceptableProtocols=protocols)
        context = options.getContext()
    except Exception as e:
        raise ConfigError([f"tls.key_file: not the PEM key of tls.cert_file: {e}"]) from None
    leaf = certs[0].dump(crypto.FILETYPE_ASN1)
    return context, hashlib.sha256(leaf).hexdigest()[:16]


@implementer(IOpenSSLServerConnectionCreator)
class ServerCertificate:
    """The listener's certificate, swappable: each new connection takes the
    context in force when it is accepted."""

    name = "tls certificate"

    def __init__(self, tls: TLSConfig) -> None:
        self.tls = tls
        self.protocols = alpn()
        self._context, self.fingerprint = load_context(tls, self.protocols)

    def serverConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        return SSL.Connection(self._context, None)

    def wrap(self, site: Site, clock: IReactorTime, http2: Callable[[], Protocol] | None = None,
             handshake_seconds: float = 10.0) -> TLSMemoryBIOFactory:
        """`site` served over TLS with this certificate; a client that chose h2
        by ALPN gets `http2()` (None: HTTP/1.1 for every client, and ALPN
        offers http/1.1 alone)."""
        if http2 is None and b"h2" in self.protocols:
            self.protocols = alpn(False)
            self._context, self.fingerprint = load_context(self.tls, self.protocols)
        return TLSMemoryBIOFactory(self, False, NegotiatingFactory(
            site, http2, clock, handshake_seconds), clock=clock)

    def stage(self, config: Config) -> Staged:
        """For a reload: the files read again; in force once committed."""
        tls = config.tls or self.tls      # a change of `tls` itself is refused
        context, fingerprint = load_context(tls, self.protocols)

        def commit() -> None:
            self._context, self.fingerprint = context, fingerprint

        unchanged = fingerprint == self.fingerprint
        label = (f"tls certificate {tls.cert_file} "
                 f"({'unchanged' if unchanged else 'sha256 ' + fingerprint})")
        return Staged(label, [] if unchanged else ["tls certificate (renewed)"], commit)
