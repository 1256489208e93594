"""Live-UI fan-out and chart-data benchmark, through a real uvicorn and the Redis channel layer.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/fanout.py [--quick]

What it does:
1. migrates the database in DATABASE_URL and seeds its own team, CPU group,
   experiment, RUNNING run, run token and a signed-in user session (deleted at the end);
2. starts uvicorn on ``rlplatform.asgi:application`` as a subprocess with ``--workers``
   processes (default 2: what docker-compose.yml deploys);
3. *fan-out*: ``--clients`` WebSocket clients (default 50) open ``ws/runs/<id>/``
   with the session cookie and subscribe; one producer posts metric batches to
   the ingest API at ``--rate`` points/s (default 2,000; ``--batch`` points per
   POST, so rate/batch POSTs per second), each point carrying 8 metrics and its
   send time. Each client records, per stream entry, receive time minus the
   send time of the batch (delivery latency: ingest + commit + Redis + consumer
   + socket), and checks it received every seq exactly once, in order.
   Dropped = entries appended during the phase that a client never received.
   The first ``--warmup`` second of batches (cold code paths in the server) is
   delivered and checked like the rest but left out of the latency figures.
   Clients read seq, type and send time from the head of each message instead
   of parsing all of it (``--full-parse`` parses it all): on this 2-core machine
   50 parsing clients would take over half a core from the server measured.
   The server's CPU per entry (ingest of one batch and its fan-out) is reported
   too: a figure that depends less on what else the machine runs.
4. *chart data*: a second run gets 100,000 steps x 30 metrics (JSON rows inserted in SQL),
   then the server time of ``jobs.series.series`` (in-process: query + downsampling
   to 1,000 points) is measured for the 6 keys of one chart group and for all 30:
   first from the JSON rows, then from the chart-data store after
   ``jobs.series_store.backfill`` packed the run (the blocks ingest writes), side by
   side with their ratio and a check that both give the same answers; then the full
   HTTP round trip of ``GET /api/runs/<id>/metrics/`` through uvicorn (the store).

Targets (issue 6): p99 delivery <= 100 ms, 0 dropped; chart data <= 300 ms.
Prints human-readable figures; the LAST line is one JSON object of them all.
The client processes share the machine with the server: on a loaded machine
latencies include CPU contention of both.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import platform
import re
import secrets
import signal
import statistics
import sys
import time

from harness import free_port, loadavg, setup_django, start_server, stop_server, tree_cpu_s

SPEC = "name: bench-fanout\nresources:\n  device: cpu\n  trainer_devices: 1\n"
CHART_KEYS = 30
CHART_STEPS = 100_000


def seed(tag: str) -> dict:
    """Team, group of 2 CPU devices, two RUNNING runs, a run token, a user session cookie."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.test import Client

    from jobs import handler
    from jobs.ingest.tokens import mint_run_token
    from jobs.models import Experiment
    from jobs.states import RunState
    from rlplatform.models import Device, Host, Membership, Quota, ResourceGroup, Team

    team = Team.objects.create(name=f"bench-fanout-{tag}")
    group = ResourceGroup.objects.create(name=f"bench-fanout-{tag}", kind="cpu", device_model="cpu")
    group.teams.set([team])
    host = Host.objects.create(group=group, name=f"bench-fanout-{tag}-h1", address="127.0.0.1")
    for i in range(2):
        Device.objects.create(host=host, index=i, kind="cpu", model="cpu", memory_mb=1024)
    quota = Quota.objects.create(team=team, group=group, name="bench", max_devices=2, max_concurrent_runs=2)
    experiment = Experiment.objects.create(team=team, name="bench", group=group, quota=quota)
    runs = []
    for _ in range(2):
        run, _ = handler.submit_run(None, experiment, SPEC)
        for state in (RunState.STARTING, RunState.RUNNING):
            handler.transition(run, state)
        runs.append(run)
    user = get_user_model().objects.create_user(username=f"bench-fanout-{tag}", password=secrets.token_urlsafe(16))
    Membership.objects.create(team=team, user=user, role="viewer")
    client = Client()
    client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    return {"runs": runs, "token": mint_run_token(runs[0], 0), "cookie": cookie, "user": user}


def cleanup(seeded: dict) -> None:
    from jobs import handler

    run = seeded["runs"][0]
    team, group = run.experiment.team, run.experiment.group
    for r in seeded["runs"]:
        handler.cancel_run(None, r)
    run.experiment.delete()  # cascades to runs, metric points, stream entries, tokens
    group.hosts.all().delete()
    for quota in group.quotas.all():
        quota.delete()
    group.delete()
    team.delete()
    seeded["user"].delete()


def wait_ready(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/login/")
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start") from None
            time.sleep(0.2)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


# --- fan-out ----------------------------------------------------------------------------------------------


# What a client needs of a live entry is at its head: jobs.stream encodes ``{"seq": n, "type": t, "data": ...}``
# and the producer puts ``bench/sent`` first in each point's values.
_HEAD = re.compile(r'\{"seq": (\d+), "type": "(\w+)"')
_SENT = re.compile(r'"bench/sent": ([-+0-9.eE]+)')


def read_entry(raw: str, full_parse: bool) -> tuple[int, str, float | None]:
    """(seq, type, send time of the batch or None) of one live message.

    Without ``full_parse`` only the head of the text is read: 50 clients parsing 24 KB of JSON each,
    1,000 times a second, would take over half of one of the machine's two cores from the server it
    measures (a browser parses on its own machine).
    """
    head = None if full_parse else _HEAD.match(raw)
    if head is None:
        message = json.loads(raw)
        sent = message["data"]["points"][0]["values"]["bench/sent"] if message["type"] == "metrics" else None
        return message["seq"], message["type"], sent
    sent = _SENT.search(raw, head.end(), head.end() + 300) if head.group(2) == "metrics" else None
    return int(head.group(1)), head.group(2), float(sent.group(1)) if sent else None


async def ws_client(
    port: int, run_id: int, cookie: str, ready: asyncio.Event, stop: asyncio.Event, out: dict, full_parse: bool
):
    import websockets

    headers = {"Cookie": cookie, "Origin": f"http://127.0.0.1:{port}"}
    async with websockets.connect(
        f"ws://127.0.0.1:{port}/ws/runs/{run_id}/", additional_headers=headers, max_size=None
    ) as ws:
        await ws.send(json.dumps({"type": "subscribe", "after": out["after"]}))
        while True:
            message = json.loads(await ws.recv())
            if message.get("type") == "live":
                out["after"] = message["seq"]
                ready.set()
                break
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), timeout=0.5)
            except TimeoutError:
                continue
            now = time.time()
            seq, _type, sent = read_entry(raw, full_parse)
            out["seqs"].append(seq)
            if sent is not None:
                out["latencies"].append((sent, now - sent))
                out["by_seq"][seq] = (sent, max(out["by_seq"].get(seq, (0, 0.0))[1], now - sent))


def producer(port: int, run_id: int, token: str, rate: int, batch: int, seconds: float, first_step: int) -> dict:
    """POST batches of ``batch`` points at ``rate`` points/s for ``seconds``; returns counts."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    interval = batch / rate
    step = first_step
    posted = failures = 0
    post_ms: list[float] = []
    start = time.perf_counter()
    next_at = start
    while time.perf_counter() - start < seconds:
        now = time.time()
        points = [
            {
                "step": step + i,
                "time": now,
                "metrics": {"bench/sent": now, **{f"bench/m{k}": k * 0.1 for k in range(7)}},
            }
            for i in range(batch)
        ]
        step += batch
        body = json.dumps({"run": run_id, "attempt": 0, "points": points}).encode()
        t0 = time.perf_counter()
        conn.request(
            "POST",
            "/api/ingest/metrics",
            body=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        response = conn.getresponse()
        response.read()
        post_ms.append((time.perf_counter() - t0) * 1000)
        posted += 1
        failures += response.status != 200
        next_at += interval
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    elapsed = time.perf_counter() - start
    conn.close()
    return {
        "batches": posted,
        "failures": failures,
        "points_per_s": posted * batch / elapsed,
        "post_p50_ms": pct(post_ms, 0.5),
    }


async def fanout(
    port: int,
    seeded: dict,
    clients: int,
    rate: int,
    batch: int,
    seconds: float,
    full_parse: bool = False,
    server_pid: int | None = None,
    warmup_s: float = 1.0,
) -> dict:
    from asgiref.sync import sync_to_async

    from jobs.models import RunStreamEntry

    run = seeded["runs"][0]

    def last_seq() -> int:
        return RunStreamEntry.objects.filter(run=run).order_by("-seq").values_list("seq", flat=True).first() or 0

    start_seq = await sync_to_async(last_seq)()
    stop = asyncio.Event()
    states = [{"after": start_seq, "seqs": [], "latencies": [], "by_seq": {}} for _ in range(clients)]
    readies = [asyncio.Event() for _ in range(clients)]
    tasks = [
        asyncio.create_task(ws_client(port, run.pk, seeded["cookie"], readies[i], stop, states[i], full_parse))
        for i in range(clients)
    ]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), timeout=60)
    cpu_before = tree_cpu_s(server_pid) if server_pid else None
    # The producer gets a process of its own: in this one it would compete for the GIL with the clients.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        measure_from = time.time() + warmup_s
        produced = await asyncio.to_thread(
            pool.apply, producer, (port, run.pk, seeded["token"], rate, batch, warmup_s + seconds, 0)
        )
    end_seq = await sync_to_async(last_seq)()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any((s["seqs"][-1] if s["seqs"] else start_seq) < end_seq for s in states):
        await asyncio.sleep(0.1)
    cpu_after = tree_cpu_s(server_pid) if server_pid else None
    stop.set()
    await asyncio.gather(*tasks)
    expected = list(range(start_seq + 1, end_seq + 1))
    dropped = sum(len(set(expected) - set(s["seqs"])) for s in states)
    duplicated = sum(len(s["seqs"]) - len(set(s["seqs"])) for s in states)
    out_of_order = sum(s["seqs"] != sorted(s["seqs"]) for s in states)
    # The first batches meet cold code paths in the server (first ingest of the process, pool connections):
    # they are delivered and checked for gaps like the rest, but their latency is not a steady-state figure.
    latencies = [latency for s in states for sent, latency in s["latencies"] if sent >= measure_from]
    slowest: dict[int, float] = {}
    for state in states:
        for seq, (sent, latency) in state["by_seq"].items():
            if sent >= measure_from:
                slowest[seq] = max(slowest.get(seq, 0.0), latency)
    return {
        "clients": clients,
        "points_per_s": round(produced["points_per_s"], 1),
        "post_failures": produced["failures"],
        "post_p50_ms": round(produced["post_p50_ms"], 1),
        "entries": len(expected),
        "messages_delivered": sum(len(s["seqs"]) for s in states),
        "p50_ms": round(pct(latencies, 0.50) * 1000, 1),
        "p99_ms": round(pct(latencies, 0.99) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1) if latencies else None,
        # One slow entry is 50 late messages (one per client): which entries were slowest, and how slow.
        "slowest_entries": [
            [seq - start_seq, round(ms * 1000, 1)] for seq, ms in sorted(slowest.items(), key=lambda kv: -kv[1])[:3]
        ],
        "dropped": dropped,
        "duplicated": duplicated,
        "clients_out_of_order": out_of_order,
        # uvicorn's processes only (not PostgreSQL, Redis or the clients): ingest plus fan-out of one batch.
        "server_cpu_ms_per_entry": round((cpu_after - cpu_before) * 1000 / len(expected), 1)
        if cpu_before is not None and cpu_after is not None and expected
        else None,
    }


# --- chart data -----------------------------------------------------------------------------------------


def _fill_sql(keys: list[str]) -> str:
    """One INSERT of CHART_STEPS rows, each a JSON object of all keys (a wavy signal plus noise)."""
    pairs = ", ".join(f"'{key}', sin(s / 1000.0 + {k}) + random() * 0.1" for k, key in enumerate(keys))
    return (
        "INSERT INTO jobs_metricpoint (run_id, attempt, step, time, metrics, rewound) "
        f"SELECT %s, 0, s, to_timestamp(1700000000 + s), jsonb_build_object({pairs}), false "
        "FROM generate_series(0, %s - 1) AS s"
    )


def chart_data(port: int, seeded: dict, repeats: int) -> dict:
    from django.db import connection

    from jobs import series, series_store

    run = seeded["runs"][1]
    keys = [f"bench/metric_{k:02d}" for k in range(CHART_KEYS)]
    t0 = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(_fill_sql(keys), [run.pk, CHART_STEPS])
        cursor.execute("ANALYZE jobs_metricpoint")
    fill_s = time.perf_counter() - t0

    def timed(fn) -> list[float]:
        fn()  # warm: plan cache, pages in memory
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1000)
        return samples

    def read(n_keys: int, use_store: bool):
        return series.series(run.pk, keys[:n_keys], max_points=1000, use_store=use_store)

    # The JSON rows first (the run is not in the store yet, as a run from before it), then the same run put in
    # the store by the backfill (the blocks ingest would have written: arrival order, BLOCK_POINTS per block).
    old = {n: timed(lambda n=n: read(n, False)) for n in (6, CHART_KEYS)}
    t0 = time.perf_counter()
    series_store.backfill(run.pk)
    backfill_s = time.perf_counter() - t0
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_seriespointblock")
        cursor.execute("ANALYZE jobs_seriesvalueblock")
    new = {n: timed(lambda n=n: read(n, True)) for n in (6, CHART_KEYS)}
    same = all(read(n, True) == read(n, False) for n in (6, CHART_KEYS))
    points = len(read(6, True)["series"][keys[0]]["x"])

    def http_get():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(
            "GET",
            f"/api/runs/{run.pk}/metrics/?keys={','.join(keys[:6])}&max_points=1000",
            headers={"Cookie": seeded["cookie"]},
        )
        response = conn.getresponse()
        body = response.read()
        conn.close()
        if response.status != 200:
            raise RuntimeError(f"metrics API answered {response.status}: {body[:200]!r}")

    http_ms = timed(http_get)
    figures = {
        "steps": CHART_STEPS,
        "metrics": CHART_KEYS,
        "fill_s": round(fill_s, 1),
        "backfill_s": round(backfill_s, 1),
        "block_points": series_store.BLOCK_POINTS,
        "points_per_series": points,
        "same_answers": same,
        "http_6_keys_ms_median": round(statistics.median(http_ms), 1),
    }
    for n in (6, CHART_KEYS):
        figures[f"server_{n}_keys_ms_median"] = round(statistics.median(new[n]), 1)
        figures[f"server_{n}_keys_ms_max"] = round(max(new[n]), 1)
        figures[f"json_rows_{n}_keys_ms_median"] = round(statistics.median(old[n]), 1)
        figures[f"speedup_{n}_keys"] = round(statistics.median(old[n]) / statistics.median(new[n]), 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="5 s fan-out, one timed chart query per case (about a minute)"
    )
    parser.add_argument("--clients", type=int, default=50, help="WebSocket clients")
    parser.add_argument("--rate", type=int, default=2000, help="points per second posted")
    parser.add_argument("--batch", type=int, default=100, help="points per ingest POST (one stream entry)")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of batches before latency is measured (default 1)"
    )
    parser.add_argument("--seconds", type=float, default=None, help="fan-out duration (default 30; --quick 5)")
    parser.add_argument("--no-chart", action="store_true", help="skip the chart-data phase")
    parser.add_argument(
        "--full-parse", action="store_true", help="clients json-parse every message (default: read its head only)"
    )
    parser.add_argument(
        "--no-ws-deflate",
        action="store_true",
        help="uvicorn --ws-per-message-deflate false (default: on, as deployed; the clients offer it)",
    )
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes (default 2, as deployed)")
    args = parser.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 30.0)
    repeats = 1 if args.quick else 10

    # A timeout's SIGTERM must still stop the server and delete the seeded rows (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    setup_django(redis_reason="the fan-out goes through the Redis channel layer")
    tag = f"{int(time.time())}-{secrets.token_hex(3)}"
    seeded = seed(tag)
    load_start = loadavg()
    port = free_port()
    deflate = ["--ws-per-message-deflate", "false"] if args.no_ws_deflate else []
    server = start_server(port, args.workers, None, "--timeout-graceful-shutdown", "5", *deflate)
    try:
        wait_ready(port)
        fan = asyncio.run(
            fanout(port, seeded, args.clients, args.rate, args.batch, seconds, args.full_parse, server.pid, args.warmup)
        )
        chart = None if args.no_chart else chart_data(port, seeded, repeats)
    finally:
        stop_server(server)
        cleanup(seeded)

    setup = {
        "quick": args.quick,
        "seconds": seconds,
        "warmup_s": args.warmup,
        "workers": args.workers,
        "ws_per_message_deflate": not args.no_ws_deflate,
        "clients_full_parse": args.full_parse,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(
        f"uvicorn workers: {args.workers}; load average {load_start} at start, {setup['loadavg_end']} at end "
        "(1/5/15 min; the machine is shared)"
    )
    print(
        f"fan-out: {fan['clients']} clients, {fan['points_per_s']:.0f} points/s in {args.batch}-point batches, "
        f"{seconds:g} s: {fan['entries']} entries, {fan['messages_delivered']} messages delivered"
    )
    print(
        f"  delivery latency p50 {fan['p50_ms']} ms, p99 {fan['p99_ms']} ms, max {fan['max_ms']} ms (target p99 <= 100)"
    )
    print(
        f"  dropped {fan['dropped']} (target 0), duplicated {fan['duplicated']}, "
        f"clients out of order {fan['clients_out_of_order']}, failed POSTs {fan['post_failures']}"
    )
    print(f"  slowest entries [index in the phase, ms]: {fan['slowest_entries']}")
    print(f"  server CPU per entry (ingest of one batch + its fan-out): {fan['server_cpu_ms_per_entry']} ms")
    if chart is None:
        print(json.dumps({**setup, "fanout": fan, "chart": None}))
        return
    print(
        f"chart data, {chart['steps']:,} steps x {chart['metrics']} metrics -> {chart['points_per_series']} points/series:"
    )
    print(
        f"  server (query + downsampling), median ms: chart-data store vs JSON rows (same answers: {chart['same_answers']})"
    )
    for n in (6, CHART_KEYS):
        print(
            f"    {n:>2} keys: store {chart[f'server_{n}_keys_ms_median']} (max {chart[f'server_{n}_keys_ms_max']}), "
            f"JSON rows {chart[f'json_rows_{n}_keys_ms_median']}: {chart[f'speedup_{n}_keys']}x (target <= 300)"
        )
    print(f"  backfill of the run into the store (one-off, as for a run from before it): {chart['backfill_s']} s")
    print(f"  HTTP round trip through uvicorn, 6 keys: median {chart['http_6_keys_ms_median']} ms")
    print(json.dumps({**setup, "fanout": fan, "chart": chart}))


if __name__ == "__main__":
    main()
