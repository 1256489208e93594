"""A real local reward server for the tests: slow, failing or hanging on purpose."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RewardServer:
    """A reward server whose behaviour the test sets: ``mode`` is ok | fail | flaky | hang | slow | bad | reject."""

    def __init__(self, fail_prompt=None, reward=None):
        self.mode = "ok"
        self.fail_prompt = fail_prompt  # optional: prompts it always fails with a 500
        self.reward = reward  # optional: the reward it gives (default: the response's length)
        self.failed_prompts: set[str] = set()
        self.flaky_failures = 0  # flaky: fail this many requests, then answer
        self.hits = 0
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.release = threading.Event()  # ends every hang (at teardown at the latest)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.hits += 1
                    server.bodies.append(body)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    mode = server.mode
                    if server.fail_prompt is not None and server.fail_prompt(body["prompt"]):
                        mode = "fail"
                        server.failed_prompts.add(body["prompt"])
                    if mode == "flaky":
                        mode = "fail" if server.flaky_failures > 0 else "ok"
                        server.flaky_failures -= 1
                answered = False

                def answering():
                    # Out of flight before the reply leaves: the client may send its next request the
                    # moment it has read this one, before this thread would get to a `finally`.
                    nonlocal answered
                    if not answered:
                        answered = True
                        with server.lock:
                            server.in_flight -= 1

                try:
                    if mode == "hang":
                        server.release.wait(10)
                        return
                    if mode == "slow":
                        time.sleep(0.2)
                    if mode in ("fail", "reject"):
                        answering()
                        self.send_response(500 if mode == "fail" else 400)
                        self.end_headers()
                        return
                    reply = (
                        b"not json"
                        if mode == "bad"
                        else json.dumps(
                            {"reward": len(body["response"]) if server.reward is None else server.reward}
                        ).encode()
                    )
                    answering()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                finally:
                    answering()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
