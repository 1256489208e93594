"""Stand-in HTTP servers for tests: a threaded server on a local port, and a JSON reply.

The tests of the reporter, the contract and ingest put a small fake platform or proxy in front of the
code under test; what differs is the handler. This holds what they share.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def answer(handler: BaseHTTPRequestHandler, code: int, body: bytes | Any) -> None:
    """Reply ``code`` with ``body`` (bytes as they are, anything else as JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean."""

    def log_message(self, *args: Any) -> None:
        pass


class StubServer:
    """``handler`` served on 127.0.0.1 (``port`` 0: a free one) from a daemon thread until :meth:`stop`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0):
        ThreadingHTTPServer.allow_reuse_address = True  # a restarted stand-in takes its port back at once
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
