"""Both paths capture alike (issue 49): the plain relay (web/relay.py) and the
speedups' (speedups/relaychunks.py) feed the capture from where each already sees
the engine's bytes, so the same engine response, cut into reads anywhere, gives the
same capture on both: the same answer body (the engine's body, de-framed, as the
client read it), status, outcome and streaming flag. Harness: tests/differential.py
(two proxies in this process, real sockets), here with `"capture": {}` on both."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st

from tests.differential import Rig, cut, make_rig
from tests.differential_views import replies
from tests.test_differential_responses import CUTS, SETTINGS, Response, relayed, responses

pytestmark = pytest.mark.integration

COMPARED = ("status", "outcome", "streaming", "method", "path", "model", "host",
            "response_bytes", "request_bytes")


@pytest_twisted.async_yield_fixture(scope="module")
async def capturing_rig() -> AsyncIterator[Rig]:
    """The differential rig with capture on in both proxies."""
    made = make_rig({"capture": {}})
    yield made
    await made.close()


def newest(rig: Rig, name: str) -> dict[str, Any]:
    ring = rig.proxies[name].service.parts.captures
    assert ring is not None
    [entry] = ring.page(limit=1)["captures"]
    doc = ring.get(entry["id"])
    assert doc is not None
    return doc


@SETTINGS
@given(response=responses(), cuts=CUTS, stream=st.booleans())
@pytest_twisted.ensureDeferred
async def test_both_paths_capture_the_same_answer(
        capturing_rig: Rig, response: Response, cuts: list[float], stream: bool) -> None:
    """A well-formed engine response cut into reads anywhere: each path's capture
    holds the engine's body whole, as its client read it, and the two captures agree
    on everything but the request's id and timings."""
    reference, fast = await relayed(capturing_rig, cut(response.data, cuts), stream)
    captured = {name: newest(capturing_rig, name) for name in ("reference", "speedups")}
    for name, outcome in (("reference", reference), ("speedups", fast)):
        [reply] = replies(outcome.received)
        doc = captured[name]
        assert doc["response"]["body"].encode("utf-8") == \
            response.body.decode("utf-8", "replace").encode("utf-8") == \
            reply.body.decode("utf-8", "replace").encode("utf-8"), name
        assert doc["id"] == outcome.ended[0].request_id
    assert {k: captured["reference"][k] for k in COMPARED} == \
        {k: captured["speedups"][k] for k in COMPARED}
    assert captured["reference"]["streaming"] is stream
