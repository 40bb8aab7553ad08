"""The access files loaded once at start-up (lifecycle/accessfiles.py): every
error in one ConfigError naming its file, variable or field, and the service
built from the loaded value without reading any file again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import trustme
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.lifecycle.accessfiles import AccessFiles, load_access_files
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.components import Process
from llmproxy.testing.fakes import FakeHTTPClient


def config(tmp_path: Path, **top: Any) -> Any:
    return parse_config({
        "listen": "127.0.0.1:0",
        "keys_file": str(tmp_path / "keys.json"),
        "tls": {"cert_file": str(tmp_path / "c.pem"), "key_file": str(tmp_path / "c.key")},
        "hosts": [{"name": "gpu1", "url": "https://gpu1.lan:8443",
                   "ca_file": str(tmp_path / "ca.pem"), "api_key_env": "GPU1_KEY"}],
        **top})


def good_files(tmp_path: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert = ca.issue_cert("localhost")
    (tmp_path / "c.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    (tmp_path / "c.key").write_bytes(cert.private_key_pem.bytes())
    digest = hashlib.sha256(b"sk-alice").hexdigest()
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"name": "alice",
                                                              "sha256": digest}]}))


def test_every_bad_file_and_variable_is_named_in_one_error(tmp_path: Path) -> None:
    """A missing api_key_env variable, a keys file that is not JSON, a CA file
    without a certificate and a missing server certificate: one ConfigError
    with one line each, naming the variable, the file or the field."""
    (tmp_path / "keys.json").write_text("{")
    (tmp_path / "ca.pem").write_text("nothing")
    with pytest.raises(ConfigError) as info:
        load_access_files(config(tmp_path), {})
    errors = info.value.errors
    assert len(errors) == 4, errors
    assert errors[0] == ("hosts[0].api_key_env: the environment variable GPU1_KEY is not set "
                         "(or empty)")
    assert errors[1].startswith(f"{tmp_path / 'keys.json'}: not valid JSON")
    assert errors[2] == f"hosts[0].ca_file: no PEM certificate in {tmp_path / 'ca.pem'}"
    assert errors[3].startswith("tls.cert_file: cannot read")


def test_good_files_load_into_one_value(tmp_path: Path) -> None:
    """The keys, the host's upstream key, its TLS creator and the listener's
    certificate, all from one call; the upstream key is kept out of the repr."""
    good_files(tmp_path)
    files = load_access_files(config(tmp_path), {"GPU1_KEY": "engine-secret"})
    assert files.keys is not None and files.keys.names() == ["alice"]
    assert files.upstream_keys == {"gpu1": "engine-secret"}
    assert (b"gpu1.lan", 8443) in files.tls_policy._by_netloc
    assert files.certificate is not None and files.certificate.fingerprint
    assert "engine-secret" not in repr(files)


def test_a_config_without_access_files_loads_the_defaults(tmp_path: Path) -> None:
    """No keys file, no api_key_env, no tls: keys off, no upstream key, plain http."""
    plain = parse_config({"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]})
    files = load_access_files(plain, {})
    assert (files.keys, dict(files.upstream_keys), files.certificate) == (None, {}, None)
    assert AccessFiles().keys is None and AccessFiles().certificate is None


def test_the_service_is_built_from_the_loaded_value_without_reading_again(
        tmp_path: Path) -> None:
    """Given the loaded value, build_service reads no file and no variable: the
    files may be gone and the environment empty; the service holds the same keys
    and certificate."""
    good_files(tmp_path)
    cfg = config(tmp_path)
    files = load_access_files(cfg, {"GPU1_KEY": "engine-secret"})
    for name in ("keys.json", "c.pem", "c.key", "ca.pem"):
        (tmp_path / name).unlink()
    svc = build_service(ServiceInputs(cfg, Clock(), http=FakeHTTPClient(), access_files=files,
                                      process=Process(environ={})))
    assert svc.access.keys is files.keys
    assert svc.parts.certificate is files.certificate
    assert svc.listener.scheme == "https"


def test_without_the_value_the_service_loads_it_from_its_process_environ(
        tmp_path: Path) -> None:
    """No access files given: build_service loads them from the config and
    `process.environ`, and a bad one is the same ConfigError."""
    good_files(tmp_path)
    cfg = config(tmp_path)
    svc = build_service(ServiceInputs(cfg, Clock(), http=FakeHTTPClient(),
                                      process=Process(environ={"GPU1_KEY": "k"})))
    assert svc.access.keys is not None and svc.access.keys.names() == ["alice"]
    assert svc.parts.certificate is not None
    with pytest.raises(ConfigError) as info:
        build_service(ServiceInputs(cfg, Clock(), http=FakeHTTPClient()))
    assert info.value.errors == ("hosts[0].api_key_env: the environment variable GPU1_KEY "
                                 "is not set (or empty)",)
