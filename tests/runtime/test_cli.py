"""The runtime CLI: examples validate; bad input is one line naming the field, exit 2, before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.__main__ import main
from runtime.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PLATFORM = ("django", "rest_framework", "channels", "celery", "rlplatform", "jobs")


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_five_examples_exist():
    assert {p.name for p in EXAMPLES} >= {
        "grpo-sync.yaml",
        "grpo-async.yaml",
        "grpo-colocated.yaml",
        "ppo-sync.yaml",
        "hf-model-dir.yaml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path, capsys):
    assert main(["validate", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == load_spec(path).resolved()


def test_validate_as_a_subprocess_imports_no_platform_module():
    proc = _cli("validate", "examples/grpo-async.yaml", "pipeline.max_policy_lag=3")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["pipeline"]["max_policy_lag"] == 3
    code = (
        "import sys, runtime.pipeline.driver, runtime.__main__; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PLATFORM!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _bad(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    return code, lines


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["pipeline.modee=sync"], "pipeline.modee"),
        (["pipeline.mode=turbo"], "pipeline.mode"),
        (["pipeline.mode=colocated", "resources.rollout_devices=2"], "resources.rollout_devices"),
        (["algorithm.group_size=1"], "algorithm.group_size"),
        (["model.path=/nonexistent/model"], "model.path"),
        (["resources.device=cuda"], "cuda"),
        (["task.name=jsonl", "task.path=/nonexistent.jsonl", "task.max_len=8"], "task.path"),  # max_len: built-ins only
        (["algorithm.name=nosuch"], "nosuch"),
        (["pipeline.queue_capacity=4"], "pipeline.queue_capacity"),
        (["resources.trainer_devices=64", "pipeline.prompts_per_step=2"], "resources.trainer_devices"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_field(capsys, tmp_path, overrides, field):
    out_dir = tmp_path / "out"
    code, lines = _bad(capsys, ["run", str(ROOT / "examples/grpo-sync.yaml"), f"output_dir={out_dir}", *overrides])
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0]
    assert not out_dir.exists()  # no work started


def test_missing_spec_file(capsys, tmp_path):
    code, lines = _bad(capsys, ["run", str(tmp_path / "nope.yaml")])
    assert code == 2 and len(lines) == 1 and "no such spec file" in lines[0]


def test_resume_from_a_directory_without_checkpoints(capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, lines = _bad(
        capsys, ["run", str(ROOT / "examples/grpo-sync.yaml"), f"output_dir={out_dir}", "--resume", str(tmp_path)]
    )
    assert code == 2 and len(lines) == 1 and "--resume" in lines[0]
    assert not out_dir.exists()


def test_corrupt_checkpoint_is_refused_before_any_work(capsys, tmp_path):
    from runtime.checkpoint import CheckpointManager

    ckpt = CheckpointManager(tmp_path / "ckpts").save(3, {"pipeline": {"step": 3}})
    state_file = next((ckpt / "state").iterdir())
    state_file.write_bytes(state_file.read_bytes()[:-5])  # truncated
    out_dir = tmp_path / "out"
    code, lines = _bad(
        capsys, ["run", str(ROOT / "examples/grpo-sync.yaml"), f"output_dir={out_dir}", "--resume", str(ckpt)]
    )
    assert code == 2 and len(lines) == 1 and "truncated" in lines[0]
    assert not out_dir.exists()
    code, lines = _bad(capsys, ["eval", "--checkpoint", str(ckpt)])
    assert code == 2 and "truncated" in lines[0]


def test_override_after_an_option_is_accepted(capsys, tmp_path):
    code, lines = _bad(
        capsys, ["run", str(ROOT / "examples/grpo-sync.yaml"), "--resume", str(tmp_path), "pipeline.mode=bad"]
    )
    assert code == 2 and "pipeline.mode" in lines[0]


def test_bad_input_from_a_subprocess_has_no_traceback():
    proc = _cli("run", "examples/grpo-sync.yaml", "pipeline.steps=0")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: pipeline.steps")


def test_sft_then_run_then_eval_through_the_cli(capsys, tmp_path):
    """The warm-start -> RL -> evaluation path a user follows, on the smallest budget."""
    import json

    small = ["task.eval_size=4", "task.train_size=64", "rollout.max_new_tokens=4", "resources.threads_per_process=1"]
    model_dir = tmp_path / "sft"
    assert main(["sft", str(ROOT / "examples/grpo-sync.yaml"), *small, "--steps", "2", "--out", str(model_dir)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"model_dir": str(model_dir)}
    assert (model_dir / "config.json").is_file()

    out_dir = tmp_path / "run"
    argv = ["run", str(ROOT / "examples/hf-model-dir.yaml"), f"model.path={model_dir}", f"output_dir={out_dir}"]
    argv += [*small, "pipeline.steps=1", "pipeline.prompts_per_step=2", "algorithm.group_size=2"]
    assert main([*argv, "metrics.progress_bar=false"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["final"]["weights/version"] == 1
    assert (out_dir / "resolved_spec.yaml").is_file()

    assert main(["eval", "--checkpoint", str(out_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["checkpoint"] == summary["checkpoint"]
    assert 0.0 <= result["eval/accuracy"] <= 1.0
