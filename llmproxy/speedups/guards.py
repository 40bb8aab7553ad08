"""Guards: is the installed Twisted the one a speedup was written against?

A speedup that copies Twisted code, or rests on what a Twisted method does,
records a digest of that code's source as of the Twisted version it follows
(see llmproxy.core.sourcedigest); any change to that source turns it off.
"""

from __future__ import annotations

from llmproxy.core.sourcedigest import changed_sources, resolve, source_digest

__all__ = ["changed_sources", "resolve", "source_digest"]
