"""The host's lease on the agent's side (issue 38, part 3): a watch naming a holder takes the
lease before its hello; another proxy's watch is told who holds it and waits; start and stop
orders of anyone but the holder are refused naming it; the lease goes with the holding
watch's process (stdin closed, or kill -9) and the waiting watch takes it at once; an
upgrade's successor (same machine and runtime_dir) joins it without a gap."""

from __future__ import annotations

import shlex
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent import lease
from tests.agentrun import Agent, Stream, call, order, sim_command, start_order
from tests.procs import free_port, wait_until

pytestmark = pytest.mark.integration

FAST = {"interval": 0.1, "health_seconds": 0.2, "tick_seconds": 0.3}


def holder(runtime_dir: str, pid: int, machine: str = "proxy-a") -> dict[str, Any]:
    return {"machine": machine, "pid": pid, "runtime_dir": runtime_dir}


def watch(run: Agent, streams: list[Stream], who: dict[str, Any]) -> Stream:
    s = Stream(run.state_dir, order("watch", holder=who, **FAST))
    streams.append(s)
    return s


def test_a_second_proxy_is_refused_by_name_until_the_holder_goes(run: Agent,
                                                                  streams: list[Stream]) -> None:
    """The first watch holds the lease (lease held, then hello); a second proxy's watch says
    who holds it (machine, pid, since) and says no hello; its stop order is refused naming
    the holder, as is an order naming no holder, while the holder's own is carried out. Once
    the holder's watch is killed (-9), the waiter takes the lease within a second and says
    hello; the first proxy's orders are refused from then on."""
    a, b = holder("/run/a", 1111), holder("/run/b", 2222, machine="proxy-b")
    first = watch(run, streams, a)
    took = first.expect("lease", held=True)
    assert took["holder"]["machine"] == "proxy-a" and took["holder"]["pid"] == 1111
    first.expect("hello")
    second = watch(run, streams, b)
    refused = second.expect("lease", held=False)
    assert refused["holder"]["pid"] == 1111 and refused["holder"]["since"] == \
        took["holder"]["since"]
    time.sleep(0.5)
    assert second.of("hello") == []

    answer = run(order("stop", grace=0, holder=b))
    assert answer["ok"] is False and "held by proxy-a pid 1111 since" in answer["error"]
    assert answer["held_by"]["runtime_dir"] == "/run/a"
    assert run(order("stop", grace=0))["ok"] is False       # a holder-less order too
    assert run(order("stop", grace=0, holder={**a, "pid": 1112}))["ok"] is True

    first.popen.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    second.expect("lease", timeout=5, held=True)
    second.expect("hello")
    assert time.monotonic() - t0 < 2.0
    assert run(order("stop", grace=0, holder=a))["ok"] is False
    assert lease.current(run.state_dir)["machine"] == "proxy-b"   # type: ignore[index]


def test_the_same_proxy_joins_without_a_gap(run: Agent, streams: list[Stream]) -> None:
    """An upgrade's successor (same machine and runtime_dir, another pid) joins the lease at
    once; when the predecessor's watch ends (stdin closed), the lease stays the successor's:
    another proxy waiting all along never gets it, and is told the successor's pid."""
    old, new = holder("/run/a", 1111), holder("/run/a", 3333)
    first = watch(run, streams, old)
    first.expect("lease", held=True)
    other = watch(run, streams, holder("/run/b", 2222, machine="proxy-b"))
    other.expect("lease", held=False)
    successor = watch(run, streams, new)
    joined = successor.expect("lease", held=True)
    assert joined["holder"]["pid"] == 3333
    assert first.popen.stdin is not None
    first.popen.stdin.close()
    first.popen.wait(10)
    time.sleep(0.6)
    assert other.of("lease")[-1]["held"] is False and other.of("hello") == []
    assert lease.current(run.state_dir)["pid"] == 3333    # type: ignore[index]


@pytest.mark.parametrize("bad", [
    "me", {"machine": "", "pid": 1, "runtime_dir": "/r"}, {"machine": "m", "pid": 0,
                                                             "runtime_dir": "/r"},
    {"machine": "m", "pid": True, "runtime_dir": "/r"}, {"machine": "m", "pid": 5}])
def test_a_malformed_holder_is_bad_input(tmp_path: Path, bad: Any) -> None:
    """An order whose holder is not {machine, pid, runtime_dir} is refused with exit 2
    naming the field, whatever its op."""
    status, answer = call(tmp_path, order("status", holder=bad))
    assert status == 2 and answer["ok"] is False and "holder" in answer["error"]


def test_by_hand_orders_are_not_checked(run: Agent, streams: list[Stream]) -> None:
    """A person's stop on the host (command line, no JSON) is carried out while a proxy
    holds the lease: the host's own operator is not another proxy."""
    watch(run, streams, holder("/run/a", 1111)).expect("lease", held=True)
    p = run.popen(None, "stop")
    status, answer = run.answer(p)
    assert status == 0 and answer["ok"] is True


def test_an_order_holds_the_lease_while_nobody_else_does(run: Agent,
                                                          streams: list[Stream]) -> None:
    """A proxy whose watch is not up yet (its start, its ssh down) still changes the
    host's engines one at a time with any other: its start order takes the lease for
    as long as it runs (another proxy's watch is told so and waits, its orders are
    refused), and lets it go at its end, when the waiting watch takes it."""
    a, b = holder("/run/a", 1111), holder("/run/b", 2222, machine="proxy-b")
    port = free_port()
    slow = ["sh", "-c", "sleep 1.5; exec " + " ".join(map(shlex.quote, sim_command(port)))]
    starting = run.popen(start_order("e", slow, port, holder=a))
    assert wait_until(lambda: (run.state_dir / lease.RECORD).exists() and
                      lease.current(run.state_dir) is not None, timeout=10)
    waiting = watch(run, streams, b)
    assert waiting.expect("lease", held=False)["holder"]["machine"] == "proxy-a"
    time.sleep(0.3)
    assert waiting.of("hello") == [] and starting.poll() is None   # still starting
    status, answer = run.answer(starting)
    assert status == 0 and answer["ok"] is True
    waiting.expect("lease", timeout=5, held=True)
    assert run(order("stop", grace=0, holder=a))["ok"] is False
