"""A real h2 client (the `h2` library's state machine) wired to a server connection through a
StringTransport on a task.Clock: the in-memory HTTP/2 client of the compat and stream tests.

It records every frame the server sends (`frames`), each stream's status, data and end, and
each RST_STREAM; GOAWAYs are recorded but kept from h2's state machine (which would refuse the
streams' data after one). PINGs are answered unless `hold_pings` (then they wait in `held`
until `answer_pings()`). Received data is acknowledged (WINDOW_UPDATE) only when
`acknowledge`: a test of flow control sets the window it gives with `window`.
"""

from __future__ import annotations

import json
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, RstStreamFrame
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

PUMP_ROUNDS = 50     # exchanges `pump` makes at the most: a server that never stops is seen


class Client:
    def __init__(self, server: Any, clock: Clock, *, window: int | None = None,
                 acknowledge: bool = False) -> None:
        self.server, self.clock, self.acknowledge = server, clock, acknowledge
        self.transport = StringTransport()
        server.makeConnection(self.transport)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        if window is not None:
            self.h2.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.h2.initiate_connection()
        self.frames: list[Frame] = []
        self.held: list[bytes] = []
        self.hold_pings = False
        self.status: dict[int, int] = {}
        self.headers: dict[int, dict[str, str]] = {}
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.pump()

    # -- the exchange -------------------------------------------------------------------------
    def pump(self) -> None:
        """Send what the client has, run the clock's due calls, read what the server sent;
        again until neither side has anything to say."""
        for _ in range(PUMP_ROUNDS):
            out = self.h2.data_to_send()
            if out:
                self.server.dataReceived(out)
            self.clock.advance(0)
            got = self.transport.value()
            self.transport.clear()
            if not got and not out:
                return
            self._frames(got)

    def _frames(self, data: bytes) -> None:
        while data:
            frame, length = Frame.parse_frame_header(memoryview(data[:9]))
            raw, data = data[:9 + length], data[9 + length:]
            frame.parse_body(memoryview(raw[9:]))
            self.frames.append(frame)
            if isinstance(frame, GoAwayFrame):
                continue
            if isinstance(frame, PingFrame) and self.hold_pings:
                self.held.append(raw)
                continue
            for event in self.h2.receive_data(raw):
                self._event(event)

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.status[event.stream_id] = int(dict(event.headers)[b":status"])
            self.headers[event.stream_id] = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h2.events.DataReceived):
            self.data[event.stream_id] = self.data.get(event.stream_id, b"") + event.data
            if self.acknowledge:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.ended.add(event.stream_id)

    def answer_pings(self) -> None:
        self.hold_pings = False
        held, self.held = self.held, []
        for raw in held:
            self.h2.receive_data(raw)
        self.pump()

    # -- what the client sends ----------------------------------------------------------------
    def request(self, path: str, extra: list[tuple[str, str]] | tuple[()] = (),
                end: bool = True, method: str = "GET") -> int:
        """A new stream's headers (`end`: and its end); its id."""
        stream = int(self.h2.get_next_available_stream_id())
        self.h2.send_headers(stream, [(":method", method), (":path", path), (":scheme", "https"),
                                      (":authority", "127.0.0.1"), *extra], end_stream=end)
        self.pump()
        return stream

    def get(self, path: bytes) -> int:
        return self.request(path.decode())

    def post(self, path: str, headers: dict[str, str] | None = None) -> int:
        """Open a POST stream: its headers only, the body to follow."""
        return self.request(path, list((headers or {}).items()), end=False, method="POST")

    def send(self, stream: int, data: bytes, end: bool = False) -> None:
        self.h2.send_data(stream, data, end_stream=end)
        self.pump()

    def send_raw(self, raw: bytes) -> None:
        """Bytes the h2 state machine would not send (a flood, a frame out of turn)."""
        self.server.dataReceived(raw)
        self.pump()

    # -- what the server sent -----------------------------------------------------------------
    def resets(self) -> list[tuple[int, int]]:
        """Each RST_STREAM as (stream, error code), in order."""
        return [(f.stream_id, f.error_code) for f in self.frames if isinstance(f, RstStreamFrame)]

    def reset_code(self, stream: int) -> int | None:
        """The error code `stream` was reset with, or None."""
        return dict(self.resets()).get(stream)

    def goaways(self) -> list[tuple[int, int]]:
        """Each GOAWAY as (last stream id, error code), in order."""
        return [(f.last_stream_id, f.error_code) for f in self.frames
                if isinstance(f, GoAwayFrame)]

    def goaway_codes(self) -> list[int]:
        return [code for _, code in self.goaways()]

    def error(self, stream: int) -> dict[str, Any]:
        """The OpenAI-style error `stream` was answered with."""
        return dict(json.loads(self.data[stream])["error"])
