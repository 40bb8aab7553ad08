"""An engine's prompt cache kept across a stop the proxy chose: llama-server's slot save and
restore, done by the agent on the engine's host (it reaches the engine on the host's loopback
and the files live there, in the directory the command gives ``--slot-save-path``).

- A start order with ``kv_cache`` (`protocol.KV_CACHE`) records the engine's `Keep` bounds in
  its engine record. Once the engine answers its health check, and before the start is
  answered (so before the proxy marks it ready), `restore` loads each saved slot back.
- A stop order with ``save_kv`` calls `save_all` on the engines it stops while they still run:
  each slot that holds a prompt (``GET /slots``) is saved (``POST /slots/ID?action=save``),
  all of the order's saves bounded by one deadline. A crash is no stop order: it never saves.
- Files are named by engine and slot (``llmproxy-ENGINE-slotN.bin``), listed with the digest of
  the engine's command and model file in ``llmproxy-ENGINE.json``; a restore under another
  digest deletes them instead. After each save the directory keeps at most `Keep.max_files`
  slot files and `Keep.max_bytes` bytes of them, the oldest removed first.

Nothing here raises: what failed is said in the result's ``error`` (the proxy's warning), and
the stop or start goes on. Standard library only, Python 3.9.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from llmproxy.agent.protocol import (
    KV_CACHE,
    KV_DEADLINE,
    KV_ERROR,
    KV_MAX_BYTES,
    KV_MAX_FILES,
    KV_RESTORED,
    KV_SAVED,
)

JSONDict = dict[str, Any]
SLOT_FLAG = "--slot-save-path"
MODEL_FLAGS = ("-m", "--model")
PREFIX = "llmproxy-"
SLOT_SUFFIX = ".bin"
# (method, url, JSON body or None, timeout) -> (HTTP status, decoded JSON answer)
Request = Callable[[str, str, Optional[JSONDict], float], tuple[int, Any]]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class KvError(Exception):
    """Why a save or restore did not happen: str() says it."""


@dataclass(frozen=True)
class Keep:
    """A kept engine's bounds, as its start order gives them (`of_order`)."""

    deadline: float = KV_DEADLINE
    max_files: int = KV_MAX_FILES
    max_bytes: int = KV_MAX_BYTES


def of_order(order: JSONDict) -> Keep | None:
    """The `Keep` of a start order, None without ``kv_cache``; ValueError if malformed."""
    given = order.get(KV_CACHE)
    if given is None:
        return None
    if not isinstance(given, dict):
        raise ValueError(f"{KV_CACHE} must be an object, got {given!r:.80}")
    fields: JSONDict = {}
    for key, kind in (("deadline", (int, float)), ("max_files", (int,)), ("max_bytes", (int,))):
        if key in given:
            value = given[key]
            if type(value) not in kind or not 0 < value < float("inf"):
                raise ValueError(f"{KV_CACHE}.{key} must be a positive number, got {value!r}")
            fields[key] = value
    return Keep(**fields)


def record_keep(record: JSONDict) -> Keep | None:
    """The `Keep` an engine record carries (its start order's), or None."""
    kept = record.get(KV_CACHE)
    try:
        return Keep(**{k: v for k, v in kept.items() if k != "digest"}) \
            if isinstance(kept, dict) else None
    except TypeError:
        return None


def _loaded(record: JSONDict) -> str:
    """The digest of what a running engine loaded: its record's, else its command's now."""
    kept = record.get(KV_CACHE)
    said = kept.get("digest") if isinstance(kept, dict) else None
    return said if isinstance(said, str) else digest(record["command"])


def keep_field(keep: Keep, command: list[str], running: JSONDict | None = None) -> JSONDict:
    """How a `Keep` is written in the record of an engine started with ``command``: with the
    digest of what it loaded (`digest`, taken at its start: an engine already ``running``
    keeps its record's)."""
    return {**asdict(keep), "digest": _loaded({**(running or {}), "command": command})}


def slot_dir(command: list[str]) -> str | None:
    """The directory the command gives ``--slot-save-path``, or None."""
    for i, word in enumerate(command):
        if word == SLOT_FLAG and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(SLOT_FLAG + "="):
            return word[len(SLOT_FLAG) + 1:]
    return None


def digest(command: list[str]) -> str:
    """What the saved slots belong to: the command and its model file's size and mtime."""
    h = hashlib.sha256(json.dumps(command).encode())
    for i, word in enumerate(command[:-1]):
        if word in MODEL_FLAGS:
            with contextlib.suppress(OSError):
                st = os.stat(command[i + 1])
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def slot_file(engine: str, slot: int) -> str:
    return f"{PREFIX}{engine}-slot{slot}{SLOT_SUFFIX}"


def _meta_path(where: Path, engine: str) -> Path:
    return where / f"{PREFIX}{engine}.json"


def http_request(method: str, url: str, body: JSONDict | None,
                 timeout: float) -> tuple[int, Any]:
    """One JSON request to the engine (never through an http_proxy of the environment)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=max(timeout, 0.05)) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        with contextlib.suppress(ValueError, OSError):
            return e.code, json.loads(e.read() or b"null")
        return e.code, None


def _base(record: JSONDict) -> str:
    parts = urlsplit(str(record.get("health_url")))
    return f"{parts.scheme}://{parts.netloc}"


def _said(status: int, doc: Any) -> str:
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return f"HTTP {status}" + (f": {message}" if message else "")


def _used(slot: Any) -> bool:
    """Whether a ``GET /slots`` entry holds a prompt (llama-server lists ``id_task`` and
    ``n_prompt_tokens`` once a slot has served a task)."""
    if not isinstance(slot, dict) or type(slot.get("id")) is not int:
        return False
    tokens = slot.get("n_prompt_tokens")
    return (isinstance(tokens, int) and tokens > 0) or slot.get("id_task", -1) not in (-1, None)


def _read_meta(where: Path, engine: str) -> JSONDict:
    try:
        doc = json.loads(_meta_path(where, engine).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and isinstance(doc.get("slots"), dict) else {}


def _write_meta(where: Path, engine: str, doc: JSONDict) -> None:
    path = _meta_path(where, engine)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def discard(where: Path, engine: str) -> int:
    """Delete an engine's slot files and their list; how many files went."""
    gone = 0
    for path in where.glob(f"{PREFIX}{engine}-slot*{SLOT_SUFFIX}"):
        with contextlib.suppress(OSError):
            path.unlink()
            gone += 1
    with contextlib.suppress(OSError):
        _meta_path(where, engine).unlink()
    return gone


def prune(where: Path, max_files: int, max_bytes: int) -> list[str]:
    """Remove the oldest slot files of the directory until at most ``max_files`` files and
    ``max_bytes`` bytes are left; the names removed."""
    found = []
    for path in where.glob(f"{PREFIX}*-slot*{SLOT_SUFFIX}"):
        with contextlib.suppress(OSError):
            st = path.stat()
            found.append((st.st_mtime_ns, path.name, st.st_size, path))
    found.sort()
    total, removed = sum(f[2] for f in found), []
    while found and (len(found) > max_files or total > max_bytes):
        _, name, size, path = found.pop(0)
        with contextlib.suppress(OSError):
            path.unlink()
        total -= size
        removed.append(name)
    return removed


def _where(record: JSONDict) -> Path:
    given = slot_dir(list(record.get("command") or []))
    if given is None:
        raise KvError(f"the command has no {SLOT_FLAG}")
    return Path(given)


def _save(record: JSONDict, keep: Keep, end: float, request: Request,
          now: Callable[[], float]) -> JSONDict:
    engine, base, where = record["engine"], _base(record), _where(record)
    status, slots = request("GET", base + "/slots", None, end - now())
    if status != 200 or not isinstance(slots, list):
        raise KvError(f"GET /slots answered {_said(status, slots)}")
    meta, loaded = _read_meta(where, engine), _loaded(record)
    if meta.get("digest") != loaded:
        discard(where, engine)
        meta = {"slots": {}}
    saved: list[int] = []
    tokens = size = 0
    for slot in (s["id"] for s in slots if _used(s)):
        left = end - now()
        if left <= 0:
            raise KvError(f"not saved within {keep.deadline:g} s (slots {saved} were)")
        name = slot_file(engine, slot)
        status, doc = request("POST", f"{base}/slots/{slot}?action=save", {"filename": name},
                              left)
        if status != 200 or not isinstance(doc, dict):
            raise KvError(f"saving slot {slot} answered {_said(status, doc)}")
        saved.append(slot)
        tokens += int(doc.get("n_saved") or 0)
        size += int(doc.get("n_written") or 0)
        meta["slots"][str(slot)] = {"file": name, "tokens": doc.get("n_saved")}
        _write_meta(where, engine, {**meta, "digest": loaded, "saved_at": time.time()})
    pruned = prune(where, keep.max_files, keep.max_bytes)
    return {KV_SAVED: saved, "tokens": tokens, "bytes": size, "pruned": pruned}


def _bounded(work: Callable[[], JSONDict], deadline: float, what: str) -> JSONDict:
    """``work()``'s result, or its error, within ``deadline`` seconds (and a second's slack:
    a request that never ends is left to its daemon thread)."""
    result: JSONDict = {KV_ERROR: f"{what} not done within {deadline:g} s"}

    def run() -> None:
        try:
            done = work()
            result.clear()
            result.update(done)
        except (KvError, OSError, ValueError, KeyError, http.client.HTTPException) as e:
            result.clear()
            result[KV_ERROR] = f"{what}: {e}"

    thread = threading.Thread(target=run, daemon=True, name=what)
    thread.start()
    thread.join(deadline + 1.0)
    return dict(result) if not thread.is_alive() else {
        KV_ERROR: f"{what} not done within {deadline:g} s"}


def save_all(records: list[JSONDict], request: Request = http_request,
             now: Callable[[], float] = time.monotonic) -> dict[str, JSONDict]:
    """Save the used slots of each kept engine of ``records`` (running ones), all at once and
    within the longest of their deadlines; each kept engine's result by name."""
    kept = [(r, record_keep(r)) for r in records]
    jobs: dict[str, JSONDict] = {}
    threads = []
    for record, keep in kept:
        if keep is None:
            continue
        end = now() + keep.deadline

        def one(record: JSONDict = record, keep: Keep = keep, end: float = end) -> None:
            jobs[record["engine"]] = _bounded(
                lambda: _save(record, keep, end, request, now), keep.deadline,
                f"saving the slots of {record['engine']}")

        threads.append(threading.Thread(target=one, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return jobs


def _restore(record: JSONDict, keep: Keep, end: float, request: Request,
             now: Callable[[], float]) -> JSONDict:
    engine, base, where = record["engine"], _base(record), _where(record)
    meta = _read_meta(where, engine)
    if not meta:
        return {KV_RESTORED: [], "tokens": 0}
    if meta.get("digest") != _loaded(record):
        return {KV_RESTORED: [], "tokens": 0, "discarded": discard(where, engine)}
    restored: list[int] = []
    tokens = 0
    for slot, entry in sorted(meta["slots"].items()):
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not (where / name).is_file():
            continue   # pruned since it was saved
        left = end - now()
        if left <= 0:
            raise KvError(f"not restored within {keep.deadline:g} s (slots {restored} were)")
        status, doc = request("POST", f"{base}/slots/{slot}?action=restore",
                              {"filename": name}, left)
        if status != 200 or not isinstance(doc, dict):
            raise KvError(f"restoring slot {slot} answered {_said(status, doc)}")
        restored.append(int(slot))
        tokens += int(doc.get("n_restored") or 0)
    return {KV_RESTORED: restored, "tokens": tokens}


def restore(record: JSONDict, request: Request = http_request,
            now: Callable[[], float] = time.monotonic) -> JSONDict | None:
    """Load a kept engine's saved slots back (None for an engine not kept), within its
    deadline; a digest other than its command's deletes the files instead."""
    keep = record_keep(record)
    if keep is None:
        return None
    end = now() + keep.deadline
    return _bounded(lambda: _restore(record, keep, end, request, now), keep.deadline,
                    f"restoring the slots of {record['engine']}")
