"""An engine that crashes, for supervision tests (``python -m
llmproxy.testing.crashengine --port P``): it serves ``/health`` and answers any
POST with an empty chat completion, and ``--crash-after`` seconds after its
first health check answered it prints ``--say`` (its log's last line) and
exits with ``--exit-status``, as llama-server does when CUDA runs out of memory.
Plain standard library: it starts in a fraction of a second."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import threading
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="crashengine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="mc", help="the model its answers name")
    parser.add_argument("--crash-after", type=float, default=0.5,
                        help="seconds after the first health check answered")
    parser.add_argument("--exit-status", type=int, default=3)
    parser.add_argument("--say", default="CUDA out of memory",
                        help="the line printed just before it exits")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print("loading model", flush=True)
    armed = threading.Event()

    def die() -> None:
        print(args.say, flush=True)
        os._exit(args.exit_status)

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, doc: dict[str, Any]) -> None:
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.answer({"status": "ok"})
            if not armed.is_set():
                armed.set()
                threading.Timer(args.crash_after, die).start()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.answer({"model": args.model, "choices": []})

        def log_message(self, format: str, *_: Any) -> None:
            pass

    http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
