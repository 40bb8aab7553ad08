"""The process: start, reload, upgrade and stop. May import every other part.

Modules:

- `service`: the root service; orders start and stop, nothing more.
- `children`: the root's child services (host locks, listener, fleet, roster refresher, watchdog).
- `front`: the web site and the listening socket it is served on.
- `webapp`: the web's facade over the running proxy (`web.routes.App`).
- `assemble`: every part built from a config (`build_service`), once.
- `components`: the parts the root wires together, and the process's OS seams.
- `accessfiles`: the keys file, upstream keys and TLS files, loaded once at start-up.
- `stop`: the graceful stop, one chain under one budget.
- `signals`: signals and exit statuses.
- `listen`: the listening socket (bound, inherited from systemd or a predecessor).
- `openfiles`: the open-files limit, and a port that survives running out of descriptors.
- `tlslistener`: https on the listening socket, its certificate reloadable; ALPN h2, http/1.1.
- `negotiation`: each TLS connection's HTTP as ALPN chose it (HTTP/2 or HTTP/1.1).
- `reload`: the SIGHUP reload that tells the truth.
- `runtime`: the config in force, the rosters, and the catalog made of both.
- `keysfile`: the keys file as a reloadable part.
- `upgrade`: the SIGUSR1 upgrade, both sides (`Upgrade`).
- `handover`: what passes between two generations in an upgrade.
- `pidfile`: twistd's pid file, handed on by an upgrade.
- `notify`: sd_notify without libsystemd.
- `upstreamtls`: TLS to https engines, each host's own trust.
- `logtext`: twistd's text log lines, made for less.
- `gcfreeze`: start-up's heap frozen out of full garbage collections.
"""
