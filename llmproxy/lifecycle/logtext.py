"""twistd's text log, the same lines for less: the observer twistd would write
to standard output with, cheaper on llmproxy's own lines.

Every request ends with an access line, so a line's cost counts
(docs/performance.md). Twistd's observer (`textFileLogObserver`) builds each
timestamp from scratch (a time zone lookup and strftime) and parses the
"{line}" format with `string.Formatter`. This observer writes exactly the same
text (tests/test_logtext.py compares the two): the timestamp made once per
second, llmproxy's "{line}" events joined directly, and every other event
through Twisted's own formatter.

It replaces twistd's observer where twistd would write plain text to
standard output (in the foreground, with no --logfile, --syslog or --logger),
and where it would write a log file (--logfile, or a daemon's twistd.log):
there the file is opened for appending (`log_file_of`, `append_to`), so an
upgrade's successor, which writes the same file while its predecessor drains,
never overwrites a line of it (twistd's own log file writes at the offset it
last knew, and rotates at 1 MB, which two writers cannot share: rotate the
file with logrotate's copytruncate instead). --syslog and --logger keep
twistd's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Any

from twisted.logger import (
    FileLogObserver,
    ILogObserver,
    formatEventAsClassicLogText,
    formatTime,
    timeFormatRFC3339,
)

from llmproxy.core.clockwaits import PerSecond


def _stamps() -> Callable[[float | None], str]:
    """The RFC 3339 timestamp of a time (no fractions: one per second), made
    once per second; "-" for no time, as Twisted's."""
    made = PerSecond(lambda second: formatTime(second, timeFormatRFC3339))
    return lambda when: "-" if when is None else made(when)


def line_formatter() -> Any:
    """A formatter giving formatEventAsClassicLogText's text, faster for the
    events llmproxy logs with the format "{line}"."""
    stamp = _stamps()

    def classic(event: dict[str, Any]) -> str | None:
        line = event.get("line")
        if event.get("log_format") != "{line}" or type(line) is not str or not line \
                or "log_failure" in event:
            return formatEventAsClassicLogText(event, formatTime=stamp)
        system = event.get("log_system")
        if system is None:
            level = event.get("log_level")
            system = f"{event.get('log_namespace', '-')}#{'-' if level is None else level.name}"
        text = f"{stamp(event.get('log_time'))} [{system}] {line}"
        return text.replace("\n", "\n\t") + "\n"

    return classic


def text_observer(out: IO[str]) -> ILogObserver:
    """twistd's text observer on `out`, with the faster formatter."""
    return FileLogObserver(out, line_formatter())


def twistd_logs_to_stdout(runner: Any) -> bool:
    """Whether twistd, with these (its own) options, writes its text log to
    standard output: in the foreground with no log file (or `-`), no syslog and
    no --logger of its own."""
    if runner is None or runner.get("syslog") or runner.get("logger"):
        return False
    logfile = runner.get("logfile")
    return bool(logfile == "-" or (runner.get("nodaemon") and not logfile))


def log_file_of(runner: Any) -> str | None:
    """The absolute path of the text log file twistd, with these (its own) options, would
    write: its --logfile, or a daemon's twistd.log; None for standard output, --syslog or
    --logger. Read before twistd daemonizes (a daemon moves to its --rundir)."""
    if runner is None or runner.get("syslog") or runner.get("logger"):
        return None
    logfile = runner.get("logfile")
    if logfile == "-" or (not logfile and runner.get("nodaemon")):
        return None
    return os.path.abspath(logfile or "twistd.log")


def append_to(path: str) -> IO[str]:
    """The log file at `path` opened for appending, line-buffered: each write lands at the
    file's end whoever else writes it (O_APPEND)."""
    return open(path, "a", buffering=1, encoding="utf-8", errors="replace")
