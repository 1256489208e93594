"""The sampler: steps a vector env with a policy and cuts the stream into fixed-length segments.

Episode ends. Gymnasium 1.x vector envs reset a finished copy themselves, when and how depending on
``autoreset_mode``: under ``NEXT_STEP`` (the default) the step that ends an episode returns its
final observation and the *next* ``step`` call ignores that copy's action, resets it and returns
reward 0 — a transition that is no transition; under ``SAME_STEP`` the reset happens inside the
same call, the final observation moved into ``info["final_obs"]``, with a seed the caller cannot
choose. The sampler does neither: right after a step that ended episodes it resets exactly those
copies (``reset(options={"reset_mask": ...})``) with a seed of its own choosing. So every recorded
step is a real transition, the final observation is the one ``step`` returned, and every episode
starts from a known seed. It takes vector envs in ``NEXT_STEP`` or ``DISABLED`` mode (the partial
reset pre-empts the pending autoreset), and refuses ``SAME_STEP``.

Determinism and checkpoints. Given its seed and worker index, the sampler's output is a function
of the policies it is given: episode ``k`` of copy ``i`` is reset with
``episode_seed(worker_seeds(seed, worker)[i], k)`` and actions are drawn from a generator of its
own. :meth:`SegmentSampler.state_dict` holds that generator, the step cursor, each copy's episode
number, return and length so far, and the actions taken in its current episode. An environment's
internal state cannot be read in general, so :meth:`load_state_dict` rebuilds it: it resets each
copy with its episode's seed and replays those actions. That is exact for environments whose
trajectory is a function of the reset seed and the actions (what Gymnasium's seeding asks of an
environment; CartPole and Pendulum, tested, keep it), and costs at most one episode's steps per copy; an environment that
reads the clock or a global RNG resumes in a different state. The action history grows with the
episode, so an environment without a time limit makes checkpoints grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import Tensor

from runtime.workloads.gym.envs import SpaceInfo, episode_seed, to_env_actions, worker_seeds
from runtime.workloads.gym.errors import SamplerError
from runtime.workloads.gym.networks import Policy
from runtime.workloads.gym.segments import Segment


class PolicySource(Protocol):
    """Where the sampler takes the policy for each step: ``current() -> (policy, weight version)``.

    Called before every step, so an async worker can switch to newer weights mid-segment; each
    step records the version that chose its actions."""

    def current(self) -> tuple[Policy, int]: ...


@dataclass
class FixedPolicy:
    """One policy at one version for the whole segment (the sync loop's source)."""

    policy: Policy
    version: int

    def current(self) -> tuple[Policy, int]:
        return self.policy, self.version


class SegmentSampler:
    """Steps ``envs`` ``segment_length`` times per :meth:`sample`; owns the envs' episode bookkeeping.

    Construction resets every copy with its first episode's seed; ``worker`` tells the workers of
    one run apart (their seeds differ)."""

    def __init__(self, envs: SyncVectorEnv, space: SpaceInfo, segment_length: int, seed: int, worker: int = 0):
        if segment_length < 1:
            raise SamplerError("segment_length must be >= 1")
        mode = envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if mode == AutoresetMode.SAME_STEP:
            raise SamplerError(
                "the sampler resets finished episodes itself; build the vector env with autoreset_mode "
                "NEXT_STEP (the default) or DISABLED, not SAME_STEP"
            )
        self.envs = envs
        self.space = space
        self.segment_length = segment_length
        self.num_envs = envs.num_envs
        *self.env_seeds, action_seed = worker_seeds(seed, worker, self.num_envs + 1)
        self.generator = torch.Generator().manual_seed(action_seed)
        self.cursor = 0  # vector steps taken since the start
        self.episode_index = [0] * self.num_envs
        self.episode_return = [0.0] * self.num_envs
        self.episode_length = [0] * self.num_envs
        self.episode_actions: list[list[Any]] = [[] for _ in range(self.num_envs)]  # what each copy was sent
        obs, _ = envs.reset(seed=[episode_seed(s, 0) for s in self.env_seeds])
        self.obs = self._flat(obs)

    @property
    def steps_per_segment(self) -> int:
        return self.segment_length * self.num_envs

    @torch.no_grad()
    def sample(self, source: PolicySource, sample_id: int, group_id: int) -> Segment:
        """The next ``segment_length`` steps of every copy, as one segment."""
        t_len, e, d = self.segment_length, self.num_envs, self.space.obs_dim
        obs = torch.empty(t_len, e, d)
        rewards = torch.empty(t_len, e)
        logprobs = torch.empty(t_len, e)
        terminated = torch.empty(t_len, e, dtype=torch.bool)
        truncated = torch.empty(t_len, e, dtype=torch.bool)
        versions = torch.empty(t_len, dtype=torch.int64)
        actions: list[Tensor] = []
        final_obs: list[Tensor] = []
        returns: list[float] = []
        lengths: list[int] = []
        for t in range(t_len):
            policy, version = source.current()
            obs[t] = self.obs
            versions[t] = version
            action, logprob = policy.act(self.obs, self.generator)
            env_actions = to_env_actions(self.space, action, self.envs.single_action_space.dtype)
            next_obs, reward, term, trunc, _ = self.envs.step(env_actions)
            actions.append(action)
            logprobs[t] = logprob
            rewards[t] = torch.from_numpy(np.asarray(reward, dtype=np.float32))
            terminated[t] = torch.from_numpy(np.asarray(term, dtype=np.bool_))
            truncated[t] = torch.from_numpy(np.asarray(trunc, dtype=np.bool_))
            flat = self._flat(next_obs)
            done = np.logical_or(term, trunc)
            for i in range(e):
                self.episode_return[i] += float(reward[i])
                self.episode_length[i] += 1
                self.episode_actions[i].append(env_actions[i])
                if done[i]:
                    final_obs.append(flat[i])
                    returns.append(self.episode_return[i])
                    lengths.append(self.episode_length[i])
            if done.any():
                flat = self._start_episodes(done)
            self.obs = flat
            self.cursor += 1
        return Segment(
            sample_id=sample_id,
            group_id=group_id,
            obs=obs,
            actions=torch.stack(actions),
            logprobs=logprobs,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            versions=versions,
            next_obs=self.obs.clone(),
            final_obs=torch.stack(final_obs) if final_obs else torch.empty(0, d),
            episode_returns=torch.tensor(returns, dtype=torch.float64),
            episode_lengths=torch.tensor(lengths, dtype=torch.int64),
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints: the cursor, the action generator and each copy's current episode."""
        return {
            "env_seeds": torch.tensor(self.env_seeds, dtype=torch.int64),
            "cursor": self.cursor,
            "generator": self.generator.get_state(),
            "episode_index": torch.tensor(self.episode_index, dtype=torch.int64),
            "episode_return": torch.tensor(self.episode_return, dtype=torch.float64),
            "episode_length": torch.tensor(self.episode_length, dtype=torch.int64),
            "episode_actions": [torch.as_tensor(np.asarray(a)) for a in self.episode_actions],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken: each copy is reset with its episode's seed and
        its episode's actions are replayed (see the module docstring for when that is exact)."""
        if state["env_seeds"].tolist() != self.env_seeds:
            raise SamplerError("sampler state is another worker's (its environment seeds differ)")
        self.cursor = int(state["cursor"])
        self.generator.set_state(state["generator"])
        self.episode_index = [int(k) for k in state["episode_index"].tolist()]
        self.episode_return = [float(r) for r in state["episode_return"].tolist()]
        self.episode_length = [int(n) for n in state["episode_length"].tolist()]
        dtype = self.envs.single_action_space.dtype
        self.episode_actions = [list(np.asarray(a.numpy(), dtype=dtype)) for a in state["episode_actions"]]
        obs, _ = self.envs.reset(
            seed=[episode_seed(s, k) for s, k in zip(self.env_seeds, self.episode_index, strict=True)]
        )
        flat = self._flat(obs)
        for i, env in enumerate(self.envs.envs):
            for action in self.episode_actions[i]:
                single_obs, *_ = env.step(action)
                flat[i] = torch.from_numpy(np.asarray(single_obs, dtype=np.float32).reshape(-1))
        self.obs = flat

    # ----------------------------------------------------------------- internals

    def _start_episodes(self, done: np.ndarray) -> Tensor:
        """Reset the copies marked ``done`` with their next episode's seed; the observations after it."""
        seeds: list[int | None] = [None] * self.num_envs
        for i in np.flatnonzero(done):
            self.episode_index[i] += 1
            self.episode_return[i] = 0.0
            self.episode_length[i] = 0
            self.episode_actions[i] = []
            seeds[i] = episode_seed(self.env_seeds[i], self.episode_index[i])
        obs, _ = self.envs.reset(seed=seeds, options={"reset_mask": np.asarray(done, dtype=np.bool_)})
        return self._flat(obs)

    def _flat(self, obs: Any) -> Tensor:
        return torch.from_numpy(np.asarray(obs, dtype=np.float32).reshape(self.num_envs, -1)).clone()
