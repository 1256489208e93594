"""The gym learners: PPO (actor + critic) and DQN (online + target Q, replay), each a trainer for the pipeline.

Both offer what the LLM workload's :class:`~runtime.train.trainer.Trainer` offers the pipeline:
``train_step(segments, step) -> metrics``, ``publish_state()`` (the sampling policy's state dict,
loaded by :func:`sampling_policy`'s module), ``version`` (+1 per step), ``state_dict`` /
``load_state_dict`` (a resumed learner on CPU continues bit-identically), ``set_lr``, and no-op
``offload_optimizer`` / ``reload_optimizer`` for the colocated mode (their optimizer state is tiny).
The math is :mod:`runtime.train.algos.control`.

PPO (Schulman et al. 2017) with separate actor and critic, each with its own Adam: per step, GAE
over every segment with the critic of the step's start (truncated episodes bootstrap from their
final observation), then ``epochs`` passes over the transitions in ``minibatches`` shuffled
minibatches (a permutation seeded by (seed, step), so identical after a resume); each minibatch
takes one clipped-surrogate step of the actor (advantages normalised per minibatch, minus
``entropy_coef`` x entropy) and one step of the critic (optionally clipped value loss), each with
its gradient norm clipped. The ratio is taken against the behaviour log-probs the sampler recorded.

DQN (Mnih et al. 2015) with the double-DQN target (van Hasselt et al. 2016): each step adds its
segments to the replay buffer, then, once ``learning_starts`` env steps were seen, makes
``updates_per_step`` gradient updates on uniform minibatches; every ``target_update_interval``
updates the target network is synced — copied when ``tau`` is 1, else moved by Polyak averaging
with ``tau`` — in a background thread that the next update waits for only just before it reads the
target (:mod:`runtime.workloads.gym.target_sync`; bit-identical to syncing inline). ε follows a
linear schedule over the env steps trained on and is published with the Q weights.

Observation normalisation (``normalize_obs``): the learner folds each step's raw observations into
the networks' statistics after its updates, so the published policy normalises as the next step
trains; DQN's target network takes the statistics at every step (they are statistics, not weights,
as Stable-Baselines3 treats batch-norm statistics of its target).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from runtime.train.algos.control import (
    double_dqn_targets,
    gae_segment,
    linear_schedule,
    ppo_policy_loss,
    ppo_value_loss,
    standardize,
    td_loss,
)
from runtime.train.optimizer import AdamW
from runtime.workloads.gym import metric_names as N
from runtime.workloads.gym.envs import SpaceInfo
from runtime.workloads.gym.errors import LearnerError
from runtime.workloads.gym.networks import (
    Activation,
    CategoricalActor,
    EpsilonGreedyPolicy,
    GaussianActor,
    build_actor,
    build_critic,
    build_q_network,
)
from runtime.workloads.gym.replay import ReplayBuffer
from runtime.workloads.gym.segments import Segment
from runtime.workloads.gym.target_sync import TARGET_SYNC_NICE, TargetSync


@dataclass(frozen=True)
class PPOConfig:
    """Defaults: the settings measured on CartPole-v1 with segments of 4 envs x 128 steps."""

    hidden: tuple[int, ...] = (64, 64)  # hidden layer sizes of the actor and of the critic
    activation: Activation = "tanh"  # between hidden layers
    normalize_obs: bool = False  # running observation normalisation inside the networks
    gamma: float = 0.99  # discount
    lam: float = 0.95  # GAE lambda
    clip: float = 0.2  # surrogate clip range: ratios outside [1 - clip, 1 + clip] stop pulling
    value_clip: float | None = None  # PPO value clipping range; None: plain squared error
    entropy_coef: float = 0.0  # entropy bonus in the actor's loss
    epochs: int = 4  # passes over each step's transitions
    minibatches: int = 4  # minibatches per pass (one actor and one critic update each)
    actor_lr: float = 3e-4  # Adam learning rate of the actor (set_lr changes it)
    critic_lr: float = 1e-3  # Adam learning rate of the critic
    max_grad_norm: float = 0.5  # gradient-norm clip, actor and critic separately
    normalize_advantages: bool = True  # standardise advantages per minibatch
    adam_eps: float = 1e-5  # Adam epsilon of both optimizers (1e-5 as in OpenAI baselines' PPO)

    def __post_init__(self) -> None:
        _positive(self, "epochs", "minibatches", "actor_lr", "critic_lr", "max_grad_norm", "clip")
        _unit(self, "gamma", "lam")


@dataclass(frozen=True)
class DQNConfig:
    """Defaults: the settings measured on CartPole-v1 with segments of 4 envs x 16 steps (64 env steps)."""

    hidden: tuple[int, ...] = (64, 64)  # hidden layer sizes of the Q-network
    activation: Activation = "relu"  # between hidden layers
    normalize_obs: bool = False  # running observation normalisation inside the networks
    gamma: float = 0.99  # discount
    lr: float = 1e-3  # Adam learning rate (set_lr changes it)
    buffer_size: int = 20_000  # transitions the replay buffer holds
    batch_size: int = 64  # transitions per gradient update
    learning_starts: int = 500  # env steps trained on before the first update
    updates_per_step: int = 16  # gradient updates per train_step
    target_update_interval: int = 1  # gradient updates between two target syncs
    tau: float = 0.01  # 1: copy the online network at a sync; < 1: Polyak-average it in
    epsilon_start: float = 1.0  # exploration rate before any env step
    epsilon_end: float = 0.02  # exploration rate after epsilon_decay_steps
    epsilon_decay_steps: int = 4_000  # env steps over which epsilon moves linearly from start to end
    max_grad_norm: float = 10.0  # gradient-norm clip
    huber_delta: float = 1.0  # TD errors beyond this count linearly (Mnih et al. 2015's error clipping)

    def __post_init__(self) -> None:
        _positive(self, "lr", "buffer_size", "batch_size", "updates_per_step", "target_update_interval")
        _positive(self, "max_grad_norm", "huber_delta")
        _unit(self, "gamma", "epsilon_start", "epsilon_end")
        if not 0.0 < self.tau <= 1.0:
            raise LearnerError(f"tau must be in (0, 1], got {self.tau}")


def sampling_policy(
    space: SpaceInfo, cfg: PPOConfig | DQNConfig
) -> CategoricalActor | GaussianActor | EpsilonGreedyPolicy:
    """The module a sampler or the evaluation agent runs; ``load_state_dict(learner.publish_state())`` fills it."""
    generator = torch.Generator().manual_seed(0)  # the weights are overwritten by the published ones
    if isinstance(cfg, PPOConfig):
        return build_actor(space, cfg.hidden, generator, cfg.activation, cfg.normalize_obs)
    q = build_q_network(space, cfg.hidden, generator, cfg.activation, cfg.normalize_obs)
    return EpsilonGreedyPolicy(q, space.action_dim, cfg.epsilon_start)


class PPOLearner:
    """PPO with separate actor and critic networks; see the module docstring."""

    def __init__(self, space: SpaceInfo, cfg: PPOConfig, seed: int = 0, device: torch.device | None = None):
        self.space = space
        self.cfg = cfg
        self.seed = seed
        self.device = device or torch.device("cpu")
        generator = torch.Generator().manual_seed(seed)
        self.actor = build_actor(space, cfg.hidden, generator, cfg.activation, cfg.normalize_obs).to(self.device)
        self.critic = build_critic(space, cfg.hidden, generator, cfg.activation, cfg.normalize_obs).to(self.device)
        self.actor_optimizer = AdamW(self.actor.parameters(), lr=cfg.actor_lr, eps=cfg.adam_eps, weight_decay=0.0)
        self.critic_optimizer = AdamW(self.critic.parameters(), lr=cfg.critic_lr, eps=cfg.adam_eps, weight_decay=0.0)
        self.version = 0
        self.env_steps = 0

    def train_step(self, segments: list[Segment], step: int) -> dict[str, float]:
        if not segments:
            raise LearnerError("train_step needs at least one segment")
        cfg = self.cfg
        out = _segment_metrics(segments, self.version)
        batch = self._batch(segments)
        n = batch["obs"].shape[0]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(cfg.epochs):
            for idx in torch.tensor_split(torch.randperm(n, generator=generator), cfg.minibatches):
                if idx.numel() == 0:
                    continue
                for key, value in self._update({k: v[idx.to(self.device)] for k, v in batch.items()}).items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        out.update({key: total / max(updates, 1) for key, total in sums.items()})
        self._update_obs_norm(batch["obs"], self.actor, self.critic)
        self.version += 1
        self.env_steps += n
        out[N.ENV_STEPS] = float(self.env_steps)
        out[N.LR] = float(self.actor_optimizer.param_groups[0]["lr"])
        return out

    def publish_state(self) -> dict[str, Tensor]:
        """The actor's weights (and observation statistics): what samplers act with."""
        return {k: v.detach() for k, v in self.actor.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "env_steps": self.env_steps,
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _require(state, "version", "env_steps", "actor", "critic", "actor_optimizer", "critic_optimizer")
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.version = int(state["version"])
        self.env_steps = int(state["env_steps"])

    def set_lr(self, lr: float) -> None:
        """The actor's learning rate (the ``lr`` metric); the critic keeps ``critic_lr``."""
        for group in self.actor_optimizer.param_groups:
            group["lr"] = lr

    def offload_optimizer(self) -> None:
        """Nothing to free: the optimizer state of these small MLPs stays where it is."""

    def reload_optimizer(self) -> None:
        """Counterpart of :meth:`offload_optimizer`; nothing to do."""

    # ----------------------------------------------------------------- internals

    @torch.no_grad()
    def _batch(self, segments: list[Segment]) -> dict[str, Tensor]:
        """Every transition of ``segments`` flattened to ``[N, ...]``, with GAE advantages and returns."""
        cfg = self.cfg
        parts: dict[str, list[Tensor]] = {k: [] for k in ("obs", "actions", "logprobs", "advantages", "returns")}
        parts["values"] = []
        for seg in segments:
            t, e, d = seg.obs.shape
            obs = seg.obs.to(self.device)
            values = self.critic(obs.reshape(-1, d)).reshape(t, e)
            next_values = self.critic(seg.next_observations().to(self.device).reshape(-1, d)).reshape(t, e)
            adv, ret = gae_segment(
                seg.rewards.to(self.device),
                values,
                next_values,
                seg.terminated.to(self.device),
                seg.truncated.to(self.device),
                cfg.gamma,
                cfg.lam,
            )
            parts["obs"].append(obs.reshape(t * e, d))
            parts["actions"].append(seg.actions.to(self.device).reshape(t * e, *seg.actions.shape[2:]))
            parts["logprobs"].append(seg.logprobs.to(self.device).reshape(-1))
            parts["advantages"].append(adv.reshape(-1))
            parts["returns"].append(ret.reshape(-1))
            parts["values"].append(values.reshape(-1))
        return {k: torch.cat(v) for k, v in parts.items()}

    def _update(self, mb: dict[str, Tensor]) -> dict[str, float]:
        """One actor step and one critic step on the minibatch ``mb``."""
        cfg = self.cfg
        dist = self.actor.distribution(mb["obs"])
        logprobs = dist.log_prob(mb["actions"])
        entropy = dist.entropy().mean()
        advantages = standardize(mb["advantages"]) if cfg.normalize_advantages else mb["advantages"]
        policy_loss, policy_metrics = ppo_policy_loss(logprobs, mb["logprobs"], advantages, cfg.clip)
        actor_norm = _clipped_step(policy_loss - cfg.entropy_coef * entropy, self.actor, self.actor_optimizer, cfg)
        values = self.critic(mb["obs"])
        value_loss = ppo_value_loss(values, mb["values"], mb["returns"], cfg.value_clip)
        _clipped_step(value_loss, self.critic, self.critic_optimizer, cfg)
        return {
            N.LOSS_POLICY: float(policy_loss.detach()),
            N.LOSS_VALUE: float(value_loss.detach()),
            N.ENTROPY: float(entropy.detach()),
            N.APPROX_KL: float(policy_metrics["approx_kl"]),
            N.CLIP_FRACTION: float(policy_metrics["clip_fraction"]),
            N.GRAD_NORM: actor_norm,
        }

    def _update_obs_norm(self, obs: Tensor, *networks: nn.Module) -> None:
        for net in networks:
            norm = getattr(net, "obs_norm", None)
            if norm is not None:
                norm.update(obs)


class DQNLearner:
    """DQN with a double-DQN target, a replay buffer and a target network; see the module docstring.

    ``background_target_sync=False`` syncs the target inside the update instead (same results, bit for
    bit): the baseline ``bench/gym.py --roles`` measures the background sync against, as it measures a
    sync thread niced by ``target_sync_nice`` (:mod:`runtime.workloads.gym.target_sync`)."""

    def __init__(
        self,
        space: SpaceInfo,
        cfg: DQNConfig,
        seed: int = 0,
        device: torch.device | None = None,
        background_target_sync: bool = True,
        target_sync_nice: int = TARGET_SYNC_NICE,
    ):
        if space.action_kind != "discrete":
            raise LearnerError("DQN needs a Discrete action space")
        self.space = space
        self.cfg = cfg
        self.seed = seed
        self.device = device or torch.device("cpu")
        generator = torch.Generator().manual_seed(seed)
        self.q = build_q_network(space, cfg.hidden, generator, cfg.activation, cfg.normalize_obs).to(self.device)
        self._target = copy.deepcopy(self.q).requires_grad_(False)
        self._target_sync = TargetSync(
            self._target, self.q, cfg.tau, background=background_target_sync, nice=target_sync_nice
        )
        self.optimizer = AdamW(self.q.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.replay = ReplayBuffer(cfg.buffer_size, space.obs_dim, seed=seed * 1_000_003 + 1)
        self.version = 0
        self.env_steps = 0
        self.updates = 0  # gradient updates since the start
        self.target_syncs = 0

    @property
    def epsilon(self) -> float:
        """The exploration rate for samplers at the learner's current env step count."""
        c = self.cfg
        return linear_schedule(c.epsilon_start, c.epsilon_end, c.epsilon_decay_steps, self.env_steps)

    @property
    def target(self) -> nn.Module:
        """The target network, once the sync in flight (if any) has landed in it."""
        self._target_sync.wait()
        return self._target

    def train_step(self, segments: list[Segment], step: int) -> dict[str, float]:
        if not segments:
            raise LearnerError("train_step needs at least one segment")
        cfg = self.cfg
        out = _segment_metrics(segments, self.version)
        for seg in segments:
            self.replay.add_segment(seg)
            self.env_steps += seg.num_steps
        sums: dict[str, float] = {}
        done = 0
        if self.env_steps >= cfg.learning_starts:
            for _ in range(cfg.updates_per_step):
                for key, value in self._update().items():
                    sums[key] = sums.get(key, 0.0) + value
                done += 1
        out.update({key: total / done for key, total in sums.items()})
        norm = getattr(self.q, "obs_norm", None)
        if norm is not None:
            norm.update(torch.cat([seg.obs.reshape(-1, self.space.obs_dim) for seg in segments]).to(self.device))
            # Buffers, which the sync in flight does not touch (it moves parameters): no need to wait for it.
            self._target.obs_norm.load_state_dict(norm.state_dict())  # type: ignore[union-attr]
        self.version += 1
        sync_events, sync_wait_s = self._target_sync.take_step_stats()
        out[N.ENV_STEPS] = float(self.env_steps)
        out[N.EPSILON] = self.epsilon
        out[N.TARGET_SYNCS] = float(self.target_syncs)
        out[N.TARGET_SYNC_EVENTS] = float(sync_events)
        out[N.TARGET_SYNC_WAIT] = sync_wait_s
        out[N.REPLAY_SIZE] = float(len(self.replay))
        out[N.LR] = float(self.optimizer.param_groups[0]["lr"])
        return out

    def publish_state(self) -> dict[str, Tensor]:
        """The Q weights and the current epsilon, as :class:`EpsilonGreedyPolicy`'s state dict."""
        state = {f"q.{k}": v.detach() for k, v in self.q.state_dict().items()}
        state["epsilon"] = torch.tensor(self.epsilon, dtype=torch.float64)
        return state

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "env_steps": self.env_steps,
            "updates": self.updates,
            "target_syncs": self.target_syncs,
            "q": self.q.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "replay": self.replay.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _require(state, "version", "env_steps", "updates", "target_syncs", "q", "target", "optimizer", "replay")
        self._target_sync.wait()  # a sync in flight must not land on the loaded weights
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.replay.load_state_dict(state["replay"])
        self.version = int(state["version"])
        self.env_steps = int(state["env_steps"])
        self.updates = int(state["updates"])
        self.target_syncs = int(state["target_syncs"])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def offload_optimizer(self) -> None:
        """Nothing to free: the optimizer state of these small MLPs stays where it is."""

    def reload_optimizer(self) -> None:
        """Counterpart of :meth:`offload_optimizer`; nothing to do."""

    # ----------------------------------------------------------------- internals

    def _update(self) -> dict[str, float]:
        """One gradient update on a replay minibatch, then the target sync if one is due.

        What does not read the target network comes first (sampling, the online forward passes), so a
        background sync of the previous update has that long to finish before :meth:`TargetSync.wait`."""
        cfg = self.cfg
        b = self.replay.sample(cfg.batch_size)
        obs, next_obs = b.obs.to(self.device), b.next_obs.to(self.device)
        with torch.no_grad():
            next_q_online = self.q(next_obs)
        q_taken = self.q(obs).gather(1, b.actions.to(self.device).unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            next_q_target = self.target(next_obs)  # waits for the sync in flight
            targets = double_dqn_targets(
                b.rewards.to(self.device), b.terminated.to(self.device), next_q_online, next_q_target, cfg.gamma
            )
        loss, metrics = td_loss(q_taken, targets, cfg.huber_delta)
        grad_norm = _clipped_step(loss, self.q, self.optimizer, cfg)
        self.updates += 1
        if self.updates % cfg.target_update_interval == 0:
            self._target_sync.start()  # reads the parameters the optimizer just wrote
            self.target_syncs += 1
        return {
            N.LOSS_TD: float(loss.detach()),
            N.TD_ERROR: float(metrics["td_error"]),
            N.Q_MEAN: float(metrics["q_mean"]),
            N.GRAD_NORM: grad_norm,
        }


# --------------------------------------------------------------------------- shared helpers


def _segment_metrics(segments: list[Segment], version: int) -> dict[str, float]:
    """Episode statistics of the episodes that ended in ``segments``, and their staleness against ``version``."""
    returns = torch.cat([s.episode_returns for s in segments])
    lengths = torch.cat([s.episode_lengths for s in segments])
    lags = [version - s.version for s in segments]
    out = {
        N.EPISODES: float(returns.numel()),
        N.STALENESS_MEAN: sum(lags) / len(lags),
        N.STALENESS_MAX: float(max(lags)),
    }
    if returns.numel():
        out[N.EPISODE_RETURN_MEAN] = float(returns.mean())
        out[N.EPISODE_RETURN_MIN] = float(returns.min())
        out[N.EPISODE_RETURN_MAX] = float(returns.max())
        out[N.EPISODE_LENGTH_MEAN] = float(lengths.double().mean())
    return out


def _clipped_step(loss: Tensor, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Any) -> float:
    """Backward, clip the gradient norm at ``cfg.max_grad_norm``, step; a non-finite norm skips the step
    (one bad batch must not turn every weight into NaN). Returns the norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _require(state: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise LearnerError(f"learner state is missing {', '.join(missing)}")


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise LearnerError(f"{name} must be > 0, got {getattr(cfg, name)}")


def _unit(cfg: Any, *names: str) -> None:
    for name in names:
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise LearnerError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")
