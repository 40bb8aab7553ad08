"""`twistd llmproxy`: options and the service maker.

`Options.postOptions` only parses and validates the command line (and the
socket systemd passed). `makeService` makes the service: it installs the
SIGHUP/SIGUSR1 latches, reads the config and its files (a bad one stops twistd
with status 78 before anything starts), and is the one place that imports the
global reactor.
"""

from __future__ import annotations

import os
import sys
from typing import Any, ClassVar, cast

from twisted.application.service import IService
from twisted.python import usage

from llmproxy.config import Config, ConfigError
from llmproxy.lifecycle.signals import refuse_to_start


class Options(usage.Options):
    """Command-line options of `twistd llmproxy`."""

    synopsis = "-c hosts.json | --demo"
    longdesc = (
        "Serve one OpenAI-compatible URL in front of the hosts named in the config. "
        "Run in the foreground as `twistd -n --pidfile= llmproxy -c hosts.json`. "
        "Validate a config without starting anything with `llmproxy check -c hosts.json`. "
        "--demo serves a built-in config in front of two simulated engines (with --config, "
        "that config, each host's engine simulated at its URL)."
    )
    optParameters: ClassVar[list[list[Any]]] = [
        ["config", "c", None, "Path of the config file (hosts.json)."],
        ["demo-port", None, None, "With --demo: listen on this port of 127.0.0.1 instead of "
                                  "the built-in demo config's 8080 (`make demo PORT=N`)."],
    ]
    optFlags: ClassVar[list[list[str | None]]] = [
        ["demo", None, "Simulate an engine at each host's URL; without --config, serve the "
                       "built-in demo config (127.0.0.1:8080 in front of 127.0.0.1:18091 "
                       "and :18092)."],
        ["standby", None, "Start as a hot standby: read the rosters and answer /healthz, but "
                          "answer /readyz 503 (standby) and serve no model until this proxy "
                          "holds every managed host's lease (a holder that lets go hands it "
                          "over); then adopt what runs there and report ready."],
    ]

    def postOptions(self) -> None:
        """Parse and validate the command line (and the environment systemd passes);
        files are read, and signal handlers installed, as the service is made."""
        from llmproxy.lifecycle.listen import ListenError, forget_inherited, inherited_socket

        # First of all, before anything imports twisted.internet.endpoints
        # (which deletes them): the socket systemd may have passed.
        try:
            self["inherited"] = inherited_socket(os.environ, os.getpid())
        except ListenError as e:
            raise refuse_to_start(str(e)) from None
        forget_inherited(os.environ)
        if not self["demo"] and not self["config"]:
            raise usage.UsageError("--config is required (or --demo for the built-in demo)")
        from llmproxy.testing import demo

        # Absolute: reloads read the same file wherever a daemon moved to.
        self["config_path"] = os.path.abspath(self["config"] or demo.CONFIG_PATH)
        if self["demo-port"] is not None:
            _demo_port(self["demo"], self["demo-port"])


def _demo_port(demo: bool, port: str) -> int:
    """--demo-port's port number (UsageError if it is not one, or without --demo)."""
    if not demo:
        raise usage.UsageError("--demo-port goes with --demo")
    if not port.isdigit() or int(port) > 65535:
        raise usage.UsageError(f"--demo-port: not a port number: {port!r}")
    return int(port)


def _load(options: dict[str, Any], process: Any) -> tuple[Config, Any]:
    """The config and its access files (keys, upstream keys, TLS files), read this
    once by the loader `llmproxy check` runs too, after the latches are installed:
    SIGHUP and SIGUSR1 never kill the process, and a SIGHUP that arrived before
    this read is satisfied by it."""
    import dataclasses

    from llmproxy.config import ListenAddress
    from llmproxy.lifecycle.accessfiles import load_startup

    process.hangup.install()
    process.upgrade_signal.install()
    path = options["config_path"]
    try:
        config, files = load_startup(path, os.environ)
    except ConfigError as e:
        raise refuse_to_start(f"invalid config {path}:\n" + str(e)) from None
    process.hangup.config_read()
    if options["demo-port"] is not None:
        port = _demo_port(options["demo"], options["demo-port"])
        config = dataclasses.replace(config, listen=ListenAddress("127.0.0.1", port))
    return config, files


def makeService(options: dict[str, Any]) -> IService:
    """Build the service tree on the global reactor."""
    import atexit
    import signal

    from twisted.internet import reactor as global_reactor

    from llmproxy.core.reactors import IServiceReactor
    from llmproxy.lifecycle.assemble import ServiceInputs, build_service, upstream_client
    from llmproxy.lifecycle.components import Process
    from llmproxy.lifecycle.gcfreeze import freeze_startup_heap
    from llmproxy.lifecycle.handover import handover_from_environ
    from llmproxy.lifecycle.logtext import log_file_of
    from llmproxy.lifecycle.notify import notifier_from_environ
    from llmproxy.lifecycle.pidfile import PidFile
    from llmproxy.lifecycle.signals import SignalLatch, exit_now
    from llmproxy.lifecycle.upgrade import Launcher
    from llmproxy.speedups import select

    # Read (and forgotten, so no child of ours takes it for its own) first of all.
    handover = handover_from_environ(os.environ)
    # SIGUSR1 is the upgrade signal: caught from here on (_load), so twistd does not
    # take it for log rotation and an early one does not kill the process.
    process = Process(hangup=SignalLatch(), upgrade_signal=SignalLatch(signal.SIGUSR1),
                      environ=dict(os.environ), settle_heap=freeze_startup_heap)
    config, files = _load(options, process)   # one load, for the engine client and the service
    # The real reactor provides every interface the parts are typed with.
    reactor = cast(IServiceReactor, global_reactor)
    speedups = select(os.environ)     # one Selection for the client and the service
    http, pool = upstream_client(config, reactor, files, speedups)
    runner = getattr(options, "parent", None)
    log_file = log_file_of(runner)    # read here: a daemon moves to its --rundir later
    # An upgrade's candidate starts where twistd started, told the daemon's log file.
    launcher = Launcher(reactor, environ=process.environ, cwd=os.getcwd(), log_file=log_file,
                        timeout=config.upgrade_timeout_seconds)
    service = build_service(ServiceInputs(
        config, reactor, http, pool=pool, process=process,
        notifier=notifier_from_environ(os.environ), config_path=options["config_path"],
        inherited=options["inherited"], handover=handover,
        standby=bool(options["standby"]),
        pidfile=PidFile.of_twistd(options), access_files=files, speedups=speedups,
        launcher=launcher))
    service.log_observer = _log_observer(runner, log_file)
    if options["demo"]:
        from llmproxy.testing.demo import demo_engines

        demo_engines(config, reactor).setServiceParent(service)

    # twistd exits 0 once the reactor has stopped; a stop that cut requests
    # says so with its own status, after twistd's own clean-up has run.
    def exit_status() -> None:
        if service.exit_status:
            exit_now(service.exit_status)

    atexit.register(exit_status)
    return service


def _log_observer(runner: Any, log_file: str | None) -> Any:
    """The text observer twistd logs through: to stdout, the daemon's log file, or
    None (twistd's own default)."""
    from llmproxy.lifecycle.logtext import append_to, text_observer, twistd_logs_to_stdout

    if twistd_logs_to_stdout(runner):
        return text_observer(sys.stdout)
    if log_file is not None:
        return text_observer(append_to(log_file))
    return None
