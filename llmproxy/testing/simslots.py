"""llama-server's slot API, simulated (given ``--slot-save-path``): ``GET /slots`` lists the
slots, ``POST /slots/ID?action=save|restore`` with ``{"filename": NAME}`` writes or reads a
slot's cached prompt in that directory, and a completion reports ``timings.prompt_n``: the
prompt words past the longest cached prefix of a slot (the words it had to process), so a
restored cache shows as it does on the real engine. ``--slot-save fail`` answers every save
with 500; ``--slot-save hang`` never answers one (a stop's deadline must end the wait)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from twisted.web.server import NOT_DONE_YET, Request

from llmproxy.testing.simanswers import sim_error

SAVE_MODES = ("ok", "fail", "hang")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slot-save-path", help="serve llama-server's slot save/restore API, "
                        "its files in this directory")
    parser.add_argument("-np", "--parallel", type=int, default=1, help="slots (1)")
    parser.add_argument("--slot-save", choices=SAVE_MODES, default="ok",
                        help="how saves go: ok, fail (500) or hang (no answer)")


@dataclass
class SimSlots:
    """The slots of a simulated engine: each one's cached prompt (a list of words)."""

    path: Path
    n: int = 1
    save_mode: str = "ok"
    cached: dict[int, list[str]] = field(default_factory=dict)
    used: set[int] = field(default_factory=set)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimSlots | None:
        if args.slot_save_path is None:
            return None
        return cls(Path(args.slot_save_path), max(1, args.parallel), args.slot_save)

    def use(self, words: list[str]) -> int:
        """Run a prompt in the slot caching the longest prefix of it (the first slot on a
        tie); the words it had to process (`prompt_n`)."""
        def common(slot: int) -> int:
            held, n = self.cached.get(slot, []), 0
            while n < min(len(held), len(words)) and held[n] == words[n]:
                n += 1
            return n

        slot = max(range(self.n), key=lambda s: (common(s), -s))
        reused = common(slot)
        self.cached[slot] = list(words)
        self.used.add(slot)
        return len(words) - reused

    def listing(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for slot in range(self.n):
            entry: dict[str, Any] = {"id": slot, "n_ctx": 4096, "is_processing": False}
            if slot in self.used:
                entry.update(id_task=slot + 1, n_prompt_tokens=len(self.cached.get(slot, [])))
            out.append(entry)
        return out

    def render(self, request: Request, path: str) -> bytes | int:
        """Answer a ``/slots`` route (NOT_DONE_YET for a save told to hang)."""
        method = request.method.decode("ascii", "replace")
        if path == "/slots" and method == "GET":
            return _json(request, 200, self.listing())
        tail = path[len("/slots/"):]
        if method != "POST" or not tail.isdigit() or int(tail) >= self.n:
            return _json(request, 404, sim_error(f"no slot route {method} {path}", "not_found"))
        slot = int(tail)
        action = parse_qs(request.uri.decode("latin-1").partition("?")[2]).get("action", [""])[0]
        try:
            body = json.loads(request.content.read() if request.content is not None else b"")
        except ValueError:
            body = None
        name = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            return _json(request, 400, sim_error("Invalid filename", "invalid_request_error"))
        if action == "save":
            return self._save(request, slot, name)
        if action == "restore":
            return self._restore(request, slot, name)
        return _json(request, 400, sim_error("Invalid action", "invalid_request_error"))

    def _save(self, request: Request, slot: int, name: str) -> bytes | int:
        if self.save_mode == "hang":
            return NOT_DONE_YET
        if self.save_mode == "fail":
            return _json(request, 500, sim_error("simulated save failure", "server_error"))
        words = self.cached.get(slot, [])
        data = json.dumps({"words": words}).encode()
        (self.path / name).write_bytes(data)
        return _json(request, 200, {"id_slot": slot, "filename": name, "n_saved": len(words),
                                    "n_written": len(data)})

    def _restore(self, request: Request, slot: int, name: str) -> bytes:
        try:
            data = (self.path / name).read_bytes()
            words = json.loads(data)["words"]
        except (OSError, ValueError, KeyError, TypeError):
            return _json(request, 400, sim_error("Unable to restore slot", "invalid_request_error"))
        self.cached[slot] = [str(w) for w in words]
        return _json(request, 200, {"id_slot": slot, "filename": name, "n_restored": len(words),
                                    "n_read": len(data)})


def prompt_words(value: Any) -> list[str]:
    """The words of a prompt or messages list, in order."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [w for v in value for w in prompt_words(v)]
    if isinstance(value, dict):
        return prompt_words(value.get("content", value.get("text")))
    return []


def _json(request: Request, status: int, obj: Any) -> bytes:
    request.setResponseCode(status)
    request.responseHeaders.setRawHeaders(b"Content-Type", [b"application/json"])
    return json.dumps(obj).encode("utf-8")
