"""The status page and its assets carry security headers (through the real
Site in memory): a Content-Security-Policy that allows no inline code and no
framing, nosniff, X-Frame-Options; and the page's HTML has nothing inline that
such a policy would block."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.testing.fakes import Connection, FakeHTTPClient
from llmproxy.web.paths import PAGE_DIR, PAGE_FILES

CONFIG = {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]}


def directives(policy: str) -> dict[str, list[str]]:
    out = {}
    for part in policy.split(";"):
        name, *values = part.split()
        out[name] = values
    return out


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("path", sorted(PAGE_FILES))
def test_each_page_path_sends_the_security_headers(path: str, method: str) -> None:
    """`/` and each file of the page (GET and HEAD): 200 with
    X-Content-Type-Options: nosniff, X-Frame-Options: DENY and a CSP whose every
    source is the proxy itself (data: for the icon only), with no
    'unsafe-inline' or 'unsafe-eval', frame-ancestors 'none' and nothing by default."""
    svc = build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=FakeHTTPClient()))
    conn = Connection(svc.site)
    conn.send(method, path)
    answer = conn.response()
    assert answer.status == 200
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["x-frame-options"] == "DENY"
    csp = directives(answer.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"]
    assert csp["frame-ancestors"] == ["'none'"]
    assert csp["script-src"] == ["'self'"] and csp["style-src"] == ["'self'"]
    assert csp["connect-src"] == ["'self'"] and csp["img-src"] == ["'self'", "data:"]
    assert not any("unsafe" in v for values in csp.values() for v in values)


class Inline(HTMLParser):
    """Collects what a CSP without 'unsafe-inline' would block in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "style":
            self.found.append("<style>")
        if tag == "script":
            self._in_script = True
            if not names.get("src"):
                self.found.append("<script> without src")
        for name, value in attrs:
            if name.startswith("on") or name == "style":
                self.found.append(f"{tag} {name}=")
            if name in ("href", "src", "action") and (value or "").startswith("javascript:"):
                self.found.append(f"{tag} {name}=javascript:")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.found.append("inline script text")


def test_the_page_has_no_inline_script_style_or_handler() -> None:
    """index.html's scripts and styles are files of the proxy (what its CSP
    allows); it has no inline script, style element, style attribute, on*= handler
    or javascript: URL; and its scripts (app.js, tokens.js, captures.js, playground.js) build
    no style attribute or HTML string (the playground shows what a model sends as text)."""
    parser = Inline()
    parser.feed((PAGE_DIR / "index.html").read_text())
    assert parser.found == []
    for name in ("app.js", "tokens.js", "captures.js", "playground.js"):
        script = (PAGE_DIR / name).read_text()
        for blocked in ("innerHTML", "outerHTML", "insertAdjacentHTML", "eval(", "new Function",
                        '"style"', "document.write", "DOMParser"):
            assert blocked not in script, (name, blocked)


def test_the_playground_stores_nothing() -> None:
    """playground.js (comments aside) touches no browser storage: a key typed into the
    page stays in memory (the browser test checks the storage is empty after use)."""
    code = "\n".join(line for line in (PAGE_DIR / "playground.js").read_text().splitlines()
                     if not line.lstrip().startswith("//"))
    for storage in ("localStorage", "sessionStorage", "document.cookie", "indexedDB",
                    "caches.", "history.", "location.href", "location.hash", "location.search",
                    "location.assign", "location.replace"):
        assert storage not in code, storage
