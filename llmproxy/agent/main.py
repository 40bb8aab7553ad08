"""llmproxy-agent: start, stop and report the LLM engines of a GPU host.

A program (the proxy, over ssh) writes one JSON order on stdin: ``{"protocol": 2, "op":
"start" | "status" | "stop", ...}``. A person may give the order on the command line alone
(``llmproxy-agent status``, ``llmproxy-agent stop ENGINE``), without a protocol. The agent
writes one JSON answer line on stdout, carrying ``"protocol": 2``, and exits 0 when it answered
(even ``"ok": false``), 2 for unusable input, an order of another protocol included. Every call
holds an exclusive flock on ``<state_dir>/agent.lock``, so calls on one host run one at a time.
Plain stdlib on purpose: the GPU host needs no Twisted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO

from llmproxy.agent.orders import BadInput, JSONDict, op_status, op_stop
from llmproxy.agent.start import interrupted, op_start
from llmproxy.agent.state import locked, migrate, state_dir

PROTOCOL = 2  # the orders and answers this agent speaks; the proxy checks it too
OPS: dict[str, Callable[[Path, JSONDict], JSONDict]] = {
    "start": op_start, "status": op_status, "stop": op_stop}


def check_protocol(order: JSONDict, by_hand: bool = False) -> None:
    """Refuse (BadInput) an order of another protocol than PROTOCOL; an order without one is
    a protocol 1 proxy's, unless a person gave it on the command line (``by_hand``)."""
    given = order.get("protocol")
    if given is None and by_hand:
        return
    if given is None:
        sent = "protocol 1 (an order without a protocol field)"
    elif type(given) is not int:
        raise BadInput(f"protocol must be a whole number, got {given!r}")
    elif given == PROTOCOL:
        return
    else:
        sent = f"protocol {given}"
    fix = ("upgrade llmproxy on the proxy's machine to this host's version"
           if given is None or given < PROTOCOL else "upgrade llmproxy on this host to the "
           "proxy's version")
    raise BadInput(f"llmproxy-agent speaks protocol {PROTOCOL}; the proxy sent {sent}: {fix}")


def run(order: JSONDict, sd: Path, *, by_hand: bool = False) -> JSONDict:
    """Carry out one order in state directory ``sd`` (created 0700) and return the answer."""
    check_protocol(order, by_hand)
    op = order.get("op")
    if op is None:
        raise BadInput("no op given: expected start, status or stop")
    if op not in OPS:
        raise BadInput(f"unknown op {op!r}: expected start, status or stop")
    sd.mkdir(mode=0o700, parents=True, exist_ok=True)
    with locked(sd):
        migrate(sd)
        return OPS[op](sd, order)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BadInput(message)


def read_order(argv_op: str | None, stdin: TextIO | None,
               argv_engine: str | None = None) -> tuple[JSONDict, bool]:
    """The order: ``{"op": argv_op, "engine": argv_engine}`` (those given) updated by the JSON
    object on stdin, if any; and whether it came from the command line alone (a person's)."""
    text = "" if stdin is None or stdin.isatty() else stdin.read()
    order: JSONDict = {} if argv_op is None else {"op": argv_op}
    if argv_engine is not None:
        order["engine"] = argv_engine
    if not text.strip():
        return order, True
    try:
        given = json.loads(text)
    except ValueError as e:
        raise BadInput(f"stdin is not JSON: {e}") from None
    if not isinstance(given, dict):
        raise BadInput(f"stdin must hold one JSON object, got {type(given).__name__}")
    order.update(given)
    return order, False


def _on_signal(signum: int, frame: object) -> None:
    interrupted.append(signum)  # a start gives up and cleans up; a stop finishes first


def main(argv: list[str] | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> int:
    """Console script ``llmproxy-agent``: answer one order as one JSON line on stdout."""
    parser = _Parser(prog="llmproxy-agent", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("op", nargs="?", help="start, status or stop (else from the JSON)")
    parser.add_argument("engine", nargs="?", help="the engine to stop (default: every one)")
    parser.add_argument("--state-dir", help="where the engine records, lock and logs live")
    status = 0
    handlers: dict[int, Any] = {}
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        order, by_hand = read_order(args.op, sys.stdin if stdin is None else stdin, args.engine)
        interrupted.clear()
        with contextlib.suppress(ValueError):  # only the main thread may set handlers
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                handlers[sig] = signal.signal(sig, _on_signal)
        answer = run(order, state_dir(args.state_dir), by_hand=by_hand)
    except BadInput as e:
        answer, status = {"ok": False, "error": str(e)}, 2
    except OSError as e:
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out = sys.stdout if stdout is None else stdout
    with contextlib.suppress(OSError):  # the caller may have gone away
        out.write(json.dumps({"ok": answer.pop("ok"), "protocol": PROTOCOL, **answer}) + "\n")
        out.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
