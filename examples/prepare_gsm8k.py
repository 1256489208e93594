"""Turn GSM8K's parquet files (openai/gsm8k, config `main`) into the local files examples/gsm8k-grpo-qwen2.5.yaml
reads: ``train`` and ``test`` tables with the columns ``question`` and ``answer`` (the answer ending in
``#### <number>``), each row checked the way the run's `dataset` task will read it. Offline: it reads files
you downloaded before (docs/recipes/gsm8k-qwen2.5.md says how) and fetches nothing.

    python examples/prepare_gsm8k.py --source /data/gsm8k-raw --out /data/gsm8k            # parquet
    python examples/prepare_gsm8k.py --train T.parquet --test E.parquet --out DIR --format jsonl

``--source`` is the downloaded dataset directory: its ``main/train-*.parquet`` and ``main/test-*.parquet``
(several shards of a split are concatenated in name order). A row whose question is empty or whose answer
holds no number the math verifier can read is an error naming the file and row, and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.tasks.math_verify import extract_answer  # noqa: E402

COLUMNS = ("question", "answer")  # GSM8K's own names, and the recipe's task.prompt_key / task.answer_key


class PrepareError(ValueError):
    """A source file or row the recipe could not train on; the message names the file and row."""


def split_files(source: Path, split: str) -> list[Path]:
    """The parquet shards of ``split`` in a downloaded openai/gsm8k directory (config ``main``)."""
    files = sorted((source / "main").glob(f"{split}-*.parquet"))
    if not files:
        raise PrepareError(f"--source: no {split}-*.parquet under {source / 'main'}")
    return files


def read_rows(files: list[Path]) -> list[dict[str, str]]:
    """The ``question`` / ``answer`` rows of ``files``, in order, each checked (rows count from 1 per file)."""
    rows: list[dict[str, str]] = []
    for file in files:
        if not file.is_file():
            raise PrepareError(f"{file}: no such file")
        table = pq.read_table(file)
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise PrepareError(f"{file}: no column {', '.join(missing)}; its columns: {', '.join(table.column_names)}")
        for number, row in enumerate(table.select(list(COLUMNS)).to_pylist(), start=1):
            question, answer = row["question"], row["answer"]
            if not isinstance(question, str) or not question.strip():
                raise PrepareError(f"{file} row {number}: the question is empty or not text")
            if not isinstance(answer, str) or extract_answer(answer) is None:
                raise PrepareError(f"{file} row {number}: the answer holds no number: {str(answer)[-80:]!r}")
            rows.append({"question": question, "answer": answer})
    if not rows:
        raise PrepareError(f"{', '.join(map(str, files))}: no rows")
    return rows


def write_rows(rows: list[dict[str, str]], path: Path) -> None:
    """``rows`` as parquet or JSON lines, by ``path``'s extension."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, help="a downloaded openai/gsm8k directory (holding main/*.parquet)")
    ap.add_argument("--train", type=Path, nargs="+", help="train parquet file(s), instead of --source")
    ap.add_argument("--test", type=Path, nargs="+", help="test parquet file(s), instead of --source")
    ap.add_argument("--out", type=Path, required=True, help="directory to write train.<format> and test.<format>")
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = ap.parse_args(argv)
    if (args.source is None) == (args.train is None or args.test is None):
        ap.error("give --source, or both --train and --test")
    try:
        splits = {
            "train": args.train or split_files(args.source, "train"),
            "test": args.test or split_files(args.source, "test"),
        }
        tables = {split: read_rows(files) for split, files in splits.items()}  # all checked before any write
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for split, rows in tables.items():
        path = args.out / f"{split}.{args.format}"
        write_rows(rows, path)
        print(f"{path}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
