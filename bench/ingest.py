"""Metric ingest into PostgreSQL through the real ingest API and ASGI server.

    DATABASE_URL=postgres://... .venv/bin/python bench/ingest.py [--quick] [--workers 2] [--clients 4]

What it does:
1. migrates the database in DATABASE_URL, seeds its own team, CPU group,
   experiment, RUNNING run and run token (deleted again at the end);
2. starts uvicorn on ``rlplatform.asgi:application`` as a subprocess;
3. posts reporter-shaped batches (``--points`` steps x ``--metrics`` metrics,
   default 500 x 32) from ``--clients`` threads on keep-alive connections,
   bodies encoded before the clock starts:
   - *fresh*: every batch new steps (INSERT path), sustained;
   - *replay*: the same batches again (all conflicts, nothing new: the
     path of a reporter resending after a lost reply);
   - *single step*: 1-step batches from one client (a reporter in steady
     state), for the latency of one small POST;
4. checks the row count: every step stored exactly once.

A "point" is one metric value at one step, the idempotency unit (run, attempt,
step, metric); rows are steps. Target (issue 5): >= 50,000 points/s.
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import threading
import time

from harness import free_port, setup_django, start_server, stop_server

SPEC = "name: bench-ingest\nresources:\n  device: cpu\n  trainer_devices: 1\n"


def seed(tag: str):
    """A RUNNING one-device run of a fresh team; returns (run, token)."""
    from jobs import handler
    from jobs.ingest.tokens import mint_run_token
    from jobs.models import Experiment
    from jobs.states import RunState
    from rlplatform.models import Device, Host, Quota, ResourceGroup, Team

    team = Team.objects.create(name=f"bench-ingest-{tag}")
    group = ResourceGroup.objects.create(name=f"bench-ingest-{tag}", kind="cpu", device_model="cpu")
    group.teams.set([team])
    host = Host.objects.create(group=group, name=f"bench-ingest-{tag}-h1", address="127.0.0.1")
    Device.objects.create(host=host, index=0, kind="cpu", model="cpu", memory_mb=1024)
    quota = Quota.objects.create(team=team, group=group, name="bench", max_devices=1, max_concurrent_runs=1)
    experiment = Experiment.objects.create(team=team, name="bench", group=group, quota=quota)
    run, _ = handler.submit_run(None, experiment, SPEC)
    for state in (RunState.STARTING, RunState.RUNNING):
        handler.transition(run, state)
    return run, mint_run_token(run, 0)


def cleanup(run) -> None:
    from jobs import handler

    team, group = run.experiment.team, run.experiment.group
    handler.cancel_run(None, run)
    run.experiment.delete()  # cascades to the run, its metric points and tokens
    group.hosts.all().delete()
    for quota in group.quotas.all():
        quota.delete()
    group.delete()
    team.delete()


def post(conn: http.client.HTTPConnection, body: bytes, token: str) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    conn.request("POST", "/api/ingest/metrics", body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


def wait_ready(port: int, token: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            status, data = post(conn, b'{"points": []}', token)
            conn.close()
            if status == 200:
                return
            raise RuntimeError(f"server answered {status}: {data[:300]!r}")
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start") from None
            time.sleep(0.2)


def make_bodies(run_id: int, n_batches: int, points: int, metrics: int, first_step: int = 0) -> list[bytes]:
    names = [f"group{m % 4}/metric_{m:02d}" for m in range(metrics)]
    bodies = []
    for b in range(n_batches):
        pts = []
        for i in range(points):
            step = first_step + b * points + i
            pts.append(
                {
                    "seq": step,
                    "step": step,
                    "time": 1_700_000_000.0 + step,
                    "metrics": {n: (step * 31 + k) % 1000 / 997.0 for k, n in enumerate(names)},
                }
            )
        bodies.append(json.dumps({"run": str(run_id), "attempt": 0, "points": pts, "events": []}).encode())
    return bodies


def drive(port: int, token: str, bodies: list[bytes], clients: int) -> dict:
    """Post every body once from ``clients`` threads; latency per request, wall time overall."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(len(bodies)))

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            t0 = time.perf_counter()
            status, data = post(conn, bodies[i], token)
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
                if status != 200:
                    failures.append(f"{status}: {data[:200]!r}")
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failures:
        raise RuntimeError(f"{len(failures)} failed requests, first: {failures[0]}")
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000

    return {
        "batches": len(bodies),
        "wall_s": wall,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": latencies[-1] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (under a minute)")
    parser.add_argument("--batches", type=int, default=None, help="batches per phase (default 300; --quick 60)")
    parser.add_argument("--points", type=int, default=500, help="steps per batch")
    parser.add_argument("--metrics", type=int, default=32, help="metrics per step")
    parser.add_argument(
        "--clients", type=int, default=2, help="concurrent posting threads (one per worker: no queueing)"
    )
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    args = parser.parse_args()
    n_batches = args.batches or (60 if args.quick else 300)

    setup_django()
    from jobs.models import MetricPoint

    run, token = seed(secrets.token_hex(4))
    port = free_port()
    server = start_server(port, args.workers)
    figures: dict = {
        "bench": "ingest",
        "machine": f"{platform.machine()} {os.cpu_count()} cores (shared; loaded by other work)",
        "batch": f"{args.points} steps x {args.metrics} metrics",
        "clients": args.clients,
        "uvicorn_workers": args.workers,
    }
    try:
        wait_ready(port, token)
        bodies = make_bodies(run.pk, n_batches, args.points, args.metrics)
        # Warm-up on steps after the measured ones: every worker opens its database connection and
        # loads its code before the clock starts.
        warm = make_bodies(run.pk, 2 * args.workers, args.points, args.metrics, first_step=n_batches * args.points)
        drive(port, token, warm, args.clients)
        per_batch = args.points * args.metrics
        print(
            f"ingest: {n_batches} batches of {args.points} steps x {args.metrics} metrics "
            f"({sum(map(len, bodies)) / n_batches / 1024:.0f} KiB each), {args.clients} clients, "
            f"{args.workers} uvicorn workers"
        )
        for phase in ("fresh", "replay"):
            r = drive(port, token, bodies, args.clients)
            points_s = n_batches * per_batch / r["wall_s"]
            rows_s = n_batches * args.points / r["wall_s"]
            figures[phase] = {
                "points_per_s": round(points_s),
                "steps_per_s": round(rows_s),
                "batches_per_s": round(n_batches / r["wall_s"], 2),
                "p50_ms": round(r["p50_ms"], 1),
                "p99_ms": round(r["p99_ms"], 1),
                "max_ms": round(r["max_ms"], 1),
            }
            print(
                f"  {phase:6s}: {points_s:10,.0f} points/s ({rows_s:,.0f} steps/s), "
                f"latency p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, max {r['max_ms']:.0f} ms"
            )
        # What one reporter sees in steady state: one step per POST, one client at a time.
        n_small = 100 if args.quick else 500
        small = make_bodies(run.pk, n_small, 1, args.metrics, first_step=(n_batches + len(warm)) * args.points)
        r = drive(port, token, small, 1)
        figures["single_step"] = {
            "posts_per_s": round(n_small / r["wall_s"], 1),
            "p50_ms": round(r["p50_ms"], 1),
            "p99_ms": round(r["p99_ms"], 1),
            "max_ms": round(r["max_ms"], 1),
        }
        print(
            f"  1-step batches, 1 client: {n_small / r['wall_s']:,.0f} posts/s, "
            f"latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
        )
        rows = MetricPoint.objects.filter(run=run, step__lt=n_batches * args.points).count()
        figures["rows_stored"] = rows
        figures["rows_expected"] = n_batches * args.points
        print(
            f"  stored {rows:,} rows for {n_batches * args.points:,} steps (each exactly once: {rows == n_batches * args.points})"
        )
        figures["target_points_per_s"] = 50_000
        figures["meets_target"] = figures["fresh"]["points_per_s"] >= 50_000
    finally:
        stop_server(server)
        cleanup(run)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
