"""The agent the proxy brings to a GPU host over ssh: nothing of llmproxy is installed there.

`llmproxy.agent` is standard library only and runs on python3 3.9 or later. `bundle()` packs
its modules (and an empty ``llmproxy/__init__.py``) into a zip whose bytes depend on the
sources alone, so its `digest` names exactly the code this proxy runs. On the host the code
lives unpacked in ``~/.cache/llmproxy/agent-code/<digest>/`` (the reaper runs as a file, so a
directory, not a zip on sys.path), written once by an ``install`` call and kept: every later
call runs ``python3 -c BOOT DIGEST PROTOCOL ARGS...``, which imports the agent from there. A
proxy after an upgrade has another digest, so its agent is its own, never an older one.

The boot's own answers carry ``"protocol": PROTOCOL`` (given on its command line), so an
``"ok": false`` from it (python too old, no code for this digest) reads as the reason it is,
not as an agent of another protocol. An answer with ``"bundle_missing"`` means the host has no
code for this digest (a first contact, or a cache cleaned since): install, then call again.
"""

from __future__ import annotations

import functools
import hashlib
import io
import shlex
import zipfile
from dataclasses import dataclass
from pathlib import Path

# The agent's sources, read as files: the proxy never imports the agent (tests/test_layout.py).
AGENT_PACKAGE = Path(__file__).resolve().parent.parent / "agent"
PYTHON = "python3"          # the host's interpreter, found on its non-interactive PATH
MIN_PYTHON = (3, 9)
CODE_DIR = "~/.cache/llmproxy/agent-code"
_STAMP = (2020, 1, 1, 0, 0, 0)   # every member's date: the zip depends on the sources alone

# Runs on the host: argv is DIGEST PROTOCOL then either ``install`` (the zip on stdin) or the
# agent's own arguments. Python 3.9 syntax, stdlib only; keep it short (it is on every call).
BOOT = r"""
import hashlib,io,json,os,shutil,sys,zipfile
dg,pr=sys.argv[1],int(sys.argv[2])
def say(**a):
    print(json.dumps(dict(a,protocol=pr)));sys.exit(0)
if sys.version_info<MIN:
    v=sys.version.split()[0]
    say(ok=False,error="the agent needs python3 %d.%d or later, found %s"%(MIN+(v,)))
root=os.path.expanduser(DIR);code=os.path.join(root,dg)
if sys.argv[3:4]==["install"]:
    data=sys.stdin.buffer.read()
    if hashlib.sha256(data).hexdigest()!=dg:
        say(ok=False,error="the agent code arrived damaged (%d bytes)"%len(data))
    if not os.path.isdir(code):
        os.makedirs(root,exist_ok=True);tmp=code+".%d"%os.getpid()
        zipfile.ZipFile(io.BytesIO(data)).extractall(tmp)
        try:
            os.rename(tmp,code)
        except OSError:
            shutil.rmtree(tmp,ignore_errors=True)
    say(ok=True,installed=dg,python=sys.version.split()[0])
if not os.path.isdir(code):
    say(ok=False,bundle_missing=dg,error="no agent code "+dg+" on this host")
sys.path.insert(0,code)
from llmproxy.agent.main import main
sys.argv=["llmproxy-agent"]+sys.argv[3:]
sys.exit(main())
""".replace("MIN", repr(MIN_PYTHON)).replace("DIR", repr(CODE_DIR))


@dataclass(frozen=True)
class Bundle:
    """The agent's code as sent to a host: `data` (a zip) and its sha256 `digest`."""

    data: bytes
    digest: str

    def remote(self, protocol: int, *args: str, python: str = PYTHON) -> list[str]:
        """The words after the ssh target that run the boot with `args`, each quoted for the
        remote shell (ssh joins them with spaces and the login shell splits them again)."""
        words = [python, "-I", "-c", BOOT, self.digest, str(protocol), *args]
        return [shlex.quote(w) for w in words]


def sources(package: Path | None = None) -> dict[str, bytes]:
    """The files of the bundle by their path in it: every module of `llmproxy.agent`."""
    folder = package or AGENT_PACKAGE
    files = {"llmproxy/__init__.py": b'"""llmproxy\'s agent, as the proxy ships it."""\n'}
    for path in sorted(folder.glob("*.py")):
        files[f"llmproxy/agent/{path.name}"] = path.read_bytes()
    return files


def pack(files: dict[str, bytes]) -> Bundle:
    """A deterministic zip of `files` (sorted, fixed dates and modes) and its digest."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, _STAMP)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, files[name])
    data = out.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest())


@functools.lru_cache(maxsize=1)
def bundle() -> Bundle:
    """This proxy's agent, packed once per process (its sources do not change under it)."""
    return pack(sources())
