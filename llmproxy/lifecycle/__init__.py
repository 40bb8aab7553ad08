"""The process: the root service that wires the parts and orders start and stop
(`service`), the stop chain (`stop`), signals and exit statuses (`signals`), the
listening socket (`listen`), open files (`accept`), sd_notify (`notify`), SIGHUP
reloads (`reload`) and the SIGUSR1 upgrade (`upgrade`, `pidfile`). May import
every other part."""
