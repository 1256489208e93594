"""/metrics latency with a populated platform: 1,000 runs and 100 hosts, against a real uvicorn.

    DATABASE_URL=postgres://... .venv/bin/python bench/metrics_endpoint.py [--quick] [--workers 2]

What it does:
1. migrates the database in DATABASE_URL and seeds, under a tag of its own (deleted at the end): 4 resource
   groups of 25 hosts with 8 CPU devices each (100 hosts, 800 devices, heartbeats of varied age); 1,000
   runs in every state (300 queued; 200 holding 2 devices each; the rest ended, with released allocations
   as history); for each run not queued, 20 runtime events, 5 platform events (a tenth of the runs with a
   restart and a failure) and 2 commands (every seventh run's a preemption); a scrape token;
2. starts uvicorn on ``rlplatform.asgi:application`` (``--workers``, default 2: what docker-compose.yml
   deploys) with a fresh PROMETHEUS_MULTIPROC_DIR (each worker's counters in files of its own, summed
   by whichever answers);
3. times sequential ``GET /metrics`` with the scrape token over one kept-alive connection (``--requests``,
   default 300, 50 with --quick) after 5 warm-up requests: p50, p95, p99, max, the reply's size;
   and, in this process, the collector's SQL alone (jobs.metrics.platform_state).

Target (issue 27): p50 <= 100 ms. Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import secrets
import statistics
import tempfile
import time

from harness import free_port, server_figures, setup_django, start_server, stop_server

SPEC = "name: bench\nresources:\n  device: cpu\n  trainer_devices: 2\n"
GROUPS, HOSTS_PER_GROUP, DEVICES_PER_HOST, RUNS = 4, 25, 8, 1000
# (state, runs): 300 queued, 200 holding devices, 500 ended.
STATES = [
    ("QUEUED", 300),
    ("RUNNING", 150),
    ("ADMITTED", 20),
    ("STARTING", 15),
    ("PAUSED", 15),
    ("COMPLETED", 400),
    ("FAILED", 50),
    ("CANCELLED", 50),
]
ACTIVE = {"RUNNING", "ADMITTED", "STARTING", "PAUSED"}


def seed(tag: str) -> dict:
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from jobs.models import Allocation, Command, Experiment, Run, RunEvent
    from rlplatform import scrape_tokens
    from rlplatform.models import Device, Host, Quota, ResourceGroup, Team

    now = timezone.now()
    staff = get_user_model().objects.create_user(username=f"{tag}-staff", is_staff=True)
    team = Team.objects.create(name=f"{tag}-team")
    experiments, devices_by_group = [], []
    for g in range(GROUPS):
        group = ResourceGroup.objects.create(name=f"{tag}-g{g}", kind="cpu", device_model="bench")
        hosts = Host.objects.bulk_create(
            Host(
                group=group,
                name=f"{tag}-g{g}-h{i}",
                queue=f"host.{tag}-g{g}-h{i}",
                last_heartbeat=now - datetime.timedelta(seconds=i),
            )
            for i in range(HOSTS_PER_GROUP)
        )
        devices_by_group.append(
            Device.objects.bulk_create(
                Device(host=h, index=j, kind="cpu", model="bench") for h in hosts for j in range(DEVICES_PER_HOST)
            )
        )
        quota = Quota.objects.create(team=team, group=group, name=f"q{g}")
        experiments.append(Experiment.objects.create(team=team, name=f"e{g}", group=group, quota=quota))
    states = [state for state, n in STATES for _ in range(n)]
    runs = Run.objects.bulk_create(
        Run(
            experiment=experiments[i % GROUPS],
            name=f"r{i}",
            spec=SPEC,
            resolved_spec={},
            state=state,
            devices_requested=2,
            rollout_workers=1,
            submitted_at=now - datetime.timedelta(seconds=RUNS - i),
        )
        for i, state in enumerate(states)
    )
    free = [list(devices) for devices in devices_by_group]
    allocations, events, commands = [], [], []
    for i, run in enumerate(runs):
        group = i % GROUPS
        if run.state in ACTIVE:
            allocations += [Allocation(run=run, device=free[group].pop(), created_at=now) for _ in range(2)]
        elif run.state != "QUEUED":
            at = now - datetime.timedelta(hours=1)
            pair = devices_by_group[group][(i * 2) % len(devices_by_group[group]) :][:2]
            allocations += [Allocation(run=run, device=d, created_at=at, released_at=now) for d in pair]
        if run.state == "QUEUED":
            continue
        events += [
            RunEvent(run=run, attempt=0, role="trainer-0", seq=s, kind="eval", payload={"step": s}, time=now)
            for s in range(20)
        ]
        platform = ["role_queued", "role_started", "role_exited", "role_restarted" if i % 10 == 0 else "role_done"]
        platform.append("role_failed" if i % 10 == 0 else "role_done")
        events += [
            RunEvent(
                run=run,
                attempt=0,
                role="platform",
                seq=s,
                kind=kind,
                payload={"role": "trainer-0", "attempt": 0, "cause": "exit_code"},
                time=now,
            )
            for s, kind in enumerate(platform)
        ]
        commands += [
            Command(run=run, kind="preempt" if i % 7 == 0 else "set_params", state="done"),
            Command(run=run, kind="pause", state="done"),
        ]
    Allocation.objects.bulk_create(allocations)
    RunEvent.objects.bulk_create(events, batch_size=5000)
    Command.objects.bulk_create(commands)
    _token, raw = scrape_tokens.mint(f"{tag}-prometheus", created_by=staff)
    counts = {"runs": len(runs), "hosts": GROUPS * HOSTS_PER_GROUP, "devices": sum(map(len, devices_by_group))}
    counts |= {"allocations": len(allocations), "events": len(events), "commands": len(commands)}
    return {"tag": tag, "team": team.pk, "staff": staff.pk, "token": raw, "counts": counts}


def cleanup(seeded: dict) -> None:
    from django.contrib.auth import get_user_model

    from jobs.models import Experiment, Run
    from rlplatform.models import Host, Quota, ResourceGroup, ScrapeToken, Team

    tag = seeded["tag"]
    Run.objects.filter(experiment__team_id=seeded["team"]).delete()
    Experiment.objects.filter(team_id=seeded["team"]).delete()
    Quota.objects.filter(team_id=seeded["team"]).delete()
    Host.objects.filter(name__startswith=f"{tag}-").delete()
    ResourceGroup.objects.filter(name__startswith=f"{tag}-").delete()
    Team.objects.filter(pk=seeded["team"]).delete()
    ScrapeToken.objects.filter(name=f"{tag}-prometheus").delete()
    get_user_model().objects.filter(pk=seeded["staff"]).delete()


def get(conn: http.client.HTTPConnection, token: str) -> tuple[int, bytes]:
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
    response = conn.getresponse()
    return response.status, response.read()


def wait_ready(port: int, token: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            status, _body = get(http.client.HTTPConnection("127.0.0.1", port, timeout=10), token)
            if status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /metrics within {limit_s:g} s")
        time.sleep(0.2)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def collector_ms(repeats: int) -> float:
    """The median time of the collector's queries and families alone, in this process."""
    from jobs.metrics.platform_state import PlatformStateCollector

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        list(PlatformStateCollector().collect())
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under a minute in all)")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn workers (default 2, as deployed)")
    parser.add_argument("--requests", type=int, default=None, help="timed requests (default 300; 50 with --quick)")
    args = parser.parse_args()
    requests = args.requests or (50 if args.quick else 300)
    figures: dict = server_figures(args.workers, args.quick)
    multiproc_dir = tempfile.mkdtemp(prefix="tandem-bench-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir  # this process and the server's workers
    setup_django()
    tag = f"bench-metrics-{secrets.token_hex(3)}"
    started = time.perf_counter()
    seeded = seed(tag)
    figures["seeded"] = seeded["counts"]
    figures["seed_s"] = round(time.perf_counter() - started, 1)
    print(f"seeded {seeded['counts']} in {figures['seed_s']} s")
    port = free_port()
    server = start_server(port, args.workers, {"PROMETHEUS_MULTIPROC_DIR": multiproc_dir})
    try:
        wait_ready(port, seeded["token"])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(5):
            get(conn, seeded["token"])
        latencies, size = [], 0
        for _ in range(requests):
            t0 = time.perf_counter()
            status, body = get(conn, seeded["token"])
            latencies.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                raise RuntimeError(f"/metrics answered {status}: {body[:200]!r}")
            size = len(body)
        figures["requests"] = requests
        figures["latency_ms"] = {
            "p50": round(pct(latencies, 50), 1),
            "p95": round(pct(latencies, 95), 1),
            "p99": round(pct(latencies, 99), 1),
            "max": round(max(latencies), 1),
            "mean": round(statistics.mean(latencies), 1),
        }
        figures["reply_bytes"] = size
        figures["series"] = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        figures["collector_sql_ms_p50"] = round(collector_ms(10 if args.quick else 30), 1)
        figures["target_p50_ms"] = 100
        figures["meets_target"] = figures["latency_ms"]["p50"] <= 100
        lat = figures["latency_ms"]
        print(
            f"GET /metrics x{requests}: p50 {lat['p50']} ms, p95 {lat['p95']} ms, p99 {lat['p99']} ms, max {lat['max']} ms"
        )
        print(
            f"reply {size} bytes, {figures['series']} series; collector alone (in-process) {figures['collector_sql_ms_p50']} ms"
        )
    finally:
        stop_server(server)
        cleanup(seeded)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
