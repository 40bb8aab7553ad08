"""Any engine head, through the whole proxy (the real Site, Forwarder and relay,
in memory) and either engine client (the reference one with the reference
path, the fast one with every speedup): the client's status line is always
`HTTP/1.1 <code> <the standard phrase>`, and its head holds only headers the
proxy set or passed on from a well-formed engine head (end-to-end, not named
by the engine's Connection header), with the engine's values. A head that is
not well formed (web.enginehead's rules: a control character but HTAB in a
value among them) is the proxy's 502 `upstream_failed`, nothing of the
engine's in it."""

from __future__ import annotations

import json
import re
import string
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.speedups import REFERENCE, select
from llmproxy.speedups.engineclient import UpstreamClient, UpstreamPool
from llmproxy.testing.fakes import Connection
from llmproxy.web.engineclient import EngineClient, EnginePool
from llmproxy.web.errors import reason
from llmproxy.web.relay import HOP_BY_HOP, named_by_connection, proxy_owned
from tests.selections import compat_entries
from tests.test_proxy import CONFIG

TCHAR = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
TOKEN = re.compile(rb"[" + re.escape(TCHAR.encode()) + rb"]+")
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")     # in a value: all but HTAB
# What the proxy may set itself (any value unless listed).
PROXY_OWN: dict[bytes, set[bytes] | None] = {
    b"date": None, b"server": None, b"content-type": None, b"content-length": None,
    b"x-accel-buffering": {b"no"}, b"x-request-id": None, b"x-llmproxy-queue-wait": None,
    b"transfer-encoding": {b"chunked"}, b"connection": {b"close"}}
NOT_GENERATED = {b"content-length", b"transfer-encoding", b"content-encoding"}
CLIENTS = {"reference": REFERENCE, "fast": select({})}    # the fast one: every speedup

# Mostly what an engine may send, now and then a hostile byte where it hurts.
token = st.text(TCHAR, min_size=1, max_size=8).map(str.encode)
names = st.one_of(
    st.sampled_from([b"Set-Cookie", b"X-Secret", b"Connection", b"Keep-Alive", b"Upgrade",
                     b"TE", b"Content-Type", b"X-Request-Id", b"Server", b"x-other"]),
    token, token,
    st.text(TCHAR + " :\x00\r\n\t", min_size=0, max_size=8).map(str.encode),
).filter(lambda n: n.split(b":")[0].strip().lower() not in NOT_GENERATED)
clean = st.text(string.printable.replace("\r", "").replace("\n", ""), max_size=12)
values = st.one_of(
    st.sampled_from([b"x-secret, keep-alive", b"close", b"X-Other", b"pwned=1", b"  a b  "]),
    clean.map(str.encode), clean.map(str.encode), st.binary(max_size=12))
separators = st.sampled_from([b"\r\n"] * 16 + [b"\n", b"\r", b"\r\n "])
status_lines = st.tuples(
    st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"ICY"]),
    st.one_of(st.sampled_from([200, 201, 299, 404, 418, 500, 503, 599]),
              st.integers(0, 1200)).filter(lambda c: c >= 200 and c not in (204, 304)),
    # (no CRLF in a phrase: it would end the status line, not spoil it)
    st.one_of(st.none(), st.sampled_from([b"OK", b"OK\nSet-Cookie: pwned=1"]),
              st.binary(max_size=12).filter(lambda p: b"\r\n" not in p)))
heads = st.tuples(status_lines, st.lists(st.tuples(names, values, separators), max_size=5),
                  separators)


def assemble(status: tuple[bytes, int, bytes | None],
             fields: list[tuple[bytes, bytes, bytes]], first: bytes) -> bytes:
    version, code, phrase = status
    line = b"%s %d" % (version, code) + (b"" if phrase is None else b" " + phrase)
    return line + first + b"".join(n + b": " + v + sep for n, v, sep in fields) + \
        b"Content-Length: 2\r\n\r\nok"


def as_read(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    """A generated field as a parser reads its line: the name ends at the first colon."""
    name, _, value = (name + b": " + value).partition(b":")
    return name, value


def well_formed(status: tuple[bytes, int, bytes | None],
                fields: list[tuple[bytes, bytes, bytes]], first: bytes) -> bool:
    """What the proxy takes from an engine (see web.enginehead)."""
    version, code, phrase = status
    return first == b"\r\n" and version in (b"HTTP/1.1", b"HTTP/1.0") and \
        100 <= code <= 599 and not re.search(rb"[\r\n\0]", phrase or b"") and \
        all(sep == b"\r\n" and TOKEN.fullmatch(as_read(n, v)[0]) and
            not CONTROL.search(as_read(n, v)[1]) for n, v, sep in fields)


def passed_on(fields: list[tuple[bytes, bytes, bytes]]) -> dict[bytes, list[bytes]]:
    """The engine's headers a client gets (lower-case names, values in order): all but
    hop-by-hop ones, those its Connection names, and those the proxy owns."""
    read = [as_read(n, v) for n, v, _ in fields]
    named = named_by_connection([v.strip() for n, v in read if n.lower() == b"connection"])
    out: dict[bytes, list[bytes]] = {}
    for name, value in read:
        if name.lower() not in HOP_BY_HOP and name.lower() not in named \
                and not proxy_owned(name.lower()):
            out.setdefault(name.lower(), []).append(value.strip())
    return out


def serve(client: str, raw: bytes) -> bytes:
    """A chat completion through the proxy, its engine answering `raw`: what
    the client got."""
    reactor = MemoryReactorClock()
    http: Any
    if client == "reference":
        http = EngineClient(reactor, EnginePool(reactor), 5.0)
    else:
        http = UpstreamClient(reactor, UpstreamPool(reactor), 5.0)
    svc = build_service(ServiceInputs(parse_config(CONFIG), reactor, http=http,
                                      speedups=CLIENTS[client], compat=compat_entries()))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", json.dumps({"model": "coder"}).encode())
    host, port, factory, _, _ = reactor.tcpClients[-1]
    engine = factory.buildProtocol(IPv4Address("TCP", host, port))
    engine.makeConnection(StringTransport())
    engine.dataReceived(raw)
    return conn.transport.value()


def client_head(answer: bytes) -> tuple[bytes, dict[bytes, list[bytes]], bytes]:
    """The status line, headers (lower-case names) and body of an answer whose
    head is strict HTTP/1.1 (CRLF line breaks only, no NUL, each header a token,
    a colon, a space, a value)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    assert sep and b"\0" not in head
    assert head.count(b"\n") == head.count(b"\r") == head.count(b"\r\n")
    status, *lines = head.split(b"\r\n")
    headers: dict[bytes, list[bytes]] = {}
    for line in lines:
        name, colon, value = line.partition(b": ")
        assert colon and TOKEN.fullmatch(name), line
        headers.setdefault(name.lower(), []).append(value)
    return status, headers, body


def check(answer: bytes, status: tuple[bytes, int, bytes | None],
          fields: list[tuple[bytes, bytes, bytes]], good: bool) -> None:
    """One client's answer to an engine head (see the module docstring)."""
    status_line, headers, body = client_head(answer)
    code = status[1] if good else 502
    assert status_line == b"HTTP/1.1 %d %s" % (code, reason(code))
    engine = passed_on(fields) if good else {}
    for name, got in headers.items():
        if name in engine:
            assert got == engine[name], name
        else:
            assert name in PROXY_OWN, name
            allowed = PROXY_OWN[name]
            assert allowed is None or set(got) <= allowed, (name, got)
    assert set(engine) <= set(headers)
    if good:
        assert body == b"ok"
    else:
        assert json.loads(body)["error"]["code"] == "upstream_failed"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=heads)
@example(head=((b"HTTP/1.1", 200, b"OK\nSet-Cookie: pwned=1"), [], b"\r\n"))
@example(head=((b"HTTP/1.1", 299, b"Fine"),
               [(b"Connection", b"x-secret", b"\r\n"), (b"X-Secret", b"1", b"\r\n")], b"\r\n"))
@example(head=((b"HTTP/1.1", 200, b"OK"), [(b"X-A", b"a\x00b", b"\r\n")], b"\r\n"))
@example(head=((b"HTTP/1.1", 200, None), [(b"Set-Cookie", b"\x80", b"\r\n")], b"\r\n"))
@example(head=((b"HTTP/1.1", 200, b"OK"), [(b"X-A", b"a\x01b", b"\r\n")], b"\r\n"))
@example(head=((b"HTTP/1.1", 200, b"OK"), [(b"X-A", b" a\tb\t", b"\r\n")], b"\r\n"))
@example(head=((b"HTTP/1.1", 200, None), [(b"0:", b"x-secret, keep-alive", b"\r\n")], b"\r\n"))
def test_the_client_gets_the_proxys_status_line_and_only_headers_it_set_or_passed_on(
        head: tuple[Any, list[tuple[bytes, bytes, bytes]], bytes]) -> None:
    """For any engine head, through either client (see the module docstring);
    a head both take gives the client the same bytes either way (but for the
    request id)."""
    status, fields, first = head
    good = well_formed(status, fields, first)
    raw = assemble(status, fields, first)
    answers = {client: serve(client, raw) for client in CLIENTS}
    for answer in answers.values():
        check(answer, status, fields, good)
    if good:
        same = [re.sub(rb"X-Request-Id: [^\r]*", b"", a) for a in answers.values()]
        assert same[0] == same[1]
