"""An engine's ``kv_cache`` key, validated like the rest (`parse`): ``"keep"`` keeps the
engine's prompt cache across the stops the proxy chooses (llmproxy/agent/kvcache.py), which
needs a llama-server started with ``--slot-save-path DIR``; ``"drop"`` (the default) does not.
`needs_swa_full` says when a kept cache will not pay off without ``--swa-full``. Every error
names its field."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

ENGINE_KEYS = ("kv_cache",)
SLOT_FLAG = "--slot-save-path"      # as the agent reads it (llmproxy/agent/kvcache.py)
MODEL_FLAGS = ("-m", "--model")
KV_CACHE = ("keep", "drop")
SWA_FLAG = "--swa-full"
# Model families whose attention uses a sliding window: llama-server reuses a restored
# cache of theirs only when it keeps the full window cache (`--swa-full`).
_SLIDING = re.compile(r"gemma-?[23]|gemma-?3n|mistral|ministral|gpt-oss|cohere|command-?r7b",
                      re.IGNORECASE)


class Checks(Protocol):
    """What these checks use of the config parser."""

    def error(self, path: str, message: str) -> None: ...


def engine_kv_cache(p: Checks, d: dict[str, Any], path: str,
                    command: Sequence[str] | None) -> dict[str, Any]:
    """The EngineConfig field of an engine's ``kv_cache`` key, when given."""
    if "kv_cache" not in d:
        return {}
    value = d["kv_cache"]
    if value not in KV_CACHE:
        p.error(f"{path}.kv_cache", 'must be "keep" or "drop"')
        return {}
    if value == "keep" and command and not _has_slot_dir(command):
        p.error(f"{path}.kv_cache", f'"keep" needs {SLOT_FLAG} DIR in {path}.command '
                "(llama-server saves and restores slots there)")
    return {"kv_cache": value}


def needs_swa_full(command: Sequence[str]) -> str | None:
    """The model file of a command whose model uses a sliding window and which lacks
    ``--swa-full`` (a kept cache of it would not be reused), or None."""
    if SWA_FLAG in command:
        return None
    words = list(command)
    models = [words[i + 1] for i, w in enumerate(words[:-1]) if w in MODEL_FLAGS]
    models += [w.split("=", 1)[1] for w in words if w.startswith("--model=")]
    return next((m for m in models if _SLIDING.search(m.rsplit("/", 1)[-1])), None)


def _has_slot_dir(command: Sequence[str]) -> bool:
    """Whether the command gives llama-server ``--slot-save-path DIR`` (or ``=DIR``)."""
    return any((w == SLOT_FLAG and i + 1 < len(command)) or w.startswith(SLOT_FLAG + "=")
               for i, w in enumerate(command))
