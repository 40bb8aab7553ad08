"""The reactor, typed by what each part uses of it.

Twisted describes a reactor by many small interfaces; a part that needs
several gets one of these unions (zope interfaces that extend Twisted's), so
its signature says what it may do. Only `makeService` holds the real reactor,
and it provides all of them.
"""

from __future__ import annotations

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorFDSet,
    IReactorFromThreads,
    IReactorProcess,
    IReactorSocket,
    IReactorTCP,
    IReactorTime,
)


class IProcessClock(IReactorProcess, IReactorTime):
    """Spawns processes and keeps time (the agent's ssh calls, an upgrade's candidate)."""


class IUpgradeReactor(IProcessClock, IReactorFDSet):
    """Also reads a pipe from the predecessor."""


class IServiceReactor(IUpgradeReactor, IReactorCore, IReactorFromThreads, IReactorSocket,
                      IReactorTCP):
    """Everything the root service and its parts use."""
