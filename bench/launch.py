"""Time from submit to first metric: a run through the whole platform on this machine.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/launch.py [--quick] [--repeats N]

What it does:
1. migrates the database, seeds its own team, CPU group, experiment and API token;
2. starts uvicorn (``rlplatform.asgi``) and a Celery worker that is this machine's host agent (its own
   Redis database, embedded beat), as a deployment runs them;
3. submits a run through the REST API (``--quick``: 4 steps of a tiny sync GRPO run; otherwise the
   demo's async GRPO spec on the built-in tiny model, 20 steps) and polls the database every 20 ms
   for each milestone: ADMITTED, STARTING (role process started), RUNNING (the runtime's first
   heartbeat), the first metric point stored, COMPLETED;
4. repeats ``--repeats`` times and reports the median of each milestone.

The runtime's start (Python, torch, the model) dominates; the platform's own hops (admission, the
launch and start tasks, the claim, the spawn) are the ADMITTED and STARTING figures.
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import yaml
from harness import ROOT, free_port, setup_django, start_server, stop_server

BENCH_REDIS_DB = 10
MILESTONES = ("admitted", "starting", "running", "first_metric", "completed")


def spec_text(quick: bool) -> str:
    if quick:
        spec = {
            "name": "bench-launch",
            "model": {"builtin": "tiny-qwen2"},
            "task": {"name": "reverse", "min_len": 1, "max_len": 4, "train_size": 256, "eval_size": 8},
            "algorithm": {"name": "grpo", "group_size": 4},
            "rollout": {"max_new_tokens": 6, "max_batch_size": 16},
            "pipeline": {"mode": "sync", "steps": 4, "prompts_per_step": 4, "eval_interval": 0},
            "resources": {"threads_per_process": 1},
        }
    else:
        spec = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
        spec["model"] = {"builtin": "tiny-qwen2"}  # the demo's warm start is not part of the launch path
        spec["pipeline"].update(steps=20, eval_interval=0)
        spec["checkpoint"] = {"interval": 0, "keep_last": 1}
    spec["metrics"] = {"progress_bar": False}
    return yaml.safe_dump(spec)


def seed(tag: str):
    from django.contrib.auth import get_user_model

    from jobs.models import Experiment
    from rlplatform import tokens
    from rlplatform.models import Membership, Quota, ResourceGroup, Role, Team

    team = Team.objects.create(name=f"bench-launch-{tag}")
    user = get_user_model().objects.create(username=f"bench-launch-{tag}")
    Membership.objects.create(team=team, user=user, role=Role.ADMIN)
    group = ResourceGroup.objects.create(name=f"bench-launch-{tag}", kind="cpu")
    group.teams.add(team)
    quota = Quota.objects.create(team=team, group=group, name="bench", max_devices=1, max_concurrent_runs=1)
    experiment = Experiment.objects.create(team=team, name="bench", group=group, quota=quota)
    _token, raw = tokens.mint(user, team, "bench")
    return team, user, group, experiment, raw


def one_run(client, experiment: str, text: str, timeout: float) -> dict[str, float]:
    from jobs.models import MetricPoint, Run

    t0 = time.perf_counter()
    created, body = client.submit(experiment, text)
    seen: dict[str, float] = {}
    run_id = body["id"]
    deadline = time.monotonic() + timeout
    while "completed" not in seen:
        if time.monotonic() > deadline:
            raise SystemExit(f"run {run_id} did not complete within {timeout:g} s (milestones so far: {seen})")
        state, started = Run.objects.filter(pk=run_id).values_list("state", "started_at").get()
        now = time.perf_counter() - t0
        for milestone, reached in (
            ("admitted", state != "QUEUED"),
            ("starting", state in ("STARTING", "RUNNING", "COMPLETED")),
            ("running", started is not None),
            ("first_metric", "first_metric" in seen or MetricPoint.objects.filter(run_id=run_id).exists()),
            ("completed", state == "COMPLETED"),
        ):
            if reached and milestone not in seen:
                seen[milestone] = now
        if state in ("FAILED", "CANCELLED"):
            reason = Run.objects.filter(pk=run_id).values_list("reason", flat=True).get()
            raise SystemExit(f"run {run_id} ended {state}: {reason}")
        time.sleep(0.02)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sync run, one repeat (under a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="runs to time (default 1 quick, 3 full)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    setup_django(redis_reason="the Celery broker of the worker")
    from jobs.client import TandemClient as Client

    broker = urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{BENCH_REDIS_DB}"))
    import redis

    redis.Redis.from_url(broker).flushdb()
    tag = secrets.token_hex(3)
    team, user, group, experiment, token = seed(tag)
    runs_root = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "REDIS_URL": broker,
        "TANDEM_CHECKPOINT_ROOT": str(runs_root),
        "TANDEM_PLATFORM_URL": url,
        "TANDEM_SUPERVISE_S": "0.2",
        "TANDEM_ROLE_HEARTBEAT_S": "0.5",
        "TANDEM_HEARTBEAT_S": "1",
    }
    server = start_server(port, 1, env)
    worker_env = {
        **os.environ,
        **env,
        "TANDEM_HOST_NAME": f"bench-launch-{tag}",
        "TANDEM_HOST_GROUP": group.name,
        "TANDEM_HOST_DEVICE_KIND": "cpu",
        "TANDEM_CPU_DEVICES": "1",
    }
    command = [sys.executable, "-m", "celery", "-A", "rlplatform", "worker", "--pool", "threads", "-Q", "default"]
    command += ["-n", f"bench-launch-{tag}@%h", "--without-gossip", "--without-mingle", "-l", "WARNING"]
    worker = subprocess.Popen(command, cwd=ROOT, env=worker_env)
    try:
        from rlplatform.models import Host

        deadline = time.monotonic() + 60
        while not Host.objects.filter(name=f"bench-launch-{tag}", devices__isnull=False).exists():
            if time.monotonic() > deadline:
                raise SystemExit("the worker's agent did not register its host within 60 s")
            time.sleep(0.2)
        client = Client(url, token)
        text = spec_text(args.quick)
        results = [one_run(client, experiment.name, text, 600) for _ in range(repeats)]
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        stop_server(server)
        experiment.delete()  # its runs with it; team, group and host stay (harmless, named by tag)
        user.delete()
    figures = {f"submit_to_{m}_s": round(statistics.median(r[m] for r in results), 3) for m in MILESTONES}
    figures.update(
        repeats=repeats, quick=args.quick, spec="tiny sync, 4 steps" if args.quick else "demo async, 20 steps"
    )
    print(
        f"submit -> ADMITTED {figures['submit_to_admitted_s']:.3f} s, STARTING {figures['submit_to_starting_s']:.3f} s,"
    )
    print(
        f"          RUNNING {figures['submit_to_running_s']:.2f} s, first metric {figures['submit_to_first_metric_s']:.2f} s,"
    )
    print(f"          COMPLETED {figures['submit_to_completed_s']:.2f} s  (median of {repeats}, {figures['spec']})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
