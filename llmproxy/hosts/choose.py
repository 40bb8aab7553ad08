"""Which host serves a request for a model several hosts serve (replicas).

The rule (`rank`, pure): a cordoned host is never chosen; a host is up when its
last roster read was good (a managed host: its engine is started on demand, so
its roster is not asked), no connection to it failed in the last
UNREACHABLE_SECONDS (or since, a good roster read came), and it is not asleep
(nor, with a wake block, lost: hosts/sleepwake.py, so a host able to serve
is preferred to waking one); among those up, an
engine already running for the model (no switch) first, then the least loaded
(in flight and queued per slot), ties in turn (round robin per model). With
`affinity`, a session's host comes first while it is up: the host it was last
served by (``header:``/``body:``), or for ``prefix`` the host the prefix ring
gives it among the hosts up (`prefixring`: bounded-load consistent hashing, on
the hosts' requests in flight and queued). Hosts that are down come last, to
try when nothing else answers.

`Chooser` keeps the state the rule needs (each model's turn, the sessions,
bounded) and publishes each choice and each failover. A session is remembered
by a fixed-size digest of its key (`session_digest`), never the key itself:
what a client puts in a header or a body field costs the table the same few
dozen bytes whatever its length, and at most MAX_SESSIONS are kept.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from twisted.internet.interfaces import IReactorTime

from llmproxy.core.capacity import EnginePlaced, Failover, ReplicaChosen
from llmproxy.core.hub import Publish
from llmproxy.hosts import prefixring, siting
from llmproxy.hosts.catalog import Catalog, Route
from llmproxy.hosts.host import Host

UNREACHABLE_SECONDS = 30.0   # a host whose connection failed counts as down this long
MAX_SESSIONS = 10_000        # affinity sessions remembered, least recently used out first


def session_digest(session: str) -> bytes:
    """The 16-byte digest a session is remembered by (its key may be any length)."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class Candidate:
    """One host of a model, as the rule sees it."""

    host: str
    up: bool
    cordoned: bool = False
    ready: bool = True       # the model's engine runs there (no switch needed)
    load: float = 0.0        # (in flight + queued) per slot


def rank(candidates: Sequence[Candidate], turn: int = 0,
         sticky: str | None = None) -> tuple[list[str], str]:
    """The hosts to try, best first, and why the first one; no hosts when all
    are cordoned."""
    open_ = [c for c in candidates if not c.cordoned]
    up = [c for c in open_ if c.up]
    down = [c.host for c in open_ if not c.up]
    if not up:
        return down, "no host is up" if down else "cordoned"
    place = {c.host: (i - turn) % len(candidates) for i, c in enumerate(candidates)}
    best = sorted(up, key=lambda c: (not c.ready, c.load, place[c.host]))
    order = [c.host for c in best]
    if sticky in order:
        order.remove(sticky)
        return [sticky, *order, *down], "affinity"
    if len(best) == 1:
        reason = "only host up"
    elif best[0].ready and not best[1].ready:
        reason = "engine running"
    elif best[0].load < best[1].load:
        reason = "least loaded"
    else:
        reason = "round robin"
    return order + down, reason


class Chooser:
    """Orders a route's hosts for each request; remembers turns and sessions."""

    def __init__(self, gates: Mapping[str, Host], clock: IReactorTime, publish: Publish,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self._gates = gates
        self._clock = clock
        self._publish = publish
        self._max_sessions = max_sessions
        self._turns: dict[str, int] = {}
        self._sessions: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self.reservations = siting.Reservations()

    def candidate(self, gate: Host, route: Route, catalog: Catalog) -> Candidate:
        """How the rule sees `gate` for `route` now."""
        name = gate.host.name
        failed = gate.unreachable_at
        roster = catalog.rosters.get(name)
        if failed is not None and (self._clock.seconds() - failed >= UNREACHABLE_SECONDS
                                   or (roster is not None and (roster.fetched_at or 0) > failed
                                       and catalog.roster_ok(name))):
            failed = None
            gate.unreachable(None)
        naps = gate.sleepwake
        asleep = naps is not None and (naps.state != "awake" or naps.needs_wake())
        up = failed is None and not asleep and (gate.host.managed or catalog.roster_ok(name))
        ready = route.engine is None or not gate.host.managed or gate.runs(route.engine)
        return Candidate(name, up, gate.cordoned, ready, gate.load())

    def choose(self, route: Route, catalog: Catalog, session: str | None = None,
               request_id: str | None = None) -> list[Host]:
        """The gates to try for one request, best first; none: all cordoned."""
        gates = [self._gates[h.name] for h in route.hosts if h.name in self._gates]
        if len(gates) <= 1:
            return [g for g in gates if not g.cordoned]
        turn = self._turns.get(route.name, 0)
        candidates = [self.candidate(g, route, catalog) for g in gates]
        placed = self._placement(route, gates, candidates, request_id)
        if placed is not None:
            return placed
        if route.affinity == "prefix":
            sticky = None if session is None else prefixring.pick(session, {
                c.host: self._gates[c.host].in_flight() + self._gates[c.host].queued()
                for c in candidates if c.up and not c.cordoned})
        else:
            sticky = None if session is None else \
                self._sessions.get((route.name, session_digest(session)))
        order, reason = rank(candidates, turn, sticky)
        if reason != "affinity":
            self._turns[route.name] = turn + 1    # sessions do not skew the turns
        if order:
            self._publish(ReplicaChosen(self._clock.seconds(), request_id, route.name,
                                        order[0], tuple(order), reason))
        return [self._gates[h] for h in order]

    def _placement(self, route: Route, gates: list[Host], candidates: list[Candidate],
                   request_id: str | None) -> list[Host] | None:
        """When the model's engine runs on none of its managed hosts: the
        hosts to try as the placement rule orders them (hosts/siting.py), the room
        reserved on the first, the choice published. None: the replica rule decides."""
        engine, now = route.engine, self._clock.seconds()
        if engine is None or not all(g.host.managed for g in gates):
            return None
        sites = [siting.site_of(g, engine, c.up and not g.held_by
                                and not g.supervisor.failed(engine), self.reservations, now)
                 for g, c in zip(gates, candidates, strict=True) if not c.cordoned]
        if not sites or any(c.ready and c.up and not c.cordoned for c in candidates):
            return None     # it runs: the replica rule spreads the load over its copies
        placed = siting.place(sites)
        first = self._gates[placed.order[0]]
        site = next(s for s in sites if s.host == first.host.name)
        if site.usable:      # (a host without a budget: any reservation fills it)
            self.reservations.reserve(site.host, engine, site.need_gb if
                                      first.host.memory_gb is not None else 1.0, now)
        self._publish(EnginePlaced(now, request_id, route.name, engine, first.host.name,
                                   placed.why, placed.order, placed.headroom))
        return [self._gates[h] for h in placed.order]

    def start_failed(self, gate: Host, route: Route) -> None:
        """The engine of `route` could not be started on `gate`: its room is free again."""
        if route.engine is not None:
            self.reservations.release(gate.host.name, route.engine)

    def left(self, gate: Host, route: Route) -> None:
        """A request sent to `gate` left its queue unserved (its client went, its wait
        timed out, the queue was full): the room placed there for its engine is free
        again, unless another request still waits there for that engine."""
        engine = route.engine
        if engine is not None and not gate.waiting_for(engine):
            self.reservations.release(gate.host.name, engine)

    def served(self, route: Route, session: str | None, host: str) -> None:
        """A request of `session` went to `host`: the session stays there while it is up."""
        if session is None or len(route.hosts) < 2 or route.affinity == "prefix":
            return      # a prefix's host is the ring's, not remembered
        key = (route.name, session_digest(session))
        self._sessions[key] = host
        self._sessions.move_to_end(key)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    def unreachable(self, gate: Host, route: Route, next_gate: Host, reason: str,
                    request_id: str | None = None) -> None:
        """Nothing of a request reached `gate`'s host: it counts as down for a while,
        and the request tries `next_gate`."""
        gate.unreachable(self._clock.seconds())
        self.start_failed(gate, route)
        self._publish(Failover(self._clock.seconds(), request_id, route.name, gate.host.name,
                               next_gate.host.name, reason))
