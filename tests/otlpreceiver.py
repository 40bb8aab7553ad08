"""A real OTLP/HTTP trace receiver for the tracing tests: a threaded
`http.server` on 127.0.0.1 that decodes each POST to /v1/traces with
opentelemetry-proto and keeps every span it received (its name, trace and span
ids, parent, kind, attributes and events). `hold` keeps each answer back until
released (a collector that stalls)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    """One span as the collector received it (ids in hex)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    start: int
    end: int
    service: str


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@dataclass
class Receiver:
    """The collector: `spans` received so far; `posts` counted; while `hold`
    is clear, each answer waits for it."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    posts: int = 0
    hold: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        """The spans once at least `count` arrived (or whatever came in `timeout`)."""
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.spans) >= count, timeout)
            return list(self.spans)

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


def start_receiver() -> Receiver:
    """A receiver listening on 127.0.0.1 (a free port), answering at once."""
    receiver = Receiver()
    receiver.hold.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            receiver.hold.wait(30)
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            got = []
            for resource in message.resource_spans:
                service = next((_value(a.value) for a in resource.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        got.append(ReceivedSpan(
                            s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                            s.kind, {a.key: _value(a.value) for a in s.attributes},
                            [e.name for e in s.events], s.start_time_unix_nano,
                            s.end_time_unix_nano, service))
            with receiver.arrived:
                receiver.posts += 1
                receiver.spans.extend(got)
                receiver.arrived.notify_all()
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    receiver.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.server.daemon_threads = True
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver
