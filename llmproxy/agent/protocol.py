"""The agent's wire protocol, one module for both ends: the version, the orders' names, the
events' names and fields, how an exit is said, and the one decode of an event line into a
typed record. The agent (`main`, `watch`, `logs`) writes what is named here; the proxy
(llmproxy/hosts/agentstream.py) decodes each line it reads once, with `decode`. Standard
library only, Python 3.9 (it is imported on the GPU host too): no ``X | Y`` at run time.

Protocol 4: every order the proxy sends names its host (``"host": NAME``, the config's host
name), and each host's engines, exits, logs, lock and lease live in a state directory of that
host's own (`state.host_dir`): hosts that share an ssh target never see each other's engines,
so engine names may repeat across them and each host's watch reports only its own exits.

An event is one JSON object per line, ``{"event": NAME, ...}``. A stream (``watch``, ``log``)
may also end with the agent's refusal, ``{"ok": false, "error": WHY}`` (`Refused`). A line
that is neither, or an event whose fields the proxy needs are missing or of the wrong type,
is a `BadEvent`: an agent that speaks otherwise is never misread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

PROTOCOL = 4  # the orders, answers and events both ends speak
HOST_FIELD = "host"  # the order's field naming the proxy's host (a NAME, as engine names)
OP_FIELD = "op"      # the order's field naming what to do
EVENT_FIELD = "event"  # an event line's field naming it

# The orders (the ``op`` field).
START, STATUS, STOP, WATCH, LOG = "start", "status", "stop", "watch", "log"
SLEEP = "sleep"   # run the order's ``command`` (a list of strings) to suspend the host
SLEEP_DELAY = 1.0  # seconds between a sleep order's answer and its command
# A message the proxy writes on a watch's stdin after its order (one JSON line, once the
# hello is read): ``{"op": "pace", "busy": true}`` while requests are in flight on the
# host's engines, the GPUs are then sampled each BUSY_TELEMETRY_SECONDS instead of the
# order's ``telemetry_seconds``; ``"busy": false`` goes back to that.
PACE = "pace"
BUSY_TELEMETRY_SECONDS = 1.0

# Keeping an engine's prompt cache across a stop the proxy chose (llmproxy/agent/kvcache.py):
# a start order's ``kv_cache`` (a dict, the `kvcache.Keep` bounds, {} for the defaults) marks its
# engine's slots as kept; a stop order's (or an exclusive start's) ``save_kv: true`` saves the
# kept slots of the engines it stops before they are stopped. Answers carry what was done as
# ``kv_cache`` (`KV_SAVED`, `KV_RESTORED`, `KV_ERROR`): a start's answer for its restore, each
# ``stopped`` entry for its save.
KV_CACHE = "kv_cache"
SAVE_KV = "save_kv"
KV_DEADLINE = 15.0            # seconds for all of one order's saves, or one start's restores
KV_MAX_FILES = 16             # slot files kept in one slot directory, oldest removed first
KV_MAX_BYTES = 16 * 2**30     # bytes of slot files kept in one slot directory
KV_SAVED, KV_RESTORED, KV_ERROR = "saved", "restored", "error"

# The events (the ``event`` field): a watch says these ...
HELLO = "hello"        # first once the lease is held: the protocol and the running engines
LEASE = "lease"        # who holds the host's lease: ``held``, ``holder``
EXIT = "exit"          # an engine ended that no order asked to stop
HEALTH = "health"      # an engine's health check changed
GPU = "gpu"            # the GPUs' figures
MEMORY = "engine_memory"  # one engine's measured GPU memory (see `Memory`)
WARNING = "warning"    # trouble of the agent's own, once per kind
TICK = "tick"          # the agent lives
# ... and a log order says this one.
LOG_LINE = "log"       # one line of an engine's log
EVENTS = frozenset({HELLO, LEASE, EXIT, HEALTH, GPU, MEMORY, WARNING, TICK, LOG_LINE})


def exit_text(exit_status: int | None, signal: int | None) -> str:
    """How an exit is said: `signal 9`, `exit status 3`, or `exit status unknown`."""
    if signal is not None:
        return f"signal {signal}"
    return f"exit status {exit_status}" if exit_status is not None else "exit status unknown"


def returncode_exit(returncode: int) -> tuple[int | None, int | None]:
    """(exit status, signal) of a subprocess return code (negative: killed by a signal)."""
    return (returncode, None) if returncode >= 0 else (None, -returncode)


class BadEvent(ValueError):
    """A line the proxy cannot read as an agent event: str() says why."""


@dataclass(frozen=True)
class Seen:
    """An engine a hello lists: its name and whether its health check passes."""

    engine: str
    healthy: bool


@dataclass(frozen=True)
class Hello:
    protocol: object           # the agent's; the stream compares it with PROTOCOL
    engines: tuple[Seen, ...]


@dataclass(frozen=True)
class LeaseState:
    held: bool                 # True: this watch holds it; False: `holder` does
    holder: dict[str, Any]


@dataclass(frozen=True)
class Exit:
    engine: str
    exit_status: int | None = None
    signal: int | None = None
    log_tail: tuple[str, ...] = ()

    @property
    def how(self) -> str:
        return exit_text(self.exit_status, self.signal)


@dataclass(frozen=True)
class Health:
    engine: str
    healthy: bool


@dataclass(frozen=True)
class Gpu:
    gpus: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Memory:
    """``engine_memory``: the GPU memory an engine's processes hold, in bytes: nvidia-smi's
    per-process used memory (``--query-compute-apps=pid,used_memory``) summed over the
    processes of the engine's session (its process group). Said with each ``gpu`` sample
    for each running engine that nvidia-smi lists; never said without nvidia-smi or for an
    engine it lists no process of (the proxy then keeps the declared ``memory_gb``)."""

    engine: str
    memory_bytes: int


@dataclass(frozen=True)
class AgentWarning:
    message: str


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class LogLine:
    line: str
    engine: str | None = None   # named when the order asked for every engine's log


@dataclass(frozen=True)
class Refused:
    """The agent refused the stream's order (its ``{"ok": false}`` answer)."""

    error: str


AgentEvent = Union[Hello, LeaseState, Exit, Health, Gpu, Memory, AgentWarning, Tick, LogLine,
                   Refused]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _engine(doc: dict[str, Any]) -> str:
    engine = doc.get("engine")
    if not isinstance(engine, str):
        raise _bad(doc, "no engine name")
    return engine


def _bad(doc: dict[str, Any], what: str) -> BadEvent:
    return BadEvent(f"a malformed {doc.get(EVENT_FIELD)} event ({what}): {_shown(doc)}")


def _shown(doc: object) -> str:
    text = repr(doc)
    return text if len(text) <= 200 else text[:200] + "..."


def _hello(doc: dict[str, Any]) -> Hello:
    engines = doc.get("engines", [])
    if not isinstance(engines, list):
        raise _bad(doc, "its engines are not a list")
    return Hello(doc.get("protocol"), tuple(
        Seen(e["engine"], e.get("healthy") is True) for e in engines
        if isinstance(e, dict) and isinstance(e.get("engine"), str)))


def _lease(doc: dict[str, Any]) -> LeaseState:
    holder = doc.get("holder")
    if not isinstance(holder, dict):
        raise _bad(doc, "no holder")
    return LeaseState(doc.get("held") is True, dict(holder))


def _exit(doc: dict[str, Any]) -> Exit:
    tail = doc.get("log_tail")
    return Exit(_engine(doc), _int(doc.get("exit_status")), _int(doc.get("signal")),
                tuple(map(str, tail)) if isinstance(tail, list) else ())


def _gpu(doc: dict[str, Any]) -> Gpu:
    gpus = doc.get("gpus")
    if not isinstance(gpus, list):
        raise _bad(doc, "its gpus are not a list")
    return Gpu(tuple(dict(g) for g in gpus if isinstance(g, dict)))


def _memory(doc: dict[str, Any]) -> Memory:
    figure = _int(doc.get("memory_bytes"))
    if figure is None or figure < 0:
        raise _bad(doc, "no memory_bytes")
    return Memory(_engine(doc), figure)


def _log_line(doc: dict[str, Any]) -> LogLine:
    line, engine = doc.get("line"), doc.get("engine")
    if not isinstance(line, str):
        raise _bad(doc, "no line")
    return LogLine(line, engine if isinstance(engine, str) else None)


_DECODERS: dict[str, Callable[[dict[str, Any]], AgentEvent]] = {
    HELLO: _hello,
    LEASE: _lease,
    EXIT: _exit,
    HEALTH: lambda doc: Health(_engine(doc), doc.get("healthy") is True),
    GPU: _gpu,
    MEMORY: _memory,
    WARNING: lambda doc: AgentWarning(str(doc.get("message"))),
    TICK: lambda doc: Tick(),
    LOG_LINE: _log_line,
}


def decode(doc: object) -> AgentEvent:
    """The typed record of one decoded JSON line of a stream; BadEvent if it is none."""
    if not isinstance(doc, dict):
        raise BadEvent(f"not a JSON event: {_shown(doc)}")
    name = doc.get(EVENT_FIELD)
    if name is None and doc.get("ok") is False:
        return Refused(str(doc.get("error") or "the agent refused the order"))
    decoder = _DECODERS.get(name) if isinstance(name, str) else None
    if decoder is None:
        raise BadEvent(f"an unknown event {name!r}: {_shown(doc)}")
    return decoder(doc)
