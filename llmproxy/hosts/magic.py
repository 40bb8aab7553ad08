"""Wake-on-LAN: the magic packet of a MAC (6 bytes 0xff, then the MAC's 6 bytes 16
times), sent by UDP to a broadcast address through the reactor (`MagicSender`:
never a blocking socket call on the reactor's thread)."""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime, IReactorUDP
from twisted.internet.protocol import DatagramProtocol

from llmproxy.config.wake import WakeConfig

REPEATS = 3          # copies of each packet (UDP may drop one)


def magic_packet(mac: str) -> bytes:
    """The magic packet of `mac` (12 hex digits, any case; ``:`` or ``-`` allowed)."""
    digits = mac.replace(":", "").replace("-", "")
    raw = bytes.fromhex(digits)
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + raw * 16


class MagicSender:
    """Sends a host's magic packet REPEATS times, from a UDP port of its own that
    allows broadcast (opened for the send, closed after it). The port's socket is
    non-blocking: a datagram is queued by the kernel or refused at once."""

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor     # it provides IReactorUDP too (the real one does)

    def send(self, wake: WakeConfig) -> str | None:
        """Send `wake.mac`'s packet to `wake.broadcast`:`wake.port`: None, or why it
        could not be sent (never raised: the wake's timeout and its event say it)."""
        packet = magic_packet(wake.mac)
        try:
            port = IReactorUDP(self._reactor).listenUDP(0, DatagramProtocol(), "", 8192)
        except Exception as e:  # any failure to open is reported the same
            return f"no UDP port for the magic packet: {e}"
        try:
            port.setBroadcastAllowed(True)     # type: ignore[attr-defined]
            for _ in range(REPEATS):
                port.write(packet, (wake.broadcast, wake.port))   # type: ignore[attr-defined]
        except OSError as e:
            return f"magic packet to {wake.broadcast}:{wake.port} not sent: {e}"
        finally:
            port.stopListening()
        return None
