"""The agent's ``watch`` order: one long call that tells the proxy, as JSON lines, what
happens to the host's engines and GPUs, until its stdin closes or a signal comes (ssh going
away).

A watch whose order names a ``holder`` holds the host's lease (`lease`) for as long as it
lives: before anything else it takes the lease, or, while another proxy holds it, says
``lease`` with ``held: false`` and that holder (again when the holder changes) and tries again
each ``interval``; once taken it says ``lease`` with ``held: true`` and its record, then watches.

Events: ``hello`` first once the lease is held (the protocol and the running engines, as
``status`` lists them, and one ``health`` event per engine); ``exit`` within ``interval`` of an
engine's end that no order asked for (`exits`); ``health`` when an engine's health check (every
``health_seconds``) changes; ``gpu`` every ``telemetry_seconds`` where nvidia-smi is on PATH
(`gpus`), every BUSY_TELEMETRY_SECONDS while the proxy says the host is busy (protocol.PACE),
each followed by an ``engine_memory`` event per running engine it lists a process of
(protocol.Memory); ``warning`` once per kind of trouble; ``tick`` every ``tick_seconds`` (5). While
watching, engine logs over ``log_rotate_bytes`` are rotated (`logs`).

It takes the agent's lock only to migrate an older agent's record, and only when it is free:
a start holds the lock while it waits for health, and the watch must go on meanwhile. Health
checks and nvidia-smi run on threads of their own, so neither delays an exit event; only this
module's loop writes.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmproxy.agent import exits, gpus, logs
from llmproxy.agent.lease import Lease, holder_of
from llmproxy.agent.orders import JSONDict, check_all, entries, number
from llmproxy.agent.processes import leader_alive, proc_stat
from llmproxy.agent.protocol import (
    BUSY_TELEMETRY_SECONDS,
    EVENT_FIELD,
    EXIT,
    GPU,
    HEALTH,
    HELLO,
    LEASE,
    MEMORY,
    OP_FIELD,
    PACE,
    PROTOCOL,
    TICK,
    WARNING,
)
from llmproxy.agent.state import RUNNING, Record, locked, log_path, migrate, records, state_of

TAIL_LINES = 20  # log lines an exit event carries
PROBLEM = "problem"  # trouble a thread queues for the loop to warn of (never sent as is)
Emit = Callable[[JSONDict], Any]


def _running(sd: Path) -> list[Record]:
    """The records of running engines whose leader lives, read without the lock."""
    return [r for r in records(sd) if state_of(r) == RUNNING and leader_alive(r)]


def _health_loop(sd: Path, every: float, known: dict[tuple[str, int], bool],
                 events: queue.Queue[JSONDict], stop: threading.Event,
                 healthy: threading.Event) -> None:
    """Check every running engine's health each ``every`` s; queue the changes; set
    ``healthy`` when an engine turns healthy (its memory is measured then)."""
    while not stop.wait(every):
        try:
            found = _running(sd)
        except OSError as e:
            events.put({EVENT_FIELD: PROBLEM, "key": f"health:{type(e).__name__}",
                        "message": f"checking the engines' health: {e}"})
            continue
        now = dict(zip([(r["engine"], r["pid"]) for r in found],
                       check_all([r.get("health_url") for r in found])))
        for (engine, pid), ok in now.items():
            if known.get((engine, pid)) != ok:
                events.put({EVENT_FIELD: HEALTH, "engine": engine, "pid": pid, "healthy": ok,
                            "at": time.time()})
                if ok:
                    healthy.set()
        known = now


def _group_of(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat[1] if stat is not None else None


def _memory(sd: Path, executable: str) -> list[JSONDict]:
    """A memory event for each running engine nvidia-smi lists a process of (gpus.by_group
    over the engines' sessions); a Problem when nvidia-smi gives no per-process figures."""
    used = gpus.sample_apps(executable)
    groups = {r["pid"]: r["engine"] for r in _running(sd)}
    now = time.time()
    return [{EVENT_FIELD: MEMORY, "engine": engine, "memory_bytes": figure, "at": now}
            for engine, figure in sorted(gpus.by_group(used, _group_of, groups).items())]


def _gpu_loop(sd: Path, executable: str, every: float, events: queue.Queue[JSONDict],
              stop: threading.Event, healthy: threading.Event, busy: threading.Event) -> None:
    """Sample the GPUs at once, then each ``every`` s (each BUSY_TELEMETRY_SECONDS while
    ``busy``) and whenever ``healthy`` is set (an engine turned healthy, or the pace
    changed); queue a gpu event, and the engines' memory events (at most each ``every`` s
    unless woken), or the problem (a sample whose GPU query failed asks no per-process
    figures: one warning per trouble)."""
    memory_due = 0.0
    while True:
        try:
            events.put({EVENT_FIELD: GPU, "gpus": gpus.sample(executable), "at": time.time()})
            if time.monotonic() >= memory_due:
                memory_due = time.monotonic() + every
                for event in _memory(sd, executable):
                    events.put(event)
        except gpus.AppsProblem as problem:
            events.put({EVENT_FIELD: PROBLEM, "key": f"apps:{problem.key}",
                        "message": str(problem)})
        except gpus.Problem as problem:
            events.put({EVENT_FIELD: PROBLEM, "key": f"gpu:{problem.key}",
                        "message": str(problem)})
        except OSError as e:
            events.put({EVENT_FIELD: PROBLEM, "key": f"apps:{type(e).__name__}",
                        "message": f"reading the engines' processes: {e}"})
        if healthy.wait(BUSY_TELEMETRY_SECONDS if busy.is_set() else every):
            memory_due = 0.0
        healthy.clear()
        if stop.is_set():
            return


class Watch:
    """One watch call: its settings, what it already said, and its loop (`run`)."""

    def __init__(self, sd: Path, order: JSONDict, emit: Emit,
                 inbox: queue.Queue[JSONDict] | None = None) -> None:
        self.sd = sd
        self.interval = number(order, "interval", 0.5, minimum=0.05)
        self.telemetry = number(order, "telemetry_seconds", 10.0, minimum=0.5)
        self.health = number(order, "health_seconds", 2.0, minimum=0.1)
        self.tick = number(order, "tick_seconds", 5.0, minimum=0.1)
        self.rotate_bytes = int(number(order, "log_rotate_bytes", logs.LOG_ROTATE_BYTES,
                                       minimum=1024))
        self.emit = emit
        self.events: queue.Queue[JSONDict] = queue.Queue()
        self.stop = threading.Event()
        self.healthy = threading.Event()   # an engine turned healthy: measure its memory
        self.busy = threading.Event()      # the proxy said requests are in flight (PACE)
        self.inbox: queue.Queue[JSONDict] = inbox if inbox is not None else queue.Queue()
        self.exited: set[tuple[str, int]] = set()
        self.warned: set[str] = set()
        holder = holder_of(order)
        self.lease = None if holder is None else Lease(sd, holder)

    def wait_for_lease(self, ended: Callable[[float], bool]) -> bool:
        """Take the lease (a watch naming no holder needs none), saying who holds it while
        another does; False when the watch ended first."""
        if self.lease is None:
            return True
        told: tuple[object, ...] | None = None
        while True:
            record = self.lease.take(time.time())
            if self.lease.held:
                self.emit({EVENT_FIELD: LEASE, "held": True, "holder": record, "at": time.time()})
                return True
            key = (record.get("machine"), record.get("pid"), record.get("since"))
            if key != told:
                told = key
                self.emit({EVENT_FIELD: LEASE, "held": False, "holder": record,
                           "at": time.time()})
            if ended(self.interval):
                return False

    def hello(self) -> dict[tuple[str, int], bool]:
        """Say hello with the running engines, and each one's health; that health."""
        with contextlib.suppress(BlockingIOError), locked(self.sd, wait=False):
            migrate(self.sd)
        listed = entries(_running(self.sd))
        self.emit({EVENT_FIELD: HELLO, "protocol": PROTOCOL, "engines": listed})
        now = time.time()
        for e in listed:
            self.emit({EVENT_FIELD: HEALTH, "engine": e["engine"], "pid": e["pid"],
                       "healthy": e["healthy"], "at": now})
        return {(e["engine"], e["pid"]): e["healthy"] for e in listed}

    def warn(self, key: str, message: str) -> None:
        """A warning event, once per kind of trouble (``key``) in this watch."""
        if key not in self.warned:
            self.warned.add(key)
            self.emit({EVENT_FIELD: WARNING, "message": message, "at": time.time()})

    def look(self) -> None:
        """Report the engines that ended since the last look; rotate the long logs."""
        try:
            exits.find_crashes(self.sd)
            taken = exits.take_exits(self.sd)
            for r in records(self.sd):
                logs.rotate(log_path(self.sd, r["engine"]), self.rotate_bytes)
        except OSError as e:
            self.warn(f"look:{type(e).__name__}", f"watching the engines: {e}")
            return
        for doc in taken:
            self.exited.add((doc["engine"], doc["pid"]))
            self.emit({EVENT_FIELD: EXIT, "engine": doc["engine"], "pid": doc["pid"],
                       "engine_pid": doc.get("engine_pid", doc["pid"]),
                       "exit_status": doc.get("exit_status"), "signal": doc.get("signal"),
                       "log_tail": logs.bounded_tail(logs.tail_lines(
                           log_path(self.sd, doc["engine"]), TAIL_LINES)),
                       "at": doc.get("at", time.time())})

    def paced(self) -> None:
        """Follow the pace messages the proxy wrote (protocol.PACE): a change wakes the
        GPU loop, so a busy host's first fast sample comes at once."""
        while True:
            try:
                doc = self.inbox.get_nowait()
            except queue.Empty:
                return
            if doc.get(OP_FIELD) != PACE or doc.get("busy") is self.busy.is_set():
                continue
            if doc.get("busy") is True:
                self.busy.set()
            else:
                self.busy.clear()
            self.healthy.set()

    def deliver(self) -> None:
        """Write what the threads queued (health of an engine already reported ended: never)."""
        self.paced()
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            if event[EVENT_FIELD] == PROBLEM:
                self.warn(event["key"], event["message"])
            elif event[EVENT_FIELD] != HEALTH or (event["engine"], event["pid"]) not in \
                    self.exited:
                self.emit(event)

    def start_threads(self, known: dict[tuple[str, int], bool]) -> None:
        threading.Thread(target=_health_loop, daemon=True, name="health-checks",
                         args=(self.sd, self.health, known, self.events, self.stop,
                               self.healthy)).start()
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            threading.Thread(target=_gpu_loop, daemon=True, name="nvidia-smi",
                             args=(self.sd, smi, self.telemetry, self.events, self.stop,
                                   self.healthy, self.busy)).start()

    def run(self, ended: Callable[[float], bool]) -> None:
        """Watch until ``ended`` (which waits up to the seconds it is given) says so."""
        try:
            if not self.wait_for_lease(ended):
                return
            self.start_threads(self.hello())
            next_look = next_tick = time.monotonic()
            next_tick += self.tick
            while True:
                self.deliver()
                if time.monotonic() >= next_look:
                    self.look()
                    next_look = time.monotonic() + self.interval
                if time.monotonic() >= next_tick:
                    self.emit({EVENT_FIELD: TICK, "at": time.time()})
                    next_tick = time.monotonic() + self.tick
                if ended(max(0.0, min(next_look, next_tick) - time.monotonic())):
                    return
        finally:
            self.stop.set()
            self.healthy.set()
            if self.lease is not None:
                self.lease.release()


def op_watch(sd: Path, order: JSONDict, emit: Emit, ended: Callable[[float], bool],
             inbox: queue.Queue[JSONDict] | None = None) -> None:
    """The ``watch`` order (see the module docstring); ``inbox``: the proxy's messages."""
    Watch(sd, order, emit, inbox).run(ended)
