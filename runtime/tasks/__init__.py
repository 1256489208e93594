"""Tasks: prompt sets and rule verifiers. :func:`build_task` turns a TaskSpec into a :class:`Task`."""

from __future__ import annotations

from typing import Any

from runtime.tasks.base import Task, TaskError
from runtime.tasks.builtin import GENERATORS, BuiltinTask, draw_size
from runtime.tasks.dataset import DatasetTask
from runtime.tasks.jsonl import JsonlTask, read_rows
from runtime.tasks.verifiers import VERIFIERS, get_verifier


def build_task(task_spec: Any, model_path: str | None = None) -> Task:
    """The task described by a runtime.spec.TaskSpec (a dataset file is read and checked here). ``model_path``:
    the model directory whose tokenizer's chat template the dataset task applies with ``task.chat_template``."""
    if task_spec.name == "dataset":
        return DatasetTask(task_spec, model_path)
    if task_spec.name == "jsonl":
        if not task_spec.path:
            raise TaskError("task.path: task `jsonl` needs a JSONL file")
        return JsonlTask(task_spec.path, task_spec.eval_path, task_spec.verifier, task_spec.eval_size, task_spec.seed)
    return BuiltinTask(
        task_spec.name, task_spec.train_size, task_spec.eval_size, task_spec.min_len, task_spec.max_len, task_spec.seed
    )


__all__ = [
    "GENERATORS",
    "VERIFIERS",
    "BuiltinTask",
    "DatasetTask",
    "JsonlTask",
    "Task",
    "TaskError",
    "build_task",
    "draw_size",
    "get_verifier",
    "read_rows",
]
