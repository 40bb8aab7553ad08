"""llmproxy.compat: what Twisted has no public API for. Each entry is guarded
(and reported off when its guard fails), names the public API it waits for,
and does what it promises when on: here, a malformed request answered with
the proxy's JSON 400 on every combination of speedups, and Twisted's bare 400
when the entry is off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from twisted.internet.task import Clock
from twisted.web.resource import Resource

from llmproxy import compat
from llmproxy.compat import CompatSelection, badrequest
from llmproxy.speedups import Selection
from llmproxy.speedups.site import site_class
from llmproxy.testing.fakes import Connection, parse_response

COMBINATIONS = [(), ("response_writes",)]
MALFORMED = [
    b"POST /a HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: lots\r\n\r\n",
    b"GET  /a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /a HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


def test_every_entry_is_on_with_the_installed_twisted() -> None:
    """Each entry's guard passes on the pinned Twisted, and says what it waits for."""
    chosen = compat.select()
    assert chosen.off == {}
    for entry in compat.known():
        assert chosen.on(entry.name) and entry.waits_for
    assert badrequest.COMPAT.waits_for == "a public hook for the answer to a malformed request"
    assert chosen.as_json() == {"active": [e.name for e in compat.known()], "off": {}}


def test_a_changed_twisted_turns_the_entry_off_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest that does not match (or a guard that raises) is a reason: the
    entry is off, nothing is mixed in."""
    name = "twisted.web.http.HTTPChannel._respondToBadRequestAndDisconnect"
    monkeypatch.setitem(badrequest.SOURCES, name, "0" * 16)
    chosen = compat.select()
    assert not chosen.on("bad_request_json")
    assert f"{name} changed" in chosen.off["bad_request_json"]
    assert compat.channel_mixins(chosen) == ()
    monkeypatch.setitem(badrequest.SOURCES, "twisted.web.http.NoSuchThing", "1" * 16)
    assert "twisted.web.http.NoSuchThing is gone" in compat.select().off["bad_request_json"]


def test_a_raising_guard_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> str | None:
        raise RuntimeError("cannot tell")

    entry = badrequest.COMPAT
    monkeypatch.setattr(compat, "known", lambda: (
        compat.Compat(entry.name, entry.summary, entry.waits_for, broken, entry.mixin),))
    assert compat.select().off == {
        "bad_request_json": "its guard failed: RuntimeError: cannot tell"}


def served(names: tuple[str, ...], mixins: tuple[type, ...], data: bytes) -> Connection:
    site = site_class(Selection(True, names), mixins)(Resource(), 1 << 20, reactor=Clock())
    conn = Connection(site)
    conn.channel.dataReceived(data)
    return conn


@pytest.mark.parametrize("data", MALFORMED)
@pytest.mark.parametrize("names", COMBINATIONS)
def test_with_the_entry_on_a_malformed_request_gets_the_json_400(
        names: tuple[str, ...], data: bytes) -> None:
    """The proxy's OpenAI-style 400, then the connection closes."""
    conn = served(names, compat.channel_mixins(compat.select()), data)
    resp = parse_response(conn.transport.value())
    assert resp.status == 400 and resp.headers["connection"] == "close"
    assert json.loads(resp.body)["error"]["code"] == "bad_request"
    assert conn.closed


@pytest.mark.parametrize("names", COMBINATIONS)
def test_with_the_entry_off_twisteds_bare_400_stands(names: tuple[str, ...]) -> None:
    """Off, the feature falls back to Twisted's own answer; nothing breaks."""
    conn = served(names, compat.channel_mixins(CompatSelection()), MALFORMED[0])
    assert conn.transport.value() == b"HTTP/1.1 400 Bad Request\r\n\r\n" and conn.closed


def test_a_channel_without_an_answer_of_its_own_keeps_twisteds() -> None:
    """The mixin on a plain HTTPChannel (no malformed_request_answer): Twisted's 400."""
    from twisted.internet.testing import StringTransport
    from twisted.web.http import HTTPChannel

    channel = type("Plain", (badrequest.MalformedRequestAnswer, HTTPChannel), {})()
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(MALFORMED[1])
    assert transport.value() == b"HTTP/1.1 400 Bad Request\r\n\r\n"


def test_the_package_stays_small() -> None:
    """compat is for the little Twisted has no public API for: five entries
    (the JSON 400, the accept guard, the HTTP/2 GOAWAY, the HTTP/2 bounds, the
    HTTP/2 stream hooks), 860 lines at most."""
    package = Path(compat.__file__).parent
    assert sum(len(p.read_text().splitlines()) for p in package.glob("*.py")) <= 860
