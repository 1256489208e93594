"""What a role's name says about it (the names themselves are runtime.contract's). Pure."""

from __future__ import annotations

from runtime.contract import EVALUATOR_ROLE, ROLLOUT_PREFIX, TRAINER_PREFIX


def is_rollout(name: str) -> bool:
    """A remote rollout role, ``rollout-<i>``."""
    return name.startswith(ROLLOUT_PREFIX)


def is_trainer(name: str) -> bool:
    """``trainer-0`` or a further trainer role (ranks on another host): they restart together."""
    return name.startswith(TRAINER_PREFIX)


def connects_to_trainer(name: str) -> bool:
    """A remote rollout role or the evaluator: it serves trainer-0 over the link, while the run goes on."""
    return is_rollout(name) or name == EVALUATOR_ROLE


def trainer_index(name: str) -> int:
    """The ``<i>`` of ``trainer-<i>`` (the trainer roles restart in this order)."""
    return int(name.removeprefix(TRAINER_PREFIX))


def rollout_names(count: int) -> list[str]:
    return [f"{ROLLOUT_PREFIX}{i}" for i in range(count)]


def trainer_names(count: int) -> list[str]:
    return [f"{TRAINER_PREFIX}{i}" for i in range(count)]


def role_kind(name: str) -> str:
    """``trainer``, ``rollout`` or ``evaluator``: the role's kind whatever its index (a metrics label)."""
    if is_trainer(name):
        return "trainer"
    if is_rollout(name):
        return "rollout"
    return "evaluator" if name == EVALUATOR_ROLE else "other"
