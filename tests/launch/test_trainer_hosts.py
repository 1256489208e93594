"""Trainer ranks over several hosts: placement (one host, then one switch, then fewest hosts), one trainer
role per host with its ranks and the leader's rendezvous, and the trainer roles living and dying together.

Decisions are tested against the database (start tasks captured, not sent); the end-to-end test at the
bottom (slow) runs uvicorn, a Celery worker per host and real ``python -m runtime role trainer|trainer-ranks``
processes whose ranks meet over gloo.
"""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from jobs import handler, placement, supervisor
from jobs.lifecycle import apply, files
from jobs.lifecycle.roles import role_names
from jobs.models import RoleState as R
from jobs.models import RunEvent, RunRole
from jobs.states import RunState
from tests.launch.helpers import launch_captured

# --- the pure placement -------------------------------------------------------------------------------


def test_spread_keeps_the_ranks_in_one_switch_with_the_leader_on_the_fullest_host():
    free = {1: [10, 11, 12], 2: [20, 21], 3: [30, 31, 32, 33], 4: [40]}
    switches = {1: "a", 2: "b", 3: "a", 4: "b"}
    # 5 ranks: switch b has only 3 free, switch a has 7: fullest first there (host 3 leads)
    assert placement.spread(5, 1, free, switches) == [(3, [30, 31, 32, 33]), (1, [10])]
    # the leader must hold rank 0 and its 4 extras: no host has 5, so it cannot be done
    assert placement.spread(6, 5, free, switches) is None
    # no switch holds 8: the fewest hosts anywhere
    assert placement.spread(8, 1, free, switches) == [(3, [30, 31, 32, 33]), (1, [10, 11, 12]), (2, [20])]


def test_a_run_goes_on_one_host_when_it_can_and_spreads_its_ranks_only_when_it_must():
    free = {1: [10, 11], 2: [20, 21, 22], 3: [30, 31]}
    switches = {1: "a", 2: "b", 3: "b"}
    one_host = placement.Shape(need=3, home=3, lead=1)
    assert placement.place_run(one_host, free, switches) == [20, 21, 22]
    # 4 trainer devices: switch b holds them (host 2 leads); 1 remote rollout role on what is left
    spanning = placement.Shape(need=5, home=4, lead=1)
    assert placement.place_run(spanning, free, switches) == [20, 21, 22, 30, 31]
    # rank 0 + 2 rollout devices on one host: host 2; the other rank beside it on switch b
    assert placement.place_run(placement.Shape(need=4, home=4, lead=3), free, switches) == [20, 21, 22, 30]
    assert placement.place_run(placement.Shape(need=4, home=4, lead=4), free, switches) is None


def test_shape_of_a_spec_counts_the_leaders_own_devices():
    resources = {"trainer_devices": 3, "rollout_devices": 1, "eval_devices": 1, "remote_rollout_workers": 2}
    assert placement.shape_of(resources) == placement.Shape(need=7, home=5, lead=3)
    assert placement.shape_of({}) == placement.Shape(need=1, home=1, lead=1)


# --- launch and start -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _roots(settings, tmp_path):
    settings.TANDEM_CHECKPOINT_ROOT = tmp_path


def _spec(trainer_devices: int, mode: str = "sync", **resources) -> str:
    extra = "".join(f"  {key}: {value}\n" for key, value in resources.items())
    return f"name: ranks\npipeline:\n  mode: {mode}\nresources:\n  device: cpu\n  trainer_devices: {trainer_devices}\n{extra}"


def _roles(run) -> dict[str, RunRole]:
    return {role.name: role for role in RunRole.objects.filter(run=run).select_related("host")}


@pytest.fixture
def spanning(experiment, owner, django_capture_on_commit_callbacks):
    """A RUNNING run of 6 trainer ranks on two hosts of 4 (cpu_group): trainer-0 and trainer-1 live."""
    run, _ = handler.submit_run(owner, experiment, _spec(6, max_restarts=2))
    assert run.state == RunState.ADMITTED, run.reason
    launch_captured(run, django_capture_on_commit_callbacks)
    RunRole.objects.filter(run=run).update(state=R.RUNNING, pid=999999, launched_at=timezone.now())
    handler.transition(run, RunState.STARTING)
    handler.transition(run, RunState.RUNNING)
    return run


def test_launch_gives_each_host_of_the_trainer_ranks_a_role(experiment, owner, django_capture_on_commit_callbacks):
    run, _ = handler.submit_run(owner, experiment, _spec(6))  # two hosts of four: no single host holds 6
    trainer, sent = launch_captured(run, django_capture_on_commit_callbacks)
    assert trainer.name == "trainer-0" and len(sent) == 2
    placed = {name: (r.host.name, r.device_indices, r.state) for name, r in _roles(run).items()}
    assert placed == {
        "trainer-0": ("cpu-local-h1", [0, 1, 2, 3], R.PENDING),
        "trainer-1": ("cpu-local-h2", [0, 1], R.PENDING),
    }
    assert role_names(run) == ["trainer-0", "trainer-1"]


def test_each_trainer_role_starts_with_its_ranks_at_the_leaders_rendezvous(
    experiment, cpu_group, owner, django_capture_on_commit_callbacks
):
    cpu_group.hosts.filter(name="cpu-local-h1").update(address="10.0.0.1")
    cpu_group.hosts.filter(name="cpu-local-h2").update(address="10.0.0.2")
    # 4 ranks + 2 rollout devices beside rank 0: trainer-0 holds 4 devices (ranks 0-1 + the two), trainer-1 two
    run, _ = handler.submit_run(owner, experiment, _spec(4, "async", rollout_devices=2))
    launch_captured(run, django_capture_on_commit_callbacks)
    roles = _roles(run)
    assert [(r.host.name, len(r.device_indices)) for r in roles.values()] == [("cpu-local-h1", 4), ("cpu-local-h2", 2)]
    leader = supervisor._role_env(run, roles["trainer-0"], "tdr_x")
    follower = supervisor._role_env(run, roles["trainer-1"], "tdr_x")
    assert (leader["TANDEM_LOCAL_RANKS"], leader["MASTER_ADDR"]) == ("0-1", "10.0.0.1")
    assert (follower["TANDEM_RANKS"], follower["MASTER_ADDR"]) == ("2-3", "10.0.0.1")
    assert leader["MASTER_PORT"] == follower["MASTER_PORT"]
    assert "TANDEM_RANKS" not in leader and "TANDEM_LOCAL_RANKS" not in follower
    assert follower["TANDEM_ROLE"] == "trainer-1"
    path = files.run_dir(run.pk) / "spec.yaml"
    assert supervisor._command(roles["trainer-1"], path)[4] == "trainer-ranks"
    assert supervisor._command(roles["trainer-0"], path)[4] == "trainer"


def test_a_trainer_on_one_host_gets_no_rank_split(experiment, owner, django_capture_on_commit_callbacks):
    run, _ = handler.submit_run(owner, experiment, _spec(4))
    launch_captured(run, django_capture_on_commit_callbacks)
    env = supervisor._role_env(run, _roles(run)["trainer-0"], "tdr_x")
    assert "TANDEM_LOCAL_RANKS" not in env and "TANDEM_RANKS" not in env


# --- the trainer roles live and die together ---------------------------------------------------------


def _exit(run, name: str, code: int | None, why: str = "") -> str:
    role = RunRole.objects.get(run=run, name=name)
    return apply.role_exited(role.pk, role.attempt, code, why=why)


def _snapshot(run) -> dict[str, tuple]:
    return {n: (r.state, r.attempt, r.restarts, r.stop_requested) for n, r in _roles(run).items()}


def test_a_failed_trainer_role_stops_the_others_and_they_restart_together(spanning, django_capture_on_commit_callbacks):
    run = spanning
    assert _exit(run, "trainer-1", 1) == "stopping"
    assert _snapshot(run) == {"trainer-0": (R.RUNNING, 0, 0, True), "trainer-1": (R.EXITED, 0, 0, False)}
    assert supervisor.Supervisor("h", 1.0)._should_stop(_roles(run)["trainer-0"], timezone.now())
    with django_capture_on_commit_callbacks(execute=False) as sent:
        assert _exit(run, "trainer-0", 143) == "restarting"  # its SIGTERM: not a failure of its own
    assert _snapshot(run) == {"trainer-0": (R.PENDING, 1, 1, False), "trainer-1": (R.PENDING, 1, 1, False)}
    assert len([c for c in sent if "_request_start" in c.__qualname__]) == 2
    run.refresh_from_db()
    assert run.state == RunState.RUNNING
    stopping = RunEvent.objects.get(run=run, kind="trainer_group_stopping").payload
    assert stopping == {"role": "trainer-1", "stopping": ["trainer-0"], "reason": "exit code 1"}
    restarted = RunEvent.objects.filter(run=run, kind="role_restarted").values_list("payload", flat=True)
    assert [(p["role"], p["attempt"], p["reason"]) for p in restarted] == [
        ("trainer-0", 1, "trainer-1: exit code 1"),
        ("trainer-1", 1, "trainer-1: exit code 1"),
    ]


def test_a_failed_leader_stops_its_further_ranks_too(spanning, django_capture_on_commit_callbacks):
    run = spanning
    assert _exit(run, "trainer-0", None, why="the process vanished") == "stopping"
    assert _snapshot(run)["trainer-1"] == (R.RUNNING, 0, 0, True)
    # its collective failed meanwhile: any exit of a role asked to stop is the stop, not a failure of its own
    with django_capture_on_commit_callbacks(execute=False):
        assert _exit(run, "trainer-1", 1) == "restarting"
    assert {n: s[:3] for n, s in _snapshot(run).items()} == {
        "trainer-0": (R.PENDING, 1, 1),
        "trainer-1": (R.PENDING, 1, 1),
    }
    reasons = set(RunEvent.objects.filter(run=run, kind="role_restarted").values_list("payload__reason", flat=True))
    assert reasons == {"the process vanished"}


def test_the_trainer_roles_fail_the_run_once_their_restart_budget_is_spent(
    spanning, django_capture_on_commit_callbacks
):
    run = spanning
    RunRole.objects.filter(run=run, name="trainer-0").update(restarts=2)  # the group's count is its highest
    assert _exit(run, "trainer-1", 1) == "failed"
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == "trainer-1 failed after 2 restarts: exit code 1"
    role = _roles(run)["trainer-0"]  # stopped as any role of an ended run, after its grace
    later = timezone.now() + datetime.timedelta(seconds=supervisor.STOP_GRACE_S)
    assert not role.stop_requested and supervisor.Supervisor("h", 1.0)._should_stop(role, later)


def test_a_further_trainer_role_that_exits_zero_is_done_and_the_run_follows_trainer_0(spanning):
    run = spanning
    assert _exit(run, "trainer-1", 0) == "done"  # trainer-0 stopped its ranks at the end of the run
    run.refresh_from_db()
    assert run.state == RunState.RUNNING
    assert _exit(run, "trainer-0", 0) == "completed"
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    assert {n: s[:3] for n, s in _snapshot(run).items()} == {
        "trainer-0": (R.EXITED, 0, 0),
        "trainer-1": (R.EXITED, 0, 0),
    }


def test_bad_input_of_a_further_trainer_role_fails_the_run_at_once(spanning):
    run = spanning
    role = RunRole.objects.get(run=run, name="trainer-1")
    tail = "error: TANDEM_RANKS: '0-1' includes rank 0, which is trainer-0's\n"
    assert apply.role_exited(role.pk, 0, 2, tail) == "failed"
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == "trainer-1 rejected its input: TANDEM_RANKS: '0-1' includes rank 0, which is trainer-0's"


# --- end to end: a real worker per host, real trainer ranks meeting over gloo ---------------------------

RUN_S = 240.0  # ceiling for each wait on a loaded machine (three ranks, a rollout process, two workers)


def _rank_processes(role: RunRole) -> list[int]:
    """The trainer rank processes a further trainer role started under its runtime process: forked by its fork
    server (runtime/processes.py: a fork of the runtime process, or a fresh ``forkserver`` interpreter), or
    spawned by it under TANDEM_START_METHOD=spawn."""
    from pathlib import Path

    def children(pid: int) -> list[int]:
        try:
            return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    ranks = []
    for runtime in children(role.pid):  # the wrapper's child: python -m runtime role trainer-ranks
        for child in children(runtime):
            if b"spawn_main" in cmdline(child):
                ranks.append(child)
            elif b"resource_tracker" not in cmdline(child):  # the fork server: its children are the ranks
                ranks.extend(children(child))
    return ranks


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_trainer_ranks_on_two_hosts_train_as_one_and_restart_together_after_a_dead_rank(platform, cluster, second_host):
    """3 trainer ranks: ranks 0-1 with trainer-0 on the first host (2 devices), rank 2 as trainer-1 on the
    second. A rank process of trainer-1 is SIGKILLed mid-run: the trainer roles stop and restart together,
    trainer-0 resumes from its newest checkpoint and trainer-1's rank joins it again; then the run is
    stopped, and every step's metrics are there once."""
    import os
    import signal

    import yaml

    from jobs.client import TandemClient
    from jobs.models import CheckpointRecord, Experiment, MetricPoint, RoleHeartbeat, Run
    from rlplatform.models import Quota
    from tests.launch.helpers import e2e_spec, stop_and_wait_for_the_end, wait_for

    quota = Quota.objects.create(
        team=cluster["team"], group=cluster["group"], name="ranks", max_devices=3, max_concurrent_runs=1
    )
    Experiment.objects.create(team=cluster["team"], name="ranks", group=cluster["group"], quota=quota)
    spec = e2e_spec(
        "ranks-on-two-hosts",
        {"trainer_devices": 3, "rollout_workers": 1, "max_restarts": 2},
        {"interval": 2, "keep_last": 1000},
    )  # trainer.collective_timeout_s stays 600 s: a loaded machine may start trainer-0 long after trainer-1
    api = TandemClient(platform.url, cluster["token"])
    created, body = api.submit("ranks", yaml.safe_dump(spec))
    assert created, body
    run = Run.objects.get(pk=body["id"])
    logs = [*platform.logs, second_host["log"]]

    def role_logs():
        from pathlib import Path

        workdirs = set(RunRole.objects.filter(run=run).values_list("workdir", flat=True))
        return sorted(log for workdir in workdirs for log in Path(workdir).glob("roles/*/attempt-*/log"))

    roles = wait_for(lambda: len(_roles(run)) == 2 and _roles(run), "the trainer roles to be placed", 60, logs)
    assert {name: (r.host.name, len(r.device_indices)) for name, r in roles.items()} == {
        "trainer-0": (platform.host_name, 2),
        "trainer-1": (second_host["name"], 1),
    }

    def training(attempt: int):
        run.refresh_from_db()
        assert run.state in (RunState.ADMITTED, RunState.STARTING, RunState.RUNNING), run.reason
        follower = RunRole.objects.get(run=run, name="trainer-1")
        beat = RoleHeartbeat.objects.filter(run=run, role="trainer-1", attempt=attempt, status="running").exists()
        stepped = MetricPoint.objects.filter(run=run, attempt=attempt).exists()
        ranks = follower.attempt == attempt and follower.state == R.RUNNING and _rank_processes(follower)
        return beat and stepped and ranks

    ranks = wait_for(lambda: training(0), "the three ranks to train", RUN_S, logs + role_logs())
    wait_for(lambda: CheckpointRecord.objects.filter(run=run).exists(), "a checkpoint", RUN_S, logs + role_logs())
    os.kill(ranks[0], signal.SIGKILL)  # rank 2 dies
    wait_for(lambda: training(1), "the trainer roles to restart together", RUN_S, logs + role_logs())

    stop_and_wait_for_the_end(api, run, logs + role_logs(), RUN_S)
    ended = {r.name: (r.attempt, r.restarts, r.exit_code, r.host.name) for r in _roles(run).values()}
    assert ended == {
        "trainer-0": (1, 1, 0, platform.host_name),
        "trainer-1": (1, 1, 0, second_host["name"]),  # trainer-0 stopped its rank at the end
    }
    assert RunEvent.objects.filter(run=run, kind="trainer_group_stopping").count() == 1
    resumed = RunEvent.objects.get(run=run, role="trainer-0", attempt=1, kind="resume")
    assert CheckpointRecord.objects.filter(run=run, attempt=0, step=resumed.payload["step"]).exists()
    live = sorted(MetricPoint.objects.filter(run=run).live().values_list("step", flat=True))
    assert live == list(range(1, live[-1] + 1))  # every step once, up to the one it stopped at


def _state(run) -> str:
    run.refresh_from_db()
    return run.state
