"""What ``llmproxy doctor`` asks a GPU host, run there as ``python3 -`` over ssh.

This module's source is sent whole, followed by ``report(PARAMS)``: it must stay standard
library only and readable by Python 3.7 and later (no walrus, no match, no ``X | Y`` outside
annotations), so
that a host whose python3 is too old still says which version it is. `report` prints one JSON
line:

- ``python``: the host's Python version, e.g. ``"3.11.2"``;
- ``engines``: per engine name, ``executable`` (the path its command's first word resolves to
  on this non-interactive PATH, or null) and ``models`` (each model file the command names
  after ``-m``/``--model`` (unless the command is python's), or any argument ending in
  ``.gguf``: ``path`` and ``bytes``, null
  when absent);
- ``listening``: every TCP socket in LISTEN state, ``{"address", "port"}`` (from /proc/net);
- ``nvidia_smi``: the path of nvidia-smi or null; ``gpus``: its answer to GPU_QUERY, or
  ``gpu_error``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

MODEL_FLAGS = ("-m", "--model")
# llmproxy.agent.gpus.QUERY, whose parser reads the answer (a test keeps them equal)
GPU_QUERY = ["--query-gpu=index,name,memory.used,memory.total,utilization.gpu,"
             "temperature.gpu,power.draw", "--format=csv,noheader,nounits"]


def _models(command: list[str]) -> list[dict[str, object]]:
    paths = []
    # python's own -m names a module, not a model
    flags = () if os.path.basename(command[0]).startswith("python") else MODEL_FLAGS
    for i, word in enumerate(command):
        if word in flags and i + 1 < len(command):
            paths.append(command[i + 1])
        elif word.startswith("--model="):
            paths.append(word[len("--model="):])
        elif word.endswith(".gguf") and (i == 0 or command[i - 1] not in MODEL_FLAGS):
            paths.append(word)
    found: list[dict[str, object]] = []
    for path in dict.fromkeys(paths):
        try:
            size = os.stat(path).st_size
        except OSError:
            size = None
        found.append({"path": path, "bytes": size})
    return found


def _executable(word: str) -> str | None:
    if os.sep in word:
        return word if os.path.isfile(word) and os.access(word, os.X_OK) else None
    return shutil.which(word)


def _address(hex_address: str) -> str:
    if len(hex_address) == 8:
        return ".".join(str(int(hex_address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    words = [hex_address[i:i + 8] for i in range(0, 32, 8)]
    raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
    groups = [raw[i:i + 2].hex() for i in range(0, 16, 2)]
    text = ":".join(g.lstrip("0") or "0" for g in groups)
    if raw == bytes(16):
        return "::"
    if raw[:12] == bytes(10) + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in raw[12:])
    if raw == bytes(15) + b"\x01":
        return "::1"
    return text


def _listening() -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":   # TCP_LISTEN
                address, port = fields[1].split(":")
                found.append({"address": _address(address), "port": int(port, 16)})
    return found


def _gpus(smi: str) -> tuple[str | None, str | None]:
    try:
        done = subprocess.run(
            [smi, *GPU_QUERY],
            check=False, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi failed: {e}"
    if done.returncode != 0:
        return None, (f"nvidia-smi exited {done.returncode}: "
                      f"{done.stderr.strip()[-300:]}")
    return done.stdout[:65536], None


def report(params: dict[str, dict[str, list[str]]]) -> None:
    engines: dict[str, object] = {}
    for name, command in params.get("engines", {}).items():
        engines[name] = {"executable": _executable(command[0]) if command else None,
                         "models": _models(command)}
    smi = shutil.which("nvidia-smi")
    gpus, gpu_error = _gpus(smi) if smi else (None, None)
    sys.stdout.write(json.dumps({
        "python": ".".join(str(n) for n in sys.version_info[:3]), "engines": engines,
        "listening": _listening(), "nvidia_smi": smi, "gpus": gpus, "gpu_error": gpu_error,
    }) + "\n")
