"""llmproxy-agent: start, stop, watch and report the LLM engines of a GPU host.

A program (the proxy, over ssh) writes one JSON order on stdin, on one line: ``{"protocol": 4,
"op": "start" | "status" | "stop" | "sleep" | "watch" | "log", "host": NAME, ...}``. ``host``
names the proxy's host: each host has a state directory of its own (`state.host_dir`), so hosts that
share an ssh target never see each other's engines. A person may give the order on the
command line alone (``llmproxy-agent status --host gpu1``, ``llmproxy-agent stop ENGINE``,
``llmproxy-agent log ENGINE -f``), without a protocol. For start, status, stop and sleep the agent
writes one JSON answer line on stdout, carrying ``"protocol": 4``, and exits 0 when it answered
(even ``"ok": false``), 2 for unusable input, an order of another protocol included. Orders
name their proxy (``"holder"``, see `lease`): a start or stop is answered ``"ok": false`` with
``held_by`` while another proxy holds the host's lease (one given by hand is not checked); each such
call holds an exclusive flock on the host's ``agent.lock``, so they run one at a time. watch
and log write JSON lines (events) as they come, without holding the lock, until stdin closes or
a signal (SIGTERM, SIGHUP, SIGINT) comes; an order they refuse is answered like the others.
Plain stdlib on purpose: the GPU host needs no Twisted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO

from llmproxy.agent import lease
from llmproxy.agent.logs import op_log
from llmproxy.agent.orders import BadInput, JSONDict, op_status, op_stop
from llmproxy.agent.protocol import (
    HOST_FIELD,
    LOG,
    OP_FIELD,
    PROTOCOL,
    SLEEP,
    START,
    STATUS,
    STOP,
    WATCH,
)
from llmproxy.agent.sleep import op_sleep
from llmproxy.agent.start import interrupted, op_start
from llmproxy.agent.state import NAME, host_dir, locked, migrate, state_dir, take_shared
from llmproxy.agent.watch import op_watch

__all__ = ["PROTOCOL", "main", "run"]

OPS: dict[str, Callable[[Path, JSONDict], JSONDict]] = {
    START: op_start, STATUS: op_status, STOP: op_stop, SLEEP: op_sleep}
CHANGING = frozenset({START, STOP, SLEEP})   # orders refused while another proxy holds the lease
Emit = Callable[[JSONDict], Any]
Inbox = queue.Queue[JSONDict]  # what the proxy wrote on a stream's stdin after its order
MAX_MESSAGE = 4096  # one such line; the proxy's are far smaller
STREAMS: dict[str, Callable[[Path, JSONDict, Emit, Callable[[float], bool], Inbox], None]] = {
    WATCH: op_watch, LOG: op_log}
EXPECTED = "expected start, status, stop, sleep, watch or log"


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


def check_order(order: JSONDict, by_hand: bool = False) -> str:
    """The order's op, once its protocol and op are known good (else BadInput)."""
    check_protocol(order, by_hand)
    op = order.get(OP_FIELD)
    if op is None:
        raise BadInput(f"no op given: {EXPECTED}")
    if not isinstance(op, str) or (op not in OPS and op not in STREAMS):
        raise BadInput(f"unknown op {op!r}: {EXPECTED}")
    return op


def of_host(order: JSONDict, sd: Path) -> Path:
    """The state directory of the host the order names (created 0700, a protocol 3 agent's
    engines taken over: `state.take_shared`), or ``sd`` when it names none."""
    host = order.get(HOST_FIELD)
    if host is not None and (not isinstance(host, str) or not NAME.fullmatch(host)):
        raise BadInput(f"host must be a name matching {NAME.pattern}, got {host!r:.100}")
    sd.mkdir(mode=0o700, parents=True, exist_ok=True)
    hd = host_dir(sd, host)
    if hd != sd:
        hd.mkdir(mode=0o700, parents=True, exist_ok=True)
        take_shared(sd, hd)
    return hd


def run(order: JSONDict, sd: Path, *, by_hand: bool = False) -> JSONDict:
    """Carry out one start, status or stop order in state directory ``sd`` (created 0700;
    the order's host's own under it, `of_host`) and return the answer."""
    op = check_order(order, by_hand)
    if op not in OPS:
        raise BadInput(f"{op} is not an order with one answer")
    lease.holder_of(order)    # a malformed holder is bad input, whatever the op
    sd = of_host(order, sd)
    with locked(sd):
        migrate(sd)
        if op not in CHANGING or by_hand:
            return OPS[op](sd, order)
        refusal, held = lease.check(sd, order)
        if refusal is not None:
            return {"ok": False, "error": refusal, "held_by": lease.current(sd)}
        try:
            return OPS[op](sd, order)
        finally:
            if held is not None:
                held.release()


def _watch_stdin(stdin: TextIO, closed: threading.Event, inbox: queue.Queue[JSONDict]) -> None:
    """Set ``closed`` once stdin ends (the proxy closed it, or its ssh session went away);
    each JSON object line the proxy writes meanwhile (protocol.PACE) goes to ``inbox``."""
    try:
        fd: int | None = stdin.fileno()
    except (OSError, ValueError):
        fd = None

    def read() -> bytes:
        if fd is None:
            return stdin.read().encode()
        return os.read(fd, 65536)  # the fd: the buffer above it holds no lock while this blocks

    def wait() -> None:
        held = b""
        with contextlib.suppress(OSError, ValueError):
            while chunk := read():
                *lines, held = (held + chunk).split(b"\n")
                held = held[-MAX_MESSAGE:]
                for line in lines:
                    with contextlib.suppress(ValueError):
                        doc = json.loads(line)
                        if isinstance(doc, dict):
                            inbox.put(doc)
                if fd is None:
                    break
        closed.set()

    threading.Thread(target=wait, daemon=True, name="stdin").start()


def _emitter(out: TextIO, op: str, order: JSONDict, by_hand: bool) -> Emit:
    """How a stream writes each event: a JSON line, or a person's log as plain lines."""
    def emit(event: JSONDict) -> None:
        if by_hand and op == LOG:
            named = order.get("engine") is None
            out.write(f"{event['engine']}: {event['line']}\n" if named else event["line"] + "\n")
        else:
            out.write(json.dumps(event) + "\n")
        out.flush()

    return emit


def stream(order: JSONDict, sd: Path, out: TextIO, stdin: TextIO, by_hand: bool) -> None:
    """Carry out a watch or log order: events on ``out`` until stdin ends (unless a person
    gave the order) or a signal comes."""
    op = check_order(order, by_hand)
    sd = of_host(order, sd)
    closed = threading.Event()
    inbox: queue.Queue[JSONDict] = queue.Queue()
    if not by_hand:
        _watch_stdin(stdin, closed, inbox)

    def ended(timeout: float) -> bool:
        return bool(interrupted) or closed.wait(timeout) or bool(interrupted)

    STREAMS[op](sd, order, _emitter(out, op, order, by_hand), ended, inbox)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BadInput(message)


def _read_json(stdin: TextIO) -> str:
    """The text of the JSON value on stdin, read line by line until it is whole (a watch's
    stdin stays open after its order), or to the end."""
    text = ""
    for line in iter(stdin.readline, ""):
        text += line
        with contextlib.suppress(ValueError):
            json.loads(text)
            break
    return text


def read_order(given: JSONDict, stdin: TextIO | None) -> tuple[JSONDict, bool]:
    """The order: the fields ``given`` on the command line updated by the JSON object on stdin,
    if any; and whether it came from the command line alone (a person's)."""
    text = "" if stdin is None or stdin.isatty() else _read_json(stdin)
    order = {key: value for key, value in given.items() if value is not None}
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


def _silence(out: TextIO) -> None:
    """Point a closed stdout at /dev/null, so the exit's flush of what is left fails no more."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, out.fileno())
        os.close(fd)


def _parser() -> _Parser:
    parser = _Parser(prog="llmproxy-agent", description=(__doc__ or "").split("\n")[0])
    parser.add_argument(OP_FIELD, nargs="?", help=f"the order ({EXPECTED[len('expected '):]}; "
                        "else from the JSON on stdin)")
    parser.add_argument("engine", nargs="?", help="the engine to stop or whose log to show "
                        "(default: every one)")
    parser.add_argument("--state-dir", help="where the engine records, lock and logs live")
    parser.add_argument("--host", help="the proxy's name of the host whose engines to act on "
                        "(each has its own state under STATE_DIR/hosts; default: none)")
    parser.add_argument("-n", "--lines", type=int, help="log: how many last lines (50)")
    parser.add_argument("-f", "--follow", action="store_true", default=None,
                        help="log: then the new lines as they come, until Ctrl-C")
    return parser


def main(argv: list[str] | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> int:
    """Console script ``llmproxy-agent``: answer one order as one JSON line on stdout, or
    stream a watch or log order's events."""
    status = 0
    handlers: dict[int, Any] = {}
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if stdout is None else stdout
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        order, by_hand = read_order({OP_FIELD: args.op, "engine": args.engine, "lines": args.lines,
                                     "follow": args.follow, HOST_FIELD: args.host}, stdin)
        interrupted.clear()
        with contextlib.suppress(ValueError):  # only the main thread may set handlers
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                handlers[sig] = signal.signal(sig, _on_signal)
        if isinstance(order.get(OP_FIELD), str) and order[OP_FIELD] in STREAMS:
            stream(order, state_dir(args.state_dir), out, stdin, by_hand)
            return 0
        answer = run(order, state_dir(args.state_dir), by_hand=by_hand)
    except BadInput as e:
        answer, status = {"ok": False, "error": str(e)}, 2
    except BrokenPipeError:  # whoever read the stream went away: nothing more to say
        _silence(out)
        return 0
    except OSError as e:
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    with contextlib.suppress(OSError):  # the caller may have gone away
        out.write(json.dumps({"ok": answer.pop("ok"), "protocol": PROTOCOL, **answer}) + "\n")
        out.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
