"""Opt-in capture (`capture` in hosts.json): what each API request asked and what
it was answered, kept in a bounded ring in memory, compressed.

While a request runs, its `Recording` holds bounded references to what passed:
the request's body (taken when it was dispatched) and the answer's pieces as
the relay saw them (`feed`: the engine's bytes, on both relay paths, or the
proxy's own error body), at most `max_record_bytes` of each; what is beyond is
only counted. At the request's end (after its last byte went to the client)
`CaptureRing.keep` redacts it (observe/captureredact.py), compresses it
(zlib) and keeps it.

One bound, `max_bytes`, holds both: the kept captures (`accounted`: the
compressed records and their listing entries) and what the recordings of the
requests in flight hold (`live`). The oldest captures go to make room; when
none is left, a recording holds nothing more (its capture says `truncated`).
Nothing is written to disk unless `dir` is set (observe/capturefiles.py).
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime

from llmproxy.config.capture import CaptureConfig
from llmproxy.observe import captureredact as redact
from llmproxy.observe.capturefiles import CaptureFiles
from llmproxy.observe.inflight import Exchange

# What one kept capture costs besides its compressed record: its listing entry
# (a dict of a dozen small fields) and the ring's slot, counted at a flat rate.
ENTRY_COST = 1024
PAGE_MAX = 200          # captures in one page of GET /api/captures
PAGE_DEFAULT = 50
# zlib's fastest level: a third of the default's time for a stream's events, which
# still shrink several times over (docs/performance.md).
LEVEL = 1
# A capture holding this much or more is packed (redacted, compressed) by `offload`
# (in the proxy: in later turns of the loop, a slice at a time), not in its end's turn.
OFFLOAD_BYTES = 4 * 1024
# Runs a packing function later; its Deferred fires, in the reactor's thread, with
# what it returned.
Offload = Callable[[Callable[[], bytes]], "Deferred[bytes]"]


class Recording:
    """One request's capture while it runs: bounded references to what passed."""

    __slots__ = (
        "held",
        "limit",
        "method",
        "parts",
        "path",
        "request_body",
        "request_bytes",
        "request_headers",
        "ring",
        "secrets",
        "total",
    )

    def __init__(self, ring: CaptureRing, limit: int, method: str, path: str,
                 request_headers: list[tuple[bytes, list[bytes]]], body: bytes,
                 body_bytes: int, secrets: tuple[str, ...]) -> None:
        self.ring = ring
        self.limit = limit
        self.method, self.path = method, path
        self.request_headers = request_headers
        self.request_body = body if ring.room(len(body)) else b""
        ring.live += len(self.request_body)
        self.request_bytes = body_bytes
        self.secrets = secrets         # the client's own credentials, never kept
        self.parts: list[bytes] = []
        self.held = 0
        self.total = 0

    def feed(self, data: bytes) -> None:
        """The next piece of the answer: held while the record and the capture's
        bound have room (the oldest captures go to make it), counted always."""
        self.total += len(data)
        room = self.limit - self.held
        if room > 0:
            piece = data if len(data) <= room else data[:room]
            size = len(piece)
            ring = self.ring
            if ring.accounted + ring.live + size > ring.max_bytes and not ring.room(size):
                self.limit = self.held        # full: nothing more is held
                return
            ring.live += size
            self.parts.append(piece)
            self.held += size


@dataclass
class _Kept:
    """A capture in the ring: its listing entry and its compressed record."""

    entry: dict[str, Any]
    blob: bytes
    cost: int = field(init=False)

    def __post_init__(self) -> None:
        self.cost = len(self.blob) + ENTRY_COST


def _pack(entry: dict[str, Any], heads: dict[str, Any], asked: bytes, parts: list[bytes],
          config: CaptureConfig, secrets: tuple[str, ...]) -> bytes:
    """One capture's record, compressed: its head (a JSON line), then its bodies as
    bytes, never escaped into JSON here (a read, `_record`, puts them together)."""
    asked = redact.raw_body(asked, config, secrets) if config.bodies else b""
    answered = redact.raw_body(b"".join(parts), config, secrets) if config.bodies else b""
    head = json.dumps({**entry, **heads, "asked": len(asked)}).encode("utf-8")
    return zlib.compress(b"%b\n%b%b" % (head, asked, answered), LEVEL)


def _record(blob: bytes) -> dict[str, Any]:
    """A kept capture as its reader sees it: its entry, `request` and `response`
    (each `headers`, `body` as text or None without bodies, `truncated`)."""
    data = zlib.decompress(blob)
    at = data.index(b"\n")
    head: dict[str, Any] = json.loads(data[:at])
    asked, answered = data[at + 1:at + 1 + head["asked"]], data[at + 1 + head["asked"]:]
    bodies = head.pop("bodies")
    del head["asked"]
    for side, body in (("request", asked), ("response", answered)):
        head[side] = {"headers": head.pop(f"{side}_headers"),
                      "body": body.decode("utf-8", "replace") if bodies else None,
                      "truncated": head.pop(f"{side}_truncated")}
    return head


class CaptureRing:
    """The captures, newest last, within `config.max_bytes` (see the module's doc)."""

    def __init__(self, config: CaptureConfig, clock: IReactorTime,
                 secrets: Callable[[], Iterable[str]] = tuple,
                 files: CaptureFiles | None = None, offload: Offload | None = None) -> None:
        self.config = config
        self._clock = clock
        self._secrets = secrets        # engine keys: blanked wherever they appear
        self._files = files
        self._offload = offload        # None: every capture is packed in the caller's turn
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self.max_bytes = config.max_bytes
        self.accounted = 0      # the kept captures' cost
        self.live = 0           # the bytes recordings of requests in flight hold
        self.evicted = 0
        self.lost = 0
        self.seq = 0
        self._packing: set[Deferred[None]] = set()   # captures `offload` packs

    def recording(self, method: str, path: str,
                  headers: list[tuple[bytes, list[bytes]]], body: bytes,
                  body_bytes: int, credentials: tuple[str, ...] = ()) -> Recording:
        """A recording for a request just dispatched (`body`: what was copied of its body)."""
        limit = self.config.max_record_bytes if self.config.bodies else 0
        return Recording(self, limit, method, path, headers, body[:limit], body_bytes,
                         credentials)

    def room(self, size: int) -> bool:
        """Whether `size` bytes more fit within `max_bytes` with what is kept and
        held, after letting the oldest captures go as need be."""
        while self.accounted + self.live + size > self.max_bytes and self._kept:
            self._evict()
        return self.accounted + self.live + size <= self.max_bytes

    def _evict(self) -> None:
        _, old = self._kept.popitem(last=False)
        self.accounted -= old.cost
        self.evicted += 1

    def keep(self, rec: Recording, exchange: Exchange, status: int | None,
             response_headers: list[tuple[bytes, list[bytes]]]) -> None:
        """The request ended: redact, compress and keep its capture (a large one in
        `offload`, its bytes counted as held until then); evict the oldest
        while over `max_bytes`."""
        config = self.config
        secrets = (*rec.secrets, *self._secrets())
        now = self._clock.seconds()
        entry = {
            "id": exchange.id, "time": exchange.started,
            "method": rec.method, "path": rec.path, "model": exchange.model,
            "host": exchange.host, "engine": exchange.engine, "key": exchange.key,
            "status": status, "outcome": exchange.outcome, "streaming": exchange.streaming,
            "duration": round(now - exchange.started, 6),
            "ttfb": None if exchange.first_byte_at is None
            else round(exchange.first_byte_at - exchange.started, 6),
            "prompt_tokens": exchange.prompt_tokens,
            "completion_tokens": exchange.completion_tokens,
            "request_bytes": rec.request_bytes, "response_bytes": rec.total,
            "detail": None if exchange.detail is None else redact.scrub(exchange.detail,
                                                                         secrets),
        }
        heads = {"bodies": config.bodies,
                 "request_headers": redact.headers(rec.request_headers, config),
                 "request_truncated": config.bodies and rec.request_bytes > len(rec.request_body),
                 "response_headers": redact.headers(response_headers, config),
                 "response_truncated": config.bodies and rec.total > rec.held}
        held = rec.held + len(rec.request_body)
        body, parts = rec.request_body, rec.parts
        rec.held = rec.limit = 0
        rec.request_body, rec.parts = b"", []

        def pack() -> bytes:      # later, maybe: it reads nothing but its own
            return _pack(entry, heads, body, parts, config, secrets)

        if self._offload is None or held < OFFLOAD_BYTES:
            self._store(entry, pack(), held)
        else:
            packing = self._offload(pack).addCallbacks(
                lambda blob: self._store(entry, blob, held), lambda _: self._lost(held))
            self._packing.add(packing)
            packing.addBoth(lambda _: self._packing.discard(packing))

    def settled(self) -> Deferred[Any]:
        """Fires once every capture `offload` is packing now is kept
        (written to `dir` too) or lost: the stop waits for it (a while) before the
        reactor stops."""
        return DeferredList([_after(d) for d in self._packing])

    def _store(self, entry: dict[str, Any], blob: bytes, held: int) -> None:
        """A capture packed: kept (its bytes no longer held), the oldest let go."""
        self.live -= held
        self.seq += 1
        entry["seq"] = self.seq
        kept = _Kept(entry, blob)
        self._kept[entry["id"]] = kept
        self.accounted += kept.cost
        while self.accounted + self.live > self.max_bytes and self._kept:
            self._evict()
        if self._files is not None:
            self._files.write(json.dumps(self._doc(kept), ensure_ascii=False).encode())

    def _lost(self, held: int) -> None:
        """Packing a capture failed: it is not kept (and counted so)."""
        self.live -= held
        self.lost += 1

    def get(self, id: str) -> dict[str, Any] | None:
        """One whole capture (redacted as kept), None if unknown or gone."""
        kept = self._kept.get(id)
        return None if kept is None else self._doc(kept)

    @staticmethod
    def _doc(kept: _Kept) -> dict[str, Any]:
        return {**_record(kept.blob), "seq": kept.entry["seq"]}

    def page(self, limit: int = PAGE_DEFAULT, before: int | None = None) -> dict[str, Any]:
        """Up to `limit` listing entries, newest first, older than `before` (a seq);
        `next`: the `before` of the next page (None: no more)."""
        limit = max(1, min(limit, PAGE_MAX))
        out: list[dict[str, Any]] = []
        more = False
        for kept in reversed(self._kept.values()):
            if before is not None and kept.entry["seq"] >= before:
                continue
            if len(out) == limit:
                more = True
                break
            out.append(kept.entry)
        return {"enabled": True, "captures": out,
                "next": out[-1]["seq"] if more else None, **self.summary()}

    def summary(self) -> dict[str, Any]:
        """The ring's size, its bound, and what it let go."""
        summary: dict[str, Any] = {"count": len(self._kept), "bytes": self.accounted,
                                   "in_flight_bytes": self.live, "lost": self.lost,
                   "max_bytes": self.config.max_bytes, "evicted": self.evicted,
                   "bodies": self.config.bodies}
        if self._files is not None:
            summary["dir"] = self._files.summary()
        return summary


def _after(d: Deferred[None]) -> Deferred[None]:
    """A Deferred that fires when `d` has, leaving `d`'s own result alone."""
    out: Deferred[None] = Deferred()

    def fired(result: object) -> object:
        out.callback(None)
        return result

    d.addBoth(fired)
    return out
