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

:func:`dataset_columns` reads a file's column names without reading its rows (a parquet or arrow file's
schema, a json / jsonl file's first record), so the platform's submit can check the keys with the rule
(:func:`check_keys`) the runtime applies to the whole table, before any work starts.
"""

from __future__ import annotations

import codecs
import json
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


class DatasetFileError(TaskError):
    """A dataset file's problem, its spec field kept apart (``field``, ``problem``) for the platform's field errors;
    its text is ``"<field>: <problem>"`` as every TaskError's."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


def _dataset_file(path: str, field: str) -> tuple[Path, str]:
    """The file at ``path`` and the `datasets` builder of its extension; an unknown extension, a missing or an
    empty file is a DatasetFileError."""
    file = Path(path).expanduser()
    builder = DATASET_FORMATS.get(file.suffix.lower())
    if builder is None:
        raise DatasetFileError(field, f"{path}: the dataset task reads {', '.join(DATASET_FORMATS)} files")
    if not file.is_file():
        raise DatasetFileError(field, f"no such file: {path}")
    if file.stat().st_size == 0:
        raise DatasetFileError(field, f"{path}: the file is empty")
    return file, builder


def load_table(path: str, field: str) -> Any:
    """The rows of a local dataset file as a `datasets.Dataset`; a missing or unreadable file is a TaskError."""
    file, builder = _dataset_file(path, field)
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
    check_keys(list(table.column_names), path, field, prompt_key, answer_key)
    rows: list[Row] = []
    for index, (prompt, answer) in enumerate(_decoded_rows(table, path, field, prompt_key, answer_key), start=1):
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


def _decoded_rows(table: Any, path: str, field: str, prompt_key: str, answer_key: str) -> Any:
    """(prompt, answer) per row; text that is not UTF-8 (pyarrow decodes a row only when it is read) is a
    TaskError naming the row, not a crash."""
    prompts, answers = table[prompt_key], table[answer_key]
    for start in range(0, len(table), _DECODE_ROWS):
        stop = min(start + _DECODE_ROWS, len(table))
        try:
            yield from zip(prompts[start:stop], answers[start:stop], strict=True)
        except UnicodeDecodeError:
            for index in range(start, stop):  # which row: decode them one by one
                try:
                    _ = (prompts[index], answers[index])
                except UnicodeDecodeError:
                    raise TaskError(f"{field}: {path} row {index + 1}: not UTF-8 text") from None
            raise


_DECODE_ROWS = 4096  # rows decoded at once: slices are fast, single rows slow


def check_keys(columns: list[str], path: str, field: str, prompt_key: str, answer_key: str) -> None:
    """A DatasetFileError unless ``columns`` (a dataset file's) hold ``prompt_key`` and ``answer_key``."""
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key not in columns:
            raise DatasetFileError(field, f"{path}: no column {key!r} ({role}); its columns: {', '.join(columns)}")


# How far into a json / jsonl file its first record is looked for: a record longer than this is not judged.
FIRST_RECORD_LIMIT = 8 << 20
_FIRST_CHUNK = 1 << 16
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def dataset_columns(path: str, field: str) -> list[str] | None:
    """The column names of a local dataset file, without reading its rows: a parquet file's schema (its footer),
    an arrow file's schema, a json / jsonl file's first record's keys (a row without a key the others have is
    null there, which :func:`read_dataset` refuses as well). None when the first record runs past
    FIRST_RECORD_LIMIT bytes. A missing, empty or unreadable file is a DatasetFileError naming ``field``; an
    OSError opening or reading it (permissions) propagates: it says nothing about the file's content."""
    file, builder = _dataset_file(path, field)
    if builder == "json":
        return _first_record_keys(file, path, field)
    # imported here: pyarrow comes with the `datasets` library, which only the dataset task needs
    import pyarrow as pa
    import pyarrow.parquet as pq

    with file.open("rb") as handle:
        try:
            if builder == "parquet":
                return list(pq.read_schema(handle).names)
            try:  # `datasets` writes the arrow stream format; the file format is read too, as its builder does
                return list(pa.ipc.open_stream(handle).schema.names)
            except pa.ArrowInvalid:
                handle.seek(0)
                return list(pa.ipc.open_file(handle).schema.names)
        except OSError:
            raise
        except (pa.ArrowException, ValueError) as exc:
            raise DatasetFileError(field, f"{path}: not a readable {file.suffix} file ({_why(exc)})") from None


def _first_record_keys(file: Path, path: str, field: str) -> list[str] | None:
    """The keys of the first record of a JSON Lines file or of a JSON array of records, read a chunk at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    text, read, size, total = "", 0, _FIRST_CHUNK, file.stat().st_size
    with file.open("rb") as handle:
        while True:
            chunk = handle.read(min(size, FIRST_RECORD_LIMIT - read))
            read, size = read + len(chunk), size * 2  # doubling: a long record is parsed a few times, not hundreds
            ended = not chunk or read >= total
            try:
                text += decoder.decode(chunk, final=ended)
            except UnicodeDecodeError:
                raise DatasetFileError(field, f"{path}: not a readable {file.suffix} file (not UTF-8 text)") from None
            body = text.lstrip("\ufeff \t\r\n")  # a byte-order mark, then blank lines
            if body.startswith("["):  # a JSON array of records
                body = body[1:].lstrip()
                if body.startswith("]"):
                    raise DatasetFileError(field, f"{path}: no rows")
            try:
                record, _ = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError as exc:
                if ended:  # the whole file was read: it is malformed, not cut short
                    if not body:
                        raise DatasetFileError(field, f"{path}: no rows") from None
                    why = f"{exc.msg} in the first record"
                    raise DatasetFileError(field, f"{path}: not a readable {file.suffix} file ({why})") from None
                if read >= FIRST_RECORD_LIMIT:
                    return None
                continue
            if not isinstance(record, dict):
                problem = f"its first record is a JSON {_JSON_TYPES[type(record)]}, not an object of columns"
                raise DatasetFileError(field, f"{path}: {problem}")
            return list(record)


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
    # imported here: runtime.models brings torch, which reading a dataset does not need
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
