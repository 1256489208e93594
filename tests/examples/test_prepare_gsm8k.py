"""examples/prepare_gsm8k.py: GSM8K's parquet layout in, the recipe's files out, read back by the dataset task."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime.tasks.dataset import read_dataset
from runtime.tasks.math_verify import extract_answer

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", ROOT / "examples" / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source(tmp_path: Path, train: list[dict], test: list[dict]) -> Path:
    main = tmp_path / "gsm8k" / "main"
    main.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(train[:1]), main / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(train[1:]), main / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(test), main / "test-00000-of-00001.parquet")
    return tmp_path / "gsm8k"


TRAIN = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A shelf holds 1,200 books; 200 leave.", "answer": "1,200 - 200 = 1,000\n#### 1,000"},
]
TEST = [{"question": "Half of 10?", "answer": "10 / 2 = 5\n#### 5"}]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_prepared_files_are_what_the_dataset_task_reads(tmp_path, fmt):
    out = tmp_path / "out"
    code = _script().main(["--source", str(_source(tmp_path, TRAIN, TEST)), "--out", str(out), "--format", fmt])
    assert code == 0
    train = read_dataset(str(out / f"train.{fmt}"), "task.path", "question", "answer")
    test = read_dataset(str(out / f"test.{fmt}"), "task.eval_path", "question", "answer")
    # shards concatenated in name order; GSM8K's `#### x` answers parsed, thousands separators included
    assert [prompt for prompt, _ in train] == [row["question"] for row in TRAIN]
    assert [answer for _, answer in train] == [row["answer"] for row in TRAIN]
    assert [extract_answer(answer) for _, answer in train + test] == [7, 1000, 5]


def test_a_row_without_a_readable_answer_names_file_and_row_and_writes_nothing(tmp_path, capsys):
    bad = [TRAIN[0], {"question": "What?", "answer": "no idea"}]
    out = tmp_path / "out"
    code = _script().main(["--source", str(_source(tmp_path, bad, TEST)), "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "train-00001-of-00002.parquet row 1" in err and "holds no number" in err
    assert not out.exists()
