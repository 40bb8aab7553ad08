"""The Site class a selection of speedups runs: the reference `web.site.ProxySite`,
or its subclass whose channel and request classes mix in exactly the active
speedups (response_writes).

Compatibility entries (llmproxy.compat, which this package may not import) come
in as channel mixins: `site_class(selection, compat.channel_mixins(...))`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from llmproxy.speedups import Selection
from llmproxy.speedups.responsewrites import GatheringChannel, SendingRequest
from llmproxy.web.channel import ProxyChannel
from llmproxy.web.site import ProxyRequest, ProxySite

# Each speedup's channel and request class (each a subclass of the reference's).
PARTS: dict[str, tuple[type[ProxyChannel], type[ProxyRequest]]] = {
    "response_writes": (GatheringChannel, SendingRequest),
}


def site_class(selection: Selection, channel_mixins: Sequence[type] = ()) -> type[ProxySite]:
    """The Site for `selection` (the speedups it names that this module knows),
    its channel also made of `channel_mixins` (before it in the bases). The
    same selection gives the same class."""
    return _site_class(tuple(name for name in selection.active if name in PARTS),
                       tuple(channel_mixins))


@cache
def _site_class(names: tuple[str, ...], channel_mixins: tuple[type, ...]) -> type[ProxySite]:
    if not names and not channel_mixins:
        return ProxySite
    channels = tuple(PARTS[name][0] for name in names) or (ProxyChannel,)
    requests = tuple(PARTS[name][1] for name in names) or (ProxyRequest,)
    suffix = "".join(name.title().replace("_", "") for name in names)
    channel = type(f"ProxyChannel{suffix}", (*channel_mixins, *channels), {})
    request = type(f"ProxyRequest{suffix}", requests, {})
    return type(f"ProxySite{suffix}", (ProxySite,),
                {"protocol": channel, "requestFactory": request})
