"""The dataset task in a run: a short GRPO sync run on a GSM8K-like parquet file with the tiny built-in model,
and bad data found by the CLI's preflight: exit 2 with one line naming the file and row, before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import yaml

from runtime.__main__ import main
from runtime.contract import EXIT_BAD_INPUT
from runtime.pipeline import run
from tests.runtime.helpers import derived, tiny_spec

ROOT = Path(__file__).resolve().parents[3]
datasets.disable_progress_bars()  # writing the test files draws bars on stderr
ROWS = [
    {"question": f"{a}+{b}=", "answer": f"{a} plus {b} is {a + b}\n#### {a + b}"} for a in range(4) for b in range(3)
]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_a_grpo_sync_run_trains_and_evaluates_on_a_parquet_dataset(tmp_path):
    torch.set_num_threads(1)
    data = write_parquet(tmp_path / "train.parquet", ROWS)
    task = {"name": "dataset", "path": str(data), "eval_size": 2, "system_prompt": "Add."}
    base = derived()
    base["task"] = task  # the whole section: a built-in task's sizes are refused with a dataset
    spec = tiny_spec(tmp_path, "gsm", base, pipeline__steps=2, pipeline__eval_interval=2)
    result = run(spec)
    assert result["steps"] == 2
    [evaluation] = [e for e in result["eval"] if e["step"] == 2]
    assert 0.0 <= evaluation["eval/accuracy"] <= 1.0
    recorded = yaml.safe_load((tmp_path / "gsm" / "resolved_spec.yaml").read_text())["task"]
    assert recorded == {
        "name": "dataset",
        "path": str(data),
        "eval_path": None,
        "prompt_key": "question",
        "answer_key": "answer",
        "system_prompt": "Add.",
        "eval_size": 2,
        "seed": 1234,
    }


def _spec_file(tmp_path: Path, task: dict) -> Path:
    data = derived(pipeline={"steps": 2})
    data["task"] = task
    data.update(name="bad", output_dir=str(tmp_path / "out"))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda d: d / "absent.parquet", "task.path: no such file: {path}"),
        (
            lambda d: write_parquet(
                d / "train.parquet", [*ROWS, *ROWS[:4], {"question": "q", "answer": None}, *ROWS[:3]]
            ),
            "task.path: {path} row 17: no answer_key 'answer'",
        ),
        (
            lambda d: write_parquet(d / "train.parquet", [{"problem": "q", "answer": "#### 1"}] * 3),
            "task.path: {path}: no column 'question' (prompt_key); its columns: problem, answer",
        ),
        (
            lambda d: write_parquet(d / "train.parquet", [*ROWS[:4], {"question": "q", "answer": "#### none"}]),
            "task.path: {path} row 5: answer_key 'answer' holds no number: '#### none'",
        ),
    ],
)
def test_bad_data_exits_2_before_any_work_naming_the_file_and_row(tmp_path, capsys, make, problem):
    path = make(tmp_path)
    spec = _spec_file(tmp_path, {"name": "dataset", "path": str(path)})
    assert main(["run", str(spec)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"error: {problem.format(path=path)}\n"
    assert not (tmp_path / "out").exists()  # the preflight found it: nothing was started or written


def test_an_unsupported_file_is_a_field_error_exit_2(tmp_path, capsys):
    spec = _spec_file(tmp_path, {"name": "dataset", "path": str(tmp_path / "train.csv")})
    assert main(["validate", str(spec)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: task.path: Value error, ") and "ends in .jsonl, .json, .parquet, .arrow" in err


def test_the_command_line_exits_2_on_a_malformed_row(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:2], {"question": 5, "answer": "#### 1"}]))
    spec = _spec_file(tmp_path, {"name": "dataset", "path": str(path)})
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", "run", str(spec)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    assert (
        proc.stderr.splitlines()[-1] == f"error: task.path: {path} row 3: prompt_key 'question' is a int, not a string"
    )
