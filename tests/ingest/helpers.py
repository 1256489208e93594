"""Helpers of the ingest tests: post a body, build a reporter batch, read what was stored, and a
forwarding proxy that can lose requests and replies."""

from __future__ import annotations

import urllib.error
import urllib.request

from tests.http_stub import QuietHandler, StubServer, answer


def post(client, endpoint: str, body):
    return client.post(f"/api/ingest/{endpoint}", body, format="json")


def batch(run, steps, metrics=None, *, attempt=0, events=(), role="trainer-0"):
    """A reporter body: one point per step with ``metrics(step)`` (default {"reward": step / 10})."""
    metrics = metrics or (lambda step: {"reward": step / 10})
    return {
        "run": str(run.pk),
        "attempt": attempt,
        "role": role,
        "points": [
            {"seq": i, "step": s, "time": 1_700_000_000.0 + s, "metrics": metrics(s)} for i, s in enumerate(steps)
        ],
        "events": list(events),
    }


def stored(run, attempt=0, *, rewound=False) -> dict[int, dict]:
    """step -> metrics of the run's stored rows (live ones by default)."""
    from jobs.models import MetricPoint

    rows = MetricPoint.objects.filter(run=run, attempt=attempt, rewound=rewound).order_by("step")
    return {row.step: row.metrics for row in rows}


class Proxy:
    """Forwards POSTs to ``target``, a stand-in for the network between a role and the platform.

    Modes: ``ok``; ``down`` (503, not forwarded); ``lose_replies`` (forwarded, then 502 to the caller).
    Paths in ``lose`` get a 503 and are not forwarded whatever the mode (counted in ``lost``);
    ``forwarded`` counts the requests that reached the platform, ``refused`` those ``down`` turned away."""

    def __init__(self, target: str):
        self.mode = "ok"
        self.forwarded = 0
        self.refused = 0
        self.lose: set[str] = set()
        self.lost = 0
        proxy = self
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path in proxy.lose:
                    proxy.lost += 1
                    return answer(self, 503, b'{"detail": "lost"}')
                if proxy.mode == "down":
                    proxy.refused += 1
                    return answer(self, 503, b'{"detail": "down"}')
                request = urllib.request.Request(
                    target + self.path,
                    data=body,
                    method="POST",
                    headers={"Content-Type": "application/json", "Authorization": self.headers["Authorization"]},
                )
                try:
                    with opener.open(request, timeout=30) as resp:
                        code, data = resp.status, resp.read()
                except urllib.error.HTTPError as exc:
                    code, data = exc.code, exc.read()
                proxy.forwarded += 1
                if proxy.mode == "lose_replies":
                    return answer(self, 502, b'{"detail": "reply lost"}')
                answer(self, code, data)

        self.stub = StubServer(Handler)
        self.url = self.stub.url

    def stop(self):
        self.stub.stop()
