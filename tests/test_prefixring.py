"""Automatic prefix affinity: the stable prefix of a body (`prefix_key`), the
bounded-load consistent-hash ring (`pick`, `order`, `capacity`: pure, no clock),
and the rule through the real Site with a fake upstream: one prefix, one host;
many prefixes spread; a host that leaves moves only its own prefixes; a host
past the bound hands new prefixes to the next one on the ring."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.hosts.prefixring import PREFIX_BYTES, capacity, order, pick, prefix_key
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse

HOSTS = ["gpu1", "gpu2", "gpu3"]


def chat(system: str, user: str, *later: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for i, text in enumerate(later):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return {"model": "m", "messages": messages}


# -- the prefix --------------------------------------------------------------------
def test_a_chat_prefix_is_its_system_and_first_user_message() -> None:
    """Later turns, other fields and the model do not change the key; another
    system message or first user message does."""
    key = prefix_key(chat("you are terse", "fix the bug"))
    assert key is not None
    assert prefix_key({**chat("you are terse", "fix the bug", "ok", "and now?"),
                       "temperature": 0.2, "model": "other"}) == key
    assert prefix_key(chat("you are verbose", "fix the bug")) != key
    assert prefix_key(chat("you are terse", "write tests")) != key


def test_anthropic_system_counts_and_no_prefix_is_none() -> None:
    """The Anthropic API's top-level `system` is part of the prefix; a body with
    no messages and no prompt, or an empty prompt, has none."""
    one = {"system": "a", "messages": [{"role": "user", "content": "x"}]}
    two = {"system": "b", "messages": [{"role": "user", "content": "x"}]}
    assert prefix_key(one) != prefix_key(two)
    assert prefix_key({"model": "m"}) is None
    assert prefix_key({"messages": []}) is None
    assert prefix_key({"prompt": ""}) is None


def test_a_completion_prefix_is_its_prompts_first_2_kb() -> None:
    """Prompts that share their first PREFIX_BYTES bytes share a key; a difference
    inside them does not; a batch goes by its first prompt, tokens by their list."""
    base = "x" * PREFIX_BYTES
    assert prefix_key({"prompt": base + "tail one"}) == prefix_key({"prompt": base + "two"})
    assert prefix_key({"prompt": "y" + base}) != prefix_key({"prompt": base})
    assert prefix_key({"prompt": ["abc", "def"]}) == prefix_key({"prompt": "abc"})
    assert prefix_key({"prompt": [1, 2, 3]}) != prefix_key({"prompt": [1, 2, 4]})


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=12))
def test_any_json_body_gives_a_key_or_none(value: Any) -> None:
    """Whatever a client sends as messages, system or prompt: a string or None,
    never an exception."""
    for body in ({"messages": value}, {"prompt": value}, {"system": value, "messages": [value]}):
        key = prefix_key(body)
        assert key is None or (isinstance(key, str) and len(key) == 32)


# -- the ring ----------------------------------------------------------------------
def keys(n: int) -> list[str]:
    return [f"prefix-{i}" for i in range(n)]


def test_the_same_key_always_lands_on_the_same_host_whatever_the_order() -> None:
    """`order` is a function of the set of hosts, not of their order; its first
    host is the key's own, and every host appears once."""
    for key in keys(50):
        ranked = order(key, HOSTS)
        assert ranked == order(key, list(reversed(HOSTS)))
        assert sorted(ranked) == HOSTS
        assert pick(key, dict.fromkeys(HOSTS, 0)) == ranked[0]


def test_many_keys_spread_over_every_host() -> None:
    """3000 prefixes on three idle hosts: each gets between a fifth and a half."""
    counts = Counter(order(key, HOSTS)[0] for key in keys(3000))
    assert set(counts) == set(HOSTS)
    assert all(600 <= n <= 1500 for n in counts.values()), counts


def test_a_host_that_leaves_moves_only_its_own_keys() -> None:
    """gpu2 goes down: every key of gpu1 and gpu3 stays where it was; gpu2's
    keys spread over the others. It comes back: everything is as before."""
    before = {key: order(key, HOSTS)[0] for key in keys(2000)}
    after = {key: order(key, ["gpu1", "gpu3"])[0] for key in keys(2000)}
    for key, host in before.items():
        if host != "gpu2":
            assert after[key] == host
    assert {after[k] for k, h in before.items() if h == "gpu2"} == {"gpu1", "gpu3"}
    assert {key: order(key, HOSTS)[0] for key in keys(2000)} == before


def test_the_bound_is_125_percent_of_the_average_load_plus_one() -> None:
    """capacity = ceil(1.25 * (total + 1) / hosts); never zero."""
    assert capacity({"a": 0, "b": 0}) == 1
    assert capacity({"a": 4, "b": 3, "c": 0}) == 4      # ceil(1.25 * 8 / 3) = ceil(3.33)
    assert capacity({"a": 10, "b": 10}) == 14            # ceil(1.25 * 21 / 2) = ceil(13.1)


def test_a_host_at_the_bound_hands_the_key_to_the_next_on_the_ring() -> None:
    """A key's own host under the bound keeps it; at the bound, the next host of
    the key's ring order that is under it takes it."""
    key = "prefix-7"
    home, second, third = order(key, HOSTS)
    assert pick(key, {home: 2, second: 1, third: 1}) == home      # bound ceil(1.25*5/3) = 3
    assert pick(key, {home: 4, second: 1, third: 1}) == second    # bound ceil(1.25*7/3) = 3
    assert pick(key, {home: 4, second: 3, third: 0}) == second    # bound ceil(1.25*8/3) = 4
    assert pick(key, {home: 5, second: 5, third: 0}) == third     # bound ceil(1.25*11/3) = 5
    assert pick(key, {}) is None


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.text(max_size=20))
def test_the_pick_is_never_over_the_bound(loads: list[int], key: str) -> None:
    """Whatever the loads, the chosen host's load is under the bound (one always is)."""
    named = {f"h{i}": n for i, n in enumerate(loads)}
    chosen = pick(key, named)
    assert chosen is not None and named[chosen] < capacity(named)


# -- through the proxy -------------------------------------------------------------
CONFIG: dict[str, Any] = {
    "hosts": [{"name": h, "url": f"http://10.0.0.{i + 5}:8081"} for i, h in enumerate(HOSTS)],
    "models": {"m": {"hosts": HOSTS, "affinity": "prefix"}},
    "server_names": ["proxy"],
}


def make(runtime_dir: Path) -> tuple[LLMProxyService, FakeHTTPClient]:
    """The proxy, its cordons saved under `runtime_dir` (a test's own)."""
    http = FakeHTTPClient()
    config = parse_config({**CONFIG, "runtime_dir": str(runtime_dir)})
    svc = build_service(ServiceInputs(config, Clock(), http=http))
    for host in HOSTS:
        svc.runtime.rosters.record_success(host, 1, (RosterEntry("m"),))
    return svc, http


def send(svc: LLMProxyService, http: FakeHTTPClient, body: dict[str, Any],
         finish: bool = True) -> str:
    """The host the request went to (answered at once unless not `finish`)."""
    Connection(svc.site).send("POST", "/v1/chat/completions", json.dumps(body).encode())
    call = http.calls[-1]
    if finish:
        response = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
        call.deferred.callback(response)
        response.send(b"{}")
        response.finish()
    return HOSTS[int(call.url.split("//")[1].split(":")[0].rsplit(".", 1)[1]) - 5]


def test_one_prefix_one_host_and_many_prefixes_spread_through_the_proxy(tmp_path: Path) -> None:
    """Every turn of one conversation goes to one host; 60 conversations use all
    three hosts; the ring's choice is what the request got."""
    svc, http = make(tmp_path)
    homes = {send(svc, http, chat("sys", "task", *["t"] * n)) for n in range(6)}
    assert len(homes) == 1
    spread = Counter(send(svc, http, chat("sys", f"task {i}")) for i in range(60))
    assert set(spread) == set(HOSTS)
    key = prefix_key(chat("sys", "task"))
    assert key is not None and homes == {order(key, HOSTS)[0]}


def test_a_cordoned_host_moves_only_its_own_prefixes_through_the_proxy(tmp_path: Path) -> None:
    """One host cordoned: the prefixes of the two others keep their hosts."""
    svc, http = make(tmp_path)
    before = {i: send(svc, http, chat("sys", f"task {i}")) for i in range(30)}
    gone = before[0]
    cordon = Connection(svc.site, "127.0.0.1")
    cordon.send("POST", f"/admin/cordon?host={gone}")
    assert cordon.response().json()["outcome"] == "cordoned"
    after = {i: send(svc, http, chat("sys", f"task {i}")) for i in range(30)}
    assert all(after[i] == host for i, host in before.items() if host != gone)
    assert gone not in after.values()


def test_a_busy_host_hands_a_prefix_on_then_takes_it_back(tmp_path: Path) -> None:
    """The prefix's home holds a request (the bound on three idle hosts is one): the
    next request of that prefix goes to the ring's next host; once both ended,
    the prefix is home again."""
    svc, http = make(tmp_path)
    body = chat("sys", "hot")
    key = prefix_key(body)
    assert key is not None
    home, second, _ = order(key, HOSTS)
    assert send(svc, http, body, finish=False) == home
    assert send(svc, http, body, finish=False) == second
    for call in http.calls:
        response = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
        call.deferred.callback(response)
        response.send(b"{}")
        response.finish()
    assert send(svc, http, body) == home
