"""The ``llmproxy`` command: small tools around a running or configured proxy.
Nothing here imports the reactor (``check`` validates a config without starting
anything).

Modules:

- `main`: the parser with every subcommand, and `main` (the console script).
- `check`: ``llmproxy check``, a config file validated.
- `status`: ``llmproxy status``, what the running proxy is doing.
- `control`: ``llmproxy reload`` and ``llmproxy upgrade``.
- `hosts`: ``llmproxy cordon``, ``uncordon`` and ``engine``, one host's actions.
- `logs`: ``llmproxy logs``, an engine's log printed and followed.
- `sleepwake`: ``llmproxy wake`` and ``llmproxy sleep``, a host woken or put to sleep.
- `capture`: ``llmproxy capture list|show|replay``, the proxy's captured requests.
- `replay`: ``llmproxy capture replay``, a capture sent again and both answers compared.
- `doctor`: ``llmproxy doctor``, each managed host checked from this machine, a fix per failure.
- `doctorprobe`: what doctor runs on a GPU host (standard library only, sent over ssh).
- `proxyclient`: how a command reaches the running proxy (its URL, the key, `ask`).
"""

from __future__ import annotations

from llmproxy.cli.main import main

__all__ = ["main"]
