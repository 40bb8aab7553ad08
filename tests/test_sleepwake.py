"""Hosts that sleep and wake, on a clock (hosts/sleepwake.py, hosts/naps.py,
hosts/magic.py, config/wake.py): the sleep timer and what keeps a host awake, the
wake's state machine (packets, probes, timeout, backoff), a request's acquire
through a wake, and the chooser's preference for a host that is awake."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from llmproxy.config import Config, ConfigError, parse_config
from llmproxy.config.wake import WakeConfig
from llmproxy.core.events import Event
from llmproxy.core.sleepwake import HostSlept, HostWoke
from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.choose import Chooser
from llmproxy.hosts.host import Host
from llmproxy.hosts.magic import magic_packet
from llmproxy.hosts.naps import Naps, sleep_doc
from llmproxy.hosts.queueerrors import SwitchFailed, WakeFailed
from llmproxy.hosts.sleepwake import (
    ASLEEP,
    AWAKE,
    BACKOFF,
    PROBE_EVERY,
    REWATCH,
    SETTLE,
    SLEEPING,
    WAKING,
    SleepWake,
)
from llmproxy.testing.agentfakes import FakeAgentTransport


def host_doc(name: str = "gpu1", **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": "http://10.0.0.5:8081", "ssh": f"llm@{name}",
            "engines": {"e": {"command": ["llama-server"]}}, **extra}


WAKE = {"mac": "AA:BB:CC:DD:EE:01", "broadcast": "10.0.0.255", "timeout_seconds": 60}
SLEEP = {"after_seconds": 100, "command": ["systemctl", "suspend"]}


class Gate:
    """What the sleep rule reads of a host, set by the test."""

    def __init__(self) -> None:
        self.closing = False
        self.busy = False
        self.last_used = 0.0
        self.running: tuple[str, ...] = ()
        self.flying = 0
        self.waiting = 0

    def running_engines(self) -> tuple[str, ...]:
        return self.running

    def in_flight(self, engine: str | None = None) -> int:
        return self.flying

    def queued(self) -> int:
        return self.waiting


class Rig:
    def __init__(self, backoff: float = BACKOFF, **blocks: Any) -> None:
        blocks = blocks or {"wake": WAKE, "sleep": SLEEP}
        self.config = parse_config({"hosts": [host_doc(**blocks)]}).hosts[0]
        self.clock = Clock()
        self.events: list[Event] = []
        self.sent: list[WakeConfig] = []
        self.sent_error: str | None = None
        self.transport = FakeAgentTransport()
        self.lease = True
        self.reachable = True
        self.woke = 0
        self.sw = SleepWake(self.config, self.clock, self.events.append, send=self._send,
                            call=lambda order, t: self.transport.call(self.config, order, t),
                            lease_held=lambda: self.lease, reachable=lambda: self.reachable,
                            woke=self._woke, backoff=backoff)
        self.gate = Gate()
        self.sw.attach(self.gate)

    def _send(self, wake: WakeConfig) -> str | None:
        self.sent.append(wake)
        return self.sent_error

    def _woke(self) -> None:
        self.woke += 1

    def ops(self) -> list[str]:
        return [o["op"] for o in self.transport.orders]

    def put_to_sleep(self) -> None:
        self.clock.advance(101)
        self.sw.check()
        self.transport.last("sleep").answer({"ok": True, "sleeping": True})
        assert self.sw.state == ASLEEP


def fleet(config: Config, **naps_args: Any) -> tuple[Clock, FakeAgentTransport, Naps,
                                                    dict[str, Host]]:
    """`config`'s hosts as gates on a Clock and one fake agent transport, their
    sleep and wake followed by one Naps (attached)."""
    clock = Clock()
    transport = FakeAgentTransport()
    naps = Naps(config, clock, transport, lambda e: None, {}, **naps_args)
    gates = {h.name: Host(h, clock, transport=transport, sleepwake=naps.of(h.name))
             for h in config.hosts}
    naps.attach(gates)
    return clock, transport, naps, gates


def test_magic_packet_is_six_ff_then_the_mac_sixteen_times() -> None:
    packet = magic_packet("aa:bb:cc:dd:ee:01")
    assert packet[:6] == b"\xff" * 6 and len(packet) == 102
    assert packet[6:] == bytes.fromhex("aabbccddee01") * 16
    with pytest.raises(ValueError):
        magic_packet("aa:bb")


def test_config_errors_name_the_field() -> None:
    """Bad wake and sleep blocks are refused, each error naming its field; a host
    without engines may have neither."""
    doc = {"hosts": [host_doc(wake={"mac": "nope", "broadcast": "x", "port": 70000,
                                    "timeout_seconds": 0, "extra": 1},
                              sleep={"command": []}),
                     {"name": "plain", "url": "http://10.0.0.9:1", "wake": WAKE}]}
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert set(e.value.errors) >= {
        'hosts[0].wake.mac: must be a MAC address like "aa:bb:cc:dd:ee:ff"',
        'hosts[0].wake.broadcast: must be an IPv4 address like "10.0.0.255"',
        "hosts[0].wake.port: must be a port number, 1 to 65535",
        "hosts[0].wake.timeout_seconds: must be a number > 0",
        "hosts[0].wake.extra: unknown key",
        "hosts[0].sleep.after_seconds: required",
        "hosts[1].wake: needs engines: only a managed host is woken",
    }
    assert any(m.startswith("hosts[0].sleep.command: must be a command") for m in e.value.errors)
    good = parse_config({"hosts": [host_doc(wake=WAKE, sleep=SLEEP)]}).hosts[0]
    assert good.wake == WakeConfig("aabbccddee01", "10.0.0.255", 9, 60.0)
    assert good.sleep is not None and good.sleep.command == ("systemctl", "suspend")


def test_an_idle_host_sleeps_after_its_period_and_says_so() -> None:
    """No order before after_seconds of idleness; then one sleep order with the
    command, the host asleep, host.sleep published."""
    rig = Rig()
    rig.clock.advance(99)
    rig.sw.check()
    assert rig.ops() == []
    rig.clock.advance(2)
    rig.sw.check()
    assert rig.sw.state == SLEEPING
    call = rig.transport.last("sleep")
    assert call.order["command"] == ["systemctl", "suspend"]
    rig.sw.check()                       # no second order while the first is out
    assert rig.ops() == ["sleep"]
    call.answer({"ok": True, "sleeping": True})
    assert rig.sw.state == ASLEEP
    slept = [e for e in rig.events if isinstance(e, HostSlept)]
    assert len(slept) == 1 and slept[0].why == "idle" and slept[0].idle == pytest.approx(101)
    assert slept[0].type == "host.sleep"


def test_a_request_restarts_the_idle_count() -> None:
    rig = Rig()
    rig.clock.advance(60)
    rig.gate.last_used = 60.0
    rig.clock.advance(60)
    rig.sw.check()
    assert rig.ops() == []
    rig.clock.advance(41)
    rig.sw.check()
    assert rig.ops() == ["sleep"]


@pytest.mark.parametrize(("change", "why"), [
    (lambda r: setattr(r, "lease", False), "this proxy does not hold its lease"),
    (lambda r: setattr(r.gate, "running", ("e",)), "engines run: e"),
    (lambda r: setattr(r.gate, "flying", 1), "1 in flight, 0 queued"),
    (lambda r: setattr(r.gate, "waiting", 2), "0 in flight, 2 queued"),
    (lambda r: setattr(r.gate, "busy", True), "an agent call is in progress"),
    (lambda r: setattr(r.gate, "closing", True), "the proxy is stopping or handing over"),
])
def test_never_sleeps_while_something_keeps_it_awake(change: Any, why: str) -> None:
    """Not the lease holder, an engine resident, work in flight or queued, an agent
    call (an operator's command) in progress, a hand-over or stop: no sleep order,
    on the timer or by hand."""
    rig = Rig()
    change(rig)
    rig.clock.advance(1000)
    rig.sw.check()
    assert rig.ops() == []
    refused: list[Any] = []
    Deferred.fromCoroutine(rig.sw.sleep_now()).addCallback(refused.append)
    assert refused == [why] and rig.ops() == [] and rig.sw.state == AWAKE


def test_an_agent_that_refuses_or_fails_the_sleep_keeps_it_awake() -> None:
    """The agent refuses (or cannot be reached): the host stays awake, the event says
    why, and the timer asks again only after another idle period."""
    rig = Rig()
    rig.clock.advance(101)
    rig.sw.check()
    rig.transport.last("sleep").answer({"ok": False, "error": "engines run here: e"})
    assert rig.sw.state == AWAKE
    rig.sw.check()
    assert rig.ops() == ["sleep"]
    rig.clock.advance(101)
    rig.sw.check()
    rig.transport.last("sleep").fail("ssh: connection refused")
    assert rig.sw.state == AWAKE
    refused = [e.refused for e in rig.events if isinstance(e, HostSlept)]
    assert refused == ["engines run here: e", "the agent could not be told: ssh: connection "
                                              "refused"]
    assert rig.events[-1].line() == ("warn", "host gpu1 not sent to sleep: the agent could "
                                             "not be told: ssh: connection refused")


def test_a_wake_during_the_sleep_order_waits_for_it_then_settles() -> None:
    """A request while the sleep order is out: no packet, no probe until the order's
    outcome; the host then asleep, the wake waits SETTLE before its packet (a host going
    to sleep still answers)."""
    rig = Rig()
    rig.clock.advance(101)
    rig.sw.check()
    assert rig.sw.needs_wake()
    waiter = rig.sw.wake()
    rig.clock.advance(30)
    assert rig.sent == [] and rig.ops() == ["sleep"]
    rig.transport.last("sleep").answer({"ok": True})
    assert rig.sw.state == WAKING and rig.sent == []
    rig.clock.advance(SETTLE)
    assert rig.sent == [rig.config.wake] and rig.ops() == ["sleep", "status"]
    rig.transport.last("status").answer({"ok": True})
    assert waiter.called and rig.sw.state == AWAKE


def test_a_magic_packet_that_cannot_be_sent_is_named_in_the_failure() -> None:
    rig = Rig()
    rig.sent_error = "magic packet to 10.0.0.255:9 not sent: [Errno 101] Network is unreachable"
    rig.reachable = False
    failures: list[Any] = []
    rig.sw.wake().addErrback(failures.append)
    for _ in range(70):
        for call in rig.transport.pending:
            call.fail("ssh: no route to host")
        rig.clock.advance(1)
    assert str(failures[0].value) == ("host gpu1 did not wake within 60s "
                                      "(wake.timeout_seconds); " + rig.sent_error)


def test_the_sender_sends_three_copies_through_the_reactors_udp() -> None:
    """MagicSender on the real reactor (no run needed: a UDP write is immediate): three
    copies of the packet reach a socket; a send that fails says why, never raises."""
    from twisted.internet import reactor

    from llmproxy.hosts.magic import MagicSender

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as r:
        r.bind(("127.0.0.1", 0))
        r.settimeout(5)
        wake = WakeConfig("aabbccddee01", "127.0.0.1", r.getsockname()[1])
        assert MagicSender(reactor).send(wake) is None
        assert [r.recv(200) for _ in range(3)] == [magic_packet("aabbccddee01")] * 3
    refused = MagicSender(reactor).send(WakeConfig("aabbccddee01", "127.0.0.1", 0))
    assert refused is not None and refused.startswith("magic packet to 127.0.0.1:0 not sent")


def test_an_operator_sleep_skips_the_idle_period() -> None:
    rig = Rig()
    out: list[Any] = []
    Deferred.fromCoroutine(rig.sw.sleep_now()).addCallback(out.append)
    rig.transport.last("sleep").answer({"ok": True})
    assert out == [None] and rig.sw.state == ASLEEP
    assert [e.why for e in rig.events if isinstance(e, HostSlept)] == ["operator"]


def test_a_wake_sends_the_packet_probes_until_the_agent_answers_and_reports_how_long() -> None:
    """Asleep: a wake sends the magic packet (after the settle time of a fresh
    sleep), probes the agent's status every PROBE_EVERY, and once it answers is
    awake: waiters fire, the watch is nudged, host.wake says how long it took."""
    rig = Rig()
    rig.put_to_sleep()
    assert rig.sw.needs_wake()
    first, second = rig.sw.wake(), rig.sw.wake()
    assert rig.sw.state == WAKING and rig.sent == []       # settling
    rig.clock.advance(SETTLE)
    assert rig.sent == [rig.config.wake]                   # one wake for both waiters
    rig.transport.last("status").fail("ssh: no route to host")
    rig.clock.advance(PROBE_EVERY)
    rig.transport.last("status").fail("ssh: connection refused")
    rig.clock.advance(PROBE_EVERY)
    assert not first.called
    rig.transport.last("status").answer({"ok": True, "engines": [], "lease": None})
    assert first.called and second.called and rig.sw.state == AWAKE and rig.woke == 1
    woke = [e for e in rig.events if isinstance(e, HostWoke)]
    assert [e.stage for e in woke] == ["begun", "done"]
    assert woke[0].mac == "aabbccddee01" and woke[1].elapsed == pytest.approx(2 * PROBE_EVERY)
    assert woke[1].type == "host.wake"


def test_a_wake_that_times_out_fails_its_waiters_with_424_text_and_backs_off() -> None:
    """Nothing answers within timeout_seconds: every waiter fails naming the host
    and the timeout; a wake during the backoff fails at once, sending nothing;
    after it, a wake sends again."""
    rig = Rig()
    rig.put_to_sleep()
    rig.clock.advance(SETTLE)
    waiter = rig.sw.wake()
    failures: list[Any] = []
    waiter.addErrback(failures.append)
    for _ in range(200):
        for call in rig.transport.pending:
            call.fail("ssh: no route to host")
        rig.clock.advance(1)
    assert len(failures) == 1 and failures[0].check(WakeFailed)
    error = failures[0].value
    assert isinstance(error, SwitchFailed)
    assert str(error) == "host gpu1 did not wake within 60s (wake.timeout_seconds)"
    assert len(rig.sent) == 6     # at 0, 10, ... 50 s (RESEND)
    assert rig.sw.state == ASLEEP
    failed = [e for e in rig.events if isinstance(e, HostWoke) and e.stage == "failed"]
    assert failed and failed[0].backoff == BACKOFF
    again: list[Any] = []
    rig.sw.wake().addErrback(again.append)
    assert again and "no new wake for" in str(again[0].value) and len(rig.sent) == 6
    rig.clock.advance(BACKOFF)
    rig.sw.wake()
    assert len(rig.sent) == 7


def test_a_waiter_that_leaves_is_withdrawn_alone() -> None:
    rig = Rig()
    rig.put_to_sleep()
    leaving, staying = rig.sw.wake(), rig.sw.wake()
    leaving.addErrback(lambda f: None)
    leaving.cancel()
    rig.clock.advance(SETTLE)
    rig.transport.last("status").answer({"ok": True})
    assert staying.called and rig.sw.state == AWAKE


def test_an_unreachable_host_with_a_wake_block_is_woken_and_one_without_is_not() -> None:
    rig = Rig()
    rig.reachable = False
    assert rig.sw.needs_wake()
    rig.sw.wake()
    assert rig.sent == [rig.config.wake]        # no settle: it was never sent to sleep
    rig.clock.advance(SETTLE)
    rig.transport.last("status").answer({"ok": True})
    assert rig.sw.state == AWAKE and rig.woke == 1
    assert not rig.sw.needs_wake()              # its watch has REWATCH s to reconnect
    rig.clock.advance(REWATCH)
    assert rig.sw.needs_wake()
    plain = Rig(sleep=SLEEP)
    plain.reachable = False
    assert not plain.sw.needs_wake() and plain.sw.wake().called


def test_a_request_for_an_asleep_host_waits_for_the_wake_then_queues() -> None:
    """Host.acquire on an asleep host: the wake first (the request's Deferred
    pending meanwhile), then the queue; a wake that fails is a SwitchFailed."""
    rig = Rig()
    host = Host(rig.config, rig.clock, transport=rig.transport, sleepwake=rig.sw)
    rig.sw.attach(host)
    rig.put_to_sleep()
    assert host.state_of("e") == ASLEEP
    rig.clock.advance(SETTLE)
    pending = host.acquire("e", "r1")
    assert host.state_of("e") == WAKING
    assert not pending.called and rig.ops()[-1] == "status"
    rig.transport.last("status").answer({"ok": True})
    assert rig.ops()[-1] == "start"        # the scheduler switches to e as for any request


def test_the_chooser_prefers_an_awake_host_to_waking_one() -> None:
    """A model on two managed hosts, neither running its engine: the asleep one is
    placed last."""
    config = parse_config({
        "hosts": [host_doc("gpu1", wake=WAKE, sleep=SLEEP), host_doc("gpu2")],
        "models": {"m": {"hosts": ["gpu1", "gpu2"], "engine": "e"}}})
    clock, transport, naps, gates = fleet(config, sender=None)
    chooser = Chooser(gates, clock, lambda e: None)
    catalog = Catalog(config, {})
    route = catalog.resolve("m")
    assert route is not None
    first = [g.host.name for g in chooser.choose(route, catalog, None, "r1")]
    assert first[0] == "gpu1"          # both awake: in config order
    out: list[Any] = []
    Deferred.fromCoroutine(naps.command("gpu1", "sleep")).addCallback(out.append)
    transport.last("sleep").answer({"ok": True})
    assert out == [None] and naps.state("gpu1") == ASLEEP
    chooser.reservations.release("gpu1", "e")
    assert [g.host.name for g in chooser.choose(route, catalog, None, "r2")] == ["gpu2", "gpu1"]


def test_the_sleep_timer_looks_at_each_host_every_period() -> None:
    config = parse_config({"hosts": [host_doc("gpu1", sleep={"after_seconds": 8,
                                                             "command": ["true"]})]})
    clock, transport, naps, _gates = fleet(config)
    naps.start()
    clock.advance(6)
    assert transport.orders == []
    clock.advance(4)
    assert [o["op"] for o in transport.orders] == ["sleep"]
    naps.stop()
    assert clock.getDelayedCalls() == []


def test_no_host_sleeps_during_an_upgrades_hand_over() -> None:
    """While the hand-over runs (a successor starting, or a predecessor draining) the
    timer sends no sleep order and an operator's sleep is refused; after it, it sleeps."""
    config = parse_config({"hosts": [host_doc("gpu1", sleep={"after_seconds": 8,
                                                             "command": ["true"]})]})
    clock, transport, naps, _gates = fleet(config)
    handing_over = [True]
    naps.hold_during(lambda: handing_over[0])
    naps.start()
    clock.advance(30)
    out: list[Any] = []
    Deferred.fromCoroutine(naps.command("gpu1", "sleep")).addCallback(out.append)
    assert transport.orders == [] and out == ["an upgrade's hand-over is in progress"]
    handing_over[0] = False
    clock.advance(2)
    assert [o["op"] for o in transport.orders] == ["sleep"]
    naps.stop()


def test_llmproxy_status_says_a_host_is_asleep() -> None:
    """`llmproxy status`'s host line ends with the sleep state unless awake."""
    from llmproxy.cli.status import describe_status

    def doc(state: str) -> dict[str, Any]:
        return {"version": "x", "state": "ready", "hosts": [
            {"name": "gpu1", "url": "http://a", "roster": {"generation": 1, "models": [],
                                                           "fetched_seconds_ago": 1},
             "engine": {"running": None, "in_flight": 0, "queued": 0,
                        "sleep": {"state": state}}}]}

    assert describe_status(doc("asleep"), "http://p").splitlines()[1].endswith(
        "engine none, 0 in flight, 0 queued; asleep")
    assert describe_status(doc("awake"), "http://p").splitlines()[1].endswith("0 queued")


def test_commands_for_hosts_without_the_block_say_so() -> None:
    config = parse_config({"hosts": [host_doc("gpu1", sleep=SLEEP), host_doc("gpu2")]})
    clock = Clock()
    naps = Naps(config, clock, FakeAgentTransport(), lambda e: None, {})
    out: list[Any] = []
    for host, op in (("gpu1", "wake"), ("gpu2", "sleep"), ("gpu2", "wake")):
        Deferred.fromCoroutine(naps.command(host, op)).addCallback(out.append)
    assert out == ["host gpu1 has no wake block", "host gpu2 has no wake or sleep block",
                   "host gpu2 has no wake or sleep block"]
    assert naps.snapshot("gpu2", 0.0) is None and naps.state("gpu1") == AWAKE


def test_a_wake_that_breaks_fails_its_waiters_and_status_says_how_the_last_went() -> None:
    """The sender raising (a bug) fails the waiters instead of leaving them waiting; a
    wake's outcome shows in the snapshot with its age."""
    rig = Rig()
    rig.reachable = False

    def broken(wake: WakeConfig) -> str | None:
        raise RuntimeError("boom")

    rig.sw._send = broken
    failures: list[Any] = []
    rig.sw.wake().addErrback(failures.append)
    assert failures and str(failures[0].value) == "waking host gpu1 failed: boom"
    assert rig.sw.state == ASLEEP
    rig.sw._send = rig._send
    rig.sw.wake()
    rig.clock.advance(SETTLE)
    rig.transport.last("status").answer({"ok": True})
    rig.clock.advance(5)
    last = sleep_doc(rig.sw, rig.clock.seconds())["last_wake"]
    assert last == {"seconds_ago": 5.0, "seconds": 3.0, "ok": True}   # began at 0


def test_a_host_asleep_without_a_wake_block_is_ranked_last_too() -> None:
    """A host with a sleep block only (woken by hand, never by the proxy) that sleeps
    is down for the chooser: the other host serves."""
    config = parse_config({
        "hosts": [host_doc("gpu1", sleep=SLEEP), host_doc("gpu2")],
        "models": {"m": {"hosts": ["gpu1", "gpu2"], "engine": "e"}}})
    clock, transport, naps, gates = fleet(config)
    Deferred.fromCoroutine(naps.command("gpu1", "sleep"))
    transport.last("sleep").answer({"ok": True})
    chooser = Chooser(gates, clock, lambda e: None)
    catalog = Catalog(config, {})
    route = catalog.resolve("m")
    assert route is not None
    assert [g.host.name for g in chooser.choose(route, catalog, None, "r1")] == ["gpu2", "gpu1"]


def test_a_host_that_slept_answering_again_is_awake() -> None:
    """Woken by hand (its power button): once its watch opens again, past SETTLE after
    the sleep, the host is awake (a hello within SETTLE is the host still going down)."""
    rig = Rig(sleep=SLEEP)
    rig.put_to_sleep()
    rig.sw.heard()
    assert rig.sw.state == ASLEEP
    rig.clock.advance(SETTLE + 1)
    rig.sw.heard()
    assert rig.sw.state == AWAKE and not rig.sw.needs_wake()
    assert rig.sw.idle_for(rig.clock.seconds()) == 0
