"""One validation (issue 45, item 5): `llmproxy check` runs the loader `twistd
llmproxy` runs, so each config twistd refuses (exit 78) check refuses too (exit
78), with the same message lines, naming the field, file or variable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import env, twistd

pytestmark = pytest.mark.integration

HOST = {"name": "gpu1", "url": "http://127.0.0.1:9"}
UNSET = "LLMPROXY_TEST_SURELY_UNSET_KEY"

# name -> the config (a JSON value, or raw text) and a line both must print.
CORPUS: dict[str, tuple[object, str]] = {
    "tls cert missing": ({"hosts": [HOST], "tls": {"cert_file": "no-cert.pem",
                                                    "key_file": "no-key.pem"}},
                         "no-cert.pem"),
    "upstream CA missing": ({"hosts": [{**HOST, "url": "https://127.0.0.1:9",
                                        "ca_file": "no-ca.pem"}]}, "no-ca.pem"),
    "api_key_env unset": ({"hosts": [{**HOST, "api_key_env": UNSET}]},
                          f"hosts[0].api_key_env: the environment variable {UNSET} is not set"),
    "keys file missing": ({"hosts": [HOST], "keys_file": "no-keys.json"}, "no-keys.json"),
    "keys file unknown key": ({"hosts": [HOST], "keys_file": "keys.json"},
                              'keys[0].nmae: unknown key (did you mean "name"?)'),
    "unknown key": ({"hosts": [{**HOST, "max_conncurrent": 2}]},
                    'hosts[0].max_conncurrent: unknown key (did you mean "max_concurrent"?)'),
    "bad listen": ({"hosts": [HOST], "listen": "gpu-box:80"}, "listen: not a host:port"),
    "not JSON": ('{"hosts": [', "not valid JSON"),
}


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in env().items() if k != UNSET}
    e["PATH"] = f"{Path(sys.executable).parent}:{e.get('PATH', '')}"
    return subprocess.run(argv, cwd=cwd, env=e, capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.parametrize("name", CORPUS)
def test_check_refuses_what_twistd_refuses_with_the_same_lines(name: str,
                                                              tmp_path: Path) -> None:
    """Both exit 78; the error lines check prints (but its count) are the lines
    twistd prints under `invalid config PATH:`, and include the expected one."""
    config, expected = CORPUS[name]
    path = tmp_path / "hosts.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    (tmp_path / "keys.json").write_text(json.dumps(
        {"keys": [{"nmae": "a", "name": "a", "sha256": "0" * 64}]}))
    checked = run([sys.executable, "-m", "llmproxy.cli", "check", "-c", str(path)], tmp_path)
    served = run([twistd(), "-n", "--pidfile=", "llmproxy", "-c", str(path)], tmp_path)
    assert (checked.returncode, served.returncode) == (78, 78), (checked.stderr, served.stdout,
                                                                 served.stderr)
    lines = checked.stderr.splitlines()
    assert lines[-1].startswith(f"llmproxy check: {path}: ")
    errors = lines[:-1]
    assert any(expected in line for line in errors), errors
    said = served.stderr.split(f"llmproxy: invalid config {path}:\n", 1)
    assert len(said) == 2, served.stderr
    assert said[1].splitlines()[:len(errors)] == errors
