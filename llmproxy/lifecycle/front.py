"""The proxy's front door: the web site over the parts, and the listening
socket it is served on (plain, or https with HTTP/2 by ALPN)."""

from __future__ import annotations

from functools import partial
from typing import Any

from llmproxy.compat import channel_mixins
from llmproxy.compat.h2limits import connection_class
from llmproxy.compat.streamhooks import hooked
from llmproxy.core.reactors import IServiceReactor
from llmproxy.lifecycle.components import Parts
from llmproxy.lifecycle.listen import Listener
from llmproxy.speedups.site import site_class
from llmproxy.web.routes import App, Root
from llmproxy.web.timers import ClientTimeouts


def front_door(parts: Parts, reactor: IServiceReactor, app: App) -> tuple[Any, Listener]:
    """The site serving `app`, and the listener (not yet open) that hands it connections."""
    config = parts.runtime.config
    site = site_class(parts.speedups, channel_mixins(parts.compat))(
        Root(app), config.max_body_bytes, reactor, ClientTimeouts.of(config), door=parts.access)
    # https on the same socket when the config has `tls` (see tlslistener),
    # HTTP/2 by ALPN there, drained with two GOAWAYs when the entry is on;
    # offered only bounded (compat/h2limits.py) and with the stream hooks (no door or
    # timer before a stream's body ends without them: compat/streamhooks.py).
    http2 = connection_class(parts.compat.on("h2_goaway")) \
        if parts.compat.on("h2_limits") else None
    if http2 is not None:
        http2 = hooked(http2) if parts.compat.on("h2_streams") else None
    factory: Any = site if parts.certificate is None else parts.certificate.wrap(
        site, reactor, None if http2 is None else
        partial(http2, reactor, site, parts.hub.publish),
        config.client_header_timeout_seconds)
    listener = Listener(reactor, config.listen, factory, parts.inherited,
                        scheme="http" if parts.certificate is None else "https",
                        guarded=parts.compat.on("accept_guard"))
    return site, listener
