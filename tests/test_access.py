"""Inbound API keys and upstream credentials, through the real Site and HTTP
channel in memory (task.Clock, a fake upstream client): who gets in, what each
key sees, what reaches an engine, and that no secret is ever written."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import LogEvent, capturedLogs, formatEvent

from llmproxy.config import ConfigError, parse_config
from llmproxy.config.keys import ApiKey, KeyRing, load_keys, parse_keys
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import AccessFiles
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.components import Process
from llmproxy.lifecycle.keysfile import KeysFile
from llmproxy.lifecycle.reload import APPLIED, KEPT, Reloader
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse, ParsedResponse
from llmproxy.web.access import Access

SECRETS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-abcdefghij", "root": "sk-root-zyxw"}
CONFIG: dict[str, Any] = {
    "listen": "127.0.0.1:0",
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"},
              {"name": "laptop", "url": "http://10.0.0.7:11434", "api_key_env": "LAPTOP_KEY"}],
    "models": {"qwen-32b": {"host": "gpu1", "upstream": "qwen-up"},
               "mistral": {"host": "laptop"}},
    "aliases": {"coder": "qwen-32b"},
    # the Host the in-memory client (testing.fakes.Connection) names: keyless admin
    # actions answer only IP literals, localhost and these
    "server_names": ["proxy"],
}
UPSTREAM_SECRET = "engine-secret-42"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def ring() -> KeyRing:
    return parse_keys({"keys": [
        {"name": "alice", "sha256": digest(SECRETS["alice"]), "models": ["qwen*", "coder"]},
        {"name": "bob", "sha256": digest(SECRETS["bob"])},
        {"name": "root", "sha256": digest(SECRETS["root"]), "admin": True},
    ]}, "keys.json")


def make(public_status: bool = False, keys: KeyRing | None = None,
         ) -> tuple[LLMProxyService, FakeHTTPClient, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    config = parse_config({**CONFIG, "public_status": public_status})
    files = AccessFiles(keys=keys or ring(), upstream_keys={"laptop": UPSTREAM_SECRET})
    svc = build_service(ServiceInputs(config, clock, http=http, access_files=files,
                                      process=Process(environ={"LAPTOP_KEY": UPSTREAM_SECRET})))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    svc.runtime.rosters.record_success("laptop", 1, (RosterEntry("mistral", 8192),))
    return svc, http, clock


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def chat(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def lines(events: list[LogEvent]) -> str:
    return "\n".join(formatEvent(e) for e in events)


def send(svc: LLMProxyService, method: str, path: str, body: bytes = b"",
         headers: dict[str, str] | None = None, client_ip: str = "10.1.2.3",
         opened: list[Connection] | None = None) -> Any:
    """One request on a new connection (added to `opened`, when given)."""
    conn = Connection(svc.site, client_ip=client_ip)
    if opened is not None:
        opened.append(conn)
    conn.send(method, path, body, headers)
    if not conn.transport.value():     # forwarded: the upstream has not answered
        return ParsedResponse(0, {}, b"", False)
    return conn.response()


def test_no_key_and_wrong_key_are_401_and_nothing_goes_upstream() -> None:
    """Without a key, or with one nobody configured, the answer is the OpenAI
    401 `invalid_api_key`, and no request reaches an engine."""
    svc, http, _ = make()
    for headers in (None, {"Authorization": "Bearer sk-nobody"}, {"x-api-key": "sk-nobody"}):
        resp = send(svc, "POST", "/v1/chat/completions", chat("qwen-32b"), headers)
        assert resp.status == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert http.calls == []


@pytest.mark.parametrize("header", [
    "Bearer", "Bearer ", "Token abc", "Bearer a b", "Basic !!!notbase64", "Basic " +
    base64.b64encode(b"no-colon").decode(), "bearer\tx y", "Bearer \xe9t\xe9 x"])
def test_malformed_authorization_is_401_never_500(header: str) -> None:
    """Every malformed Authorization header is a 401 that says it is malformed."""
    svc, http, _ = make()
    resp = send(svc, "POST", "/v1/chat/completions", chat("qwen-32b"), {"Authorization": header})
    assert resp.status == 401 and "malformed" in resp.json()["error"]["message"]
    assert http.calls == []


def test_two_different_keys_in_one_request_are_401() -> None:
    """Authorization and x-api-key that disagree are refused, not guessed between."""
    svc, _, _ = make()
    resp = send(svc, "POST", "/v1/chat/completions", chat("qwen-32b"),
                {**bearer("alice"), "x-api-key": SECRETS["bob"]})
    assert resp.status == 401


def test_right_key_is_forwarded_without_client_credentials_and_logged_by_name() -> None:
    """A valid key (Bearer or x-api-key) gets through; the engine never sees the
    client's Authorization or x-api-key; the access line names the key."""
    svc, http, _ = make()
    with capturedLogs() as events:
        for headers in (bearer("alice"), {"x-api-key": SECRETS["alice"]}):
            conn = Connection(svc.site)
            conn.send("POST", "/v1/chat/completions", chat("coder"), headers)
            call = http.calls[-1]
            assert call.headers.getRawHeaders(b"authorization") is None
            assert call.headers.getRawHeaders(b"x-api-key") is None
            upstream = FakeResponse(200, {"Content-Type": "application/json"})
            call.deferred.callback(upstream)
            upstream.send(b"{}")
            upstream.finish()
            assert conn.response().status == 200
    access = [formatEvent(e) for e in events if e.get("log_namespace") == "llmproxy.access"]
    assert len(access) == 2 and all("key=alice" in line for line in access)


def test_out_of_scope_model_reads_exactly_like_a_missing_one() -> None:
    """alice may use qwen* and coder: mistral is a 404 `model_not_found` whose
    body is the one a model that does not exist gets, by POST and by GET."""
    svc, http, _ = make()
    scoped = send(svc, "POST", "/v1/chat/completions", chat("mistral"), bearer("alice"))
    bob = make()[0]
    missing = send(bob, "POST", "/v1/chat/completions", chat("mistral-x"), bearer("bob"))
    assert scoped.status == missing.status == 404
    assert scoped.body == missing.body.replace(b"mistral-x", b"mistral")
    assert http.calls == []
    by_get = send(svc, "GET", "/v1/models/mistral", headers=bearer("alice"))
    absent = send(svc, "GET", "/v1/models/nothing", headers=bearer("alice"))
    assert by_get.status == 404
    assert by_get.body == absent.body.replace(b"nothing", b"mistral")


def test_models_list_shows_only_the_keys_models() -> None:
    """/v1/models lists what the key may use; a key without `models` sees all."""
    svc, _, _ = make()

    def listed(name: str) -> set[str]:
        doc = send(svc, "GET", "/v1/models", headers=bearer(name)).json()
        return {m["id"] for m in doc["data"]}

    alice, bob = listed("alice"), listed("bob")
    assert alice == {"qwen-32b", "coder"}
    assert bob == {"qwen-32b", "mistral", "coder"}
    assert send(svc, "GET", "/v1/models").status == 401


def test_scope_globs_match_host_prefixed_names_too() -> None:
    """With `naming: host` the listed name is gpu1/qwen-32b: the glob qwen*
    still matches it (globs are over public names, with or without the host)."""
    key = ApiKey("k", hashlib.sha256(b"s").digest(), ("qwen*",))
    config = parse_config({**CONFIG, "naming": "host"})
    files = AccessFiles(keys=KeyRing((key,)), upstream_keys={"laptop": "x"})
    svc = build_service(ServiceInputs(config, Clock(), http=FakeHTTPClient(), access_files=files,
                                      process=Process(environ={"LAPTOP_KEY": "x"})))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    listed = send(svc, "GET", "/v1/models", headers={"x-api-key": "s"}).json()["data"]
    assert [m["id"] for m in listed] == ["gpu1/qwen-32b"]


def test_status_events_metrics_and_page_need_an_admin_key() -> None:
    """With keys on: no key 401 (with a Basic challenge, so a browser asks);
    a user key 403; an admin key 200, by Bearer or as the Basic password;
    /healthz and /readyz stay open."""
    svc, _, _ = make()
    for path in ("/status", "/metrics", "/"):
        none = send(svc, "GET", path)
        assert none.status == 401 and none.headers["www-authenticate"].startswith("Basic")
        assert send(svc, "GET", path, headers=bearer("bob")).status == 403
        assert send(svc, "GET", path, headers=bearer("root")).status == 200
    basic = base64.b64encode(f"admin:{SECRETS['root']}".encode()).decode()
    assert send(svc, "GET", "/status", headers={"Authorization": f"Basic {basic}"}).status == 200
    assert send(svc, "GET", "/api/events").status == 401
    assert send(svc, "GET", "/healthz").status == 200


def test_public_status_opens_the_views_not_the_api() -> None:
    """public_status: the views answer without a key; the API still needs one."""
    svc, _, _ = make(public_status=True)
    assert send(svc, "GET", "/status").status == 200
    assert send(svc, "GET", "/metrics").status == 200
    assert send(svc, "GET", "/v1/models").status == 401


def test_admin_actions_need_loopback_or_an_admin_key() -> None:
    """/admin/reload: from another host, no key 401, a user key 403, an admin key
    gets through (409 here: built without a file); from loopback, no key needed."""
    svc, _, _ = make()
    svc._ready = True
    far = "10.9.9.9"
    assert send(svc, "POST", "/admin/reload", client_ip=far).status == 401
    assert send(svc, "POST", "/admin/reload", headers=bearer("bob"), client_ip=far).status == 403
    assert send(svc, "POST", "/admin/reload", headers=bearer("root"), client_ip=far).status == 409
    assert send(svc, "POST", "/admin/reload", client_ip="127.0.0.1").status == 409


def test_without_keys_admin_actions_stay_loopback_only() -> None:
    """Without a keys file nothing changes: the API is open, admin is loopback only."""
    config = parse_config({**CONFIG, "hosts": [CONFIG["hosts"][0]],
                           "models": {"qwen-32b": CONFIG["models"]["qwen-32b"]},
                           "aliases": {}})
    svc = build_service(ServiceInputs(config, Clock(), http=FakeHTTPClient()))
    assert send(svc, "GET", "/status").status == 200
    far = send(svc, "POST", "/admin/reload", client_ip="10.9.9.9")
    assert far.status == 403 and "loopback only" in far.json()["error"]["message"]


def test_the_hosts_own_key_goes_upstream_never_the_clients() -> None:
    """laptop has api_key_env: its requests carry that variable's value as a
    Bearer; gpu1's carry nothing."""
    svc, http, _ = make()
    send(svc, "POST", "/v1/chat/completions", chat("mistral"), bearer("bob"))
    send(svc, "POST", "/v1/chat/completions", chat("qwen-32b"), bearer("bob"))
    laptop, gpu1 = http.calls[-2:]
    assert laptop.headers.getRawHeaders(b"authorization") == [f"Bearer {UPSTREAM_SECRET}".encode()]
    assert gpu1.headers.getRawHeaders(b"authorization") is None


def test_the_hosts_key_replaces_a_clients_when_keys_are_off() -> None:
    """Even without inbound keys, a host with api_key_env gets its own key, not
    the one the client sent; the roster read carries it too."""
    config = parse_config(CONFIG)
    http = FakeHTTPClient()
    svc = build_service(ServiceInputs(config, Clock(), http=http,
                                      process=Process(environ={"LAPTOP_KEY": UPSTREAM_SECRET})))
    svc.runtime.rosters.record_success("laptop", 1, (RosterEntry("mistral", 8192),))
    send(svc, "POST", "/v1/chat/completions", chat("mistral"), {"Authorization": "Bearer c"})
    assert http.calls[-1].headers.getRawHeaders(b"authorization") == [
        f"Bearer {UPSTREAM_SECRET}".encode()]
    svc.runtime.read_rosters()
    roster = [c for c in http.calls if c.url == "http://10.0.0.7:11434/v1/models"]
    assert roster[0].headers.getRawHeaders(b"authorization") == [
        f"Bearer {UPSTREAM_SECRET}".encode()]


def test_a_missing_upstream_key_variable_is_a_config_error() -> None:
    """api_key_env naming an unset variable stops the build, naming the field."""
    with pytest.raises(ConfigError) as info:
        build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=FakeHTTPClient()))
    assert info.value.errors == ("hosts[1].api_key_env: the environment variable LAPTOP_KEY "
                                 "is not set (or empty)",)


def test_per_key_counts_in_status_and_metrics() -> None:
    """Requests and tokens are counted by key name, in /status and /metrics."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat("coder"), bearer("alice"))
    upstream = FakeResponse(200, {"Content-Type": "application/json"})
    http.calls[-1].deferred.callback(upstream)
    upstream.send(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 7}}')
    upstream.finish()
    send(svc, "GET", "/v1/models", headers=bearer("alice"))
    per_key = send(svc, "GET", "/status", headers=bearer("root")).json()["access"]["per_key"]
    alice = next(k for k in per_key if k["name"] == "alice")
    assert (alice["requests"], alice["prompt_tokens"], alice["completion_tokens"]) == (2, 3, 7)
    metrics = send(svc, "GET", "/metrics", headers=bearer("root")).body.decode()
    assert 'llmproxy_key_requests_total{key="alice",status="200"} 2.0' in metrics
    assert 'llmproxy_key_tokens_total{key="alice",kind="completion"} 7.0' in metrics


def test_no_secret_in_logs_status_or_error_bodies() -> None:
    """Across every kind of answer, no client secret and no upstream key is in
    a log line, /status or a response body."""
    svc, _, _ = make()
    bodies = []
    opened: list[Connection] = []
    with capturedLogs() as events:
        for name in SECRETS:
            for path in ("/v1/chat/completions", "/v1/models", "/status", "/admin/reload"):
                if name == "root" and path == "/admin/reload":
                    continue     # accepted: it would wait for a start-up this test never makes
                bodies.append(send(svc, "POST" if "chat" in path or "admin" in path else "GET",
                                   path, chat("mistral"), bearer(name), opened=opened).body)
        bodies.append(send(svc, "POST", "/v1/chat/completions", chat("x"),
                           {"Authorization": f"Bearer {SECRETS['alice']}x"}).body)
        bodies.append(json.dumps(svc.status()).encode())
    text = lines(events).encode() + b"".join(bodies) + repr(svc.access.keys).encode()
    for secret in [*SECRETS.values(), UPSTREAM_SECRET]:
        assert secret.encode() not in text
    # The forwarded requests (the engine never answers them) end with their
    # clients: nothing of this test stays in flight after it.
    assert svc.inflight.active
    for conn in opened:
        conn.disconnect()
    assert not svc.inflight.active


def test_keys_file_errors_name_the_field_never_the_value(tmp_path: Path) -> None:
    """A bad keys file names its path and each field; valid ones load frozen."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"name": "a", "sha256": "sk-not-a-digest"}, {"name": "a", "sha256": digest("x"),
                                                     "models": "qwen", "admin": 1, "x": 1}]}))
    with pytest.raises(ConfigError) as info:
        load_keys(str(path))
    assert [e.split(": ")[1] for e in info.value.errors] == [
        "keys[0].sha256", "keys[1].x", "keys[1].models", "keys[1].admin"]
    assert "sk-not-a-digest" not in str(info.value)
    path.write_text('{"keys": [{"name": "a", "sha256": "' + digest("s") + '"}]}')
    assert load_keys(str(path)).find(b"s") == ApiKey("a", hashlib.sha256(b"s").digest())
    assert load_keys(str(path)).find(b"t") is None


def test_a_reload_re_reads_the_keys_file_and_a_bad_one_keeps_the_keys(tmp_path: Path) -> None:
    """A new key works after a reload (logged by name), a broken file keeps the
    running keys and the reload says so naming the file, never a secret."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "bob", "sha256": digest("b")}]}))
    config = parse_config({**CONFIG, "keys_file": str(path)})
    access = Access(load_keys(str(path)))
    clock = Clock()

    async def apply(new: Any, changes: list[str]) -> None:
        raise AssertionError("hosts.json did not change")

    reloader = Reloader(load=lambda: config, current=lambda: config, apply=apply,
                        clock=clock, parts=[KeysFile(access)])
    assert access.keys is not None and access.keys.find(b"c") is None
    path.write_text(json.dumps({"keys": [{"name": "bob", "sha256": digest("b")},
                                         {"name": "carol", "sha256": digest("c")}]}))
    result = reloader.request().result
    assert result.outcome == APPLIED and "keys (+carol)" in result.message
    assert f"re-read keys file {path} (2 keys)" in result.message
    assert access.keys.find(b"c") is not None
    path.write_text('{"keys": [{"name": "dave", "sha256": "c-secret"}')
    kept = reloader.request().result
    assert kept.outcome == KEPT and str(path) in kept.message and "keys file" in kept.message
    assert access.keys.find(b"c") is not None


@pytest.mark.parametrize("headers", [
    {"X-Big": "x" * 12000, "X-Big2": "y" * 6000},          # over totalHeadersSize in total
    {f"X-H{i}": "v" for i in range(501)},                   # over maxHeaders
    {"Authorization": "Bearer " + "k" * 20000},             # one line over MAX_LENGTH
])
def test_headers_over_the_limit_are_431_and_never_echoed(headers: dict[str, str]) -> None:
    """Too many or too large request headers: a 431 with a JSON body that quotes
    none of them, and the connection closes."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat("qwen-32b"), headers)
    resp = conn.response()
    assert resp.status == 431 and resp.json()["error"]["code"] == "request_header_fields_too_large"
    assert b"xxxx" not in resp.body and b"kkkk" not in resp.body
    assert conn.closed and http.calls == []


def test_an_upgrades_successor_judges_a_limited_key_only_with_its_use_so_far() -> None:
    """While the predecessor's state is on its way (`Access.inherit`), a request of a
    key with a rate limit waits, unsent; a key without limits is served at once.
    Once the state came (alice's one request of her 1 per minute) and it is settled,
    the waiting request is refused with 429 and never reaches the engine."""
    keys = parse_keys({"keys": [
        {"name": "alice", "sha256": digest(SECRETS["alice"]), "rpm": 1},
        {"name": "bob", "sha256": digest(SECRETS["bob"])},
    ]}, "keys.json")
    svc, http, clock = make(keys=keys)
    settle = svc.access.inherit()
    waiting = Connection(svc.site)
    waiting.send("POST", "/v1/chat/completions", chat("coder"), bearer("alice"))
    assert http.calls == [] and not waiting.transport.value()
    send(svc, "POST", "/v1/chat/completions", chat("coder"), bearer("bob"))
    assert len(http.calls) == 1             # bob's: served while alice's waits
    assert svc.access.limits is not None
    svc.access.limits.take(json.dumps({"at": clock.seconds(), "keys": {
        "alice": {"rpm": 1, "tpm": None, "requests": 1, "tokens": 0}}}).encode())
    settle()
    answer = waiting.response()
    assert answer.status == 429 and b"rate_limit_exceeded" in answer.body
    assert len(http.calls) == 1
    assert svc.access.settling(keys.keys[0]) is None   # settled: nobody waits any more
