"""Holds the listening socket systemd-socket-activate passed (fd 3), as the
systemd manager would, and starts proxy generations on it on command.

Run as: systemd-socket-activate -l ADDR --fdname=http -E PYTHONPATH -E PATH \\
            python tests/socketholder.py CMD ARGS...
Reads lines on stdin: `start` starts CMD with the socket as fd 3 and
LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES set (through sh, so LISTEN_PID is the
exec'd process's own pid), and prints `started PID`. Exits on EOF.
"""

import os
import subprocess
import sys

LAUNCH = 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"'


def main() -> None:
    names = os.environ.get("LISTEN_FDNAMES")
    for var in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    os.set_inheritable(3, True)
    children = []
    for line in sys.stdin:
        if line.strip() == "start":
            env = dict(os.environ, LISTEN_FDS="1")
            if names:
                env["LISTEN_FDNAMES"] = names
            child = subprocess.Popen(["/bin/sh", "-c", LAUNCH, "holder", *sys.argv[1:]],
                                     env=env, pass_fds=(3,), stdin=subprocess.DEVNULL,
                                     stdout=sys.stderr)   # stdout is our answer channel
            children.append(child)
            print(f"started {child.pid}", flush=True)
    for child in children:
        child.wait()


if __name__ == "__main__":
    main()
