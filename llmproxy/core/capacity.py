"""The events of a host's capacity: a request waiting in a host's queue or
refused by it, a cordon, the choice among a model's hosts, an operator's engine
command, a key's request refused by its rate limit, an engine measured far above
its memory_gb. Published once where the fact is known (see `core.hub`), like the events of
`core.events`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmproxy.core.events import INFO, WARN, Event


@dataclass(frozen=True)
class Queued(Event):
    """A request waits in a host's queue: `reason` capacity (the host is at
    max_concurrent) or switch (its engine is not the running one); `depth`
    counts the waiters, this one included."""

    type: ClassVar[str] = "queue.wait"
    host: str
    request_id: str | None
    engine: str | None
    reason: str
    depth: int


@dataclass(frozen=True)
class QueueLeft(Event):
    """A request left a host's queue without an error of its own: `outcome`
    served (it got its slot) or gone (its client left); `waited` seconds."""

    type: ClassVar[str] = "queue.leave"
    host: str
    request_id: str | None
    outcome: str
    waited: float
    depth: int


@dataclass(frozen=True)
class QueueRejected(Event):
    """A host's queue refused a request: `reason` queue_full (429: `depth`
    waiters, max_queue) or queue_timeout (503: it waited `waited` seconds)."""

    type: ClassVar[str] = "queue.reject"
    host: str
    request_id: str | None
    engine: str | None
    reason: str
    depth: int
    waited: float = 0.0

    def line(self) -> tuple[str, str]:
        who = self.request_id or "a request"
        if self.reason == "queue_full":
            return WARN, (f"queue of {self.host} is full ({self.depth} waiting): refused {who}"
                          " with 429")
        return WARN, (f"{who} waited {self.waited:.1f}s in the queue of {self.host}: gave up "
                      "with 503 (queue_timeout_seconds)")


@dataclass(frozen=True)
class EngineCommand(Event):
    """An operator's command on a managed host's engine (`llmproxy engine`), or
    the start-up's preload: `op` start, stop or preload, `stage` begun, done or
    failed (`reason`)."""

    type: ClassVar[str] = "engine.command"
    host: str
    op: str
    stage: str
    engine: str | None
    reason: str | None = None
    elapsed: float | None = None

    def line(self) -> tuple[str, str]:
        who = "" if self.op == "preload" else "operator "
        head = f"{who}{self.op} of {self.engine or 'the engine'} on {self.host}"
        if self.stage == "begun":
            return INFO, head
        if self.stage == "done":
            return INFO, f"{head}: done in {self.elapsed or 0:.1f}s"
        return WARN, f"{head} failed: {self.reason}"


@dataclass(frozen=True)
class Cordon(Event):
    """An operator cordoned a host (`cordoned` True: it takes no new request, what
    runs there finishes) or lifted it; `in_flight` and `queued` there at that moment."""

    type: ClassVar[str] = "host.cordon"
    host: str
    cordoned: bool
    in_flight: int = 0
    queued: int = 0

    def line(self) -> tuple[str, str]:
        if not self.cordoned:
            return INFO, f"uncordoned {self.host}: it takes new requests again"
        return INFO, (f"cordoned {self.host}: it takes no new request; {self.in_flight} in "
                      f"flight and {self.queued} queued there finish")


@dataclass(frozen=True)
class ReplicaChosen(Event):
    """A model several hosts serve: the hosts a request will try, best first
    (`order`; cordoned ones left out), and why the first (`reason`: only host up,
    affinity, engine running, least loaded, round robin, no host is up)."""

    type: ClassVar[str] = "replica.choice"
    request_id: str | None
    model: str
    host: str
    order: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class EnginePlaced(Event):
    """An engine that ran on none of a model's hosts is placed: `host` starts it,
    `why` says which rule chose it (hosts/siting.py), `order` the hosts to try,
    `headroom` each host's memory free then ((host, GB), None: no budget)."""

    type: ClassVar[str] = "engine.placed"
    request_id: str | None
    model: str
    engine: str
    host: str
    why: str
    order: tuple[str, ...]
    headroom: tuple[tuple[str, float | None], ...]

    def line(self) -> tuple[str, str]:
        room = ", ".join(f"{h} {'-' if gb is None else f'{gb:g} GB'}"
                         for h, gb in self.headroom)
        return INFO, (f"placed {self.engine} on {self.host} for {self.request_id or 'a request'}"
                      f": {self.why} (free: {room})")


@dataclass(frozen=True)
class Failover(Event):
    """A request could not reach `host` and nothing of it was sent (`reason`: the
    connection was refused or timed out, or the request was never written, or
    the engine could not be started): it goes to `next_host`."""

    type: ClassVar[str] = "replica.failover"
    request_id: str | None
    model: str
    host: str
    next_host: str
    reason: str

    def line(self) -> tuple[str, str]:
        return WARN, (f"{self.request_id or 'a request'} for {self.model}: {self.host} "
                      f"unreachable ({self.reason}), nothing was sent: trying {self.next_host}")


@dataclass(frozen=True)
class RateLimited(Event):
    """A key's request was refused by one of its limits (`limit`: requests,
    tokens or energy: its rpm, tpm or wh_per_day): a 429 that asks it to wait
    `wait` seconds."""

    type: ClassVar[str] = "ratelimit.refuse"
    key: str
    request_id: str | None
    limit: str
    wait: float

    def line(self) -> tuple[str, str]:
        who = self.request_id or "a request"
        per = {"requests": "rpm", "tokens": "tpm"}.get(self.limit, "wh_per_day")
        return WARN, (f"key {self.key} is over its {per}: refused {who} with 429 "
                      f"(retry in {self.wait:.1f}s)")


@dataclass(frozen=True)
class EngineMemoryAbove(Event):
    """A managed engine's measured GPU memory is far above its declared `memory_gb`
    (hosts/measured.py says how far): placement now counts the measured figure."""

    type: ClassVar[str] = "engine.memory_above"
    host: str
    engine: str
    declared_gb: float
    measured_gb: float

    def line(self) -> tuple[str, str]:
        return WARN, (f"engine {self.engine} on {self.host} holds {self.measured_gb:.2f} GiB "
                      f"of GPU memory, its memory_gb says {self.declared_gb:g}: placing it by "
                      "the measured figure (raise memory_gb)")
