"""Making environments: by registered id or a user's entry point, and the field errors for what goes wrong."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from runtime.workloads.gym.envs import (
    EnvSpecError,
    SpaceInfo,
    check_algorithm,
    describe_spaces,
    episode_seed,
    make_env,
    make_vector_env,
    to_env_actions,
    worker_seeds,
)

USER = "tests.runtime.workloads.gym.user_envs"


def test_a_registered_id_makes_the_env_and_describes_its_spaces():
    env = make_env("CartPole-v1")
    assert isinstance(env, gym.Env)
    assert describe_spaces(env) == SpaceInfo(obs_dim=4, action_kind="discrete", action_dim=2)
    pendulum = describe_spaces(make_env("Pendulum-v1"))
    assert (pendulum.action_kind, pendulum.action_dim) == ("box", 1)
    assert (pendulum.action_low, pendulum.action_high) == ((-2.0,), (2.0,))


def test_kwargs_reach_a_registered_env():
    env = make_env("CartPole-v1", kwargs={"max_episode_steps": 7})
    assert env.spec is not None and env.spec.max_episode_steps == 7


def test_an_entry_point_makes_the_users_env_with_its_kwargs():
    env = make_env(entry_point=f"{USER}:make_env", kwargs={"max_steps": 2})
    env.reset(seed=0)
    env.step(0)
    _, _, terminated, truncated, _ = env.step(0)
    assert (terminated, truncated) == (False, True)
    assert describe_spaces(env, "env.entry_point").obs_dim == 2


@pytest.mark.parametrize(
    ("env_id", "words"),
    [
        ("NoSuchEnv-v0", "not a registered Gymnasium environment"),
        ("CartPole-v9", "not a registered Gymnasium environment"),
        ("NoSuchNamespace/Thing-v0", "not a registered Gymnasium environment"),
    ],
)
def test_an_unknown_id_is_an_env_id_error(env_id, words):
    with pytest.raises(EnvSpecError, match=words) as err:
        make_env(env_id)
    assert err.value.field == "env.id"
    assert str(err.value).startswith("env.id: ")
    assert isinstance(err.value, ValueError)


def test_a_kwarg_the_registered_env_does_not_take_is_an_env_kwargs_error():
    with pytest.raises(EnvSpecError, match="unexpected keyword") as err:
        make_env("CartPole-v1", kwargs={"gravity_scale": 2})
    assert err.value.field == "env.kwargs"


@pytest.mark.parametrize(
    ("entry_point", "field", "words"),
    [
        ("no_colon_here", "env.entry_point", "not of the form"),
        (":make_env", "env.entry_point", "not of the form"),
        ("tests.runtime.workloads.gym.no_such_module:make_env", "env.entry_point", "does not import"),
        (f"{USER}:no_such_factory", "env.entry_point", "has no callable 'no_such_factory'"),
        (f"{USER}:NOT_CALLABLE", "env.entry_point", "has no callable 'NOT_CALLABLE'"),
        (f"{USER}:make_not_an_env", "env.entry_point", "returned a dict, not a gymnasium.Env"),
        (f"{USER}:make_failing_env", "env.entry_point", "raised RuntimeError: simulator licence not found"),
    ],
)
def test_a_bad_entry_point_is_an_env_entry_point_error(entry_point, field, words):
    with pytest.raises(EnvSpecError, match=words) as err:
        make_env(entry_point=entry_point)
    assert err.value.field == field


def test_kwargs_the_entry_point_does_not_take_are_an_env_kwargs_error():
    with pytest.raises(EnvSpecError, match="does not take these kwargs") as err:
        make_env(entry_point=f"{USER}:make_env", kwargs={"gravity": 1})
    assert err.value.field == "env.kwargs"


def test_exactly_one_of_id_and_entry_point():
    for args in ({}, {"env_id": "CartPole-v1", "entry_point": f"{USER}:make_env"}):
        with pytest.raises(EnvSpecError, match="exactly one"):
            make_env(**args)


def test_dqn_refuses_box_actions_and_ppo_takes_both():
    box = describe_spaces(make_env("Pendulum-v1"))
    discrete = describe_spaces(make_env("CartPole-v1"))
    with pytest.raises(EnvSpecError, match="Box action space does not suit dqn, which needs Discrete") as err:
        check_algorithm(box, "dqn", "env.id")
    assert err.value.field == "env.id"
    check_algorithm(box, "ppo")
    check_algorithm(discrete, "ppo")
    check_algorithm(discrete, "dqn")
    with pytest.raises(ValueError, match="not a control algorithm"):
        check_algorithm(discrete, "grpo")


def test_an_unsupported_observation_space_is_refused():
    with pytest.raises(EnvSpecError, match="observation space Discrete") as err:
        describe_spaces(make_env("FrozenLake-v1"), "env.id")
    assert err.value.field == "env.id"


def test_seeds_differ_across_workers_and_repeat_for_the_same_worker():
    assert worker_seeds(7, 0, 3) == worker_seeds(7, 0, 3)
    assert len(set(worker_seeds(7, 0, 3) + worker_seeds(7, 1, 3) + worker_seeds(8, 0, 3))) == 9
    assert episode_seed(5, 0) != episode_seed(5, 1)


def test_the_vector_env_holds_num_envs_copies():
    envs = make_vector_env(lambda: make_env("CartPole-v1"), 3)
    assert envs.num_envs == 3
    with pytest.raises(ValueError, match="num_envs"):
        make_vector_env(lambda: make_env("CartPole-v1"), 0)


def test_actions_go_to_the_env_numbered_from_the_space_start_or_clipped_to_its_bounds():
    discrete = SpaceInfo(obs_dim=1, action_kind="discrete", action_dim=3, action_start=-1)
    assert to_env_actions(discrete, torch.tensor([0, 2]), np.int64).tolist() == [-1, 1]
    box = SpaceInfo(obs_dim=1, action_kind="box", action_dim=2, action_low=(-1.0, 0.0), action_high=(1.0, 5.0))
    got = to_env_actions(box, torch.tensor([[3.0, -2.0], [0.5, 2.5]]), np.float32)
    assert got.dtype == np.float32 and got.tolist() == [[1.0, 0.0], [0.5, 2.5]]
