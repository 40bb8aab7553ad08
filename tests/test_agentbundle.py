"""The agent the proxy brings over ssh (llmproxy/hosts/agentbundle.py): the bundle itself, the
transport's install-then-call on a fake reactor, and the real boot run by a real python3 (the
oldest one found here, 3.9 when there is one) through a stand-in for ssh that runs the remote
words with sh, as a login shell would."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.python.failure import Failure

from llmproxy.agent.protocol import PROTOCOL, Hello
from llmproxy.config import HostConfig
from llmproxy.hosts.agentbundle import AGENT_PACKAGE, CODE_DIR, Bundle, bundle, pack, sources
from llmproxy.hosts.agentclient import AgentError, SSHAgentTransport
from llmproxy.hosts.agentstream import AgentStream
from llmproxy.testing.agentfakes import FakeProcessReactor
from tests import gpuhost

SSH = ("ssh", "-o", "BatchMode=yes")
HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5")
CODE = pack({"llmproxy/__init__.py": b"", "llmproxy/agent/main.py": b"print(1)\n"})


def transport(reactor: FakeProcessReactor) -> SSHAgentTransport:
    return SSHAgentTransport(reactor, SSH, environ={"PATH": "/usr/bin"},
                             killpg=lambda pid, sig: None, agent_code=lambda: CODE)


def answer(reactor: FakeProcessReactor, line: dict[str, Any], status: int = 0) -> None:
    reactor.processes[-1].out(json.dumps(line).encode() + b"\n")
    reactor.processes[-1].exit(status)


def test_the_bundle_is_the_agent_package_and_depends_on_the_sources_alone() -> None:
    """Every module of llmproxy.agent and a stub llmproxy/__init__.py (nothing else of the
    proxy); packing twice gives the same bytes, a changed source another digest."""
    files = sources()
    assert set(files) == {"llmproxy/__init__.py"} | {
        f"llmproxy/agent/{p.name}" for p in AGENT_PACKAGE.glob("*.py")}
    assert "llmproxy/agent/reaper.py" in files
    one, two = pack(files), pack(dict(files))
    assert one == two and one == bundle()
    names = zipfile.ZipFile(io.BytesIO(one.data)).namelist()
    assert names == sorted(files)
    changed = pack({**files, "llmproxy/agent/main.py": files["llmproxy/agent/main.py"] + b"#\n"})
    assert changed.digest != one.digest


def test_a_host_without_agent_command_runs_the_boot_with_this_proxys_digest() -> None:
    """No `agent` in the host's config: ssh runs `python3 -I -c BOOT DIGEST PROTOCOL`, each word
    quoted for the remote shell; an explicit agent command is run as given."""
    reactor = FakeProcessReactor()
    t = transport(reactor)
    t.call(HOST, {"op": "status"}, 30)
    args = reactor.processes[-1].args
    assert args[:5] == ["setsid", "--wait", *SSH]
    assert args[5] == "llm@10.0.0.5"
    assert args[6:9] == ["python3", "-I", "-c"]
    assert args[10:] == [CODE.digest, str(PROTOCOL)]
    explicit = HostConfig("gpu2", "http://10.0.0.6:8081", ssh="llm@10.0.0.6",
                          agent=("/opt/llmproxy/bin/llmproxy-agent",))
    t.call(explicit, {"op": "status"}, 30)
    assert reactor.processes[-1].args[6:] == ["/opt/llmproxy/bin/llmproxy-agent"]


def test_a_first_contact_installs_the_code_then_makes_the_call_again() -> None:
    """`bundle_missing`: the code goes over in an `install` call (the zip on stdin), then the
    same order is sent again and its answer is the call's; later calls install nothing."""
    reactor = FakeProcessReactor()
    t = transport(reactor)
    results: list[Any] = []
    t.call(HOST, {"op": "status"}, 30).addBoth(results.append)
    order = reactor.processes[-1].stdin
    answer(reactor, {"ok": False, "protocol": PROTOCOL, "bundle_missing": CODE.digest,
                     "error": "x"})
    install = reactor.processes[-1]
    assert install.args[-3:] == [CODE.digest, str(PROTOCOL), "install"]
    assert install.stdin == CODE.data and install.stdin_closed
    answer(reactor, {"ok": True, "protocol": PROTOCOL, "installed": CODE.digest})
    assert reactor.processes[-1].stdin == order
    answer(reactor, {"ok": True, "protocol": PROTOCOL, "engines": []})
    assert results == [{"ok": True, "protocol": PROTOCOL, "engines": []}]
    assert len(reactor.processes) == 3
    t.call(HOST, {"op": "status"}, 30)
    assert reactor.processes[-1].args[-1] == str(PROTOCOL)      # the order itself, no install first
    assert len(reactor.processes) == 4


def test_a_refused_install_is_an_agent_error_with_the_hosts_reason() -> None:
    """A python3 too old (the boot's own answer) fails the call, naming why."""
    reactor = FakeProcessReactor()
    t = transport(reactor)
    results: list[Any] = []
    t.call(HOST, {"op": "status"}, 30).addBoth(results.append)
    answer(reactor, {"ok": False, "protocol": PROTOCOL, "bundle_missing": CODE.digest,
                     "error": "x"})
    answer(reactor, {"ok": False, "protocol": PROTOCOL,
                     "error": "the agent needs python3 3.9 or later, found 3.6.15"})
    [failure] = results
    assert isinstance(failure, Failure) and failure.check(AgentError)
    assert str(failure.value) == ("agent on gpu1: cannot install the agent: the agent needs "
                                  "python3 3.9 or later, found 3.6.15")


def test_a_stream_installs_first_and_a_cleaned_cache_ends_it_for_a_fresh_install() -> None:
    """A watch on a host not yet known to hold the code sends it first; a stream told
    `bundle_missing` ends with that reason, and the next one installs again."""
    reactor = FakeProcessReactor()
    t = transport(reactor)
    events: list[dict[str, Any]] = []
    stream = AgentStream(reactor, t, HOST, {"op": "watch"}, events.append, killpg=lambda p, s: None)
    assert reactor.processes[-1].args[-1] == "install"
    answer(reactor, {"ok": True, "protocol": PROTOCOL, "installed": CODE.digest})
    watch = reactor.processes[-1]
    assert json.loads(watch.stdin)["op"] == "watch"
    watch.out(json.dumps({"event": "hello", "protocol": PROTOCOL}).encode() + b"\n")
    assert events == [Hello(PROTOCOL, ())]
    watch.out(json.dumps({"ok": False, "protocol": PROTOCOL, "bundle_missing": CODE.digest,
                          "error": "no agent code here"}).encode() + b"\n")
    assert str(stream.ended.result) == "agent on gpu1: no agent code here"
    AgentStream(reactor, t, HOST, {"op": "watch"}, events.append, killpg=lambda p, s: None)
    assert reactor.processes[-1].args[-1] == "install"


def stand_in_ssh(tmp_path: Path) -> Path:
    """An `ssh` that drops its target and runs the remote words with sh, in a HOME of its own
    and with PATH holding only the host's python3 (no llmproxy anywhere)."""
    home, bindir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bindir.mkdir()
    (bindir / "python3").symlink_to(gpuhost.host_python())
    ssh = tmp_path / "ssh"
    ssh.write_text(f'#!/bin/sh\nshift\nexec env -i HOME={home} PATH={bindir}:/usr/bin:/bin '
                   'sh -c "$*"\n')
    ssh.chmod(0o755)
    return home


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_the_real_boot_installs_and_runs_the_agent_on_the_hosts_own_python(
        tmp_path: Path) -> None:
    """Through real processes: the first call installs the code under the host's HOME, the
    agent answers on the host's python3 (the oldest found here), and a damaged transfer is
    refused without leaving code behind."""
    from twisted.internet import reactor

    home = stand_in_ssh(tmp_path)
    t = SSHAgentTransport(reactor, [str(tmp_path / "ssh")], environ=os.environ)
    got = await t.call(HOST, {"op": "status"}, timeout=30)
    assert got["ok"] is True and got["protocol"] == PROTOCOL and got["engines"] == []
    code = Path(CODE_DIR.replace("~", str(home))) / bundle().digest
    assert (code / "llmproxy" / "agent" / "reaper.py").is_file()
    damaged = SSHAgentTransport(reactor, [str(tmp_path / "ssh")], environ=os.environ,
                                agent_code=lambda: Bundle(b"not a zip", "0" * 64))
    with pytest.raises(AgentError, match=r"cannot install the agent: the agent code arrived "
                                         r"damaged \(9 bytes\)"):
        await damaged.call(HOST, {"op": "status"}, timeout=30)
    assert not (code.parent / ("0" * 64)).exists()
