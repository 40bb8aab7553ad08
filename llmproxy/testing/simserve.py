"""The simulated engine's command line (`llmproxy-simengine`, `python -m
llmproxy.testing.simengine`): its options, and serving until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Protocol, cast

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Site

from llmproxy.testing import simextra, simslots
from llmproxy.testing.simengine import SimEngine, make_site


class _Reactor(Protocol):
    """What ``serve`` uses of the global reactor (``listenTCP`` typed to take a ``Site``)."""

    def listenTCP(self, port: int, factory: Site, interface: str) -> Any: ...
    def run(self) -> None: ...


def serve(argv: list[str] | None = None) -> None:
    """Console script ``llmproxy-simengine``: serve a simulated engine until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(
        prog="llmproxy-simengine", description="A simulated OpenAI-compatible LLM engine."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--models", default="sim", help="comma-separated model names")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--idle-timeout", type=float, default=None,
                        help="close keep-alive connections idle this many seconds")
    simextra.add_arguments(parser)
    simslots.add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        parser.error("--models needs at least one name")

    from twisted.internet import reactor as _reactor

    reactor = cast(_Reactor, _reactor)
    clock = cast(IReactorTime, reactor)
    hang_at = None if args.hang_after is None else clock.seconds() + args.hang_after
    engine = SimEngine(models, clock, ctx=args.ctx, delay=args.delay, tokens=args.tokens,
                       api_key=args.api_key, health_file=args.health_file, hang_at=hang_at,
                       slots=simslots.SimSlots.from_args(args))
    port, scheme = simextra.listen(reactor, make_site(engine, args.idle_timeout), args)
    real_port = port.getHost().port
    listening = (f"simengine listening on {scheme}://{args.host}:{real_port} "
                 f"models={','.join(models)}")
    print(listening, flush=True)
    reactor.run()
