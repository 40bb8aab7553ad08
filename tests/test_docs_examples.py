"""Every JSON example in the README, docs/ and etc/ is a config `llmproxy check` accepts (with
placeholder files substituted): an example a user copies is never refused. A fragment is checked
inside a small config around it (BASE): a host replaces the host of its name, any other key is
laid over BASE; a keys file example is checked as the `keys_file` of BASE."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trustme

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"```json\n(.*?)```", re.S)
_ENGINE = {"command": ["llama-server", "--host", "0.0.0.0", "--port", "8081", "-m", "m.gguf"]}
BASE: dict[str, Any] = {"hosts": [
    {"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
     "engines": {"big": _ENGINE}},
    {"name": "gpu2", "url": "http://10.0.0.6:8081", "ssh": "llm@10.0.0.6",
     "engines": {"big": _ENGINE}},
    {"name": "laptop", "url": "http://10.0.0.7:11434"}]}


def examples() -> list[tuple[str, str]]:
    """(where, text) of every JSON example: fenced ```json blocks and etc/*.json files."""
    found = [(str(path.relative_to(ROOT)), path.read_text())
             for path in sorted((ROOT / "etc").glob("*.json"))]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, m in enumerate(FENCE.finditer(path.read_text())):
            found.append((f"{path.relative_to(ROOT)} example {i + 1}", m.group(1)))
    return [(where, _hashes(text)) for where, text in found]


def _hashes(text: str) -> str:
    """`text` with each key hash shown as "<hex>" made a distinct SHA-256 of its own."""
    parts = text.split('"<hex>"')
    out = parts[0]
    for i, part in enumerate(parts[1:]):
        out += '"' + f"{i:064x}" + '"' + part
    return out


def as_config(text: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The config to check for an example, and a keys file when the example is one."""
    try:
        value = json.loads(text)
    except ValueError:
        value = json.loads("{" + text + "}")     # a fragment of keys: "cors": {...}
    assert isinstance(value, dict), text
    if "hosts" in value:
        return value, None
    if "keys" in value:
        return dict(BASE), value
    if "name" in value and "url" in value:
        return {"hosts": [value, *(h for h in BASE["hosts"] if h["name"] != value["name"])]}, None
    return {**BASE, **value}, None


def substitute(value: Any, files: dict[str, str]) -> Any:
    """`value` with every placeholder path (a string of an absolute path that does not exist
    here) replaced by a file made for the test, by the key that names it."""
    if isinstance(value, dict):
        return {k: files.get(k, v) if isinstance(v, str) and v.startswith("/")
                and not Path(v).exists() and k in files else substitute(v, files)
                for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, files) for v in value]
    return value


@pytest.fixture(scope="module")
def placeholder_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("placeholders")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    paths = {"cert": folder / "cert.pem", "key": folder / "key.pem", "ca": folder / "ca.pem"}
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "k", "key": "sk-" + "x" * 40}]}))
    return {"cert_file": str(paths["cert"]), "key_file": str(paths["key"]),
            "ca_file": str(paths["ca"]), "client_cert_file": str(paths["cert"]),
            "client_key_file": str(paths["key"]), "keys_file": str(keys),
            "access_log": str(folder / "access.log"), "runtime_dir": str(folder)}


def check(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", "check", "-c", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_there_are_examples_of_each_kind() -> None:
    """The collection finds the examples this test is about (a broken pattern finds none)."""
    where = [w for w, _ in examples()]
    assert "etc/hosts.example.json" in where
    assert any(w.startswith("docs/managed-engines.md") for w in where)
    assert any(w.startswith("README.md") for w in where)


@pytest.mark.parametrize(("where", "text"), examples(), ids=[w for w, _ in examples()])
def test_every_json_example_is_a_config_check_accepts(
        where: str, text: str, tmp_path: Path, placeholder_files: dict[str, str]) -> None:
    """`llmproxy check` says ok to the example (its fragment in BASE), exit 0."""
    config, keys = as_config(text)
    config = substitute(config, placeholder_files)
    if keys is not None:
        keys_path = tmp_path / "keys.json"
        keys_path.write_text(json.dumps(keys))
        config["keys_file"] = str(keys_path)
    done = check(config, tmp_path)
    assert done.returncode == 0, f"{where}: {done.stdout}{done.stderr}"
    assert done.stdout.startswith("ok: ")


def test_every_llama_server_example_listens_beyond_loopback_and_names_its_model() -> None:
    """A llama-server in an example passes `--host 0.0.0.0` (else it listens on the GPU host's
    127.0.0.1, out of the proxy's reach) and `--alias` (else its model is named by its path)."""
    for where, text in examples():
        config, _ = as_config(text)
        for host in config.get("hosts", []):
            for name, engine in host.get("engines", {}).items():
                command = engine["command"]
                if command[0] != "llama-server" or host in BASE["hosts"]:
                    continue
                assert "--host" in command, (where, name)
                assert command[command.index("--host") + 1] == "0.0.0.0", (where, name)
                assert "--alias" in command, (where, name)
