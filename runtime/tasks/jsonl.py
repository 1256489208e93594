"""User datasets: JSONL files of ``{"prompt": ..., "answer": ...}`` rows scored by a named verifier.

A row may carry other keys (ignored). ``answer`` may be a string or a number. Blank lines are skipped.
Any bad row is a TaskError naming the file and line. Without ``eval_path`` the held-out set is a
seeded random split of ``path``: ``min(eval_size, rows // 5)`` rows (at least one). ``train_size``
does not apply: every remaining row is a training prompt.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from runtime.samples import Prompt
from runtime.tasks.base import Task, TaskError
from runtime.tasks.verifiers import get_verifier, last_boxed, parse_number


def read_rows(path: str | Path, verifier: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a JSONL file, validated row by row."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TaskError(f"task.path: no such file: {path}")
    rows: list[tuple[str, str]] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{where}: a row must be a JSON object with `prompt` and `answer`")
            for key in ("prompt", "answer"):
                if key not in row:
                    raise TaskError(f"{where}: missing `{key}`")
            prompt, answer = row["prompt"], row["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise TaskError(f"{where}: `prompt` must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                raise TaskError(f"{where}: `answer` must be a string or a number")
            answer = str(answer)
            if verifier == "numeric" and parse_number(answer) is None:
                raise TaskError(f"{where}: `answer` {answer!r} is not a number (verifier `numeric`)")
            if verifier == "boxed" and not (last_boxed(answer) or answer.strip()):
                raise TaskError(f"{where}: `answer` is empty (verifier `boxed`)")
            rows.append((prompt, answer))
    if not rows:
        raise TaskError(f"{path}: no rows")
    return rows


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, path: str, eval_path: str | None, verifier: str, eval_size: int, seed: int):
        super().__init__(get_verifier(verifier))
        self.path, self.eval_path, self.verifier_name = path, eval_path, verifier
        self.eval_size, self.seed = eval_size, seed
        self._rows = read_rows(path, verifier)  # read now: a bad file fails before any work starts
        self._eval_rows = read_rows(eval_path, verifier) if eval_path else None
        if self._eval_rows is None and len(self._rows) < 2:
            raise TaskError(f"{path}: at least 2 rows are needed to split off eval prompts (or set task.eval_path)")

    def _build(self) -> tuple[list[Prompt], list[Prompt]]:
        if self._eval_rows is not None:
            train_rows, eval_rows = self._rows, self._eval_rows[: self.eval_size]
        else:
            n_eval = max(1, min(self.eval_size, len(self._rows) // 5))
            order = list(range(len(self._rows)))
            random.Random(f"jsonl:{self.seed}").shuffle(order)
            held = set(order[:n_eval])
            train_rows = [r for i, r in enumerate(self._rows) if i not in held]
            eval_rows = [self._rows[i] for i in sorted(held)]
        train = [Prompt(prompt_id=i, text=p, answer=a) for i, (p, a) in enumerate(train_rows)]
        first = len(train)
        evals = [Prompt(prompt_id=first + i, text=p, answer=a) for i, (p, a) in enumerate(eval_rows)]
        return train, evals
