"""Hundreds of CI jobs long-polling one run, against a real uvicorn, PostgreSQL and Redis.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/longpoll.py [--quick]

What it does:
1. migrates the database in DATABASE_URL and seeds its own team, user, API token,
   CPU group, experiment and one ADMITTED run (everything is deleted at the end);
2. starts uvicorn on ``rlplatform.asgi:application`` (``--workers``, default 2: what
   docker-compose.yml deploys; each worker has its own connection pool of
   DATABASE_POOL_MAX, default 16);
3. *without waiters*: other reads at a fixed rate (``--rate`` req/s, default 50, half
   run-status reads ``GET /api/runs/{id}/`` — the fast path — and half run lists
   ``GET /api/runs/?page_size=10`` through Django and DRF): p50, p99, statuses;
4. opens ``--waiters`` connections (default 500), each sending
   ``GET /api/runs/{id}/wait/?timeout=…``, waits until every server process listens
   for the run's end (its channel-layer group's members in Redis) and the server is idle,
   counts the server's PostgreSQL connections (pg_stat_activity), and runs the same
   reads again, side by side;
5. cancels the run and measures how long each waiter takes to answer (wake latency),
   and that every answer is a 200 with ``terminal: true``.

Targets (issue 13): 0 errors among the waiters; other reads' p99 with waiters within
2x of without. Before: 200 waiters gave 104 x 500 (PoolTimeout) and an ordinary read
took 10.5 s and failed.
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time

from api_load import Connection, Result, cleanup, fixed_rate, seed, wait_ready
from harness import free_port, loadavg, server_figures, setup_django, start_server, stop_server, tree_cpu_s


def pg_connections() -> int:
    """Backends connected to the benchmark's database, this process's included."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


async def settle(server_pid: int, idle_cpu: float = 0.15, window_s: float = 0.5, limit_s: float = 60.0) -> None:
    """Until the server uses under ``idle_cpu`` of a core over ``window_s``: the waiters got past authentication."""
    deadline = time.perf_counter() + limit_s
    before = tree_cpu_s(server_pid)
    while time.perf_counter() < deadline:
        await asyncio.sleep(window_s)
        now = tree_cpu_s(server_pid)
        if before is None or now is None or (now - before) / window_s < idle_cpu:
            return
        before = now


async def listening(run_id: int) -> int:
    """Server processes listening for the run's end: its channel-layer group's members."""
    from channels.layers import get_channel_layer

    from jobs import stream

    layer = get_channel_layer()
    group = stream.run_end_group(run_id)
    # channels_redis keeps a group as a sorted set of its members' channel names.
    return await layer.connection(layer.consistent_hash(group)).zcard(layer._group_key(group))


async def reads(port: int, token: str, run_id: int, rate: float, duration_s: float) -> dict:
    headers = {"Authorization": f"Bearer {token}"}

    def make(i: int):
        return ("GET", f"/api/runs/{run_id}/", None) if i % 2 else ("GET", "/api/runs/?page_size=10", None)

    return (await fixed_rate("127.0.0.1", port, headers, make, rate, duration_s, pool=32)).summary()


async def phases(port: int, server_pid: int, token: str, run_id: int, args, phase_s: float) -> dict:
    from asgiref.sync import sync_to_async

    from jobs import handler
    from jobs.models import Run

    out: dict = {"waiters": args.waiters}
    await reads(port, token, run_id, args.rate, 1.0)  # warm-up
    out["pg_connections_before"] = await sync_to_async(pg_connections)()
    out["reads_without_waiters"] = await reads(port, token, run_id, args.rate, phase_s)
    print(f"other reads without waiters: {fmt(out['reads_without_waiters'])}")

    waits = Result()
    answered: list[float] = []
    bodies: list[dict] = []
    headers = {"Authorization": f"Bearer {token}"}

    async def waiter() -> None:
        conn = Connection("127.0.0.1", port, headers)
        t0 = time.perf_counter()
        try:
            status, body = await conn.request("GET", f"/api/runs/{run_id}/wait/?timeout={args.wait_timeout:g}")
            waits.add(status, time.perf_counter() - t0)
            answered.append(time.perf_counter())
            if status == 200:
                bodies.append(json.loads(body))
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            waits.errors += 1
        finally:
            await conn.close()

    start = time.perf_counter()
    tasks = [asyncio.create_task(waiter()) for _ in range(args.waiters)]
    # Each server process listens once per run, however many of its requests wait: wait for every
    # process, then let the requests still authenticating settle.
    while await listening(run_id) < args.workers and time.perf_counter() - start < 60:
        await asyncio.sleep(0.05)
    await settle(server_pid)
    out["listening_processes"] = await listening(run_id)
    out["answered_while_settling"] = sum(1 for task in tasks if task.done())
    print(f"{out['listening_processes']} server processes listening; {args.waiters} waiters sent")
    out["pg_connections_while_waiting"] = await sync_to_async(pg_connections)()
    out["reads_with_waiters"] = await reads(port, token, run_id, args.rate, phase_s)
    out["pg_connections_after_reads"] = await sync_to_async(pg_connections)()
    print(f"other reads with {args.waiters} waiters: {fmt(out['reads_with_waiters'])}")
    answered_early = len(answered)

    run = await sync_to_async(Run.objects.get)(pk=run_id)
    ended = time.perf_counter()
    await sync_to_async(handler.cancel_run)(None, run, "bench: the run ends")
    await asyncio.gather(*tasks)
    waits.elapsed_s = time.perf_counter() - start
    wake = sorted(t - ended for t in answered[answered_early:])
    out["waits"] = waits.summary()
    out["answered_before_the_end"] = answered_early
    out["answers_terminal"] = sum(1 for body in bodies if body.get("terminal") and body.get("state") == "CANCELLED")
    out["wake_after_end_ms"] = {
        "p50": round(wake[len(wake) // 2] * 1000, 1) if wake else None,
        "p99": round(wake[min(len(wake) - 1, int(0.99 * len(wake)))] * 1000, 1) if wake else None,
        "max": round(wake[-1] * 1000, 1) if wake else None,
    }
    print(
        f"waiters: statuses={out['waits']['statuses']} errors={out['waits']['errors']} "
        f"answered before the end {answered_early}; terminal answers {out['answers_terminal']}; "
        f"wake after the end p50 {out['wake_after_end_ms']['p50']} ms p99 {out['wake_after_end_ms']['p99']} ms"
    )
    print(
        f"PostgreSQL connections: {out['pg_connections_before']} before, "
        f"{out['pg_connections_while_waiting']} with the waiters parked"
    )
    return out


def fmt(summary: dict) -> str:
    return (
        f"n={summary['requests']} {summary['throughput_rps']} req/s  p50 {summary['p50_ms']} ms  "
        f"p99 {summary['p99_ms']} ms  max {summary['max_ms']} ms  statuses={summary['statuses']} "
        f"errors={summary['errors']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short read phases (under a minute in all)")
    parser.add_argument("--waiters", type=int, default=500, help="concurrent long-polls (default 500)")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes (default 2)")
    parser.add_argument("--rate", type=float, default=50.0, help="other reads per second (default 50)")
    parser.add_argument("--wait-timeout", type=float, default=120.0, help="each waiter's ?timeout= (default 120)")
    args = parser.parse_args()
    phase_s = 5.0 if args.quick else 20.0
    # One socket per waiter on each side, client and server on this machine.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * args.waiters:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * args.waiters + 1024), hard))

    setup_django("waiters listen for the run's end on the channel layer")
    tag = f"benchlp{int(time.time())}"
    s = seed(tag)
    port = free_port()
    server = start_server(port, args.workers)
    figures: dict = server_figures(args.workers, args.quick)
    print(f"load average at start: {figures['loadavg_start']} (1/5/15 min, {os.cpu_count()} cores)")
    try:
        wait_ready(port, s.token, s.status_run_id)
        figures.update(asyncio.run(phases(port, server.pid, s.token, s.status_run_id, args, phase_s)))
    finally:
        stop_server(server)
        cleanup(s)
    without, with_ = figures["reads_without_waiters"], figures["reads_with_waiters"]
    figures["reads_p99_ratio_with_to_without"] = round(with_["p99_ms"] / without["p99_ms"], 2)
    statuses = figures["waits"]["statuses"]
    figures["targets"] = {
        "waiters_no_errors": not figures["waits"]["errors"] and set(statuses) == {"200"},
        "all_waiters_answered_the_end": figures["answers_terminal"] == args.waiters,
        "reads_p99_within_2x": figures["reads_p99_ratio_with_to_without"] <= 2.0
        and not with_["errors"]
        and set(with_["statuses"]) == {"200"},
    }
    figures["loadavg_end"] = loadavg()
    print(f"other reads' p99 with waiters / without: {figures['reads_p99_ratio_with_to_without']}x")
    print(f"targets: {figures['targets']}")
    print(f"load average at end: {figures['loadavg_end']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
