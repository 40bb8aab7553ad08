"""tests/needs.py: a test that needs a missing tool is skipped, or fails when the tool's
LLMPROXY_REQUIRE_* switch is set (as CI sets them), never passes quietly."""

from __future__ import annotations

import pytest

from tests import needs, sshd


@pytest.mark.parametrize("what", sorted(needs.SWITCHES))
def test_a_missing_tool_skips_unless_required(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(needs.SWITCHES[what], raising=False)
    needs.need(what, None)                                   # there: the test goes on
    with pytest.raises(pytest.skip.Exception, match=f"no {what}: gone"):
        needs.need(what, "gone")
    with pytest.raises(pytest.skip.Exception, match=f"no {what}: gone"):
        needs.module(what, "gone")
    monkeypatch.setenv(needs.SWITCHES[what], "0")
    assert not needs.required(what)


@pytest.mark.parametrize("what", sorted(needs.SWITCHES))
def test_a_missing_required_tool_fails(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(needs.SWITCHES[what], "1")
    needs.need(what, None)
    needs.module(what, "gone")                               # the module runs: each test fails
    with pytest.raises(pytest.fail.Exception, match=f"{needs.SWITCHES[what]} is set .*: gone"):
        needs.need(what, "gone")


def test_the_sshd_fixture_fails_when_sshd_is_required_and_missing(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest.py's `sshd` under LLMPROXY_REQUIRE_SSHD=1 where no sshd can run: a failure
    that says why, not a skip."""
    monkeypatch.setattr(sshd, "available", lambda: "sshd not found")
    monkeypatch.setenv("LLMPROXY_REQUIRE_SSHD", "1")
    with pytest.raises(pytest.fail.Exception, match=r"LLMPROXY_REQUIRE_SSHD is set .*not found"):
        request.getfixturevalue("sshd")
