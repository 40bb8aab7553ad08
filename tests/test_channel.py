"""The proxy's HTTP/1.1 connection is one class over Twisted's HTTPChannel
(web/channel.py): no class of the project stacked between them, and each
member of Twisted's it overrides named, with why, in its docstring."""

from __future__ import annotations

import re

from twisted.web.http import HTTPChannel

from llmproxy.web.channel import ProxyChannel
from llmproxy.web.site import ProxySite


def _twisteds_members() -> set[str]:
    return {name for cls in HTTPChannel.__mro__ if cls is not object for name in vars(cls)}


def test_the_channel_is_one_class_over_httpchannel() -> None:
    """Between ProxyChannel and HTTPChannel there is no class of llmproxy: its
    head limits, body limit and timers are not mixins overriding the same
    parser hooks layer over layer."""
    assert ProxySite.protocol is ProxyChannel
    ours = [cls for cls in ProxyChannel.__mro__ if cls.__module__.startswith("llmproxy")]
    assert ours == [ProxyChannel]
    assert ProxyChannel.__bases__ == (HTTPChannel,)


def test_every_override_is_listed_in_its_docstring() -> None:
    """Each member of HTTPChannel (or its bases) that ProxyChannel defines is
    named in the docstring's list, and the list names nothing else."""
    overridden = {name for name in vars(ProxyChannel)
                  if name in _twisteds_members() and not name.startswith("__")}
    doc = ProxyChannel.__doc__ or ""
    items = re.findall(r"^\s*- (.*?):", doc.split("What it overrides", 1)[1], re.MULTILINE)
    listed = {name for item in items for name in re.findall(r"`(\w+)`", item)}
    assert overridden, "the channel overrides Twisted's parser hooks"
    assert overridden == listed, (overridden, listed)
