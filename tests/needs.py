"""What a test needs of this machine, checked the same way everywhere.

A test that needs a tool this machine lacks (a real sshd, systemd 254, a browser) is skipped,
saying what is missing, unless that tool's LLMPROXY_REQUIRE_* switch is set (CI sets all of
them): then it fails instead, so a CI run can never pass with the test quietly left out.

- `need(what, reason)`: in a fixture or a test; `reason` is None when the tool can run.
- `module(what, reason)`: at a module's top, for a module whose every test needs the tool:
  skips the module, or (switch set) leaves it to `need` to fail each test.
"""

from __future__ import annotations

import os

import pytest

SWITCHES = {
    "sshd": "LLMPROXY_REQUIRE_SSHD",
    "systemd": "LLMPROXY_REQUIRE_SYSTEMD",
    "browser": "LLMPROXY_REQUIRE_BROWSER",
    "otel": "LLMPROXY_REQUIRE_OTEL",
}


def required(what: str) -> bool:
    """The switch of `what` is set (unset, empty or 0 means a missing tool skips)."""
    return os.environ.get(SWITCHES[what], "") not in ("", "0")


def need(what: str, reason: str | None) -> None:
    """Go on when `reason` is None; else skip the test, or fail it when `what` is required."""
    if reason is None:
        return
    if required(what):
        pytest.fail(f"{SWITCHES[what]} is set but {what} cannot run here: {reason}")
    pytest.skip(f"no {what}: {reason}")


def module(what: str, reason: str | None) -> None:
    """At a module's top: skip the whole module when `what` cannot run and is not required."""
    if reason is not None and not required(what):
        pytest.skip(f"no {what}: {reason}", allow_module_level=True)
