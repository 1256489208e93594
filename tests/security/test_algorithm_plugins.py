"""A spec names no code the operator has not allowed (issue "structure": every knob does what it says).

``algorithm.name: package.module:factory`` makes every host of the run import that module. On the platform a
plug-in is refused at submit (a 400 naming ``algorithm.name``) and again when a role starts, unless its module
is under a prefix in ``TANDEM_ALGORITHM_PLUGINS`` (none by default). Registered algorithms need no allowing.
"""

from __future__ import annotations

import pytest

from jobs import confinement, handler
from jobs.models import Run


def _spec(algorithm: str) -> str:
    return f"name: plug\nalgorithm:\n  name: '{algorithm}'\n"


def _submit(as_user, owner, team_a, spec):
    return as_user(owner, team_a).post("/api/runs/", {"experiment": "exp-a", "spec": spec}, format="json")


def test_a_plugin_is_refused_by_default_naming_the_field_and_how_to_allow_it(as_user, owner, team_a, experiment):
    response = _submit(as_user, owner, team_a, _spec("os:getcwd"))

    assert response.status_code == 400
    [error] = response.json()["errors"]
    assert error["field"] == "algorithm.name"
    assert "'os'" in error["message"] and "TANDEM_ALGORITHM_PLUGINS" in error["message"]
    assert Run.objects.count() == 0


@pytest.mark.parametrize(
    ("algorithm", "status"),
    [
        ("team_algos:make", 201),  # the package itself
        ("team_algos.variants.clipped:make", 201),  # a module inside it
        ("team_algos_evil:make", 400),  # a name that only starts alike
        ("os:getcwd", 400),  # anything else stays refused
        ("grpo", 201),  # registered algorithms import nothing
    ],
)
def test_only_modules_under_an_allowed_prefix_are_accepted(
    as_user, owner, team_a, experiment, settings, algorithm, status
):
    settings.TANDEM_ALGORITHM_PLUGINS = ["team_algos"]

    response = _submit(as_user, owner, team_a, _spec(algorithm))

    assert response.status_code == status, response.content
    if status == 400:
        assert [e["field"] for e in response.json()["errors"]] == ["algorithm.name"]


def test_a_plugin_no_longer_allowed_is_refused_when_the_role_starts(
    owner, experiment, settings, checkpoint_root, django_capture_on_commit_callbacks
):
    """Checked again at role start: an operator who withdraws a prefix stops queued runs importing it."""
    from jobs import launch, supervisor
    from jobs.models import RoleState
    from jobs.states import RunState

    settings.TANDEM_ALGORITHM_PLUGINS = ["team_algos"]
    run, _ = handler.submit_run(owner, experiment, _spec("team_algos:make"))
    assert run.state == RunState.ADMITTED
    with django_capture_on_commit_callbacks(execute=False):
        role = launch.launch_run(run.pk)
    settings.TANDEM_ALGORITHM_PLUGINS = []

    assert supervisor.start_role(role.pk, 0) == "refused"
    run.refresh_from_db()
    role.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason.startswith("trainer-0 rejected its input: algorithm.name: plug-in module 'team_algos'")
    assert (role.state, role.exit_code, role.pid) == (RoleState.EXITED, 2, None)


def test_the_allow_list_matches_whole_module_names():
    from django.test import override_settings

    with override_settings(TANDEM_ALGORITHM_PLUGINS=["a.b", " c. "]):
        assert [confinement.plugin_allowed(m) for m in ("a.b", "a.b.x", "a", "a.bx", "c", "c.d", "")] == [
            True,
            True,
            False,
            False,
            True,
            True,
            False,
        ]


@pytest.mark.parametrize(("entry_point", "status"), [("os:getcwd", 400), ("team_envs.grid:make_env", 201)])
def test_a_gym_env_entry_point_is_confined_like_a_plugin_and_a_registered_env_is_not(
    as_user, owner, team_a, experiment, settings, entry_point, status
):
    settings.TANDEM_ALGORITHM_PLUGINS = ["team_envs"]
    spec = f"name: env\nworkload: gym\nenv:\n  entry_point: '{entry_point}'\n"

    response = _submit(as_user, owner, team_a, spec)

    assert response.status_code == status, response.content
    if status == 400:
        [error] = response.json()["errors"]
        assert error["field"] == "env.entry_point" and "TANDEM_ALGORITHM_PLUGINS" in error["message"]
    registered = _submit(as_user, owner, team_a, "name: cartpole\nworkload: gym\nenv:\n  id: CartPole-v1\n")
    assert registered.status_code == 201, registered.content
