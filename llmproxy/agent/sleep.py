"""The agent's ``sleep`` order: run the host's suspend command, once nothing of the
host's runs.

The proxy sends it (``{"op": "sleep", "command": [...]}``) when its host has been idle for
its ``sleep.after_seconds``; like start and stop it is refused while another proxy holds the
host's lease. It is refused too while an engine of the host lives: a host never sleeps
under an engine. The command runs in a session of its own, detached from the ssh session
(which the suspend ends), after SLEEP_DELAY seconds, so the answer reaches the proxy first.
Standard library only, Python 3.9.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llmproxy.agent.orders import BadInput, JSONDict, living
from llmproxy.agent.protocol import SLEEP_DELAY


def sleep_command(order: JSONDict) -> list[str]:
    """The order's command: a non-empty list of non-empty strings (else BadInput)."""
    command = order.get("command")
    if not isinstance(command, list) or not command or \
            not all(isinstance(w, str) and w for w in command):
        raise BadInput(f"command must be a non-empty list of strings, got {command!r:.100}")
    return list(command)


def op_sleep(sd: Path, order: JSONDict) -> JSONDict:
    """Start the suspend command after SLEEP_DELAY, unless an engine of the host lives."""
    command = sleep_command(order)
    engines = [r["engine"] for r in living(sd)]
    if engines:
        return {"ok": False, "error": f"engines run here: {', '.join(engines)}"}
    delayed = ["sh", "-c", f'sleep {SLEEP_DELAY:g}; exec "$@"', "sh", *command]
    try:
        proc = subprocess.Popen(delayed, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True, cwd=os.path.expanduser("~") or "/")
    except OSError as e:
        return {"ok": False, "error": f"cannot run the sleep command: {e}"}
    return {"ok": True, "sleeping": True, "pid": proc.pid}
