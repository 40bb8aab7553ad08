"""The text log observer llmproxy gives twistd: the very text of twistd's own."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
from twisted.application.service import Application, Service
from twisted.logger import (
    ILogObserver,
    LogLevel,
    formatEventAsClassicLogText,
    formatTime,
    timeFormatRFC3339,
)
from twisted.python.failure import Failure

from llmproxy.lifecycle.logtext import (
    append_to,
    line_formatter,
    log_file_of,
    text_observer,
    twistd_logs_to_stdout,
)


def twisted_text(event: dict[str, Any]) -> str | None:
    """What twistd's textFileLogObserver writes for `event`."""
    return formatEventAsClassicLogText(
        event, formatTime=lambda when: formatTime(when, timeFormatRFC3339))


def failure() -> Failure:
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        return Failure()
    raise AssertionError("unreachable")


EVENTS: list[dict[str, Any]] = [
    {"log_format": "{line}", "line": "POST /v1/chat/completions status=200 {not a field}",
     "log_time": 1764558000.25, "log_namespace": "llmproxy.access", "log_level": LogLevel.info},
    {"log_format": "{line}", "line": "two\nlines", "log_time": 1764558000.9,
     "log_namespace": "llmproxy.events", "log_level": LogLevel.warn},
    {"log_format": "{line}", "line": "a system", "log_time": 1764558001.0, "log_system": "sys"},
    {"log_format": "{line}", "line": "no time, no level"},
    {"log_format": "{line}", "line": "", "log_time": 1764558002.0},
    {"log_format": "{line}", "line": 42, "log_time": 1764558002.0},
    {"log_format": "hello {who}", "who": "world", "log_time": 1764558003.5,
     "log_namespace": "x", "log_level": LogLevel.error},
    {"log_format": "{line}", "line": "with a traceback", "log_time": 1764558004.0,
     "log_failure": failure()},
    {"log_time": 1764558005.0},
]


@pytest.mark.parametrize("event", EVENTS, ids=range(len(EVENTS)))
def test_every_event_reads_as_twistd_would_write_it(event: dict[str, Any]) -> None:
    assert line_formatter()(event) == twisted_text(event)


def test_the_second_cache_follows_the_clock() -> None:
    """Lines in the same second share a stamp; the next second gets its own, and
    going back in time (a clock step) is not served from the cache."""
    classic = line_formatter()
    for when in (100.0, 100.99, 101.0, 99.5, 1764558000.0, 1764558000.5):
        event = {"log_format": "{line}", "line": "x", "log_time": when,
                 "log_namespace": "n", "log_level": LogLevel.info}
        assert classic(event) == twisted_text(event)


def test_the_observer_writes_the_lines() -> None:
    out = io.StringIO()
    observer = text_observer(out)
    observer({"log_format": "{line}", "line": "one", "log_time": 1764558000.0,
              "log_namespace": "llmproxy.access", "log_level": LogLevel.info})
    observer({"log_format": "{line}", "line": "two", "log_time": 1764558000.0,
              "log_namespace": "llmproxy.access", "log_level": LogLevel.info})
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["one", "two"]
    assert all("[llmproxy.access#info]" in line for line in lines)


@pytest.mark.parametrize(("options", "stdout"), [
    ({"nodaemon": True, "logfile": None}, True),
    ({"nodaemon": True, "logfile": ""}, True),
    ({"nodaemon": False, "logfile": "-"}, True),
    ({"nodaemon": True, "logfile": "/var/log/llmproxy.log"}, False),
    ({"nodaemon": False, "logfile": None}, False),       # a daemon logs to twistd.log
    ({"nodaemon": True, "logfile": None, "syslog": True}, False),
    ({"nodaemon": True, "logfile": None, "logger": "my.observer"}, False),
    (None, False),
])
def test_only_twistds_plain_stdout_log_is_replaced(options: dict[str, Any] | None,
                                                    stdout: bool) -> None:
    assert twistd_logs_to_stdout(options) is stdout


def test_the_root_service_hands_its_observer_to_the_application() -> None:
    """twistd reads the application's ILogObserver after the root service joined
    it; LLMProxyService sets it there when tap.py gave it one."""
    from llmproxy.lifecycle.service import LLMProxyService

    application = Application("llmproxy")
    observer = text_observer(io.StringIO())
    service: Any = LLMProxyService.__new__(LLMProxyService)
    Service.__init__(service)
    service.log_observer = observer
    LLMProxyService.setServiceParent(service, application)
    assert application.getComponent(ILogObserver) is observer


@pytest.mark.parametrize(("options", "path"), [
    ({"nodaemon": True, "logfile": None}, None),                 # standard output
    ({"nodaemon": False, "logfile": "-"}, None),
    ({"nodaemon": False, "logfile": None}, "twistd.log"),        # a daemon's default
    ({"nodaemon": True, "logfile": "proxy.log"}, "proxy.log"),
    ({"nodaemon": False, "logfile": "/var/log/llmproxy.log"}, "/var/log/llmproxy.log"),
    ({"nodaemon": False, "logfile": None, "syslog": True}, None),
    ({"nodaemon": False, "logfile": "x.log", "logger": "my.observer"}, None),
    (None, None),
])
def test_the_log_file_is_twistds_made_absolute(options: dict[str, Any] | None,
                                               path: str | None) -> None:
    """The file twistd would log to (a daemon's twistd.log included), absolute as seen from
    where twistd started; none for standard output, syslog or a logger of its own."""
    assert log_file_of(options) == (None if path is None else os.path.abspath(path))


def test_the_log_file_is_appended_to_by_two_writers_line_by_line(tmp_path: Any) -> None:
    """Two processes' observers on one file (an upgrade's predecessor and successor): each
    line lands at the end, none written over."""
    path = str(tmp_path / "twistd.log")
    first, second = append_to(path), append_to(path)
    first.write("one\n")
    second.write("two\n")
    first.write("three\n")
    first.close()
    second.close()
    assert (tmp_path / "twistd.log").read_text() == "one\ntwo\nthree\n"
