"""Every input error the runtime can meet exits with the bad-input code (2) and one line naming the file.

The platform fails a run whose role exits 2 once, with that line, and blames no host (jobs.launch); any
other non-zero exit is a crash that is retried and, when repeated, excludes the host. So a malformed
dataset row, a missing model directory or a broken tokenizer file must never exit 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.contract import EXIT_BAD_INPUT
from runtime.models import build_policy, save_hf
from runtime.spec import load_spec
from tests.runtime.helpers import TINY

ROOT = Path(__file__).resolve().parents[2]


def _spec_file(tmp_path: Path, **sections: dict) -> Path:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    data.update(name="bad-input", output_dir=str(tmp_path / "out"))
    data["pipeline"] = {**data["pipeline"], "steps": 2}
    for section, values in sections.items():
        data[section] = values if section in ("model", "task") else {**data.get(section, {}), **values}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A loadable Hugging Face directory of the tiny built-in model (char tokenizer, HF tokenizer files)."""
    model, tokenizer = build_policy(load_spec({**TINY, "name": "m"}).model, "cpu", seed=0)
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("model") / "policy")


def _copy_model(model_dir: Path, into: Path) -> Path:
    into.mkdir()
    for item in model_dir.iterdir():
        (into / item.name).write_bytes(item.read_bytes())
    return into


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ('{"prompt": "abc"', "not valid JSON"),
        ('["abc", "cba"]', "a row must be a JSON object with `prompt` and `answer`"),
        ('{"prompt": "abc"}', "missing `answer`"),
        ('{"prompt": "", "answer": "x"}', "`prompt` must be a non-empty string"),
    ],
)
def test_a_malformed_dataset_row_exits_2_naming_the_file_and_row(tmp_path, row, problem):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "ab", "answer": "ba"}\n' + row + "\n")
    spec = _spec_file(tmp_path, task={"name": "jsonl", "path": str(data), "verifier": "exact"})
    proc = _run("run", str(spec))
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"error: {data}:2: {problem}")
    assert not (tmp_path / "out" / "checkpoints").exists()  # found before any work


def test_a_malformed_dataset_row_exits_2_in_a_platform_role(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "ab", "answer": "ba"}\n{"prompt": "cd", "answer": true}\n')
    spec = _spec_file(tmp_path, task={"name": "jsonl", "path": str(data), "verifier": "exact"})
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {
        "TANDEM_PLATFORM_URL": "http://127.0.0.1:9",  # nothing listens: the role fails before it reports
        "TANDEM_RUN_TOKEN": "tdr_unused",
        "TANDEM_RUN_ID": "1",
        "TANDEM_ROLE": "trainer-0",
        "TANDEM_ATTEMPT": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", "role", "trainer", "--spec", str(spec), "--workdir", str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, **env},
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    assert _error_lines(proc) == [f"error: {data}:2: `answer` must be a string or a number"]


def test_a_missing_model_directory_exits_2_naming_it(tmp_path):
    spec = _spec_file(tmp_path, model={"path": str(tmp_path / "no-model")})
    proc = _run("run", str(spec))
    assert proc.returncode == EXIT_BAD_INPUT
    assert _error_lines(proc) == [f"error: model.path: no such model directory: {tmp_path / 'no-model'}"]


def test_a_model_directory_without_weights_exits_2_naming_it(tmp_path, model_dir):
    broken = _copy_model(model_dir, tmp_path / "model")
    (broken / "model.safetensors").unlink()
    spec = _spec_file(tmp_path, model={"path": str(broken)})
    proc = _run("run", str(spec))
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"error: model.path: cannot load {broken}: ")


@pytest.mark.parametrize(
    ("lora", "problem"),
    [
        ({"r": 4, "target_modules": ["q_proj", "qkv_proj"]}, "model.lora.target_modules: 'qkv_proj' matches no"),
        ({"r": 4, "init_path": "/no/adapter"}, "model.lora.init_path: /no/adapter is not a PEFT adapter"),
    ],
)
def test_lora_that_does_not_fit_the_model_directory_exits_2_naming_the_field(tmp_path, model_dir, lora, problem):
    spec = _spec_file(tmp_path, model={"path": str(model_dir), "lora": lora})
    proc = _run("run", str(spec))
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"error: {problem}"), line


@pytest.mark.parametrize(
    ("file", "content"),
    [
        ("char_tokenizer.json", '{"type": "char", "chars": '),  # cut short
        ("char_tokenizer.json", '["not", "an", "object"]'),
        ("char_tokenizer.json", '{"type": "char", "chars": 42}'),
    ],
)
def test_a_broken_char_tokenizer_file_exits_2_naming_the_file(tmp_path, model_dir, file, content):
    broken = _copy_model(model_dir, tmp_path / "model")
    (broken / file).write_text(content)
    spec = _spec_file(tmp_path, model={"path": str(broken)})
    proc = _run("run", str(spec))
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"error: model.path: {broken / file}: not a char tokenizer file")


def test_a_broken_hf_tokenizer_file_exits_2_naming_the_directory(tmp_path, model_dir):
    broken = _copy_model(model_dir, tmp_path / "model")
    (broken / "char_tokenizer.json").unlink()  # so the Hugging Face tokenizer files are read
    (broken / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "nonsense"}}))
    spec = _spec_file(tmp_path, model={"path": str(broken)})
    proc = _run("run", str(spec))
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    [line] = _error_lines(proc)
    assert line.startswith(f"error: model.path {broken}: no usable tokenizer (")
