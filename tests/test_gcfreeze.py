"""Start-up's heap (lifecycle/gcfreeze.py): frozen out of the collector's full
collections, once start-up is over and before the first accept."""

from __future__ import annotations

import subprocess
import sys

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from llmproxy.config import HostConfig, parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.components import Process
from llmproxy.testing.fakes import FakeHTTPClient


def test_start_up_settles_its_heap_once_before_the_first_accept() -> None:
    order: list[str] = []

    def fetch(host: HostConfig) -> Deferred[tuple[RosterEntry, ...]]:
        return succeed((RosterEntry("m"),))

    process = Process(settle_heap=lambda: order.append("settle"))
    config = parse_config({"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]})
    svc = build_service(ServiceInputs(config, Clock(), http=FakeHTTPClient(), process=process,
                                      fetch=fetch))
    svc.listener.start_accepting = lambda: order.append("accept")  # type: ignore[method-assign]
    svc.running = True                   # as startService leaves it, before _start
    started = Deferred.fromCoroutine(svc._start())
    assert started.called and order == ["settle", "accept"]



def test_the_heap_is_collected_then_frozen() -> None:
    """In a process of its own (a frozen heap stays frozen): after start-up's
    imports, the collector's generations hold next to nothing, the rest is frozen,
    and a cycle made before the freeze was collected, not frozen."""
    script = """
import gc, weakref
import llmproxy.lifecycle.service
class Cycle: pass
a = Cycle(); a.me = a; gone = weakref.ref(a); del a
from llmproxy.lifecycle.gcfreeze import freeze_startup_heap
frozen = freeze_startup_heap()
left = sum(len(gc.get_objects(g)) for g in range(3))
print(frozen, gc.get_freeze_count(), left, gone() is None)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    frozen, count, left, collected = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert frozen == count > 20_000
    assert left < 100 and collected == "True"
