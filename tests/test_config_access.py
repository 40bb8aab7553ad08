"""The config's access and TLS keys: valid values land in the Config, every bad
one is an error naming its field, relative paths follow the config file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmproxy.config import ConfigError, TLSConfig, load_config, parse_config
from llmproxy.lifecycle.reload import refused_changes


def base(**top: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": "https://gpu1.lan:8443"},
                      {"name": "plain", "url": "http://10.0.0.7:8081"}], **top}


def errors(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(obj)
    return list(info.value.errors)


def test_every_access_and_tls_key_given() -> None:
    """keys_file, public_status, tls and each host key land in the value."""
    obj = base(keys_file="/etc/llmproxy/keys.json", public_status=True,
               tls={"cert_file": "/c.pem", "key_file": "/k.pem"})
    obj["hosts"][0].update(api_key_env="GPU1_KEY", ca_file="/ca.pem",
                           client_cert_file="/cc.pem", client_key_file="/ck.pem")
    obj["hosts"][1].update(api_key_env="PLAIN_KEY")
    config = parse_config(obj)
    assert (config.keys_file, config.public_status) == ("/etc/llmproxy/keys.json", True)
    assert config.tls == TLSConfig("/c.pem", "/k.pem")
    gpu1 = config.hosts[0]
    assert (gpu1.api_key_env, gpu1.ca_file, gpu1.client_cert_file, gpu1.client_key_file,
            gpu1.insecure_skip_verify) == ("GPU1_KEY", "/ca.pem", "/cc.pem", "/ck.pem", False)
    defaults = parse_config(base())
    assert (defaults.keys_file, defaults.public_status, defaults.tls) == (None, False, None)


@pytest.mark.parametrize("top, expected", [
    ({"keys_file": ""}, ["keys_file: must be a non-empty file path"]),
    ({"public_status": "yes"}, ["public_status: must be true or false"]),
    ({"tls": "cert.pem"}, ['tls: must be a JSON object with "cert_file" and "key_file"']),
    ({"tls": {"cert_file": "c", "x": 1}}, ["tls.x: unknown key", "tls.key_file: required"]),
])
def test_bad_top_level_values_name_their_field(top: dict[str, Any], expected: list[str]) -> None:
    """Each bad top-level access or TLS value is one error naming its field."""
    assert errors(base(**top)) == expected


@pytest.mark.parametrize("host, expected", [
    ({"api_key_env": "sk-live-123"}, ["hosts[0].api_key_env: must name an environment variable "
                                      "([A-Za-z_][A-Za-z0-9_]*), never hold the key itself"]),
    ({"insecure_skip_verify": "true"}, ["hosts[0].insecure_skip_verify: must be true or false"]),
    ({"client_cert_file": "c.pem"}, ["hosts[0].client_key_file: required with client_cert_file"]),
    ({"insecure_skip_verify": True, "ca_file": "ca.pem"},
     ["hosts[0].ca_file: pointless with insecure_skip_verify: true"]),
])
def test_bad_host_values_name_their_field(host: dict[str, Any], expected: list[str]) -> None:
    """Each bad host access or TLS value is an error naming the host's field."""
    obj = base()
    obj["hosts"][0].update(host)
    assert errors(obj) == expected


def test_tls_keys_only_for_an_https_url() -> None:
    """ca_file and friends on an http:// host are errors, one per key."""
    obj = base()
    obj["hosts"][1].update(ca_file="ca.pem", insecure_skip_verify=True)
    assert errors(obj) == ["hosts[1].ca_file: only for an https url",
                           "hosts[1].insecure_skip_verify: only for an https url",
                           "hosts[1].ca_file: pointless with insecure_skip_verify: true"]


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    """A reload or a restart from another directory reads the same files."""
    obj = base(keys_file="keys.json", tls={"cert_file": "tls/c.pem", "key_file": "/k.pem"})
    obj["hosts"][0]["ca_file"] = "ca.pem"
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(obj))
    config = load_config(str(path))
    assert config.keys_file == str(tmp_path / "keys.json")
    assert config.tls == TLSConfig(str(tmp_path / "tls" / "c.pem"), "/k.pem")
    assert config.hosts[0].ca_file == str(tmp_path / "ca.pem")


def test_access_and_tls_settings_need_a_restart() -> None:
    """Changing keys_file, public_status, tls or a host's TLS files is refused
    by a reload, by name (the files' contents are what a reload re-reads)."""
    old = parse_config(base(keys_file="/a.json"))
    new_obj = base(keys_file="/b.json", public_status=True,
                   tls={"cert_file": "/c", "key_file": "/k"})
    new_obj["hosts"][0]["ca_file"] = "/ca.pem"
    assert refused_changes(old, parse_config(new_obj)) == [
        "hosts[0].ca_file changed: restart to apply",
        "keys_file changed: restart to apply",
        "public_status changed: restart to apply",
        "tls changed: restart to apply",
    ]


def test_llmproxy_check_validates_the_keys_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`llmproxy check` reads the keys file too: its errors name the file and field."""
    from llmproxy.cli import main
    from llmproxy.cli.check import EXIT_CONFIG

    (tmp_path / "keys.json").write_text('{"keys": [{"name": "a", "sha256": "sk-secret"}]}')
    (tmp_path / "hosts.json").write_text(json.dumps(base(keys_file="keys.json")))
    assert main(["check", "-c", str(tmp_path / "hosts.json")]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{tmp_path / 'keys.json'}: keys[0].sha256: required" in err
    assert "sk-secret" not in err


def test_commands_default_to_https_with_a_tls_listener(tmp_path: Path) -> None:
    """`llmproxy reload/status/upgrade -c hosts.json` ask https://... when the
    config has `tls`, http://... otherwise."""
    import argparse

    from llmproxy.cli.proxyclient import proxy_url

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(base(listen="0.0.0.0:8443",
                                    tls={"cert_file": "c", "key_file": "k"})))
    assert proxy_url(argparse.Namespace(url=None, config=str(path))) == "https://127.0.0.1:8443"
    path.write_text(json.dumps(base(listen="127.0.0.1:8080")))
    assert proxy_url(argparse.Namespace(url=None, config=str(path))) == "http://127.0.0.1:8080"
