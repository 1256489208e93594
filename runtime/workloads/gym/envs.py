"""Environments: one from a spec's ``env`` section, a description of its spaces, and a vector env of copies.

An environment is named either by ``env.id`` (any id registered with Gymnasium, ``gymnasium.make``)
or by ``env.entry_point`` ``"pkg.module:make_env"``, a callable that returns a ``gymnasium.Env``
(a user's own simulator); ``env.kwargs`` go to either. What goes wrong is an :class:`EnvSpecError`
naming the field, raised before any work starts.

Observations must be a ``Box`` (flattened to a vector); actions ``Discrete`` or a 1-D ``Box``, and
each algorithm takes only the kinds it can act in (:data:`ACTION_KINDS`).

Seeds: a worker's environments get seeds drawn from ``numpy.random.SeedSequence((seed, worker))``,
so workers and runs never share a stream; :func:`episode_seed` seeds each episode of one copy.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import Tensor

from runtime.workloads.gym.errors import EnvSpecError

ActionKind = Literal["discrete", "box"]

# What each algorithm can act in: DQN picks an action by argmax over a finite set.
ACTION_KINDS: dict[str, tuple[ActionKind, ...]] = {"ppo": ("discrete", "box"), "dqn": ("discrete",)}
_SPACE_NAMES: dict[str, str] = {"discrete": "Discrete", "box": "Box"}


@dataclass(frozen=True)
class SpaceInfo:
    """What the networks and the sampler need of an env's spaces."""

    obs_dim: int  # length of the flattened observation
    action_kind: ActionKind
    action_dim: int  # Discrete: number of actions; Box: length of the action vector
    action_start: int = 0  # Discrete: the first action's number (Discrete(n, start))
    action_low: tuple[float, ...] | None = None  # Box: bounds, -inf / inf where unbounded
    action_high: tuple[float, ...] | None = None


def make_env(
    env_id: str | None = None, entry_point: str | None = None, kwargs: Mapping[str, Any] | None = None
) -> gym.Env:
    """A new environment named by exactly one of ``env_id`` and ``entry_point``, built with ``kwargs``."""
    if (env_id is None) == (entry_point is None):
        raise EnvSpecError("env.id", "give exactly one of env.id and env.entry_point")
    kwargs = dict(kwargs or {})
    if env_id is not None:
        return _make_registered(env_id, kwargs)
    assert entry_point is not None
    return _make_from_entry_point(entry_point, kwargs)


def env_field(env_id: str | None) -> str:
    """The spec field that named the environment (for errors about the env itself)."""
    return "env.id" if env_id is not None else "env.entry_point"


def describe_spaces(env: gym.Env, field: str = "env.id") -> SpaceInfo:
    """The flattened observation size and the action space of ``env``; ``field`` names it in errors."""
    obs_space, act_space = env.observation_space, env.action_space
    if not isinstance(obs_space, gym.spaces.Box):
        raise EnvSpecError(field, f"observation space {obs_space} is not supported (a Box is)")
    obs_dim = math.prod(obs_space.shape)
    if isinstance(act_space, gym.spaces.Discrete):
        return SpaceInfo(obs_dim, "discrete", int(act_space.n), action_start=int(act_space.start))
    if isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1:
        low = tuple(float(x) for x in act_space.low)
        high = tuple(float(x) for x in act_space.high)
        return SpaceInfo(obs_dim, "box", int(act_space.shape[0]), action_low=low, action_high=high)
    raise EnvSpecError(field, f"action space {act_space} is not supported (Discrete or a 1-D Box is)")


def check_algorithm(space: SpaceInfo, algorithm: str, field: str = "env.id") -> None:
    """Raise :class:`EnvSpecError` when ``algorithm`` cannot act in ``space``'s action space."""
    kinds = ACTION_KINDS.get(algorithm)
    if kinds is None:
        raise ValueError(f"algorithm.name: {algorithm!r} is not a control algorithm ({', '.join(ACTION_KINDS)})")
    if space.action_kind not in kinds:
        wanted = " or ".join(_SPACE_NAMES[k] for k in kinds)
        got = _SPACE_NAMES[space.action_kind]
        raise EnvSpecError(field, f"its {got} action space does not suit {algorithm}, which needs {wanted} actions")


def make_vector_env(
    make_one: Callable[[], gym.Env],
    num_envs: int,
    autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP,
) -> SyncVectorEnv:
    """``num_envs`` copies stepped together in this process (Gymnasium's default autoreset, NEXT_STEP).

    Not reset here: the sampler resets it with per-episode seeds."""
    if num_envs < 1:
        raise ValueError("env.num_envs must be >= 1")
    return SyncVectorEnv([make_one] * num_envs, autoreset_mode=autoreset_mode)


def worker_seeds(seed: int, worker: int, count: int) -> list[int]:
    """``count`` seeds for worker ``worker`` of a run seeded ``seed``: distinct streams per (seed, worker)."""
    return [int(s) for s in np.random.SeedSequence((seed, worker)).generate_state(count, dtype=np.uint32)]


def episode_seed(env_seed: int, episode: int) -> int:
    """The reset seed of episode ``episode`` (0, 1, ...) of the copy seeded ``env_seed``."""
    return int(np.random.SeedSequence((env_seed, episode)).generate_state(1, dtype=np.uint32)[0])


def to_env_actions(space: SpaceInfo, actions: Tensor, dtype: Any) -> np.ndarray:
    """A policy's actions ``[E]`` / ``[E, A]`` as the env takes them: Discrete numbered from the space's
    start, Box clipped to its bounds (the policy's Gaussian is unbounded), in the space's ``dtype``."""
    if space.action_kind == "discrete":
        return (actions.numpy().astype(np.int64) + space.action_start).astype(dtype)
    assert space.action_low is not None and space.action_high is not None
    low = np.asarray(space.action_low, dtype=np.float32)
    high = np.asarray(space.action_high, dtype=np.float32)
    return np.clip(actions.numpy(), low, high).astype(dtype)


# --------------------------------------------------------------------------- internals


def _make_registered(env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    try:
        return gym.make(env_id, **kwargs)
    except gym.error.UnregisteredEnv as exc:  # NameNotFound, VersionNotFound, NamespaceNotFound
        raise EnvSpecError("env.id", f"{env_id!r} is not a registered Gymnasium environment ({exc})") from None
    except gym.error.DependencyNotInstalled as exc:
        raise EnvSpecError("env.id", f"{env_id!r} needs a package that is not installed ({exc})") from None
    except Exception as exc:  # the env's constructor failed: with kwargs given, most likely on them
        field = "env.kwargs" if kwargs else "env.id"
        raise EnvSpecError(field, f"making {env_id!r} raised {type(exc).__name__}: {exc}") from None


def _make_from_entry_point(entry_point: str, kwargs: dict[str, Any]) -> gym.Env:
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise EnvSpecError("env.entry_point", f"{entry_point!r} is not of the form 'pkg.module:make_env'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing the user's module is theirs to fix
        raise EnvSpecError(
            "env.entry_point", f"module {module_name!r} does not import ({type(exc).__name__}: {exc})"
        ) from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise EnvSpecError("env.entry_point", f"module {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise EnvSpecError("env.kwargs", f"{entry_point} does not take these kwargs ({exc})") from None
    except ValueError:  # no signature to read (some builtins): let the call decide
        pass
    try:
        env = factory(**kwargs)
    except Exception as exc:
        raise EnvSpecError("env.entry_point", f"{entry_point} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(env, gym.Env):
        raise EnvSpecError("env.entry_point", f"{entry_point} returned a {type(env).__name__}, not a gymnasium.Env")
    return env
