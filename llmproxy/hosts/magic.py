"""Wake-on-LAN: the magic packet of a MAC (6 bytes 0xff, then the MAC's 6 bytes 16
times), sent by UDP to a broadcast address through the reactor (`MagicSender`:
never a blocking socket call on the reactor's thread)."""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime, IReactorUDP
from twisted.internet.protocol import DatagramProtocol
from twisted.logger import Logger

from llmproxy.config.wake import WakeConfig

REPEATS = 3          # copies of each packet (UDP may drop one)
REPEAT_GAP = 0.1     # seconds between copies


def magic_packet(mac: str) -> bytes:
    """The magic packet of `mac` (12 hex digits, any case; ``:`` or ``-`` allowed)."""
    digits = mac.replace(":", "").replace("-", "")
    raw = bytes.fromhex(digits)
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + raw * 16


class MagicSender:
    """Sends a host's magic packet REPEATS times, from a UDP port of its own that
    allows broadcast (opened for the send, closed after it)."""

    log = Logger()

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor     # it provides IReactorUDP too (the real one does)

    def send(self, wake: WakeConfig) -> None:
        """Send `wake.mac`'s packet to `wake.broadcast`:`wake.port`; an OS error is
        logged (the wake's timeout says the rest), never raised."""
        packet = magic_packet(wake.mac)
        try:
            port = IReactorUDP(self._reactor).listenUDP(0, DatagramProtocol(), "", 8192)
            port.setBroadcastAllowed(True)     # type: ignore[attr-defined]
        except Exception as e:  # any failure to open is reported the same
            self.log.warn("magic packet for {mac} not sent: {error}", mac=wake.mac, error=e)
            return
        for i in range(REPEATS):
            self._reactor.callLater(i * REPEAT_GAP, self._write, port, packet, wake)
        self._reactor.callLater(REPEATS * REPEAT_GAP, port.stopListening)

    def _write(self, port: object, packet: bytes, wake: WakeConfig) -> None:
        try:
            port.write(packet, (wake.broadcast, wake.port))   # type: ignore[attr-defined]
        except OSError as e:
            self.log.warn("magic packet for {mac} to {to}:{port} failed: {error}",
                          mac=wake.mac, to=wake.broadcast, port=wake.port, error=e)
