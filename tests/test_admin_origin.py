"""Admin actions refuse what a web page may have sent: the origin and Host
decision as a table (`cross_site_refusal`), then through the real Site in
memory (task.Clock, fake upstream): the 403's shape and log line, that a
refused action changes nothing, that the commands' requests still pass; and
`server_names` in the config: validated by field, refused by name on reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.web.http_headers import Headers

from llmproxy.config import ConfigError, parse_config
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.reload import refused_changes
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient, ParsedResponse
from llmproxy.web.admin import CROSS_SITE, HOST_NOT_ALLOWED, cross_site_refusal

OK = None
X, H = CROSS_SITE, HOST_NOT_ALLOWED
NAMES = ("gpu-gateway.lan",)

# (request headers, over TLS, with a key) -> the refusal's code, or OK
CASES: list[tuple[dict[str, list[str]], bool, bool, str | None]] = [
    # what the llmproxy commands and curl send: no Origin, the proxy's address
    ({"host": ["127.0.0.1:8080"]}, False, False, OK),
    ({"host": ["[::1]:8080"]}, False, False, OK),
    ({"host": ["10.0.0.2:8080"]}, False, False, OK),
    ({"host": ["localhost:8080"]}, False, False, OK),
    ({"host": ["LocalHost"]}, False, False, OK),
    ({"host": ["gpu-gateway.lan:8080"]}, False, False, OK),          # in server_names
    ({"host": ["GPU-Gateway.LAN"]}, True, False, OK),
    # the same origin, as a browser on the proxy's own page sends it
    ({"host": ["127.0.0.1:8080"], "origin": ["http://127.0.0.1:8080"],
      "sec-fetch-site": ["same-origin"]}, False, False, OK),
    ({"host": ["127.0.0.1"], "origin": ["http://127.0.0.1"]}, False, False, OK),
    ({"host": ["127.0.0.1:80"], "origin": ["http://127.0.0.1"]}, False, False, OK),
    ({"host": ["127.0.0.1"], "origin": ["http://127.0.0.1:80"]}, False, False, OK),
    ({"host": ["localhost:8443"], "origin": ["https://localhost:8443"]}, True, False, OK),
    ({"host": ["localhost"], "origin": ["https://localhost:443"]}, True, False, OK),
    ({"host": ["[::1]:8080"], "origin": ["http://[::1]:8080"]}, False, False, OK),
    ({"host": ["[0:0::1]:8080"], "origin": ["http://[::1]:8080"]}, False, False, OK),
    ({"host": ["gpu-gateway.lan:8080"], "origin": ["http://gpu-gateway.lan:8080"]},
     False, False, OK),
    ({"host": ["127.0.0.1:8080"], "sec-fetch-site": ["none"]}, False, False, OK),
    # another site's page (a no-cors fetch, a form)
    ({"host": ["127.0.0.1:8080"], "origin": ["http://evil.example"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["http://evil.example"]}, False, True, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["null"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": [""]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["http://127.0.0.1:8080",
                                             "http://127.0.0.1:8080"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["http://127.0.0.1:8080/admin"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["http://user@127.0.0.1:8080"]}, False, False, X),
    # same host, another port or scheme: another origin
    ({"host": ["127.0.0.1:8080"], "origin": ["http://127.0.0.1:3000"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["http://127.0.0.1"]}, False, False, X),
    ({"host": ["127.0.0.1:8443"], "origin": ["http://127.0.0.1:8443"]}, True, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["https://127.0.0.1:8080"]}, False, False, X),
    ({"host": ["localhost"], "origin": ["https://localhost"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["http://localhost:8080"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "origin": ["chrome-extension://abc"]}, False, False, X),
    ({"origin": ["http://127.0.0.1:8080"]}, False, True, X),                 # no Host to match
    # what the browser says of the request's initiator
    ({"host": ["127.0.0.1:8080"], "sec-fetch-site": ["cross-site"]}, False, False, X),
    ({"host": ["127.0.0.1:8080"], "sec-fetch-site": ["same-site"]}, False, True, X),
    ({"host": ["127.0.0.1:8080"], "sec-fetch-site": ["Cross-Site "]}, False, False, X),
    # DNS rebinding: evil.example's name now points at the proxy; same origin to the browser
    ({"host": ["evil.example:8080"]}, False, False, H),
    ({"host": ["evil.example:8080"], "origin": ["http://evil.example:8080"]}, False, False, H),
    ({"host": ["localhost.evil.example"]}, False, False, H),
    ({"host": ["localhost."]}, False, False, H),
    ({"host": ["proxy"]}, False, False, H),
    ({}, False, False, H),                                                   # no Host at all
    ({"host": ["127.0.0.1:8080", "evil.example"]}, False, False, H),
    ({"host": ["evil.example@127.0.0.1"]}, False, False, H),
    ({"host": ["127.0.0.1:99999"]}, False, False, H),
    ({"host": ["::1"]}, False, False, H),                                    # v6 needs brackets
    # a key names the caller: any Host (a browser cannot send the key to another origin)
    ({"host": ["evil.example:8080"]}, False, True, OK),
    ({}, False, True, OK),
]


@pytest.mark.parametrize(("headers", "secure", "keyed", "expected"), CASES,
                         ids=[str(i) for i in range(len(CASES))])
def test_the_origin_and_host_decision(headers: dict[str, list[str]], secure: bool,
                                      keyed: bool, expected: str | None) -> None:
    """Each row: the refusal's code for a state-changing admin request with these
    headers, or none. Origin must be the proxy's own (scheme of the listener,
    Host's host and port, default ports and IPv6 spellings made equal);
    Sec-Fetch-Site must not be cross-site or same-site; without a key, Host must
    be an IP literal, localhost or a server name."""
    raw = Headers({k.encode(): [v.encode() for v in vs] for k, vs in headers.items()})
    refusal = cross_site_refusal(raw, secure, keyed, NAMES)
    assert (refusal[0] if refusal else None) == expected, refusal


def test_a_refusal_quotes_at_most_80_characters_of_a_header() -> None:
    """A huge hostile Origin is not echoed whole into the answer and the log."""
    raw = Headers({b"host": [b"127.0.0.1"], b"origin": [b"http://" + b"a" * 5000]})
    refusal = cross_site_refusal(raw, False, False, ())
    assert refusal is not None and len(refusal[1]) < 300


# -- through the Site ---------------------------------------------------------------------
def make(tmp_path: Path, **extra: Any) -> LLMProxyService:
    config = parse_config({"runtime_dir": str(tmp_path / "run"),
                           "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
                           "models": {"qwen": {"host": "gpu1"}}, **extra})
    svc = build_service(ServiceInputs(config, Clock(), http=FakeHTTPClient()))
    svc.fleet.load_cordons()
    return svc


def post(svc: LLMProxyService, path: str, *headers: str, method: str = "POST",
         client: str = "127.0.0.1") -> ParsedResponse:
    """One request with exactly these header lines (Host included), from `client`."""
    conn = Connection(svc.site, client)
    head = [f"{method} {path} HTTP/1.1", *headers, "Content-Length: 0"]
    conn.channel.dataReceived("\r\n".join(head).encode() + b"\r\n\r\n")
    return conn.response()


def cordoned(svc: LLMProxyService) -> bool:
    return bool(svc.fleet.gates["gpu1"].cordoned)


def test_a_cross_site_cordon_is_a_403_that_changes_nothing(tmp_path: Path) -> None:
    """POST /admin/cordon from loopback with Origin: http://evil.example is 403
    cross_site_request, OpenAI-shaped, its message naming the action and why; a
    warning says who was refused; the host stays uncordoned."""
    svc = make(tmp_path)
    with capturedLogs() as events:
        answer = post(svc, "/admin/cordon?host=gpu1", "Host: 127.0.0.1:8080",
                      "Origin: http://evil.example")
    assert answer.status == 403
    error = answer.json()["error"]
    assert error["code"] == CROSS_SITE and error["type"] == "permission_error"
    assert error["message"].startswith("POST /admin/cordon refused: Origin 'http://evil.example'")
    assert "http://127.0.0.1:8080" in error["message"]
    assert not cordoned(svc)
    lines = [formatEvent(e) for e in events]
    assert any(line.startswith("refused POST /admin/cordon from 127.0.0.1: Origin")
               for line in lines), lines


def test_every_admin_action_and_method_is_guarded(tmp_path: Path) -> None:
    """Each admin path, with any method but GET and HEAD, refuses Sec-Fetch-Site:
    cross-site and a rebound Host with 403 before anything else (a PUT is refused,
    not 405); GET stays a plain 405, but through a rebound Host it is 403 (the door's
    Host allow-list, on every path)."""
    svc = make(tmp_path)
    for path in ("/admin/reload", "/admin/upgrade", "/admin/cordon?host=gpu1",
                 "/admin/uncordon?host=gpu1", "/admin/engine?host=gpu1&op=stop"):
        for method in ("POST", "PUT", "DELETE"):
            site = post(svc, path, "Host: 127.0.0.1", "Sec-Fetch-Site: cross-site",
                        method=method)
            assert (site.status, site.json()["error"]["code"]) == (403, CROSS_SITE), path
            rebound = post(svc, path, "Host: evil.example:8080", method=method)
            assert (rebound.status, rebound.json()["error"]["code"]) == (403, HOST_NOT_ALLOWED)
            assert "DNS rebinding" in rebound.json()["error"]["message"]
        assert post(svc, path, "Host: 127.0.0.1", "Origin: http://evil.example",
                    method="GET").status == 405
        rebound_get = post(svc, path, "Host: evil.example", method="GET")
        assert (rebound_get.status, rebound_get.json()["error"]["code"]) == (
            403, HOST_NOT_ALLOWED)
    assert not cordoned(svc)


def test_the_commands_requests_and_same_origin_ones_pass(tmp_path: Path) -> None:
    """What `llmproxy cordon` sends (Host the listen address, no Origin) cordons;
    the page's same-origin request uncordons; a server name in Host works without
    a key."""
    svc = make(tmp_path, server_names=["gpu-gateway.lan"])
    answer = post(svc, "/admin/cordon?host=gpu1", "Host: 127.0.0.1:8080",
                  "Accept-Encoding: identity", "User-Agent: Python-urllib/3.11")
    assert answer.status == 200 and cordoned(svc)
    answer = post(svc, "/admin/uncordon?host=gpu1", "Host: 127.0.0.1:8080",
                  "Origin: http://127.0.0.1:8080", "Sec-Fetch-Site: same-origin")
    assert answer.status == 200 and not cordoned(svc)
    assert post(svc, "/admin/cordon?host=gpu1", "Host: gpu-gateway.lan:8080").status == 200
    assert cordoned(svc)


def test_the_loopback_rule_still_comes_first(tmp_path: Path) -> None:
    """From another machine, without keys, an admin action is refused as before
    ("loopback only"), whatever its Origin."""
    svc = make(tmp_path)
    far = post(svc, "/admin/cordon?host=gpu1", "Host: 127.0.0.1:8080",
               "Origin: http://127.0.0.1:8080", client="10.0.0.9")
    assert far.status == 403 and "loopback only" in far.json()["error"]["message"]


# -- the config ---------------------------------------------------------------------------
BASE = {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]}


def test_server_names_are_validated_by_field() -> None:
    """server_names is a list of host names, kept in lower case; each bad entry
    is named by its index; not a list is named too; absent means none."""
    config = parse_config({**BASE, "server_names": ["Gpu-Gateway.LAN", "proxy"]})
    assert config.server_names == ("gpu-gateway.lan", "proxy")
    assert parse_config(BASE).server_names == ()
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "server_names": ["ok.lan", "not a name", 7, "10.0.0.5", "",
                                               "-x.lan", "a..b", "x" * 64 + ".lan", "[::1]"]})
    assert [e.split(":")[0] for e in info.value.errors] == [
        f"server_names[{i}]" for i in range(1, 9)]
    assert all(e.endswith("must be a host name (IP addresses and localhost need no listing)")
               for e in info.value.errors)
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "server_names": "gpu-gateway.lan"})
    assert info.value.errors[0].startswith("server_names: must be a list of host names")


def test_a_reload_that_changes_server_names_is_refused_by_name() -> None:
    """server_names is not reloadable: a changed list refuses the reload, naming it."""
    old = parse_config({**BASE, "server_names": ["a.lan"]})
    new = parse_config({**BASE, "server_names": ["a.lan", "b.lan"]})
    assert refused_changes(old, new) == ["server_names changed: restart to apply"]
