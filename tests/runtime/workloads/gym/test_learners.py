"""The learners as the pipeline uses them: same-seed determinism, bit-identical resume on CPU, the target
network's sync points, what they publish, and their metrics."""

from __future__ import annotations

import io

import pytest
import torch

from runtime.train.algos.control import linear_schedule
from runtime.workloads.gym import metric_names as N
from runtime.workloads.gym.envs import describe_spaces, make_env, make_vector_env
from runtime.workloads.gym.learners import (
    DQNConfig,
    DQNLearner,
    LearnerError,
    PPOConfig,
    PPOLearner,
    sampling_policy,
)
from runtime.workloads.gym.sampler import SegmentSampler
from tests.runtime.workloads.gym.helpers import assert_same_state, make_segment, sync_loop

torch.set_num_threads(1)

PPO_SMALL = PPOConfig(hidden=(16, 16), epochs=2, minibatches=3, entropy_coef=0.01, value_clip=0.2)
DQN_SMALL = DQNConfig(
    hidden=(16, 16),
    batch_size=16,
    learning_starts=64,
    updates_per_step=2,
    target_update_interval=3,
    tau=1.0,
    buffer_size=100,  # small enough to wrap within the test
    epsilon_decay_steps=300,
)


def setup(cfg, seed: int = 0, env_id: str = "CartPole-v1", num_envs: int = 2, length: int = 16):
    make = lambda: make_env(env_id)  # noqa: E731
    space = describe_spaces(make())
    learner_cls = PPOLearner if isinstance(cfg, PPOConfig) else DQNLearner
    learner = learner_cls(space, cfg, seed=seed)
    sampler = SegmentSampler(make_vector_env(make, num_envs), space, length, seed=seed)
    return learner, sampler, sampling_policy(space, cfg)


def untimed(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
    """The metrics without the seconds (DQN's time/target_sync_wait): what a same-seed run repeats exactly."""
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def through_disk(state: dict) -> dict:
    data = io.BytesIO()
    torch.save(state, data)
    data.seek(0)
    return torch.load(data, weights_only=True)


@pytest.mark.parametrize("cfg", [PPO_SMALL, DQN_SMALL], ids=["ppo", "dqn"])
def test_same_seed_same_run_other_seed_other_run(cfg):
    runs = []
    for seed in (5, 5, 6):
        learner, sampler, policy = setup(cfg, seed=seed)
        metrics = untimed(sync_loop(learner, sampler, policy, range(5)))
        runs.append((metrics, learner.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert_same_state(runs[0][1], runs[1][1])
    assert runs[0][0] != runs[2][0]


@pytest.mark.parametrize("cfg", [PPO_SMALL, DQN_SMALL], ids=["ppo", "dqn"])
def test_a_resumed_run_continues_bit_identically(cfg):
    learner, sampler, policy = setup(cfg, seed=1)
    straight = sync_loop(learner, sampler, policy, range(8))

    first, first_sampler, first_policy = setup(cfg, seed=1)
    sync_loop(first, first_sampler, first_policy, range(4))
    saved = through_disk({"learner": first.state_dict(), "sampler": first_sampler.state_dict()})

    resumed, resumed_sampler, resumed_policy = setup(cfg, seed=1)
    resumed.load_state_dict(saved["learner"])
    resumed_sampler.load_state_dict(saved["sampler"])
    continued = sync_loop(resumed, resumed_sampler, resumed_policy, range(4, 8))

    assert untimed(continued) == untimed(straight[4:])
    assert_same_state(resumed.state_dict(), learner.state_dict())
    if isinstance(cfg, DQNConfig):
        assert len(learner.replay) == learner.replay.capacity  # the ring wrapped before the end


def test_the_dqn_target_network_changes_exactly_at_its_sync_points():
    cfg = DQNConfig(
        hidden=(16,), batch_size=8, learning_starts=0, updates_per_step=1, target_update_interval=3, tau=1.0
    )
    learner, sampler, policy = setup(cfg)
    before = {k: v.clone() for k, v in learner.target.state_dict().items()}
    for step in range(7):
        metrics = sync_loop(learner, sampler, policy, range(step, step + 1))[0]
        after = learner.target.state_dict()
        assert learner.updates == step + 1
        assert metrics[N.TARGET_SYNCS] == (step + 1) // 3
        if learner.updates % 3 == 0:
            assert_same_state(after, learner.q.state_dict())  # a hard copy of the online network
            assert not torch.equal(after["body.0.weight"], before["body.0.weight"])
        else:
            assert_same_state(after, before)  # untouched between syncs
        before = {k: v.clone() for k, v in after.items()}


def test_polyak_moves_the_target_by_exactly_tau_at_each_sync():
    cfg = DQNConfig(
        hidden=(16,), batch_size=8, learning_starts=0, updates_per_step=1, target_update_interval=2, tau=0.5
    )
    learner, sampler, policy = setup(cfg)
    before = {k: v.clone() for k, v in learner.target.state_dict().items()}
    for step in range(4):
        sync_loop(learner, sampler, policy, range(step, step + 1))
        after = learner.target.state_dict()
        if learner.updates % 2 == 0:
            online = learner.q.state_dict()
            # tau = 0.5 scales exactly in float32, so the expectation is exact, not approximate.
            assert_same_state(after, {k: 0.5 * online[k] + 0.5 * before[k] for k in before})
            assert not torch.equal(after["body.0.weight"], online["body.0.weight"])
        else:
            assert_same_state(after, before)
        before = {k: v.clone() for k, v in after.items()}
    assert learner.target_syncs == 2


def test_dqn_waits_for_learning_starts_and_publishes_the_scheduled_epsilon():
    cfg = DQNConfig(
        hidden=(16,), learning_starts=100, updates_per_step=1, epsilon_decay_steps=200, epsilon_end=0.1, batch_size=8
    )
    learner, sampler, policy = setup(cfg)  # 32 env steps per train step
    q_before = {k: v.clone() for k, v in learner.q.state_dict().items()}
    metrics = sync_loop(learner, sampler, policy, range(3))
    assert learner.updates == 0 and N.TD_ERROR not in metrics[-1]
    assert_same_state(learner.q.state_dict(), q_before)
    metrics = sync_loop(learner, sampler, policy, range(3, 4))  # 128 env steps >= 100
    assert learner.updates == 1 and N.TD_ERROR in metrics[-1]
    want = linear_schedule(1.0, 0.1, 200, 128)
    assert metrics[-1][N.EPSILON] == pytest.approx(want)
    published = learner.publish_state()
    assert float(published["epsilon"]) == pytest.approx(want)
    policy.load_state_dict(published)  # strict: the sampling policy takes exactly what is published


def test_ppo_reports_its_metrics_and_publishes_the_actor():
    learner, sampler, policy = setup(PPO_SMALL)
    metrics = sync_loop(learner, sampler, policy, range(2))[-1]
    for key in (
        N.LOSS_POLICY,
        N.LOSS_VALUE,
        N.ENTROPY,
        N.APPROX_KL,
        N.CLIP_FRACTION,
        N.GRAD_NORM,
        N.LR,
        N.ENV_STEPS,
        N.EPISODES,
        N.STALENESS_MEAN,
    ):
        assert key in metrics, key
    assert metrics[N.ENV_STEPS] == 64.0 and learner.version == 2
    assert_same_state(learner.publish_state(), learner.actor.state_dict())
    policy.load_state_dict(learner.publish_state())  # strict: the sampling policy takes exactly what is published


def test_episode_metrics_and_staleness_come_from_the_segments():
    space = describe_spaces(make_env("CartPole-v1"))
    learner = PPOLearner(space, PPO_SMALL)
    learner.version = 7
    segments = [make_segment(i, d=4) for i in (1, 2)]  # returns [1.5] and [1.5, 2.0]; version 5
    segments[0].actions = segments[0].actions % 2
    segments[1].actions = segments[1].actions % 2
    metrics = learner.train_step(segments, 0)
    assert metrics[N.EPISODES] == 3.0
    assert metrics[N.EPISODE_RETURN_MEAN] == pytest.approx(5.0 / 3)
    assert (metrics[N.EPISODE_RETURN_MIN], metrics[N.EPISODE_RETURN_MAX]) == (1.5, 2.0)
    assert metrics[N.EPISODE_LENGTH_MEAN] == pytest.approx(10.0 / 3)
    assert (metrics[N.STALENESS_MEAN], metrics[N.STALENESS_MAX]) == (2.0, 2.0)


def test_set_lr_changes_the_learning_rate_used_next():
    learner, sampler, policy = setup(PPO_SMALL)
    learner.set_lr(1e-5)
    assert sync_loop(learner, sampler, policy, range(1))[0][N.LR] == 1e-5
    assert learner.critic_optimizer.param_groups[0]["lr"] == PPO_SMALL.critic_lr


def test_ppo_learns_on_box_actions_too():
    learner, sampler, policy = setup(PPO_SMALL, env_id="Pendulum-v1")
    log_std = learner.actor.log_std.detach().clone()
    metrics = sync_loop(learner, sampler, policy, range(2))
    assert learner.version == 2 and metrics[-1][N.ENV_STEPS] == 64.0
    assert not torch.equal(learner.actor.log_std.detach(), log_std)


def test_observation_statistics_are_learned_from_the_batch_and_published():
    cfg = PPOConfig(hidden=(16,), epochs=1, minibatches=1, normalize_obs=True)
    learner, sampler, policy = setup(cfg)
    sync_loop(learner, sampler, policy, range(1))
    # The first step saw the 32 observations of its one segment (the prior's count is 1e-4).
    norm = learner.actor.obs_norm
    assert norm is not None and float(norm.count) == pytest.approx(32.0001)
    assert_same_state(learner.critic.obs_norm.state_dict(), norm.state_dict())
    assert torch.equal(learner.publish_state()["obs_norm.mean"], norm.mean)


def test_bad_configuration_and_input_are_refused():
    with pytest.raises(LearnerError, match="epochs"):
        PPOConfig(epochs=0)
    with pytest.raises(LearnerError, match="gamma"):
        PPOConfig(gamma=1.5)
    with pytest.raises(LearnerError, match="tau"):
        DQNConfig(tau=0.0)
    box = describe_spaces(make_env("Pendulum-v1"))
    with pytest.raises(LearnerError, match="Discrete"):
        DQNLearner(box, DQNConfig())
    learner = PPOLearner(describe_spaces(make_env("CartPole-v1")), PPO_SMALL)
    with pytest.raises(LearnerError, match="at least one segment"):
        learner.train_step([], 0)
    with pytest.raises(LearnerError, match="missing"):
        learner.load_state_dict({"version": 1})
