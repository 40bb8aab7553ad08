"""The ways a wait in a host's queue (hosts/scheduler.py) ends without a lease
(a sleeping host's wake that failed among them: hosts/sleepwake.py), and an
operator's stop that failed."""

from __future__ import annotations


class SwitchFailed(Exception):
    """A request's engine could not be made to run; str() is
    ``switching host H to engine E failed: <reason>``."""

    def __init__(self, host: str, engine: str, reason: str) -> None:
        self.host, self.engine, self.reason = host, engine, reason
        super().__init__(f"switching host {host} to engine {engine} failed: {reason}")


class ProxyStopping(Exception):
    """A request waited for something that will not come: the proxy stops. Nothing
    of it reached an engine, so it may be answered elsewhere (a successor)."""

    def __init__(self, host: str, engine: str | None) -> None:
        self.host, self.engine = host, engine
        what = f"switch to engine {engine}" if engine else "serve it"
        super().__init__(f"host {host} will not {what}: the proxy is stopping")


class QueueFull(Exception):
    """The host's queue holds `max_queue` requests already (a 429)."""

    def __init__(self, host: str, depth: int) -> None:
        self.host, self.depth = host, depth
        super().__init__(f"the queue of host {host} is full ({depth} waiting, max_queue)")


class QueueTimeout(Exception):
    """A request waited `queue_timeout_seconds` in the host's queue (a 503)."""

    def __init__(self, host: str, waited: float) -> None:
        self.host, self.waited = host, waited
        super().__init__(f"waited {waited:.0f}s in the queue of host {host} "
                         "(queue_timeout_seconds)")


class StopFailed(Exception):
    """An operator's stop of a host's engine failed; str() says why."""

    def __init__(self, host: str, engine: str, reason: str) -> None:
        self.host, self.engine, self.reason = host, engine, reason
        super().__init__(f"stopping engine {engine} on host {host} failed: {reason}")


class WakeFailed(SwitchFailed):
    """A host did not wake within its timeout (or is in its backoff after one that did
    not); str() names the host and the timeout."""

    def __init__(self, host: str, engine: str, reason: str) -> None:
        self.host, self.engine, self.reason = host, engine, reason
        Exception.__init__(self, reason)
