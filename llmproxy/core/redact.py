"""An engine's log text, and a client's address, as only an operator may read them.

An engine's log can quote a prompt (llama-server logs what it was sent at some
verbosities), so its text goes only to whoever may read the logs themselves:
an admin key, or with keys off a trusted peer (`trusted_peers`, loopback by
default). Everyone else reads `/status`, the events and error bodies with that
text withheld, and the events without the clients' addresses.

Where a message quotes a log line, the line is written by `quote_log`, between
LOG_OPEN and LOG_CLOSE (which a quoted line never contains itself), so
`redact_text` finds it in any message built from it however many times it was
wrapped, and in one cut short (a quote that has no LOG_CLOSE runs to the end).
Fields that hold log lines as such (`last_line`, `log_tail`) are withheld by
name (`redact_doc`).
"""

from __future__ import annotations

import re
from typing import Any

LOG_OPEN, LOG_CLOSE = "«", "»"
WITHHELD = f"{LOG_OPEN}withheld: engine logs are for admins{LOG_CLOSE}"
ADDRESS_WITHHELD = "withheld"
LOG_FIELDS = frozenset({"last_line", "log_tail"})   # fields that hold log lines as such
ADDRESS_FIELDS = frozenset({"client"})               # fields that hold a client's address
_QUOTED = re.compile(f"{LOG_OPEN}[^{LOG_OPEN}{LOG_CLOSE}]*(?:{LOG_CLOSE}|$)")


def quote_log(line: str) -> str:
    """`line` (an engine's log text) quoted so that `redact_text` can withhold it."""
    return LOG_OPEN + line.replace(LOG_OPEN, "‹").replace(LOG_CLOSE, "›") + LOG_CLOSE


def redact_text(text: str) -> str:
    """`text` with every quoted log line replaced by WITHHELD."""
    return _QUOTED.sub(WITHHELD, text) if LOG_OPEN in text else text


def redact_doc(doc: Any) -> Any:
    """A JSON-able document (a `/status` document, an event's fields) as a client
    that is not an operator sees it: log fields empty or None, client addresses
    withheld, quoted log lines withheld in every string. `doc` is not changed."""
    if isinstance(doc, str):
        return redact_text(doc)
    if isinstance(doc, dict):
        out: dict[Any, Any] = {}
        for name, value in doc.items():
            if name in LOG_FIELDS:
                out[name] = [] if isinstance(value, (list, tuple)) else None
            elif name in ADDRESS_FIELDS and isinstance(value, str):
                out[name] = ADDRESS_WITHHELD
            else:
                out[name] = redact_doc(value)
        return out
    if isinstance(doc, (list, tuple)):
        return [redact_doc(item) for item in doc]
    return doc
