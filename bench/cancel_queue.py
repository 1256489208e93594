"""Submit-and-cancel with a long queue: what one cancel costs as the queue behind it grows.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/cancel_queue.py [--quick]

What it does:
1. migrates the database in DATABASE_URL and seeds its own team, user, API token and
   a one-device CPU group whose device a running run holds, so every run submitted
   after it queues (everything it made is deleted at the end);
2. *in-process*, through jobs.handler as the API calls it: for queue lengths 10, 100
   and 1,000 (``--lengths``), rounds of one submit (the queue grows by one) and one
   cancel (it shrinks back): the cancel takes the HEAD of the queue (every run
   behind it moves up: the worst case) or a run at a random place. Per cancel:
   wall time and the stream entries it wrote (RunStreamEntry rows), with the
   ratio of the longest queue's median to the shortest's (flat = about 1);
3. *over HTTP*: uvicorn (``--workers``, default 2) on ``rlplatform.asgi:application``,
   the queue at the longest length, ``--clients`` concurrent clients (default 16)
   that each submit and, 35% of the time, cancel a random queued run of the
   experiment: statuses, p50/p99 of submits and cancels, stream entries per
   operation.

Target (issue 13): cancel cost flat in queue length: one stream entry per cancel
(was one per queued run behind it: 0.16 s with 10 queued, 1.2 s with 400), and
no write per run behind (positions derived on read, jobs.queue_order).
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time

from api_load import SPEC, Connection, Result, Seed, cleanup, make_group, make_queued_runs, wait_ready
from harness import free_port, loadavg, setup_django, start_server, stop_server


def seed(tag: str):
    from django.contrib.auth import get_user_model

    from jobs import handler
    from jobs.models import Experiment
    from rlplatform import tokens
    from rlplatform.models import Membership, Quota, Team

    user = get_user_model().objects.create_user(username=f"{tag}-user")
    team = Team.objects.create(name=f"{tag}-team")
    Membership.objects.create(team=team, user=user, role="admin")
    group = make_group(tag, "cq", team, hosts=1, per_host=1)
    quota = Quota.objects.create(
        team=team, group=group, name="cq", max_devices=1, max_concurrent_runs=100_000, max_rollout_workers=100_000
    )
    experiment = Experiment.objects.create(team=team, name="cq", group=group, quota=quota)
    blocker, _ = handler.submit_run(user, experiment, SPEC, submission_id="blocker")
    assert blocker.state == "ADMITTED", blocker.state
    _token, raw = tokens.mint(user, team, "bench")
    return Seed(tag, team.pk, user.pk, raw, experiment.pk, blocker.pk, [group.pk]), user, experiment


def _last_entry() -> int:
    from django.db.models import Max

    from jobs.models import RunStreamEntry

    return RunStreamEntry.objects.aggregate(last=Max("pk"))["last"] or 0


def _queued(experiment) -> list[int]:
    """The experiment's queued run ids in queue order."""
    from jobs import queue_order

    return list(queue_order.queued_in_order(experiment.group_id).values_list("pk", flat=True))


def fill_queue(experiment, length: int) -> None:
    """Top the experiment's queue up to ``length`` runs (bulk insert, then one admission pass sets reasons)."""
    from jobs import admission

    missing = length - len(_queued(experiment))
    if missing > 0:
        make_queued_runs(experiment, missing)
        admission.admit_group(experiment.group_id)


def cancel_rounds(user, experiment, length: int, rounds: int, where: str, rng: random.Random) -> dict:
    from jobs import handler
    from jobs.models import Run

    fill_queue(experiment, length)
    times, entries = [], []
    for i in range(rounds):
        handler.submit_run(user, experiment, SPEC, submission_id=f"{where}-{length}-{i}-{rng.random()}")
        queued = _queued(experiment)
        victim = queued[0] if where == "head" else rng.choice(queued)
        run = Run.objects.get(pk=victim)
        mark = _last_entry()
        t0 = time.perf_counter()
        handler.cancel_run(user, run, "bench")
        times.append(time.perf_counter() - t0)
        entries.append(_last_entry() - mark)
    times.sort()
    return {
        "queued": length,
        "cancel": where,
        "rounds": rounds,
        "p50_ms": round(statistics.median(times) * 1000, 2),
        "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1000, 2),
        "stream_entries_per_cancel": max(entries),
    }


async def http_phase(port: int, token: str, experiment_id: int, clients: int, duration_s: float, tag: str) -> dict:
    from asgiref.sync import sync_to_async

    from jobs.models import Run

    headers = {"Authorization": f"Bearer {token}"}
    submits, cancels = Result(), Result()
    rng = random.Random(7)
    counter = iter(range(10**9))
    stop_at = time.perf_counter() + duration_s
    queued_ids = sync_to_async(
        lambda: list(Run.objects.filter(experiment_id=experiment_id, state="QUEUED").values_list("pk", flat=True))
    )
    mark = await sync_to_async(_last_entry)()

    async def client() -> None:
        conn = Connection("127.0.0.1", port, headers)
        try:
            while time.perf_counter() < stop_at:
                body = {"experiment": str(experiment_id), "spec": SPEC, "submission_id": f"{tag}-h{next(counter)}"}
                t0 = time.perf_counter()
                try:
                    status, _ = await conn.request("POST", "/api/runs/", body)
                    submits.add(status, time.perf_counter() - t0)
                except (OSError, ConnectionError, asyncio.IncompleteReadError):
                    submits.errors += 1
                    await conn.close()
                if rng.random() < 0.35:
                    victim = rng.choice(await queued_ids())
                    t0 = time.perf_counter()
                    try:
                        status, _ = await conn.request("POST", f"/api/runs/{victim}/cancel/", {"reason": "bench"})
                        cancels.add(status, time.perf_counter() - t0)
                    except (OSError, ConnectionError, asyncio.IncompleteReadError):
                        cancels.errors += 1
                        await conn.close()
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    submits.elapsed_s = cancels.elapsed_s = time.perf_counter() - start
    entries = await sync_to_async(_last_entry)() - mark
    operations = len(submits.latencies_s) + len(cancels.latencies_s)
    return {
        "clients": clients,
        "submits": submits.summary(),
        "cancels": cancels.summary(),
        "stream_entries": entries,
        "stream_entries_per_operation": round(entries / operations, 2) if operations else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a short HTTP phase (under a minute)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 100, 1000], help="queue lengths")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes (default 2)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients (default 16)")
    args = parser.parse_args()
    rounds = 8 if args.quick else 30
    http_s = 8.0 if args.quick else 30.0

    setup_django("the live-UI messages of each cancel go through the channel layer")
    tag = f"benchcq{int(time.time())}"
    s, user, experiment = seed(tag)
    figures: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other work: figures are indicative)",
        "quick": args.quick,
        "loadavg_start": loadavg(),
        "in_process": [],
    }
    print(f"load average at start: {figures['loadavg_start']} (1/5/15 min, {os.cpu_count()} cores)")
    rng = random.Random(13)
    try:
        lengths = sorted(args.lengths)
        for where in ("head", "random"):
            for length in lengths:
                row = cancel_rounds(user, experiment, length, rounds, where, rng)
                figures["in_process"].append(row)
                print(
                    f"cancel at the {where:>6} of {length:>5} queued: p50 {row['p50_ms']:>8} ms  "
                    f"p99 {row['p99_ms']:>8} ms  stream entries per cancel {row['stream_entries_per_cancel']}"
                )
        by = {(r["cancel"], r["queued"]): r for r in figures["in_process"]}
        figures["head_cancel_p50_ratio_longest_to_shortest"] = round(
            by[("head", lengths[-1])]["p50_ms"] / by[("head", lengths[0])]["p50_ms"], 2
        )
        print(
            f"head cancel p50, {lengths[-1]} vs {lengths[0]} queued: "
            f"{figures['head_cancel_p50_ratio_longest_to_shortest']}x"
        )

        fill_queue(experiment, lengths[-1])
        port = free_port()
        server = start_server(port, args.workers)
        try:
            wait_ready(port, s.token, s.status_run_id)
            http = asyncio.run(http_phase(port, s.token, experiment.pk, args.clients, http_s, tag))
        finally:
            stop_server(server)
        http["queued_at_start"] = lengths[-1]
        figures["http"] = http
        sub, can = http["submits"], http["cancels"]
        print(
            f"HTTP, {args.clients} clients, {lengths[-1]} queued: submits n={sub['requests']} p50 {sub['p50_ms']} ms "
            f"p99 {sub['p99_ms']} ms statuses={sub['statuses']} errors={sub['errors']}; cancels n={can['requests']} "
            f"p50 {can['p50_ms']} ms p99 {can['p99_ms']} ms statuses={can['statuses']} errors={can['errors']}; "
            f"stream entries {http['stream_entries']} ({http['stream_entries_per_operation']} per operation)"
        )
    finally:
        cleanup(s)
    # A 409 is a cancel of a run another client had just cancelled: an answer, not a failure.
    http_ok = all(int(code) < 500 for part in ("submits", "cancels") for code in figures["http"][part]["statuses"])
    figures["targets"] = {
        "one_stream_entry_per_cancel": all(r["stream_entries_per_cancel"] == 1 for r in figures["in_process"]),
        "head_cancel_flat_within_2x": figures["head_cancel_p50_ratio_longest_to_shortest"] <= 2.0,
        "http_no_server_errors": http_ok
        and not figures["http"]["submits"]["errors"]
        and not figures["http"]["cancels"]["errors"],
    }
    figures["loadavg_end"] = loadavg()
    print(f"targets: {figures['targets']}")
    print(f"load average at end: {figures['loadavg_end']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
