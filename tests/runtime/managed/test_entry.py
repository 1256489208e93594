"""`python -m runtime role trainer`: bad input is one line naming the variable or field, exit 2, before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.__main__ import main
from runtime.contract import TRAINER_ROLE
from runtime.managed.entry import DEFAULT_HEARTBEAT_S, RoleInputError, read_env

ROOT = Path(__file__).resolve().parents[3]
GOOD_ENV = {
    "TANDEM_PLATFORM_URL": "http://127.0.0.1:9",
    "TANDEM_RUN_TOKEN": "tdr_abc_secret",
    "TANDEM_RUN_ID": "7",
    "TANDEM_ATTEMPT": "0",
}
SPEC = "name: tiny\nmodel:\n  builtin: tiny-qwen2\npipeline:\n  steps: 2\n"


@pytest.fixture
def env(monkeypatch):
    """The four required variables set (to a platform nobody listens on); tests remove or spoil one."""
    for name in [*GOOD_ENV, "TANDEM_ROLE", "TANDEM_HOST_NAME", "TANDEM_HEARTBEAT_S"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in GOOD_ENV.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def _role(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(["role", *argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("name", list(GOOD_ENV))
def test_a_missing_variable_is_named(env, capsys, spec_file, tmp_path, name):
    env.delenv(name)
    workdir = tmp_path / "work"
    code, lines = _role(capsys, "trainer", "--spec", str(spec_file), "--workdir", str(workdir))
    assert (code, lines) == (2, [f"error: {name}: required"])
    assert not workdir.exists()  # no work started


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("TANDEM_PLATFORM_URL", "ftp://host", "TANDEM_PLATFORM_URL: 'ftp://host' does not parse as http(s)"),
        ("TANDEM_PLATFORM_URL", "http://host:99999", "TANDEM_PLATFORM_URL: 'http://host:99999' does not parse"),
        ("TANDEM_ATTEMPT", "-1", "TANDEM_ATTEMPT: must be an integer >= 0, got '-1'"),
        ("TANDEM_ATTEMPT", "first", "TANDEM_ATTEMPT: must be an integer >= 0, got 'first'"),
        ("TANDEM_HEARTBEAT_S", "0", "TANDEM_HEARTBEAT_S: must be a number of seconds > 0, got '0'"),
        ("TANDEM_HEARTBEAT_S", "nan", "TANDEM_HEARTBEAT_S: must be a number of seconds > 0, got 'nan'"),
        ("TANDEM_HEARTBEAT_S", "often", "TANDEM_HEARTBEAT_S: must be a number of seconds > 0, got 'often'"),
        ("TANDEM_ROLE", "r" * 101, "TANDEM_ROLE: at most 100 characters"),
    ],
)
def test_an_invalid_variable_is_named(env, capsys, spec_file, tmp_path, name, value, message):
    env.setenv(name, value)
    workdir = tmp_path / "work"
    code, lines = _role(capsys, "trainer", "--spec", str(spec_file), "--workdir", str(workdir))
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {message}")
    assert not workdir.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "error: the following arguments are required: role, --spec, --workdir"),
        (["trainer", "--spec", "SPEC"], "error: the following arguments are required: --workdir"),
        (
            ["judge", "--spec", "SPEC", "--workdir", "WORK"],
            "error: role: 'judge' is not one of trainer, trainer-ranks, rollout, evaluator",
        ),
        (
            ["rollout", "--spec", "SPEC", "--workdir", "WORK"],
            "error: TANDEM_ROLE: a rollout role is named rollout-<index>, got 'trainer-0'",
        ),
        (
            ["trainer", "--spec", "SPEC", "--workdir", "WORK", "--resume", "always"],
            "error: argument --resume: invalid choice: 'always' (choose from 'auto', 'never')",
        ),
        (["trainer", "--spec", "SPEC", "--workdir", "WORK", "--rank", "0"], "error: unrecognized arguments: --rank 0"),
        (["trainer", "--spec", "SPEC", "--work", "WORK"], "error: the following arguments are required: --workdir"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(env, capsys, spec_file, tmp_path, argv, message):
    workdir = tmp_path / "work"
    argv = [str(spec_file) if a == "SPEC" else str(workdir) if a == "WORK" else a for a in argv]
    code, lines = _role(capsys, *argv)
    assert (code, lines) == (2, [message])
    assert not workdir.exists()


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({}, "TANDEM_RANKS: required (the trainer ranks this host runs, first-last)"),
        ({"TANDEM_RANKS": "0-1"}, "TANDEM_RANKS: '0-1' includes rank 0, which is trainer-0's"),
        ({"TANDEM_RANKS": "3-4"}, "TANDEM_RANKS: '3-4' is not within the run's ranks 0-3"),
        ({"TANDEM_RANKS": "two"}, "TANDEM_RANKS: expected first-last, e.g. 0-3, got 'two'"),
        ({"TANDEM_RANKS": "2-3"}, "MASTER_ADDR: required (trainer-0's rendezvous)"),
        ({"TANDEM_RANKS": "2-3", "MASTER_ADDR": "10.0.0.1"}, "MASTER_PORT: required (trainer-0's rendezvous)"),
    ],
)
def test_trainer_ranks_of_a_further_host_are_checked_with_the_variable_named(env, capsys, tmp_path, variables, message):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(SPEC + "resources:\n  trainer_devices: 4\n")
    for name in ("TANDEM_RANKS", "MASTER_ADDR", "MASTER_PORT"):
        env.delenv(name, raising=False)
    for name, value in variables.items():
        env.setenv(name, value)
    env.setenv("TANDEM_ROLE", "trainer-1")
    code, lines = _role(capsys, "trainer-ranks", "--spec", str(spec_file), "--workdir", str(tmp_path / "work"))
    assert (code, lines) == (2, [f"error: {message}"])


def test_an_evaluator_role_of_a_run_that_evaluates_inside_its_trainer_is_bad_input(env, capsys, spec_file, tmp_path):
    env.setenv("TANDEM_ROLE", "evaluator")
    code, lines = _role(capsys, "evaluator", "--spec", str(spec_file), "--workdir", str(tmp_path / "work"))
    assert (code, lines) == (2, ["error: resources.remote_evaluator: false; this run evaluates inside its trainer"])


def test_a_missing_spec_file_is_named(env, capsys, tmp_path):
    code, lines = _role(capsys, "trainer", "--spec", str(tmp_path / "nope.yaml"), "--workdir", str(tmp_path / "w"))
    assert (code, lines) == (2, [f"error: --spec: no such file: {tmp_path / 'nope.yaml'}"])


def test_a_workdir_that_is_a_file_is_refused(env, capsys, spec_file, tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    code, lines = _role(capsys, "trainer", "--spec", str(spec_file), "--workdir", str(afile))
    assert (code, lines) == (2, [f"error: --workdir: {afile} is not a directory"])
    assert afile.read_text() == "x"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (SPEC + "  mode: turbo\n", "pipeline.mode"),
        (SPEC + "bogus: 1\n", "bogus: unknown field"),
        (SPEC + "algorithm:\n  group_size: 1\n", "algorithm.group_size"),
        (SPEC + "algorithm:\n  name: nosuch\n", "nosuch"),
        ("name: [unclosed\n", "spec: malformed YAML"),
        (SPEC + "metrics: 3\n", "metrics"),
    ],
)
def test_a_bad_spec_is_the_runtimes_one_line(env, capsys, tmp_path, text, field):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(text)
    workdir = tmp_path / "work"
    code, lines = _role(capsys, "trainer", "--spec", str(spec_file), "--workdir", str(workdir))
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("error: ") and field in lines[0]
    assert not workdir.exists()


def test_a_corrupt_command_log_is_named(env, capsys, spec_file, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "commands.jsonl").write_text('{"id": 1, "state": "done", "message": ""}\nnot json\n{"id": 2}\n')
    code, lines = _role(capsys, "trainer", "--spec", str(spec_file), "--workdir", str(workdir), "--resume", "never")
    assert (code, lines) == (2, [f"error: {workdir / 'commands.jsonl'}: line 2 is not a command record"])
    assert sorted(p.name for p in workdir.iterdir()) == ["commands.jsonl"]  # nothing else written


def test_defaults_and_the_token_is_read_from_the_environment_only():
    env = read_env({**GOOD_ENV, "TANDEM_PLATFORM_URL": "https://platform.example:8443/"})
    assert env.platform_url == "https://platform.example:8443"
    assert (env.token, env.run_id, env.attempt) == ("tdr_abc_secret", "7", 0)
    assert (env.role, env.heartbeat_s) == (TRAINER_ROLE, DEFAULT_HEARTBEAT_S)
    assert env.host  # this machine's name when TANDEM_HOST_NAME is unset
    env = read_env({**GOOD_ENV, "TANDEM_ROLE": "trainer-1", "TANDEM_HOST_NAME": "h7", "TANDEM_HEARTBEAT_S": "0.2"})
    assert (env.role, env.host, env.heartbeat_s) == ("trainer-1", "h7", 0.2)
    with pytest.raises(RoleInputError, match="^TANDEM_RUN_TOKEN: required$"):
        read_env({**GOOD_ENV, "TANDEM_RUN_TOKEN": "  "})


def test_bad_input_from_a_subprocess_is_one_line_without_traceback(tmp_path, spec_file):
    env = {k: v for k, v in GOOD_ENV.items() if k != "TANDEM_RUN_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime",
            "role",
            "trainer",
            "--spec",
            str(spec_file),
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, "error: TANDEM_RUN_TOKEN: required\n", "")
