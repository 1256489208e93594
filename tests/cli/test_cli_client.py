"""The CI client against a live test server: --wait exit codes, errors, and every subcommand."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import client
from jobs.models import Run
from jobs.states import RunState

ROOT = Path(__file__).resolve().parents[2]
SPEC = "name: ci-run\nresources:\n  device: cpu\n  trainer_devices: 2\n"

S = RunState


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


@pytest.mark.parametrize(
    "steps,expected_code,final",
    [
        ([(S.STARTING, ""), (S.RUNNING, ""), (S.COMPLETED, "")], client.EXIT_OK, "COMPLETED"),
        ([(S.STARTING, ""), (S.FAILED, "trainer rank 0 exited with code 1")], client.EXIT_FAILED, "FAILED"),
        ([(S.CANCELLED, "cancelled by owner")], client.EXIT_CANCELLED, "CANCELLED"),
        ([(S.PREEMPTED, "preempted by a priority-100 run")], client.EXIT_PREEMPTED, "PREEMPTED"),
    ],
)
def test_submit_wait_exit_code_follows_the_final_state(
    cli, experiment, spec_file, drive_run, steps, expected_code, final
):
    sid = f"ci-{final.lower()}"
    drive_run(sid, steps)
    code, out, err = cli(
        "submit", str(spec_file), "--experiment", "exp-a", "--submission-id", sid, "--wait", "--timeout", "60"
    )
    assert code == expected_code, (out, err)
    run = Run.objects.get(submission_id=sid)
    assert run.state == final
    assert out.splitlines()[0].startswith(f"submitted run {run.pk}  ADMITTED  experiment=exp-a")
    assert out.splitlines()[-1].startswith(f"run {run.pk}  {final}")


def test_wait_times_out_with_its_own_exit_code(cli, experiment, spec_file):
    code, out, _err = cli("submit", str(spec_file), "--experiment", "exp-a", "--wait", "--timeout", "1")
    assert code == client.EXIT_TIMEOUT
    run = Run.objects.get()
    assert run.state == RunState.ADMITTED
    assert out.splitlines()[-1] == f"timed out waiting for run {run.pk} (still ADMITTED)"


def test_wait_subcommand_on_a_run_that_finishes_later(cli, experiment, spec_file, drive_run):
    code, out, _ = cli("submit", str(spec_file), "--experiment", "exp-a", "--submission-id", "w-1")
    assert code == client.EXIT_OK
    run = Run.objects.get()
    drive_run("w-1", [(S.STARTING, ""), (S.RUNNING, ""), (S.COMPLETED, "")], delay_s=1.0)
    code, out, _ = cli("wait", str(run.pk), "--timeout", "60")
    assert code == client.EXIT_OK
    assert out.strip() == f"run {run.pk}  COMPLETED  experiment=exp-a"


def test_resubmitting_with_the_same_submission_id_reuses_the_run(cli, experiment, spec_file):
    first = cli("submit", str(spec_file), "--experiment", "exp-a", "--submission-id", "pipeline-9")
    second = cli("submit", str(spec_file), "--experiment", "exp-a", "--submission-id", "pipeline-9")
    run = Run.objects.get()
    assert (first[0], second[0]) == (0, 0)
    assert second[1].startswith(f"already submitted (same submission id) run {run.pk}")


def test_rejected_spec_prints_each_field_error(cli, experiment, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pipeline:\n  mode: turbo\nresources:\n  trainer_devices: -2\n")
    code, out, err = cli("submit", str(path), "--experiment", "exp-a", "--wait")
    assert code == client.EXIT_REJECTED
    assert err == (
        "error: HTTP 400 rejected:\n"
        "  pipeline.mode: Input should be 'sync', 'async' or 'colocated'\n"
        "  resources.trainer_devices: Input should be greater than or equal to 1\n"
    )
    assert Run.objects.count() == 0


def test_unknown_experiment_is_rejected(cli, experiment, spec_file):
    code, _out, err = cli("submit", str(spec_file), "--experiment", "nope")
    assert code == client.EXIT_REJECTED
    assert "  experiment: no experiment 'nope' in your teams" in err


def test_bad_token_has_its_own_exit_code(cli, experiment, spec_file):
    code, _out, err = cli("status", "1", token="tdm_deadbeef_wrong")
    assert code == client.EXIT_AUTH
    assert err == (
        "error: HTTP 401 authentication failed (missing, unknown, expired or revoked token):\n"
        "  invalid, expired or revoked token\n"
    )


def test_connection_refused_is_reported(cli):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _out, err = cli("status", "1", url=f"http://127.0.0.1:{port}")
    assert code == client.EXIT_CONNECTION
    assert err.startswith(f"error: cannot reach http://127.0.0.1:{port}: ")
    assert "Connection refused" in err


def test_status_list_cancel_and_not_found(cli, experiment, spec_file, submit):
    run = submit(experiment, 2)
    code, out, _ = cli("status", str(run.pk))
    assert (code, out) == (0, f"run {run.pk}  ADMITTED  experiment=exp-a\n")
    code, out, _ = cli("list", "--experiment", "exp-a", "--state", "ADMITTED")
    assert (code, out) == (0, f"run {run.pk}  ADMITTED  experiment=exp-a\n(1 of 1 runs)\n")
    code, out, _ = cli("cancel", str(run.pk))
    assert code == 0
    assert out.startswith(f"cancelled run {run.pk}  CANCELLED")
    code, _, err = cli("cancel", str(run.pk))
    assert code == client.EXIT_CONFLICT
    assert f"run {run.pk} cannot move from CANCELLED to CANCELLED" in err
    code, _, _ = cli("status", "999999")
    assert code == client.EXIT_NOT_FOUND
    code, _, _ = cli("wait", str(run.pk))
    assert code == client.EXIT_CANCELLED


def test_unreadable_spec_file_is_a_usage_error(cli, tmp_path):
    code, _out, err = cli("submit", str(tmp_path / "missing.yaml"), "--experiment", "exp-a")
    assert code == client.EXIT_USAGE
    assert err.startswith(f"cannot read spec file {tmp_path / 'missing.yaml'}")


def test_module_entry_point_reads_url_and_token_from_the_environment(live_server, ci_token, experiment, submit):
    run = submit(experiment)
    env = {**os.environ, "TANDEM_URL": live_server.url, "TANDEM_TOKEN": ci_token}
    done = subprocess.run(
        [sys.executable, "-m", "jobs.client", "--json", "status", str(run.pk)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert '"state": "ADMITTED"' in done.stdout
    help_text = subprocess.run(
        [sys.executable, "-m", "jobs.client", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    assert "13  --timeout passed before the run reached a terminal state" in help_text


def test_a_long_wait_sees_the_end_of_a_run_that_ends_while_it_waits(cli, experiment, spec_file, drive_run):
    # The run ends ~2.5 s into the wait: the server's waiter, parked without a database connection
    # (jobs.longpoll; tests/security/test_load_limits.py counts the connections), is woken by the end.
    drive_run("slow-1", [(S.STARTING, ""), (S.RUNNING, ""), (S.COMPLETED, "")], delay_s=2.5)
    code, out, _ = cli("submit", str(spec_file), "--experiment", "exp-a", "--submission-id", "slow-1", "--wait")
    assert code == client.EXIT_OK
    assert out.splitlines()[-1].startswith("run ") and "COMPLETED" in out.splitlines()[-1]


def test_error_bodies_print_one_line_per_error():
    # the request as a whole (401, 403, 404, 409) by its message; a field error (400) with its field
    refused = {"detail": "Not found.", "errors": [{"field": "request", "message": "Not found."}]}
    assert client.format_error_body(refused) == "  Not found."
    rejected = {"errors": [{"field": "spec", "message": "required"}, {"field": "priority", "message": "too high"}]}
    assert client.format_error_body(rejected) == "  spec: required\n  priority: too high"
    assert client.format_error_body({"detail": "down"}) == "  down"  # a server from before the errors shape
