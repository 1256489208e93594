"""Load test of the control plane's REST API against the real ASGI server and PostgreSQL.

    DATABASE_URL=postgres://... .venv/bin/python bench/api_load.py [--quick] [--workers 2] [--compare-pool]

What it does:
1. migrates the database in DATABASE_URL and seeds its own team, user, API
   token, CPU resource group (16 hosts x 8 devices), experiment and runs
   (names carry a per-run tag; everything it made is deleted at the end);
2. starts uvicorn on ``rlplatform.asgi:application`` as a subprocess with
   ``--workers`` processes (default 2, one per core of the dev machine; Django's
   sync views run in threads, each request taking a connection from the
   per-process pool of DATABASE_POOL);
3. measures, with a small asyncio HTTP/1.1 client on keep-alive connections:
   - run-status reads (GET /api/runs/{id}/) at 1, 8 and 32 concurrent clients
     (closed loop), then at a fixed 200 requests/s (open loop: latency counts
     from each request's scheduled start, so a stall cannot hide), reporting
     the achieved rate, p50 and p99; with ``--compare-pool`` the same
     fixed-rate phase again against a server with DATABASE_POOL=false (and
     DATABASE_CONN_MAX_AGE=0: a connect per request), side by side;
   - submits (POST /api/runs/, each with its own submission_id) at 1, 8, 32
     concurrent clients; every submit runs an admission pass, and the group
     fills after 128 devices, so later submits re-evaluate a growing queue;
4. times admission in-process: one pass over 1,000 queued runs that cannot
   fit (every run re-evaluated, reasons and positions written), a second
   pass with nothing changed, and one pass that admits 1,000 runs at once
   into a group of 1,000 free devices.

Targets (issue 2, on the 2-core dev machine): run-status p99 <= 50 ms at
200 requests/s; one admission pass over 1,000 queued runs < 1 s.
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from harness import free_port, loadavg, server_figures, setup_django, start_server, stop_server, tree_cpu_s

SPEC = "name: bench\nresources:\n  device: cpu\n  trainer_devices: 1\n"

# --- load generator (standard library only) ------------------------------------------------------


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    elapsed_s: float = 0.0

    def add(self, status: int, latency: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.latencies_s.append(latency)

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        n = len(lat)

        def pct(p: float) -> float:
            return round(lat[min(n - 1, int(p * n))] * 1000, 2) if n else float("nan")

        return {
            "requests": n,
            "errors": self.errors,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "throughput_rps": round(n / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "max_ms": round(lat[-1] * 1000, 2) if n else float("nan"),
        }


class Connection:
    """One keep-alive HTTP/1.1 connection; requests on it are sequential."""

    def __init__(self, host: str, port: int, headers: dict[str, str]):
        self.host, self.port = host, port
        self.headers = headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            await self._connect()
        payload = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: application/json"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        assert self.writer is not None and self.reader is not None
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        length, close = 0, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
            elif name == "transfer-encoding" and "chunked" in value.lower():
                raise ConnectionError("chunked responses are not supported by this load generator")
        data = await self.reader.readexactly(length) if length else b""
        if close:
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


# A request factory returns (method, path, body) for the i-th request.
RequestFactory = Callable[[int], tuple[str, str, dict | None]]


async def closed_loop(
    host: str, port: int, headers: dict[str, str], make: RequestFactory, concurrency: int, duration_s: float
) -> Result:
    result = Result()
    counter = iter(range(10**9))
    stop_at = time.perf_counter() + duration_s

    async def client() -> None:
        conn = Connection(host, port, headers)
        try:
            while time.perf_counter() < stop_at:
                method, path, body = make(next(counter))
                t0 = time.perf_counter()
                try:
                    status, _ = await conn.request(method, path, body)
                except (OSError, ConnectionError, asyncio.IncompleteReadError):
                    result.errors += 1
                    await conn.close()
                    continue
                result.add(status, time.perf_counter() - t0)
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - start
    return result


async def fixed_rate(
    host: str,
    port: int,
    headers: dict[str, str],
    make: RequestFactory,
    rate: float,
    duration_s: float,
    pool: int = 64,
    grace_s: float = 5.0,
) -> Result:
    """Start ``rate`` requests per second for ``duration_s``, on up to ``pool``
    connections. A request whose slot comes while every connection is busy
    waits, and that wait counts in its latency. Requests still unanswered
    ``grace_s`` after the schedule ends are abandoned and counted in
    ``errors`` (a server far below the rate would otherwise stretch the phase
    without bound)."""
    result = Result()
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    connections = [Connection(host, port, headers) for _ in range(pool)]
    for conn in connections:
        idle.put_nowait(conn)
    total = int(rate * duration_s)
    start = time.perf_counter()

    async def one(i: int, scheduled: float) -> None:
        conn = await idle.get()
        method, path, body = make(i)
        try:
            status, _ = await conn.request(method, path, body)
            result.add(status, time.perf_counter() - scheduled)
            idle.put_nowait(conn)
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            result.errors += 1
            await conn.close()
            idle.put_nowait(conn)

    last_answer = start

    async def timed(i: int, scheduled: float) -> None:
        nonlocal last_answer
        await one(i, scheduled)
        last_answer = max(last_answer, time.perf_counter())

    tasks = []
    for i in range(total):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(i, scheduled)))
    _done, pending = await asyncio.wait(tasks, timeout=grace_s)
    for task in pending:
        task.cancel()
    result.errors += len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    # Up to the last answer, not the abandoned stragglers: throughput is the achieved rate.
    result.elapsed_s = (last_answer - start) if result.latencies_s else time.perf_counter() - start
    for conn in connections:
        await conn.close()
    return result


# --- set-up: Django, seed data, the server ----------------------------------------------------------


@dataclass
class Seed:
    tag: str
    team_id: int
    user_id: int
    token: str
    experiment_id: int
    status_run_id: int
    group_ids: list[int] = field(default_factory=list)


def make_group(tag: str, name: str, team, hosts: int, per_host: int):
    from rlplatform.models import Device, Host, ResourceGroup

    group = ResourceGroup.objects.create(name=f"{tag}-{name}", kind="cpu", device_model="bench")
    group.teams.add(team)
    host_rows = Host.objects.bulk_create(
        Host(group=group, name=f"{tag}-{name}-h{i}", queue=f"host.{tag}-{name}-h{i}", labels={"switch": f"s{i // 4}"})
        for i in range(hosts)
    )
    Device.objects.bulk_create(
        Device(host=h, index=j, kind="cpu", model="bench") for h in host_rows for j in range(per_host)
    )
    return group


def seed(tag: str) -> Seed:
    from django.contrib.auth import get_user_model

    from jobs import handler
    from jobs.models import Experiment
    from rlplatform import tokens
    from rlplatform.models import Membership, Quota, Team

    user = get_user_model().objects.create_user(username=f"{tag}-user")
    team = Team.objects.create(name=f"{tag}-team")
    Membership.objects.create(team=team, user=user, role="admin")
    group = make_group(tag, "api", team, hosts=16, per_host=8)
    quota = Quota.objects.create(
        team=team, group=group, name="api", max_devices=128, max_concurrent_runs=100_000, max_rollout_workers=100_000
    )
    experiment = Experiment.objects.create(team=team, name="api", group=group, quota=quota)
    run, _ = handler.submit_run(user, experiment, SPEC, submission_id="status-target")
    _token, raw = tokens.mint(user, team, "bench")
    return Seed(tag, team.pk, user.pk, raw, experiment.pk, run.pk, [group.pk])


def cleanup(s: Seed) -> None:
    from django.contrib.auth import get_user_model

    from jobs.models import Experiment, Run
    from rlplatform.models import Host, Quota, ResourceGroup, Team

    Run.objects.filter(experiment__team_id=s.team_id).delete()
    Experiment.objects.filter(team_id=s.team_id).delete()
    Quota.objects.filter(team_id=s.team_id).delete()
    Host.objects.filter(group_id__in=s.group_ids).delete()
    ResourceGroup.objects.filter(pk__in=s.group_ids).delete()
    Team.objects.filter(pk=s.team_id).delete()
    get_user_model().objects.filter(pk=s.user_id).delete()


def wait_ready(port: int, token: str, run_id: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/runs/{run_id}/", headers={"Authorization": f"Bearer {token}"}
    )
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not answer within 60 s")


# --- admission, in-process -------------------------------------------------------------------------------


def make_queued_runs(experiment, n: int) -> None:
    from django.utils import timezone

    from jobs.admission import WAITING_FOR_ADMISSION
    from jobs.models import Run
    from runtime.spec import load_spec

    resolved = load_spec(SPEC).resolved()
    t0 = timezone.now()
    Run.objects.bulk_create(
        Run(
            experiment=experiment,
            name=f"q{i}",
            spec=SPEC,
            resolved_spec=resolved,
            state="QUEUED",
            reason=WAITING_FOR_ADMISSION,
            devices_requested=1,
            rollout_workers=1,
            submitted_at=t0 + datetime.timedelta(microseconds=i),
        )
        for i in range(n)
    )


def bench_admission(s: Seed, n: int) -> dict:
    from jobs import admission
    from jobs.models import Experiment, Run
    from rlplatform.models import Quota, Team

    team = Team.objects.get(pk=s.team_id)
    # 1) A full group: 8 devices all held, so every queued run is re-evaluated and stays queued.
    full = make_group(s.tag, "full", team, hosts=1, per_host=8)
    s.group_ids.append(full.pk)
    quota = Quota.objects.create(team=team, group=full, name="full", max_devices=8, max_concurrent_runs=100_000)
    exp = Experiment.objects.create(team=team, name="full", group=full, quota=quota)
    make_queued_runs(exp, 8)
    admission.admit_group(full.pk)  # the 8 take every device
    make_queued_runs(exp, n)
    t0 = time.perf_counter()
    admission.admit_group(full.pk)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    admission.admit_group(full.pk)
    steady = time.perf_counter() - t0
    still_queued = Run.objects.filter(experiment=exp, state="QUEUED").count()

    # 2) An empty group of n devices: one pass admits all n runs.
    big = make_group(s.tag, "big", team, hosts=n // 8, per_host=8)
    s.group_ids.append(big.pk)
    quota = Quota.objects.create(
        team=team, group=big, name="big", max_devices=n, max_concurrent_runs=n, max_rollout_workers=n
    )
    exp = Experiment.objects.create(team=team, name="big", group=big, quota=quota)
    make_queued_runs(exp, n)
    t0 = time.perf_counter()
    admitted = admission.admit_group(big.pk)
    admit_all = time.perf_counter() - t0
    return {
        "queued_runs": n,
        "reevaluate_first_pass_s": round(first, 3),
        "reevaluate_steady_pass_s": round(steady, 3),
        "reevaluated_still_queued": still_queued,
        "admit_all_pass_s": round(admit_all, 3),
        "admitted_in_one_pass": len(admitted),
        "admissions_per_s": round(len(admitted) / admit_all, 1) if admit_all else None,
    }


# --- the run -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (under a minute in all)")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes (default 2)")
    parser.add_argument(
        "--compare-pool",
        action="store_true",
        help="repeat the fixed-rate phase against a server without the pool (a connect per request), side by side",
    )
    parser.add_argument(
        "--compare-django",
        action="store_true",
        help="repeat the status-read phases against Django's application without the run-status fast path "
        "that rlplatform/asgi.py mounts, side by side",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="fixed rate of the status-read phase (req/s)")
    parser.add_argument("--admission-runs", type=int, default=1000, help="queued runs of the admission passes")
    args = parser.parse_args()
    phase_s = 3.0 if args.quick else 10.0
    rate_s = 10.0 if args.quick else 30.0
    levels = (1, 8, 32)

    setup_django()
    tag = f"bench{int(time.time())}"
    s = seed(tag)
    port = free_port()
    server = start_server(port, args.workers)
    figures: dict = server_figures(args.workers, args.quick)
    figures["database_pool"] = os.environ.get("DATABASE_POOL", "default (on for PostgreSQL)")
    print(f"load average at start: {figures['loadavg_start']} (1/5/15 min, {os.cpu_count()} cores)")
    try:
        run_phases(s, tag, port, server.pid, args, figures, phase_s, rate_s, levels)
        if args.compare_pool:
            stop_server(server)
            port = free_port()
            # Connect per request: persistent connections (CONN_MAX_AGE > 0) under ASGI stay open in
            # each finished request thread until PostgreSQL runs out of slots for everyone.
            server = start_server(port, args.workers, {"DATABASE_POOL": "false", "DATABASE_CONN_MAX_AGE": "0"})
            summary = asyncio.run(fixed_rate_phase(s, port, args.rate, rate_s, server_pid=server.pid))
            figures["status_reads"][f"fixed_{args.rate:g}rps_no_pool"] = summary
            print(f"status reads at {args.rate:g}/s fixed rate, no pool: {fmt_fixed(summary)}")
        if args.compare_django:
            stop_server(server)
            port = free_port()
            server = start_server(port, args.workers, None, "--factory", app="bench.harness:django_only_application")
            figures["status_reads_django_only"] = asyncio.run(
                django_only_phases(s, port, server.pid, args, phase_s, rate_s)
            )
    finally:
        stop_server(server)
        if figures.get("status_reads") is None:
            cleanup(s)  # the HTTP phases failed: leave nothing behind
    try:
        adm = bench_admission(s, args.admission_runs)
        figures["admission"] = adm
        print(
            f"admission, {adm['queued_runs']} queued runs: re-evaluate first pass {adm['reevaluate_first_pass_s']} s, "
            f"steady pass {adm['reevaluate_steady_pass_s']} s; admit all in one pass {adm['admit_all_pass_s']} s "
            f"({adm['admissions_per_s']} admissions/s)"
        )
    finally:
        cleanup(s)
    fixed = figures["status_reads"][f"fixed_{args.rate:g}rps"]
    figures["targets"] = {
        "status_p99_at_200rps_le_50ms": fixed["p99_ms"] <= 50.0 and not fixed["errors"] and args.rate >= 200,
        "reevaluate_1000_queued_lt_1s": adm["reevaluate_first_pass_s"] < 1.0,
        "admit_1000_in_one_pass_lt_1s": adm["admit_all_pass_s"] < 1.0,
    }
    figures["loadavg_end"] = loadavg()
    print(f"targets: {figures['targets']}")
    print(f"load average at end: {figures['loadavg_end']}")
    print(json.dumps(figures))


def run_phases(
    s: Seed, tag: str, port: int, server_pid: int, args, figures: dict, phase_s: float, rate_s: float, levels
) -> None:
    wait_ready(port, s.token, s.status_run_id)
    headers = {"Authorization": f"Bearer {s.token}"}
    status_path = f"/api/runs/{s.status_run_id}/"

    def read(_i: int):
        return "GET", status_path, None

    def submit(i: int):
        return (
            "POST",
            "/api/runs/",
            {"experiment": str(s.experiment_id), "spec": SPEC, "submission_id": f"{tag}-{i}"},
        )

    async def phases() -> dict:
        out: dict = {"status_reads": {}, "submits": {}}
        await closed_loop("127.0.0.1", port, headers, read, 4, 1.0)  # warm-up
        for c in levels:
            r = await closed_loop("127.0.0.1", port, headers, read, c, phase_s)
            out["status_reads"][f"c{c}"] = r.summary()
            print(f"status reads, {c:>2} clients: {fmt(r.summary())}")
        summary = await fixed_rate_phase(s, port, args.rate, rate_s, warm_up=False, server_pid=server_pid)
        out["status_reads"][f"fixed_{args.rate:g}rps"] = summary
        print(f"status reads at {args.rate:g}/s fixed rate: {fmt_fixed(summary)}")
        base = 0
        for c in levels:
            offset = base

            def make(i: int, offset: int = offset):
                return submit(offset + i)

            r = await closed_loop("127.0.0.1", port, headers, make, c, phase_s)
            base += len(r.latencies_s) + r.errors + c
            out["submits"][f"c{c}"] = r.summary()
            print(f"submits,      {c:>2} clients: {fmt(r.summary())}")
        return out

    figures.update(asyncio.run(phases()))


async def fixed_rate_phase(
    s: Seed, port: int, rate: float, duration_s: float, *, warm_up: bool = True, server_pid: int | None = None
) -> dict:
    """Run-status reads at a fixed rate; the summary adds the target and achieved rates
    (and the server's CPU per request, given its pid)."""
    if warm_up:
        await asyncio.to_thread(wait_ready, port, s.token, s.status_run_id)
    headers = {"Authorization": f"Bearer {s.token}"}
    path = f"/api/runs/{s.status_run_id}/"

    def read(_i: int):
        return "GET", path, None

    if warm_up:
        await closed_loop("127.0.0.1", port, headers, read, 4, 1.0)
    cpu_before = tree_cpu_s(server_pid) if server_pid else None
    summary = (await fixed_rate("127.0.0.1", port, headers, read, rate, duration_s)).summary()
    cpu_after = tree_cpu_s(server_pid) if server_pid else None
    # A worker that uvicorn restarted meanwhile (it does, when one stops answering its pings) takes its CPU
    # time with it: then the figure is unknown, not negative.
    if cpu_before is not None and cpu_after is not None and cpu_after >= cpu_before and summary["requests"]:
        # The uvicorn processes only, not PostgreSQL's backends: what one read costs the server.
        summary["server_cpu_ms_per_request"] = round((cpu_after - cpu_before) * 1000 / summary["requests"], 2)
    summary["target_rps"] = rate
    summary["achieved_rps"] = summary["throughput_rps"]
    return summary


async def django_only_phases(s: Seed, port: int, server_pid: int, args, phase_s: float, rate_s: float) -> dict:
    """Status reads at 1 and 32 clients and at the fixed rate, through Django without the fast path."""
    await asyncio.to_thread(wait_ready, port, s.token, s.status_run_id)
    headers = {"Authorization": f"Bearer {s.token}"}
    path = f"/api/runs/{s.status_run_id}/"
    out: dict = {}
    for c in (1, 32):
        r = await closed_loop("127.0.0.1", port, headers, lambda _i: ("GET", path, None), c, phase_s)
        out[f"c{c}"] = r.summary()
        print(f"status reads, {c:>2} clients, Django only: {fmt(r.summary())}")
    summary = await fixed_rate_phase(s, port, args.rate, rate_s, server_pid=server_pid)
    out[f"fixed_{args.rate:g}rps"] = summary
    print(f"status reads at {args.rate:g}/s fixed rate, Django only: {fmt_fixed(summary)}")
    return out


def fmt_fixed(summary: dict) -> str:
    cpu = summary.get("server_cpu_ms_per_request")
    return (
        f"achieved {summary['achieved_rps']} of {summary['target_rps']:g} req/s  p50 {summary['p50_ms']} ms  "
        f"p99 {summary['p99_ms']} ms  n={summary['requests']} errors={summary['errors']} statuses={summary['statuses']}"
        + (f"  server CPU {cpu} ms/request" if cpu is not None else "")
    )


def fmt(summary: dict) -> str:
    return (
        f"{summary['throughput_rps']:>7} req/s  p50 {summary['p50_ms']:>7} ms  p99 {summary['p99_ms']:>7} ms  "
        f"n={summary['requests']} errors={summary['errors']} statuses={summary['statuses']}"
    )


if __name__ == "__main__":
    main()
