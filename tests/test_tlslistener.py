"""The listener's certificate: loaded from its files (errors name the field),
swapped by a reload only when it validates, and taken by new connections."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from llmproxy.config import ConfigError, TLSConfig, parse_config
from llmproxy.lifecycle.tlslistener import ServerCertificate


def issue(ca: trustme.CA, directory: Path) -> TLSConfig:
    cert = ca.issue_cert("localhost")
    chain, key = directory / "c.pem", directory / "c.key"
    chain.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    key.write_bytes(cert.private_key_pem.bytes())
    return TLSConfig(str(chain), str(key))


def config(tls: TLSConfig) -> object:
    return parse_config({"hosts": [{"name": "a", "url": "http://x:1"}],
                         "tls": {"cert_file": tls.cert_file, "key_file": tls.key_file}})


def test_a_reload_swaps_a_renewed_certificate_and_says_so(tmp_path: Path) -> None:
    """Unchanged files stage no change; renewed ones are a change, in force for
    new connections once committed."""
    ca = trustme.CA()
    tls = issue(ca, tmp_path)
    certificate = ServerCertificate(tls)
    first = certificate.fingerprint
    same = certificate.stage(config(tls))  # type: ignore[arg-type]
    assert same.changes == [] and same.label.endswith("(unchanged)")
    issue(ca, tmp_path)
    renewed = certificate.stage(config(tls))  # type: ignore[arg-type]
    assert renewed.changes == ["tls certificate (renewed)"]
    assert certificate.fingerprint == first          # not before the commit
    renewed.commit()
    assert certificate.fingerprint != first
    assert certificate.serverConnectionForTLS(None).get_context() is certificate._context


@pytest.mark.parametrize("breakage, field", [
    ("missing cert", "tls.cert_file: cannot read"),
    ("no pem", "tls.cert_file: no PEM certificate"),
    ("bad key", "tls.key_file: not the PEM key of tls.cert_file"),
    ("other key", "tls.key_file: not the PEM key of tls.cert_file"),
])
def test_bad_files_are_config_errors_naming_the_field(tmp_path: Path, breakage: str,
                                                      field: str) -> None:
    """A missing, empty or mismatched certificate or key: ConfigError by field."""
    ca = trustme.CA()
    tls = issue(ca, tmp_path)
    if breakage == "missing cert":
        Path(tls.cert_file).unlink()
    elif breakage == "no pem":
        Path(tls.cert_file).write_text("nothing")
    elif breakage == "bad key":
        Path(tls.key_file).write_text("nothing")
    else:
        Path(tls.key_file).write_bytes(ca.issue_cert("other").private_key_pem.bytes())
    with pytest.raises(ConfigError) as info:
        ServerCertificate(tls)
    assert info.value.errors[0].startswith(field)


def test_h2_is_offered_only_where_it_is_served(tmp_path: Path) -> None:
    """ALPN offers h2 while an HTTP/2 connection is given to the listener;
    wrapped without one (h2limits' guard failed), it offers http/1.1 alone,
    on the same certificate, and a reload keeps it so."""
    from twisted.internet.task import Clock
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    tls = issue(trustme.CA(), tmp_path)
    served = ServerCertificate(tls)
    served.wrap(Site(Resource()), Clock(), lambda: None)  # type: ignore[arg-type,return-value]
    assert served.protocols == [b"h2", b"http/1.1"]
    plain = ServerCertificate(tls)
    plain.wrap(Site(Resource()), Clock(), None)
    assert plain.protocols == [b"http/1.1"] and plain.fingerprint == served.fingerprint
    plain.stage(config(tls)).commit()  # type: ignore[arg-type]
    assert plain.protocols == [b"http/1.1"]
