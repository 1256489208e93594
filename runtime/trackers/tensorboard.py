"""TensorBoard: scalars per step in ``<output_dir>/tensorboard/``, the spec and events as text (TensorBoard
keeps no artifacts: a checkpoint is its event's text, naming the directory)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"


def params_table(params: Mapping[str, str]) -> str:
    """The parameters as a Markdown table (TensorBoard's text plugin renders it)."""
    rows = [f"| {key} | {value.replace('|', '&#124;')} |" for key, value in sorted(params.items())]
    return "\n".join(["| field | value |", "|---|---|", *rows])


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: str | Path, params: Mapping[str, str]):
        self.log_dir = Path(log_dir)
        self._params = dict(params)
        self._writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only for a run that asks

        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        if self._params:
            self._writer.add_text("spec", params_table(self._params), global_step=0)

    def log_metrics(self, step: int, metrics: Mapping[str, float | int]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        step = payload.get("step")
        self._writer.add_text(
            f"event/{kind}",
            json.dumps(dict(payload), sort_keys=True),
            global_step=step if isinstance(step, int) else None,
        )

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
