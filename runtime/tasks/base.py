"""The task interface: prompts for training and evaluation, and a rule that scores a response."""

from __future__ import annotations

from collections.abc import Callable

from runtime.samples import Prompt


class TaskError(ValueError):
    """A task cannot be built (bad dataset file, bad row, bad setting); the message names file and line."""


class Task:
    """Prompts plus a verifier. Reward is 1.0 for a correct response, 0.0 otherwise.

    Prompt lists are built once, deterministically from the task spec's seed; train prompt ids are
    0..N-1 in list order, eval prompt ids follow them (N..N+M-1), so an id never names two prompts.
    """

    name = "task"

    def __init__(self, verifier: Callable[[str, str], bool]):
        self.verifier = verifier
        self._train: list[Prompt] | None = None
        self._eval: list[Prompt] | None = None

    def _build(self) -> tuple[list[Prompt], list[Prompt]]:
        raise NotImplementedError

    def _ensure(self) -> None:
        if self._train is None or self._eval is None:
            self._train, self._eval = self._build()

    def train_prompts(self) -> list[Prompt]:
        self._ensure()
        assert self._train is not None
        return list(self._train)

    def eval_prompts(self) -> list[Prompt]:
        self._ensure()
        assert self._eval is not None
        return list(self._eval)

    def score(self, prompt: Prompt, response_text: str) -> tuple[float, bool]:
        """(reward, correct) of ``response_text`` (the decoded response, stop token removed)."""
        correct = bool(self.verifier(response_text, prompt.answer))
        return (1.0 if correct else 0.0), correct
