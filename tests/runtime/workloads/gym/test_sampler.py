"""The sampler: real transitions only across episode ends, the right final observations, per-step
versions, same-seed determinism, and an exact continuation from its checkpoint state."""

from __future__ import annotations

import pytest
import torch
from gymnasium.vector import AutoresetMode

from runtime.workloads.gym.envs import SpaceInfo, describe_spaces, episode_seed, make_env, make_vector_env, worker_seeds
from runtime.workloads.gym.learners import PPOConfig, PPOLearner, sampling_policy
from runtime.workloads.gym.sampler import FixedPolicy, SamplerError, SegmentSampler
from runtime.workloads.gym.segments import Segment

USER = "tests.runtime.workloads.gym.user_envs:make_env"

torch.set_num_threads(1)


class ConstantPolicy:
    """Always the same action, with log-prob 0."""

    def __init__(self, action: int):
        self.action = action

    def act(self, obs, generator):
        return torch.full((obs.shape[0],), self.action, dtype=torch.int64), torch.zeros(obs.shape[0])

    def greedy(self, obs):
        return torch.full((obs.shape[0],), self.action, dtype=torch.int64)


class CountingVersions:
    """A policy source whose version goes up by one every step (weights refreshed mid-segment)."""

    def __init__(self, policy):
        self.policy, self.version = policy, 10

    def current(self):
        self.version += 1
        return self.policy, self.version


def counting_sampler(num_envs=1, max_steps=3, length=5, mode=AutoresetMode.NEXT_STEP, seed=0):
    make = lambda: make_env(entry_point=USER, kwargs={"max_steps": max_steps})  # noqa: E731
    envs = make_vector_env(make, num_envs, autoreset_mode=mode)
    return SegmentSampler(envs, describe_spaces(make()), length, seed=seed)


def cartpole_sampler(seed=0, worker=0, num_envs=3, length=40):
    make = lambda: make_env("CartPole-v1")  # noqa: E731
    return SegmentSampler(make_vector_env(make, num_envs), describe_spaces(make()), length, seed=seed, worker=worker)


def cartpole_policy(seed=0):
    space = describe_spaces(make_env("CartPole-v1"))
    policy = sampling_policy(space, PPOConfig())
    policy.load_state_dict(PPOLearner(space, PPOConfig(), seed=seed).publish_state())
    return policy


def assert_same_segments(a: Segment, b: Segment) -> None:
    for name in ("obs", "actions", "logprobs", "rewards", "terminated", "truncated", "versions", "next_obs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("final_obs", "episode_returns", "episode_lengths"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_truncated_episode_keeps_its_final_observation_and_the_next_starts_without_a_dummy_step():
    sampler = counting_sampler(max_steps=3, length=5)
    seg = sampler.sample(FixedPolicy(ConstantPolicy(0), 4), sample_id=0, group_id=0)
    seed0 = episode_seed(sampler.env_seeds[0], 0) % 1000
    seed1 = episode_seed(sampler.env_seeds[0], 1) % 1000
    # Steps since reset: 0, 1, 2 | 0, 1 — the step after the time limit is the new episode's first real step.
    assert seg.obs[:, 0].tolist() == [[0, seed0], [1, seed0], [2, seed0], [0, seed1], [1, seed1]]
    assert seg.truncated[:, 0].tolist() == [False, False, True, False, False]
    assert not seg.terminated.any()
    assert seg.final_obs.tolist() == [[3, seed0]]  # what the time-limited step returned
    assert seg.next_observations()[2, 0].tolist() == [3, seed0]  # not the next episode's [0, seed1]
    assert seg.next_obs.tolist() == [[2, seed1]]
    assert seg.rewards.tolist() == [[1.0]] * 5  # no zero-reward reset transition
    assert seg.episode_returns.tolist() == [3.0] and seg.episode_lengths.tolist() == [3]
    assert seg.versions.tolist() == [4] * 5 and seg.version == 4


def test_terminated_episodes_each_leave_a_final_observation_in_step_order():
    sampler = counting_sampler(num_envs=2, length=3)
    seg = sampler.sample(FixedPolicy(ConstantPolicy(1), 0), 0, 0)
    assert seg.terminated.all() and not seg.truncated.any()
    assert seg.final_obs[:, 0].tolist() == [1.0] * 6  # one per (t, e), each after one step
    assert seg.final_obs[:, 1].tolist() == [episode_seed(s, k) % 1000 for k in range(3) for s in sampler.env_seeds]
    assert seg.episode_lengths.tolist() == [1] * 6
    assert seg.obs[:, :, 0].tolist() == [[0.0, 0.0]] * 3


def test_episode_statistics_span_segments():
    sampler = counting_sampler(max_steps=4, length=3)
    first = sampler.sample(FixedPolicy(ConstantPolicy(0), 0), 0, 0)
    second = sampler.sample(FixedPolicy(ConstantPolicy(0), 0), 1, 1)
    assert first.episode_lengths.tolist() == []
    assert second.episode_lengths.tolist() == [4] and second.episode_returns.tolist() == [4.0]


def test_each_step_records_the_version_that_chose_it():
    seg = counting_sampler(length=4).sample(CountingVersions(ConstantPolicy(0)), 0, 0)
    assert seg.versions.tolist() == [11, 12, 13, 14]
    assert seg.version == 11  # the oldest


def test_next_step_and_disabled_autoreset_give_the_same_segments_and_same_step_is_refused():
    policy = cartpole_policy()
    make = lambda: make_env("CartPole-v1")  # noqa: E731
    space = describe_spaces(make())
    segs = {}
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED):
        sampler = SegmentSampler(make_vector_env(make, 2, autoreset_mode=mode), space, 60, seed=3)
        segs[mode] = [sampler.sample(FixedPolicy(policy, 0), i, i) for i in range(2)]
    assert segs[AutoresetMode.NEXT_STEP][0].done.any()  # episodes did end inside
    for a, b in zip(segs[AutoresetMode.NEXT_STEP], segs[AutoresetMode.DISABLED], strict=True):
        assert_same_segments(a, b)
    with pytest.raises(SamplerError, match="SAME_STEP"):
        SegmentSampler(make_vector_env(make, 2, autoreset_mode=AutoresetMode.SAME_STEP), space, 10, seed=0)


def test_the_sampler_matches_a_single_env_stepped_by_hand():
    policy = cartpole_policy()
    sampler = cartpole_sampler(num_envs=1, length=80)
    seg = sampler.sample(FixedPolicy(policy, 0), 0, 0)
    env = make_env("CartPole-v1")
    seed = worker_seeds(0, 0, 1)[0]
    obs, _ = env.reset(seed=episode_seed(seed, 0))
    episode = 0
    for t in range(80):
        assert seg.obs[t, 0].tolist() == pytest.approx(obs.tolist(), abs=0)
        obs, reward, terminated, truncated, _ = env.step(int(seg.actions[t, 0]))
        assert (bool(seg.terminated[t, 0]), bool(seg.truncated[t, 0])) == (terminated, truncated)
        if terminated or truncated:
            episode += 1
            obs, _ = env.reset(seed=episode_seed(seed, episode))
    assert episode >= 1


def test_same_seed_same_segments_other_worker_other_segments():
    policy = cartpole_policy()
    a, b, c = cartpole_sampler(seed=1), cartpole_sampler(seed=1), cartpole_sampler(seed=1, worker=1)
    for i in range(2):
        sa, sb, sc = (s.sample(FixedPolicy(policy, 0), i, i) for s in (a, b, c))
        assert_same_segments(sa, sb)
        assert not torch.equal(sa.obs, sc.obs)


def test_a_sampler_restored_from_its_state_continues_exactly():
    policy = cartpole_policy()
    straight = cartpole_sampler(seed=2)
    expected = [straight.sample(FixedPolicy(policy, 0), i, i) for i in range(4)]

    first = cartpole_sampler(seed=2)
    first.sample(FixedPolicy(policy, 0), 0, 0)
    first.sample(FixedPolicy(policy, 0), 1, 1)
    state = first.state_dict()
    assert any(len(a) for a in state["episode_actions"])  # episodes were in flight at the checkpoint

    restored = cartpole_sampler(seed=2)
    restored.load_state_dict(state)
    assert restored.cursor == 80
    for i in (2, 3):
        assert_same_segments(restored.sample(FixedPolicy(policy, 0), i, i), expected[i])


def test_state_of_another_worker_is_refused():
    state = cartpole_sampler(worker=0).state_dict()
    with pytest.raises(SamplerError, match="another worker"):
        cartpole_sampler(worker=1).load_state_dict(state)


def test_box_actions_are_kept_unclipped_in_the_segment_and_clipped_for_the_env():
    make = lambda: make_env("Pendulum-v1")  # noqa: E731
    space: SpaceInfo = describe_spaces(make())
    cfg = PPOConfig()
    policy = sampling_policy(space, cfg)
    with torch.no_grad():
        policy.log_std.fill_(2.0)  # std e^2: most draws fall outside [-2, 2]
    sampler = SegmentSampler(make_vector_env(make, 2), space, 20, seed=0)
    seg = sampler.sample(FixedPolicy(policy, 0), 0, 0)
    assert seg.actions.shape == (20, 2, 1)
    assert seg.actions.abs().max() > 2.0
    assert all(abs(float(a[0])) <= 2.0 for a in sampler.episode_actions[0])
    restored = SegmentSampler(make_vector_env(make, 2), space, 20, seed=0)
    restored.load_state_dict(sampler.state_dict())
    assert torch.equal(restored.obs, sampler.obs)
