"""The ``dataset`` task: math problems from a local jsonl / json / parquet / arrow file, scored by the math verifier.

Files are read with the `datasets` library's packaged builders (``load_dataset("parquet", data_files=...)``)
and never from the hub: the library is put in offline mode, and its Arrow cache goes to a temporary directory
removed after the read, so nothing is left in ``~/.cache`` and two runs never share a cache entry.

Each row needs ``prompt_key`` (default ``question``), a non-empty string, and ``answer_key`` (default
``answer``), a string or number in which the math verifier finds a number (GSM8K's ``... #### 72`` reads 72;
runtime.tasks.math_verify). Other columns are ignored. The prompt's answer keeps the whole reference text, so
the SFT warm start trains on GSM8K's worked solutions while the verifier compares final numbers.

A prompt is the question, after ``system_prompt`` and a blank line when one is set; with ``chat_template``
it is the model tokenizer's chat template applied to ``[system, user]`` messages, with the generation
prompt added (the text ends where the assistant's reply starts).

Every problem is a TaskError naming the field, the file and the row (rows count from 1, in file order; a
JSONL file's blank lines are not rows): ``task.path: train.parquet row 17: no answer_key 'answer'``.
Without ``eval_path`` the held-out prompts are a seeded split of ``path``: ``min(eval_size, rows // 5)`` rows,
at least one, as for the jsonl task.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.samples import Prompt
from runtime.spec import DATASET_FORMATS
from runtime.tasks.base import Task, TaskError
from runtime.tasks.math_verify import extract_answer, verify_math

Row = tuple[str, str]  # (prompt text as read, reference answer text)


def _offline_datasets() -> Any:
    """The `datasets` library, set never to reach the hub."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read when the library is first imported ...
    import datasets  # imported here: it brings pyarrow and pandas, which nothing else of a run needs

    datasets.config.HF_HUB_OFFLINE = True  # ... and this at each call, should something have imported it before
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def _why(exc: BaseException) -> str:
    """The innermost message of an exception chain (`datasets` wraps pyarrow's parse errors)."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def load_table(path: str, field: str) -> Any:
    """The rows of a local dataset file as a `datasets.Dataset`; a missing or unreadable file is a TaskError."""
    file = Path(path).expanduser()
    builder = DATASET_FORMATS.get(file.suffix.lower())
    if builder is None:
        raise TaskError(f"{field}: {path}: the dataset task reads {', '.join(DATASET_FORMATS)} files")
    if not file.is_file():
        raise TaskError(f"{field}: no such file: {path}")
    if file.stat().st_size == 0:
        raise TaskError(f"{field}: {path}: the file is empty")
    datasets = _offline_datasets()
    with tempfile.TemporaryDirectory(prefix="tandem-datasets-") as cache:
        try:
            return datasets.load_dataset(
                builder, data_files=str(file), split="train", cache_dir=cache, keep_in_memory=True
            )
        except Exception as exc:  # noqa: BLE001 - pyarrow, pandas and datasets each raise their own types
            raise TaskError(f"{field}: {path}: not a readable {file.suffix} file ({_why(exc)})") from None


def read_dataset(path: str, field: str, prompt_key: str, answer_key: str) -> list[Row]:
    """(prompt, answer) of each row of a dataset file, validated row by row."""
    table = load_table(path, field)
    columns = list(table.column_names)
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key not in columns:
            raise TaskError(f"{field}: {path}: no column {key!r} ({role}); its columns: {', '.join(columns)}")
    rows: list[Row] = []
    prompts, answers = table[prompt_key], table[answer_key]
    for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True), start=1):
        where = f"{field}: {path} row {index}"
        if prompt is None:
            raise TaskError(f"{where}: no prompt_key {prompt_key!r}")
        if not isinstance(prompt, str):
            raise TaskError(f"{where}: prompt_key {prompt_key!r} is a {type(prompt).__name__}, not a string")
        if not prompt.strip():
            raise TaskError(f"{where}: prompt_key {prompt_key!r} is empty")
        if answer is None:
            raise TaskError(f"{where}: no answer_key {answer_key!r}")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise TaskError(f"{where}: answer_key {answer_key!r} is a {type(answer).__name__}, not a string or number")
        answer = str(answer)
        if extract_answer(answer) is None:
            raise TaskError(f"{where}: answer_key {answer_key!r} holds no number: {answer[-80:]!r}")
        rows.append((prompt, answer))
    if not rows:
        raise TaskError(f"{field}: {path}: no rows")
    return rows


def split_rows(rows: list[Row], eval_size: int, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, held out): ``min(eval_size, len // 5)`` rows (at least one) drawn with ``seed``, file order kept."""
    n_eval = max(1, min(eval_size, len(rows) // 5))
    order = list(range(len(rows)))
    random.Random(f"dataset:{seed}").shuffle(order)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def chat_formatter(model_path: str | None, system_prompt: str | None) -> Callable[[str], str]:
    """The function that turns a question into the text given to the model with the model tokenizer's chat
    template; a TaskError when there is no tokenizer with one."""
    # imported here: runtime.models brings torch and transformers, which reading a dataset does not need
    from runtime.models.tokenizer import CHAR_FILE, load_tokenizer

    if model_path is None:
        raise TaskError("task.chat_template: the task was built without the model directory whose tokenizer it needs")
    if (Path(model_path) / CHAR_FILE).is_file():
        raise TaskError(f"task.chat_template: {model_path} has the character tokenizer, which has no chat template")
    try:
        tokenizer = load_tokenizer(model_path)
    except ValueError as exc:
        raise TaskError(f"task.chat_template: {exc}") from None
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise TaskError(f"task.chat_template: the tokenizer in {model_path} has no chat template")
    # A template that writes the bos token itself would give it twice when encoding adds one too.
    bos = hf.bos_token if tokenizer.bos_id is not None and hf.encode("x")[:1] == [tokenizer.bos_id] else None

    def format_prompt(question: str) -> str:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": question})
        text = str(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return text.removeprefix(bos) if bos else text

    return format_prompt


def plain_formatter(system_prompt: str | None) -> Callable[[str], str]:
    """The question as is, after the system prompt and a blank line when there is one."""
    return (lambda q: f"{system_prompt}\n\n{q}") if system_prompt else (lambda q: q)


class DatasetTask(Task):
    name = "dataset"

    def __init__(self, task_spec: Any, model_path: str | None = None):
        """``task_spec``: a runtime.spec.TaskSpec with name ``dataset``; ``model_path``: the model directory whose
        tokenizer's chat template wraps the prompts (read only with ``task_spec.chat_template``)."""
        super().__init__(verify_math)
        s = task_spec
        self.eval_size, self.seed = s.eval_size, s.seed
        # read now: a bad file fails before any work starts
        self._rows = read_dataset(s.path, "task.path", s.prompt_key, s.answer_key)
        self._eval_rows = (
            read_dataset(s.eval_path, "task.eval_path", s.prompt_key, s.answer_key) if s.eval_path else None
        )
        if self._eval_rows is None and len(self._rows) < 2:
            raise TaskError(
                f"task.path: {s.path}: at least 2 rows are needed to split off eval prompts (or set task.eval_path)"
            )
        self.format = (
            chat_formatter(model_path, s.system_prompt) if s.chat_template else plain_formatter(s.system_prompt)
        )

    def _build(self) -> tuple[list[Prompt], list[Prompt]]:
        if self._eval_rows is not None:
            train_rows, eval_rows = self._rows, self._eval_rows[: self.eval_size]
        else:
            train_rows, eval_rows = split_rows(self._rows, self.eval_size, self.seed)
        fmt = self.format
        train = [Prompt(prompt_id=i, text=fmt(p), answer=a) for i, (p, a) in enumerate(train_rows)]
        first = len(train)
        evals = [Prompt(prompt_id=first + i, text=fmt(p), answer=a) for i, (p, a) in enumerate(eval_rows)]
        return train, evals
