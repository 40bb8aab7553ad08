"""One managed host's agent calls as the engine controller makes them
(hosts/controller.py): each order with its timeout, and its answer read into
None or the reason it failed, never an exception."""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmproxy.agent.protocol import (
    KV_CACHE,
    KV_DEADLINE,
    OP_FIELD,
    SAVE_KV,
    START,
    STATUS,
    STOP,
)
from llmproxy.config import HostConfig
from llmproxy.core.hub import Publish
from llmproxy.hosts.adoption import Found
from llmproxy.hosts.agentclient import AgentError, IAgentTransport, answer_error
from llmproxy.hosts.kvreport import KvReport

START_SLACK = 30.0  # added to an engine's start_timeout_seconds (+ stop grace) for the ssh call
STOP_SLACK = 30.0  # added to the stop grace for the ssh call of a stop
STATUS_TIMEOUT = 30.0


class AgentCalls:
    """The orders to one host's agent (`stop_grace`: what each stop allows an engine)."""

    log = Logger()

    def __init__(self, host: HostConfig, transport: IAgentTransport,
                 stop_grace: float = 10.0, clock: IReactorTime | None = None,
                 publish: Publish | None = None) -> None:
        self.host = host
        self.stop_grace = stop_grace
        self._transport = transport
        self._kv = (KvReport(host.name, clock, publish)
                    if clock is not None and publish is not None else None)

    @property
    def _keeps(self) -> bool:
        """Only a host with a kept engine asks its agent to save (and waits for it)."""
        return any(e.kv_cache == "keep" for e in self.host.engines.values())

    async def call(self, order: dict[str, Any],
                   timeout: float) -> tuple[dict[str, Any], str | None]:
        """The agent's answer and None, or ({}, why it failed); never raises."""
        try:
            answer = await self._transport.call(self.host, order, timeout)
        except AgentError as e:
            return {}, str(e)
        except Exception as e:
            self.log.failure("agent call {op} on {host}", host=self.host.name, op=order[OP_FIELD])
            return {}, f"{type(e).__name__}: {e}"
        return answer, answer_error(answer)

    async def status(self) -> tuple[list[Found], str | None]:
        """The engines the agent reports running and None, or ([], why it could not say)."""
        answer, reason = await self.call({OP_FIELD: STATUS}, STATUS_TIMEOUT)
        if reason is not None:
            return [], reason
        engines = answer.get("engines")
        if not (isinstance(engines, list) and all(isinstance(e, dict) for e in engines)):
            return [], f"the agent's status answer has no list of engines: {answer!r:.200}"
        return engines, None

    async def start(self, engine: str, exclusive: bool) -> str | None:
        """Start `engine` (`exclusive`: the agent stops every other one, saving their kept
        prompt caches: a switch is a stop the proxy chose); None once it runs healthy (its
        own kept cache restored), else why not."""
        config = self.host.engines[engine]
        order: dict[str, Any] = {
            OP_FIELD: START, "engine": engine, "command": list(config.command),
            "health_url": self.host.engine_url(engine) + config.health,
            "timeout": config.start_timeout_seconds, "grace": self.stop_grace}
        if config.kv_cache == "keep":
            order[KV_CACHE] = {"deadline": KV_DEADLINE}
        if exclusive:
            order["exclusive"] = True
            if self._keeps:
                order[SAVE_KV] = True
        kv = 2 * KV_DEADLINE if self._keeps else 0.0
        answer, reason = await self.call(order, config.start_timeout_seconds + self.stop_grace
                                         + START_SLACK + kv)
        if self._kv is not None:
            self._kv.started(engine, answer)
        return reason

    async def stop(self, engine: str | None, save: bool = True) -> str | None:
        """Stop `engine` (None: every engine on the host); None once stopped, else why not.
        `save`: a stop the proxy chose, which saves kept prompt caches first (a hung
        engine's stop does not)."""
        order: dict[str, Any] = {OP_FIELD: STOP, "grace": self.stop_grace}
        if engine is not None:
            order = {OP_FIELD: STOP, "engine": engine, "grace": self.stop_grace}
        kv = save and self._keeps
        if kv:
            order[SAVE_KV] = True
        answer, reason = await self.call(order, self.stop_grace + STOP_SLACK
                                         + (KV_DEADLINE if kv else 0.0))
        if self._kv is not None:
            self._kv.stopped(answer)
        return reason
