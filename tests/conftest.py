"""Shared fixtures: personas, a CPU resource group, experiments and quotas, authenticated API clients.

Personas (given / when / then in tests reads as who does what):
  owner     admin of team A          editor   editor in team A
  viewer    viewer in team A         outsider editor in team B (no role in A)
  superuser platform staff, in no team
The ``cpu_group`` (granted to both teams) has two hosts of four CPU devices on
one switch. ``make_group`` builds any other topology; ``make_experiment``
creates an experiment with its own quota.
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    # Personas are created with passwords; PBKDF2 costs about a second per user on a loaded
    # 2-core machine. pytest-django has loaded the settings module by now; no test needs a slow hash.
    from django.conf import settings

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    _flush_retries_a_deadlock()


FLUSH_ATTEMPTS = 5


def _flush_retries_a_deadlock() -> None:
    """A transactional test ends by TRUNCATE-ing every table, while the real Celery worker and server of the
    platform tests may still be reading some (heartbeats, supervision, admission). TRUNCATE locks the tables
    one by one, so PostgreSQL can find it and such a reader in a deadlock and cancel the TRUNCATE, which rolls
    back whole: it is then simply run again (the reader's transaction went on and ended)."""
    from django.core.management.base import CommandError
    from django.core.management.commands import flush

    handle = flush.Command.handle

    def retrying(self, *args, **options):
        for attempt in range(FLUSH_ATTEMPTS):
            try:
                return handle(self, *args, **options)
            except CommandError as exc:
                if attempt == FLUSH_ATTEMPTS - 1 or "deadlock detected" not in str(exc.__cause__):
                    raise

    flush.Command.handle = retrying


SPEC_1_DEVICE = "name: tiny\nresources:\n  device: cpu\n  trainer_devices: 1\n"


def spec_for(devices: int = 1, *, device: str = "cpu", rollout_workers: int = 1, name: str = "tiny") -> str:
    """A valid spec asking for ``devices`` trainer devices; more than one rollout instance makes it an async
    run (the only mode they act in), with a rollout device of its own on an accelerator."""
    text = f"name: {name}\nresources:\n  device: {device}\n  trainer_devices: {devices}\n"
    text += f"  rollout_workers: {rollout_workers}\n"
    if rollout_workers == 1:
        return text
    return "pipeline:\n  mode: async\n" + text + ("  rollout_devices: 1\n" if device != "cpu" else "")


@pytest.fixture
def make_user(db, django_user_model):
    def make(username: str, **extra):
        return django_user_model.objects.create_user(username=username, password=f"{username}-pass-123", **extra)

    return make


@pytest.fixture
def api_as(db):
    """api_as(user) -> a DRF APIClient authenticated as ``user`` (force_authenticate: no login, no CSRF)."""
    from rest_framework.test import APIClient

    def make(user):
        client = APIClient()
        client.force_authenticate(user)
        return client

    return make


@pytest.fixture
def team_a(db):
    from rlplatform.models import Team

    return Team.objects.create(name="team-a")


@pytest.fixture
def team_b(db):
    from rlplatform.models import Team

    return Team.objects.create(name="team-b")


def _member(make_user, team, username, role):
    from rlplatform.models import Membership

    user = make_user(username)
    Membership.objects.create(team=team, user=user, role=role)
    return user


@pytest.fixture
def owner(make_user, team_a):
    return _member(make_user, team_a, "owner", "admin")


@pytest.fixture
def editor(make_user, team_a):
    return _member(make_user, team_a, "editor", "editor")


@pytest.fixture
def viewer(make_user, team_a):
    return _member(make_user, team_a, "viewer", "viewer")


@pytest.fixture
def outsider(make_user, team_b):
    return _member(make_user, team_b, "outsider", "editor")


@pytest.fixture
def superuser(db, django_user_model):
    return django_user_model.objects.create_superuser(
        username="root", password="root-pass-123", email="root@example.com"
    )


@pytest.fixture
def make_group(db):
    """make_group(name, kind="cpu", hosts=[("h1", 4, "sw1"), ...], teams=[...]) -> ResourceGroup."""
    from rlplatform.models import Device, Host, ResourceGroup

    def make(name="group", kind="cpu", hosts=(("h1", 4, "sw1"),), teams=(), device_model="test-device"):
        group = ResourceGroup.objects.create(name=name, kind=kind, device_model=device_model)
        group.teams.set(teams)
        for host_name, n_devices, switch in hosts:
            labels = {"rack": "r1", "switch": switch} if switch else {}
            host = Host.objects.create(group=group, name=f"{name}-{host_name}", address="127.0.0.1", labels=labels)
            Device.objects.bulk_create(
                Device(host=host, index=i, kind=kind, model=device_model, memory_mb=1024) for i in range(n_devices)
            )
        return group

    return make


@pytest.fixture
def cpu_group(make_group, team_a, team_b):
    return make_group("cpu-local", "cpu", hosts=[("h1", 4, "sw1"), ("h2", 4, "sw1")], teams=[team_a, team_b])


@pytest.fixture
def make_experiment(db):
    """make_experiment(team, group, name="exp", **quota_limits) -> Experiment with its own quota."""
    from jobs.models import Experiment
    from rlplatform.models import Quota

    def make(team, group, name="exp", **limits):
        values = {"max_devices": 8, "max_concurrent_runs": 4, "max_rollout_workers": 64, "priority": 0}
        values.update(limits)
        quota = Quota.objects.create(team=team, group=group, name=name, **values)
        return Experiment.objects.create(team=team, name=name, group=group, quota=quota)

    return make


@pytest.fixture
def experiment(make_experiment, team_a, cpu_group, owner):
    """Team A's experiment in the CPU group: 8 devices, 4 concurrent runs."""
    return make_experiment(team_a, cpu_group, "exp-a")


@pytest.fixture
def experiment_b(make_experiment, team_b, cpu_group, outsider):
    """Team B's experiment in the same CPU group."""
    return make_experiment(team_b, cpu_group, "exp-b")


@pytest.fixture
def spec():
    """spec(devices=1, device="cpu", rollout_workers=1, name="tiny") -> YAML text of a valid run spec."""
    return spec_for


@pytest.fixture
def submit(db, owner):
    """submit(experiment, devices=1, **kwargs) -> Run, submitted by the team-A owner through the handler."""
    from jobs import handler

    def do(experiment, devices=1, *, actor=None, rollout_workers=1, **kwargs):
        run, _created = handler.submit_run(
            actor or owner, experiment, spec_for(devices, rollout_workers=rollout_workers), **kwargs
        )
        return run

    return do


@pytest.fixture
def complete(db):
    """complete(run): walk an ADMITTED run through STARTING and RUNNING to COMPLETED (frees its devices)."""
    from jobs import handler
    from jobs.states import RunState

    def do(run):
        for state in (RunState.STARTING, RunState.RUNNING, RunState.COMPLETED):
            handler.transition(run, state)
        return run

    return do


@pytest.fixture
def start(db):
    """start(run): walk an ADMITTED run to RUNNING."""
    from jobs import handler
    from jobs.states import RunState

    def do(run):
        for state in (RunState.STARTING, RunState.RUNNING):
            handler.transition(run, state)
        run.refresh_from_db()
        return run

    return do


@pytest.fixture
def run(experiment, submit, start):
    """Team A's RUNNING run (one CPU device)."""
    return start(submit(experiment))
