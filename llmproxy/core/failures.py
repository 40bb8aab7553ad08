"""Short, readable reasons for failures, for log lines, events and error bodies.

No twisted.web here: every layer may import it."""

from __future__ import annotations

from twisted.internet.defer import CancelledError


def describe(exc: BaseException) -> str:
    """A short reason for an exception, looking inside Twisted's wrapped ones
    (ResponseFailed / ResponseNeverReceived hold a list of failures)."""
    value: object = exc
    while reasons := getattr(value, "reasons", None):
        value = reasons[0].value
    if isinstance(value, CancelledError):
        return "cancelled"
    tls = _tls_reason(value)
    if tls is not None:
        return tls
    return (str(value) or type(value).__name__).rstrip(".")


def _tls_reason(value: object) -> str | None:
    """A TLS verification failure in words (by class, so nothing here imports
    pyOpenSSL or service_identity)."""
    kind, module = type(value).__name__, type(value).__module__
    if kind == "VerificationError" and module.startswith("service_identity"):
        ids = []
        for error in getattr(value, "errors", []):
            wanted = getattr(error, "mismatched_id", None)
            ids.append(str(getattr(wanted, "hostname", b"") or getattr(wanted, "ip", "")
                           or wanted).removeprefix("b'").removesuffix("'"))
        return ("TLS certificate verification failed: hostname mismatch: the certificate "
                f"is not for {', '.join(ids) or 'this host'}")
    if kind == "Error" and module.startswith("OpenSSL"):
        args = getattr(value, "args", ())
        reasons = [str(r[-1]) for r in (args[0] if args and isinstance(args[0], list) else [])
                   if isinstance(r, tuple) and r]
        detail = "; ".join(reasons) or str(value)
        if "certificate verify failed" in detail:
            return ("TLS certificate verification failed: certificate verify failed (not "
                    "signed by a CA the host's ca_file trusts, or expired)")
        return f"TLS handshake failed: {detail}"
    return None
