"""The trainer role: turns a step's samples into optimizer updates.

One :meth:`Trainer.train_step` call does, in order:

1. staleness and reward statistics of the samples (``trainer version - sample version``);
2. advantages — GRPO group-normalised (groups gathered across data-parallel
   ranks) or PPO GAE from the critic's values (whitened across ranks);
3. a no-grad scoring pass where needed: proximal log-probs (the policy before
   this step's updates, for the off-policy correction), reference log-probs
   (only when ``algorithm.kl_coef > 0`` and a reference is given), the
   critic's old values (PPO);
4. ``trainer.updates_per_step`` mini-batches, each split into micro-batches
   by a token budget (:mod:`runtime.train.batches`: packed rows, a group's
   prompt once per row unit where the attention takes a prepared mask;
   length-sorted padded rows; or the shared-prefix layout that runs a group's
   prompt once and continues its responses from the prompt's KV cache; all
   with the same loss and gradients up to float rounding), gradient
   accumulation with the loss normalised by the whole mini-batch's token /
   sequence counts across ranks (so it equals the full-batch loss), gradients
   summed over the ranks by the strategy's engine (DDP or FSDP2, see
   :mod:`runtime.train.parallel`; ranks hold disjoint shards of samples),
   then the algorithm's parameter-update step (default: gradient clipping,
   AdamW, linear warm-up).

Where a forward or backward is a collective (every forward with fsdp, the
reducing backward with ddp) every rank runs as many micro-batches as the
rank with the most: a short rank runs zero-weight padding micro-batches.

With ``updates_per_step == 1`` the proximal policy *is* the policy being
differentiated, so its log-probs are the detached log-probs of the training
forward pass and the extra scoring pass is skipped.

Sequences are right-padded; position ids count real tokens
(:func:`runtime.models.positions_from_mask`) and log-probs use
:func:`runtime.models.logprobs.logprobs_and_entropy` at the rollout temperature, the
same math as the engine's :func:`runtime.models.logprobs_from_logits`, a chunk of
rows at a time (no whole-vocabulary float32 tensor).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from runtime import metrics as M
from runtime.contract import (
    ACCURACY,
    COMM_GRAD,
    COMM_GRAD_WAIT,
    COMM_MAX_RANKS,
    COMPUTED_TOKENS_RATIO,
    CONSISTENCY_DIFF_MAX,
    CONSISTENCY_DIFF_MEAN,
    CONSISTENCY_KL,
    GRAD_NORM,
    LOSS_POLICY,
    LOSS_VALUE,
    LR,
    PACKED_SHARE,
    PADDING_RATIO,
    RESPONSE_LEN_MAX,
    RESPONSE_LEN_MEAN,
    REWARD_MEAN,
    REWARD_STD,
    SHARED_PREFIX_SHARE,
    STALENESS_MAX,
    STALENESS_MEAN,
    TRAIN_TOKENS_PER_S,
    comm_metric,
)
from runtime.models.decoder import DecoderForCausalLM
from runtime.models.logprobs import chunked_logprobs, logprobs_and_entropy, positions_from_mask
from runtime.models.lora import adapter_state, adapters_disabled, is_lora
from runtime.samples import Sample
from runtime.train.algos.core import (
    aggregate_loss,
    gae,
    grpo_advantages,
    importance_weights,
    whiten,
)
from runtime.train.algos.core import value_loss as value_loss_fn
from runtime.train.algos.interface import PolicyBatch, UpdateContext, adamw_update
from runtime.train.algos.registry import get_algorithm
from runtime.train.batches import MicroBatchPlan, ResponseLayout, attention_width, plan_micro_batches
from runtime.train.optimizer import AdamW
from runtime.train.parallel import LossScale, ParallelModel, load_shards, save_shards


class TrainerError(ValueError):
    """Bad input to the trainer (message names the field or sample)."""


def _check_samples(samples: list[Sample]) -> None:
    for s in samples:
        if not s.prompt_ids:
            raise TrainerError(f"sample {s.sample_id}: prompt_ids is empty (a response needs a prompt to condition on)")
        if len(s.logprobs) != len(s.response_ids):
            raise TrainerError(
                f"sample {s.sample_id}: {len(s.logprobs)} logprobs for {len(s.response_ids)} response tokens"
            )


# transformers' attention implementations that read packed rows (no mask, restarting position_ids) as
# separate sequences: the mask-building ones through its masking utilities, flash-attention as varlen.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def _check_packs_sequences(model: Any) -> None:
    """Refuse the packed layout for a model whose attention would let packed sequences see each other."""
    if isinstance(model, DecoderForCausalLM):
        return  # the plain decoder masks packed rows itself
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not getattr(model, "_supports_attention_backend", False) or attention not in PACKING_ATTENTION:
        raise TrainerError(
            f"trainer.layout: {type(model).__name__} (attention {attention!r}) cannot mask sequences packed into "
            "one row; set trainer.layout: padded"
        )


def takes_prepared_mask(model: Any) -> bool:
    """Whether ``model``'s attention uses a prepared boolean ``[B, 1, T, T]`` mask as given, which packed rows
    sharing a prompt need: the plain decoder, and transformers' SDPA path (its masking utilities return a 4-D
    mask as is) on a model with no sliding-window layers (a prepared mask would replace their window).
    Flash-attention reads no such mask, and transformers' eager path adds one as float."""
    if isinstance(model, DecoderForCausalLM):
        return True
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    return "sliding_attention" not in (getattr(config, "layer_types", None) or ())


def _warmup(warmup_steps: int):
    def factor(update: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (update + 1) / warmup_steps)

    return factor


# --------------------------------------------------------------------------- trainer


class Trainer:
    """Optimises ``policy`` (and, for PPO, ``critic``) on batches of samples.

    ``process_group``: the data-parallel group of trainer ranks (None: a
    single process). Every rank calls :meth:`train_step` with its own
    disjoint shard of the step's samples; the ranks end every step with
    identical weights (with fsdp: with the shards of the same weights).
    ``ref_policy`` is the frozen reference for the KL penalty (used only when
    ``algorithm.kl_coef > 0``; never sharded). With fsdp ``policy`` and
    ``critic`` are sharded in place, and :meth:`train_step`,
    :meth:`score_logprobs`, :meth:`publish_state`, :meth:`unsharded_policy`,
    :meth:`save_shards` and :meth:`load_state_dict` are collectives: every
    rank calls them together.
    """

    def __init__(
        self,
        spec: Any,
        policy: torch.nn.Module,
        tokenizer: Any,
        device: torch.device | str,
        ref_policy: torch.nn.Module | None = None,
        critic: torch.nn.Module | None = None,
        process_group: Any = None,
    ):
        self.spec = spec
        self.cfg = spec.algorithm
        self.algorithm = get_algorithm(spec.algorithm.name)
        if self.algorithm.needs_critic and critic is None:
            raise TrainerError(f"algorithm.name: {self.algorithm.name} needs a critic (runtime.models.ValueModel)")
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_id)
        self.ref_policy = ref_policy if spec.algorithm.kl_coef > 0 else None
        if self.ref_policy is not None:
            self.ref_policy.requires_grad_(False)
        # LoRA: only the adapters train, sync and go into checkpoints; the reference is the base model itself,
        # the policy's own forward with its adapters switched off (runtime.models.lora).
        self.lora = is_lora(policy)
        if self.lora and self.algorithm.needs_full_weights:
            raise TrainerError(f"model.lora: algorithm {self.algorithm.name} needs full weights; train it without lora")
        self._ref_is_base = (
            self.lora and self.ref_policy is None and spec.model.reference and spec.algorithm.kl_coef > 0
        )
        self.group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        tcfg = spec.trainer
        if tcfg.layout != "padded":
            _check_packs_sequences(policy)
        self.sharded = tcfg.strategy == "fsdp"
        # Wrapped before the optimizers are built: with fsdp they step the sharded parameters.
        self.parallel = ParallelModel(policy, tcfg, process_group, self.device, self.world)
        self.policy = policy  # the parameters and state (with fsdp: the sharded module)
        self.critic = critic if self.algorithm.needs_critic else None
        self.critic_parallel = (
            ParallelModel(self.critic, tcfg, process_group, self.device, self.world)
            if self.critic is not None
            else None
        )
        self.loss_scale = LossScale(tcfg.mixed_precision, self.device)
        self.optimizer = AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=tcfg.lr, weight_decay=tcfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup(tcfg.warmup_steps))
        self.critic_optimizer = None
        self.critic_scheduler = None
        if self.critic is not None:
            self.critic_optimizer = AdamW(
                [p for p in self.critic.parameters() if p.requires_grad],
                lr=tcfg.critic_lr,
                weight_decay=tcfg.weight_decay,
            )
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer, _warmup(tcfg.warmup_steps))
        self.version = 0  # weight version of the policy; +1 per train_step
        self.temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0
        # `auto` packs a group's samples behind one copy of their prompt (runtime.train.batches) where the
        # attention takes the mask that needs: one forward per micro-batch, so it acts with fsdp, gradient
        # checkpointing and a critic alike.
        self.shares_prompts_in_rows = tcfg.layout == "auto" and takes_prepared_mask(policy)
        self.attention_width = attention_width(getattr(policy, "config", None))
        # Elsewhere the shared-prefix layout runs a group's prompt once: it needs the prompt's KV cache with
        # its graph, which gradient checkpointing drops; fsdp would need every rank to agree on the layout per
        # micro-batch; a critic reads a single forward. Where it may act, the planner uses it if it saves tokens.
        self.shared_prefix_allowed = (
            not self.shares_prompts_in_rows
            and not self.sharded
            and not tcfg.gradient_checkpointing
            and self.critic is None
            and tcfg.layout != "packed"
        )
        self._offloaded: dict[int, dict] | None = None

    # ----------------------------------------------------------------- public

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        """Train on this rank's shard of one step's samples; returns the step's metrics (global over ranks)."""
        _check_samples(samples)
        if self._offloaded is not None:
            self.reload_optimizer()
        started = time.perf_counter()
        cfg, tcfg = self.cfg, self.spec.trainer
        stats = _Stats()
        self._sample_stats(samples, stats)

        token_advantages = self._advantages(samples)
        need_proximal = cfg.off_policy != "truncated" and tcfg.updates_per_step > 1
        reuse = need_proximal and cfg.proximal_logprobs == "behaviour"
        if reuse:
            pre = self._proximal_from_behaviour(samples)
        else:
            pre = self._score_pass(samples, proximal=need_proximal)
            if need_proximal:
                self._consistency(samples, pre["proximal"], stats)

        minis = self._mini_batches(len(samples), step)
        for k, mini in enumerate(minis):
            # Reusing the engine's log-probs, the gap is measured in the first update's forwards instead
            # (the weights are still the ones that made the fresh samples).
            self._update(samples, mini, token_advantages, pre, stats, step, measure_consistency=reuse and k == 0)
        self.version += 1

        self._comm_stats(stats)
        out = stats.finish(self.group, self.world)
        out[LR] = out.pop("_lr", float(self.optimizer.param_groups[0]["lr"]))
        elapsed = time.perf_counter() - started
        total_tokens = out.pop("_tokens", 0.0)
        if elapsed > 0:
            out[TRAIN_TOKENS_PER_S] = total_tokens / elapsed
        return out

    @torch.no_grad()
    def score_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-probs of each sample's response tokens (same math as the engine)."""
        _check_samples(samples)
        out: list[list[float]] = [[] for _ in samples]
        plan = self._plan(samples, list(range(len(samples))))  # the layout the training pass would use
        count = self.parallel.agree(len(plan), training=False)  # before any forward: they may all-gather
        for b in range(len(plan)):
            mb = plan.collate(b, samples, self.pad_id, self.device)
            logp = self._token_logprobs(self.parallel.forward, mb, prefix_model=self.parallel.prefix_forward)
            for i, values in zip(mb.indices, mb.split(logp), strict=True):
                out[i] = values.tolist()
        for _ in range(count - len(plan)):
            self._padding_forward(policy=True, critic=False)
        return out

    def set_lr(self, lr: float) -> None:
        """The policy optimizer's base learning rate; the warmup schedule keeps applying on top of it."""
        for i, group in enumerate(self.optimizer.param_groups):
            factor = self.scheduler.lr_lambdas[i](self.scheduler.last_epoch)
            self.scheduler.base_lrs[i] = lr
            group["initial_lr"] = lr
            group["lr"] = lr * factor

    def publish_state(self) -> dict[str, Tensor]:
        """The policy's weights to publish: detached references, not copies (the weight service copies if it
        must); with fsdp the full weights gathered onto rank 0's CPU (a collective; other ranks get {}).
        With LoRA only the adapters: every engine built from the spec holds the same frozen base."""
        state = self.parallel.full_state(adapters_only=self.lora)
        return adapter_state(state) if self.lora else state

    def unsharded_policy(self) -> contextlib.AbstractContextManager[torch.nn.Module | None]:
        """The policy as a plain module with all its weights, for an HF export (with fsdp a collective
        that gathers them; None on ranks > 0)."""
        return self.parallel.unsharded()

    def save_shards(self, directory: str | Path) -> None:
        """fsdp: every rank writes its shards of the policy, critic and optimizers into ``directory``
        (``torch.distributed.checkpoint``; a collective)."""
        save_shards(directory, self._parallel_models(), self._optimizers_by_name(), self.group)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs from the trainer: policy, critic, optimizers, schedulers, version.

        With fsdp the models and optimizers are not in it: they are the shards :meth:`save_shards` writes.
        """
        if self.sharded:
            light: dict[str, Any] = {
                "version": self.version,
                "strategy": "fsdp",
                "scheduler": self.scheduler.state_dict(),
            }
            if self.critic_scheduler is not None:
                light["critic_scheduler"] = self.critic_scheduler.state_dict()
            return self._with_loss_scale(light)
        policy = self.policy.state_dict()
        state: dict[str, Any] = {
            "version": self.version,
            "policy": adapter_state(policy) if self.lora else policy,  # the frozen base is rebuilt from the spec
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        if self.critic is not None and self.critic_optimizer is not None and self.critic_scheduler is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
            state["critic_scheduler"] = self.critic_scheduler.state_dict()
        return self._with_loss_scale(state)

    def _with_loss_scale(self, state: dict[str, Any]) -> dict[str, Any]:
        scale = self.loss_scale.state_dict()
        if scale:
            state["loss_scale"] = scale
        return state

    def load_state_dict(self, state: dict[str, Any], shards: str | Path | None = None) -> None:
        """Restore :meth:`state_dict` output (with fsdp also the shards in ``shards``, written by
        :meth:`save_shards`); training then continues exactly where it stopped."""
        written_with = state.get("strategy", "ddp")
        if written_with != self.spec.trainer.strategy:
            raise TrainerError(
                f"trainer.strategy: the checkpoint's trainer state was written with {written_with}, this run "
                f"trains with {self.spec.trainer.strategy}; resume it with the strategy it was written with"
            )
        if self.sharded:
            self._load_sharded(state, shards)
            return
        missing = [k for k in ("version", "policy", "optimizer", "scheduler") if k not in state]
        if self.critic is not None:
            missing += [k for k in ("critic", "critic_optimizer", "critic_scheduler") if k not in state]
        if missing:
            raise TrainerError(f"trainer state is missing {', '.join(missing)}")
        self._offloaded = None
        self.loss_scale.load_state_dict(state.get("loss_scale", {}))
        self._load_policy(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None and self.critic_optimizer is not None and self.critic_scheduler is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
            self.critic_scheduler.load_state_dict(state["critic_scheduler"])
        self.version = int(state["version"])

    def _load_policy(self, policy: dict[str, Tensor]) -> None:
        if not self.lora:
            self.policy.load_state_dict(policy)
            return
        own = adapter_state(self.policy.state_dict())
        if set(policy) != set(own):
            extra = sorted(set(policy) - set(own))[:3]
            missing = sorted(set(own) - set(policy))[:3]
            raise TrainerError(
                "model.lora: the checkpoint's policy does not hold this run's adapters "
                f"(unexpected {extra}, missing {missing}); resume with the model.lora it was written with"
            )
        self.policy.load_state_dict(policy, strict=False)

    def _load_sharded(self, state: dict[str, Any], shards: str | Path | None) -> None:
        missing = [k for k in ("version", "scheduler") if k not in state]
        if self.critic_scheduler is not None and "critic_scheduler" not in state:
            missing.append("critic_scheduler")
        if missing:
            raise TrainerError(f"trainer state is missing {', '.join(missing)}")
        if shards is None:
            raise TrainerError("trainer.strategy: an fsdp trainer state needs the checkpoint's shards directory")
        self._offloaded = None
        load_shards(shards, self._parallel_models(), self._optimizers_by_name(), self.group)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic_scheduler is not None:
            self.critic_scheduler.load_state_dict(state["critic_scheduler"])
        self.loss_scale.load_state_dict(state.get("loss_scale", {}))
        self.version = int(state["version"])

    def offload_optimizer(self) -> None:
        """Move optimizer state to host memory (frees accelerator memory for generation's KV cache)."""
        if self._offloaded is not None:
            return
        pin = self.device.type != "cpu"
        devices: dict[int, dict] = {}
        for opt in self._optimizers():
            for param, state in opt.state.items():
                for key, value in state.items():
                    if _is_dtensor(value):  # an fsdp shard: moving it moves its local tensor
                        devices.setdefault(id(param), {})[key] = value.device
                        state[key] = value.to("cpu", copy=True)
                    elif isinstance(value, Tensor):
                        devices.setdefault(id(param), {})[key] = value.device
                        host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
                        host.copy_(value)
                        state[key] = host
        self._offloaded = devices
        _empty_cache(self.device)

    def reload_optimizer(self) -> None:
        """Bring optimizer state back to where it was before :meth:`offload_optimizer`."""
        if self._offloaded is None:
            return
        for opt in self._optimizers():
            for param, state in opt.state.items():
                for key, device in self._offloaded.get(id(param), {}).items():
                    value = state[key]
                    # copy=True: on CPU the reloaded state is fresh storage, as it is on an accelerator.
                    pinned = not _is_dtensor(value) and value.is_pinned()
                    state[key] = value.to(device, non_blocking=pinned, copy=True)
        self._offloaded = None

    @property
    def optimizer_offloaded(self) -> bool:
        return self._offloaded is not None

    # ----------------------------------------------------------------- internals

    def _optimizers(self) -> Iterator[torch.optim.Optimizer]:
        yield self.optimizer
        if self.critic_optimizer is not None:
            yield self.critic_optimizer

    def _parallel_models(self) -> dict[str, ParallelModel]:
        models = {"policy": self.parallel}
        if self.critic_parallel is not None:
            models["critic"] = self.critic_parallel
        return models

    def _optimizers_by_name(self) -> dict[str, torch.optim.Optimizer]:
        optimizers: dict[str, torch.optim.Optimizer] = {"policy": self.optimizer}
        if self.critic_optimizer is not None:
            optimizers["critic"] = self.critic_optimizer
        return optimizers

    def _padding_inputs(self) -> dict[str, Tensor]:
        """A two-token sequence of padding: the input of a padding micro-batch."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}

    def _padding_forward(self, policy: bool, critic: bool) -> Tensor:
        """Forwards that contribute nothing, run where other ranks still have micro-batches: the all-gathers
        (fsdp) and gradient reductions (a zero gradient, when it is backpropagated) must be matched."""
        inputs = self._padding_inputs()
        zero = torch.zeros((), device=self.device)
        if policy:
            zero = zero + self.parallel.forward(**inputs, use_cache=False).logits.float().sum() * 0.0
        if critic and self.critic_parallel is not None:
            zero = zero + self.critic_parallel.forward(**inputs).float().sum() * 0.0
        return zero

    def _sample_stats(self, samples: list[Sample], stats: _Stats) -> None:
        rewards = [float(s.reward) for s in samples]
        stats.add_sum("reward", sum(rewards))
        stats.add_sum("reward_sq", sum(r * r for r in rewards))
        stats.add_sum("correct", sum(1.0 for s in samples if s.correct))
        stats.add_sum("samples", float(len(samples)))
        stats.add_sum("resp_tokens", float(sum(len(s.response_ids) for s in samples)))
        stats.add_sum("_tokens", float(sum(s.num_tokens for s in samples)))
        stats.add_max("resp_max", float(max((len(s.response_ids) for s in samples), default=0)))
        lags = [self.version - s.version for s in samples]
        stats.add_sum("lag", float(sum(lags)))
        stats.add_max("lag_max", float(max(lags, default=0)))

    def _advantages(self, samples: list[Sample]) -> list[Tensor]:
        """Per-sample 1-D advantage tensors over response tokens (float32, CPU)."""
        if self.algorithm.advantages == "gae":
            return self._gae_advantages(samples)
        groups = [(s.group_id, float(s.reward)) for s in samples]
        offset = 0
        if self.group is not None:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, groups, group=self.group)
            offset = sum(len(g) for g in gathered[: self.rank])
            groups = [item for g in gathered for item in g]
        if not groups:
            return []
        ids = torch.tensor([g for g, _ in groups], dtype=torch.long)
        rewards = torch.tensor([r for _, r in groups], dtype=torch.float32)
        adv = grpo_advantages(rewards, ids, normalize_std=self.cfg.normalize_adv_std)
        return [torch.full((len(s.response_ids),), float(adv[offset + i])) for i, s in enumerate(samples)]

    @torch.no_grad()
    def _gae_advantages(self, samples: list[Sample]) -> list[Tensor]:
        old_values = self._score_pass(samples, values=True)["old_values"]
        n = len(samples)
        width = max((len(s.response_ids) for s in samples), default=0)
        values = torch.zeros(n, max(width, 1))
        rewards = torch.zeros_like(values)
        mask = torch.zeros_like(values)
        for i, s in enumerate(samples):
            r = len(s.response_ids)
            if r:
                values[i, :r] = old_values[i]
                rewards[i, r - 1] = float(s.reward)  # outcome reward on the terminal token
                mask[i, :r] = 1.0
        adv, returns = gae(rewards, values, mask, self.cfg.gamma, self.cfg.lam)
        # Whiten with statistics of the whole step, across ranks.
        moments = torch.tensor([(adv * mask).sum(), (adv * adv * mask).sum(), mask.sum()], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(moments, group=self.group)
        count = max(float(moments[2]), 1.0)
        mean = moments[0] / count
        var = (moments[1] / count - mean**2).clamp(min=0)
        adv = whiten(adv, mask, mean.float(), var.float())
        self._returns = [returns[i, : len(s.response_ids)].clone() for i, s in enumerate(samples)]
        self._old_values = old_values
        return [adv[i, : len(s.response_ids)].clone() for i, s in enumerate(samples)]

    def _proximal_from_behaviour(self, samples: list[Sample]) -> dict[str, list]:
        """``algorithm.proximal_logprobs: behaviour``: samples made wholly by the current weights take the
        engine's log-probs as proximal ones; only the others (stale, or spanning a weight update) are scored.
        Every rank runs both passes (with fsdp they are collectives), with or without samples to score."""
        pre = self._score_pass(samples)  # the reference's log-probs, where a KL term needs them
        stale = [i for i, s in enumerate(samples) if not s.versions or min(s.versions) != self.version]
        scored = self._score_pass([samples[i] for i in stale], proximal=True, ref=False)["proximal"]
        proximal = [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]
        for i, values in zip(stale, scored, strict=True):
            proximal[i] = values
        pre["proximal"] = proximal
        return pre

    @torch.no_grad()
    def _score_pass(
        self, samples: list[Sample], proximal: bool = False, values: bool = False, ref: bool = True
    ) -> dict[str, list]:
        """No-grad per-sample tensors: proximal log-probs, reference log-probs, critic values. Runs (and with
        fsdp joins the other ranks' collectives) even without samples."""
        want_ref = ref and (self.ref_policy is not None or self._ref_is_base) and not values
        out: dict[str, list] = {}
        if not (proximal or want_ref or values):
            return out
        keys = [k for k, on in (("proximal", proximal), ("ref", want_ref), ("old_values", values)) if on]
        for k in keys:
            out[k] = [None] * len(samples)
        plan = self._plan(samples, list(range(len(samples))), shared_prefix=not values)
        count = self.parallel.agree(len(plan), training=False)  # before any forward: they may all-gather
        for b in range(len(plan)):
            mb = plan.collate(b, samples, self.pad_id, self.device)
            for key in keys:
                if key == "old_values":
                    assert self.critic_parallel is not None  # a critic never gets the shared-prefix layout
                    flat = mb.predicting(self.critic_parallel.forward(**mb.forward_inputs()))
                else:
                    flat = (
                        self._token_logprobs(self.parallel.forward, mb, prefix_model=self.parallel.prefix_forward)
                        if key == "proximal"
                        else self._token_logprobs(self._reference_forward(), mb)
                    )
                for i, t in zip(mb.indices, mb.split(flat.float().cpu()), strict=True):
                    out[key][i] = t
        # A padding forward for each policy forward a micro-batch made (the base reference is one, too).
        policy_forwards = sum(1 for k in keys if k == "proximal" or (k == "ref" and self._ref_is_base))
        for _ in range(count - len(plan)):
            self._padding_forward(policy=policy_forwards > 0, critic="old_values" in keys)
            for _ in range(policy_forwards - 1):
                self._padding_forward(policy=True, critic=False)
        return out

    def _reference_forward(self) -> Callable[..., Any] | None:
        """The KL reference's forward: the frozen copy, or the policy with its adapters switched off."""
        return _AdaptersOff(self.parallel).forward if self._ref_is_base else self.ref_policy

    def _plan(self, samples: list[Sample], indices: list[int], shared_prefix: bool = True) -> MicroBatchPlan:
        """The micro-batches of ``indices``: shared-prefix where this trainer allows it and it saves tokens."""
        allow = shared_prefix and self.shared_prefix_allowed
        tcfg = self.spec.trainer
        return plan_micro_batches(
            samples,
            indices,
            tcfg.micro_batch_tokens,
            allow,
            packed=tcfg.layout != "padded",
            share_prompts=self.shares_prompts_in_rows,
            width_scale=self.attention_width,
        )

    def _token_logprobs(
        self,
        model: Callable[..., Any] | None,
        mb: ResponseLayout,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        prefix_model: Callable[..., Any] | None = None,
    ):
        """Log-probs (and optionally entropy) of the response tokens only, flat ``[n]``."""
        assert model is not None
        picked, targets = mb.logits_and_targets(model, prefix_model)  # [n, V]: response positions only
        # In chunks: no whole-vocabulary float32 tensor (runtime.models.logprobs.logprobs_and_entropy). Entropy is
        # always a metric, a gradient term only with entropy_coef > 0.
        if not with_entropy:
            return chunked_logprobs(picked, targets, self.temperature)
        return logprobs_and_entropy(picked, targets, self.temperature, entropy_grad=entropy_grad)

    def _mini_batches(self, n: int, step: int) -> list[list[int]]:
        k = self.spec.trainer.updates_per_step
        if k == 1:
            return [list(range(n))]
        # A permutation seeded by (seed, step): reproducible, and identical after a resume.
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + step)
        perm = torch.randperm(n, generator=gen).tolist()
        return [perm[i::k] for i in range(k)]

    def _consistency(self, samples: list[Sample], proximal: list[Tensor], stats: _Stats) -> None:
        """Engine vs trainer log-probs on tokens the current weights produced (the only ones that should agree)."""
        fresh = [i for i, s in enumerate(samples) if s.versions and max(s.versions) == self.version == s.version]
        if not fresh:
            return
        engine = [samples[i].logprobs for i in fresh]
        trainer = [proximal[i].tolist() for i in fresh]
        got = M.consistency_metrics(engine, trainer)
        n = float(sum(len(e) for e in engine))
        stats.add_sum("cons_n", n)
        stats.add_sum("cons_diff", got[CONSISTENCY_DIFF_MEAN] * n)
        stats.add_sum("cons_kl", got[CONSISTENCY_KL] * n)
        stats.add_max("cons_max", got[CONSISTENCY_DIFF_MAX])

    def _update(
        self,
        samples: list[Sample],
        mini: list[int],
        advantages: list[Tensor],
        pre: dict[str, list],
        stats: _Stats,
        step: int,
        measure_consistency: bool = False,
    ) -> None:
        """One optimizer update on the mini-batch ``mini`` (indices into ``samples``), all ranks together;
        ``measure_consistency``: compare its forwards' log-probs with the engine's on fresh samples."""
        resp = [len(samples[i].response_ids) for i in mini]
        counts = torch.tensor([float(sum(resp)), float(sum(1 for r in resp if r > 0))], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        num_tokens, num_seqs = float(counts[0]), float(counts[1])
        plan = self._plan(samples, mini)
        stats.add_sum("real_tokens", float(plan.real_tokens))
        stats.add_sum("padded_tokens", float(plan.processed_tokens))
        stats.add_sum("sample_tokens", float(sum(samples[i].num_tokens for i in mini)))
        stats.add_sum("shared_prefix_batches", float(plan.prompt_sharing_batches()))
        stats.add_sum("packed_batches", float(len(plan)) if plan.layout == "packed" else 0.0)
        stats.add_sum("micro_batches", float(len(plan)))
        behaviour = [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]

        loss_total = torch.zeros((), dtype=torch.float64)
        vloss_total = torch.zeros((), dtype=torch.float64)
        count = self.parallel.agree(len(plan), training=True)
        for k in range(count):
            with self._accumulating(last=k == count - 1):
                if k < len(plan):
                    mb = plan.collate(k, samples, self.pad_id, self.device)
                    loss, vloss = self._micro_step(
                        samples, mb, advantages, pre, behaviour, (num_tokens, num_seqs), stats, measure_consistency
                    )
                    loss_total += loss
                    vloss_total += vloss
                else:
                    self.loss_scale.scale(self._padding_forward(policy=True, critic=True)).backward()

        loss_sum = loss_total.clone()
        if self.group is not None:
            dist.all_reduce(loss_sum, group=self.group)
        stats.add_sum("loss_policy", float(loss_sum) / self.world)  # every rank adds the global value
        self.loss_scale.unscale(self.optimizer)
        ctx = UpdateContext(self.policy, self.optimizer, self.scheduler, self.spec.trainer.grad_clip, step)
        result = self.algorithm.update_fn(ctx)
        stats.add_sum("grad_norm", float(result.get("grad_norm", 0.0)) / self.world)
        stats.add_sum("updates", 1.0 / self.world)
        if "lr" in result:
            stats.set_local("_lr", float(result["lr"]))
        if self.critic is not None and self.critic_optimizer is not None:
            if self.group is not None:
                dist.all_reduce(vloss_total, group=self.group)
            stats.add_sum("loss_value", float(vloss_total) / self.world)
            self.loss_scale.unscale(self.critic_optimizer)
            adamw_update(
                UpdateContext(
                    self.critic, self.critic_optimizer, self.critic_scheduler, self.spec.trainer.grad_clip, step
                )
            )
        self.loss_scale.update()

    def _comm_stats(self, stats: _Stats) -> None:
        """This rank's gradient communication in the step (policy and critic), as sums only this rank adds
        to: the step's reduction of the stats hands every rank's own to rank 0, reported as
        ``comm/rank<k>/...`` (runtime.contract.COMM_METRICS; ranks from COMM_MAX_RANKS on report none). One
        rank communicates nothing: no key."""
        timed = [t for t in (m.comm_seconds() for m in self._parallel_models().values()) if t is not None]
        if timed and self.rank < COMM_MAX_RANKS:
            stats.add_sum(f"comm:{self.rank}:{COMM_GRAD}", sum(t[0] for t in timed))
            stats.add_sum(f"comm:{self.rank}:{COMM_GRAD_WAIT}", sum(t[1] for t in timed))

    @contextlib.contextmanager
    def _accumulating(self, last: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for model in self._parallel_models().values():
                stack.enter_context(model.accumulating(last))
            yield

    def _micro_step(
        self,
        samples: list[Sample],
        mb: ResponseLayout,
        advantages: list[Tensor],
        pre: dict[str, list],
        behaviour: list[Tensor],
        counts: tuple[float, float],
        stats: _Stats,
        measure_consistency: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Forward and backward of one micro-batch (rows ``mb.indices`` of ``samples``); returns its policy
        and value losses (float64, detached)."""
        cfg = self.cfg
        num_tokens, num_seqs = counts
        need_entropy_grad = cfg.entropy_coef > 0
        on_the_fly_proximal = "proximal" not in pre and cfg.off_policy != "truncated"
        vloss = torch.zeros((), dtype=torch.float64)
        logp_flat, ent_flat = self._token_logprobs(
            self.parallel.forward,
            mb,
            with_entropy=True,
            entropy_grad=need_entropy_grad,
            prefix_model=self.parallel.prefix_forward,
        )
        logp = torch.zeros(mb.mask.shape, dtype=logp_flat.dtype, device=self.device).index_put(
            (mb.rows, mb.cols), logp_flat
        )
        entropy = torch.zeros_like(logp).index_put((mb.rows, mb.cols), ent_flat)
        behav = mb.scatter(behaviour)
        if cfg.off_policy == "truncated":
            old = behav
        elif on_the_fly_proximal:
            old = logp.detach()
            proximal_list = mb.split(logp_flat.detach().float().cpu())
            self._consistency([samples[i] for i in mb.indices], proximal_list, stats)
        else:
            old = mb.scatter(pre["proximal"])
            if measure_consistency:
                trained = mb.split(logp_flat.detach().float().cpu())
                self._consistency([samples[i] for i in mb.indices], trained, stats)
        weights = importance_weights(old, behav, cfg.is_cap) * mb.mask if cfg.off_policy == "decoupled" else None
        batch = PolicyBatch(
            logprobs=logp,
            old_logprobs=old,
            behaviour_logprobs=behav,
            advantages=mb.scatter(advantages),
            mask=mb.mask,
            is_weights=weights,
            ref_logprobs=mb.scatter(pre["ref"]) if "ref" in pre else None,
            entropy=entropy,
        )
        token_loss, token_metrics = self.algorithm.loss_fn(batch, cfg)
        loss = aggregate_loss(token_loss, mb.mask, cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
        self.loss_scale.scale(loss).backward()
        for name, values in token_metrics.items():
            stats.add_sum(f"tok:{name}", float((values.detach() * mb.mask).sum()))
        stats.add_sum("tok_count", float(mb.mask.sum()))
        if self.critic is not None:
            vloss = self._critic_backward(mb, num_tokens, num_seqs)  # never shared-prefix (shared_prefix_allowed)
        return loss.detach().double().cpu(), vloss

    def _critic_backward(self, mb: ResponseLayout, num_tokens: float, num_seqs: float) -> Tensor:
        assert self.critic_parallel is not None
        values = torch.zeros(mb.mask.shape, dtype=torch.float32, device=self.device)
        flat = mb.predicting(self.critic_parallel.forward(**mb.forward_inputs()))
        values = values.index_put((mb.rows, mb.cols), flat.float())
        token_loss, _ = value_loss_fn(
            values, mb.scatter(self._old_values), mb.scatter(self._returns), mb.mask, self.cfg.value_clip
        )
        loss = aggregate_loss(token_loss, mb.mask, self.cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
        self.loss_scale.scale(self.cfg.vf_coef * loss).backward()
        return loss.detach().double().cpu()


class _AdaptersOff:
    """A LoRA policy's forward with its adapters switched off: the base model, the KL reference. ``module``
    tells the layouts (runtime.train.batches) which model's keywords the forward takes."""

    def __init__(self, parallel: ParallelModel):
        self.parallel = parallel
        self.module = parallel.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.module):
            return self.parallel.forward(*args, **kwargs)


class _Stats:
    """Sums and maxima gathered during a step, reduced across ranks once at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.local: dict[str, float] = {}

    def add_sum(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def add_max(self, key: str, value: float) -> None:
        self.maxes[key] = max(self.maxes.get(key, float("-inf")), value)

    def set_local(self, key: str, value: float) -> None:
        self.local[key] = value

    def finish(self, group: Any, world: int) -> dict[str, float]:
        sums, maxes = self.sums, self.maxes
        if group is not None:
            # Every rank must reduce the same keys in the same order.
            sum_keys = _union_keys(sums, group, world)
            max_keys = _union_keys(maxes, group, world)
            s = torch.tensor([sums.get(k, 0.0) for k in sum_keys], dtype=torch.float64)
            m = torch.tensor([maxes.get(k, float("-inf")) for k in max_keys], dtype=torch.float64)
            if len(s):
                dist.all_reduce(s, group=group)
            if len(m):
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sums = dict(zip(sum_keys, s.tolist(), strict=True))
            maxes = dict(zip(max_keys, m.tolist(), strict=True))
        out: dict[str, float] = dict(self.local)
        n = max(sums.get("samples", 0.0), 1.0)
        mean_r = sums.get("reward", 0.0) / n
        out[REWARD_MEAN] = mean_r
        out[REWARD_STD] = max(sums.get("reward_sq", 0.0) / n - mean_r**2, 0.0) ** 0.5
        out[ACCURACY] = sums.get("correct", 0.0) / n
        out[RESPONSE_LEN_MEAN] = sums.get("resp_tokens", 0.0) / n
        out[RESPONSE_LEN_MAX] = max(maxes.get("resp_max", 0.0), 0.0)
        out[STALENESS_MEAN] = sums.get("lag", 0.0) / n
        out[STALENESS_MAX] = max(maxes.get("lag_max", 0.0), 0.0)
        updates = max(sums.get("updates", 0.0), 1.0)
        out[LOSS_POLICY] = sums.get("loss_policy", 0.0) / updates
        out[GRAD_NORM] = sums.get("grad_norm", 0.0) / updates
        if "loss_value" in sums:
            out[LOSS_VALUE] = sums["loss_value"] / updates
        padded = sums.get("padded_tokens", 0.0)
        out[PADDING_RATIO] = 0.0 if padded == 0 else 1.0 - sums.get("real_tokens", 0.0) / padded
        if sums.get("sample_tokens", 0.0) > 0:
            out[COMPUTED_TOKENS_RATIO] = padded / sums["sample_tokens"]
        if sums.get("micro_batches", 0.0) > 0:
            out[SHARED_PREFIX_SHARE] = sums.get("shared_prefix_batches", 0.0) / sums["micro_batches"]
            out[PACKED_SHARE] = sums.get("packed_batches", 0.0) / sums["micro_batches"]
        tok = max(sums.get("tok_count", 0.0), 1.0)
        for key, value in sums.items():
            if key.startswith("tok:"):
                out[key[4:]] = value / tok
            elif key.startswith("comm:"):  # comm:<rank>:<field>, added by that rank alone (Trainer._comm_stats)
                _, rank, field = key.split(":")
                out[comm_metric(int(rank), field)] = value
        if sums.get("cons_n", 0.0) > 0:
            out[CONSISTENCY_DIFF_MEAN] = sums["cons_diff"] / sums["cons_n"]
            out[CONSISTENCY_KL] = sums["cons_kl"] / sums["cons_n"]
            out[CONSISTENCY_DIFF_MAX] = maxes["cons_max"]
        out["_tokens"] = sums.get("_tokens", 0.0)
        return out


def _union_keys(values: dict[str, float], group: Any, world: int) -> list[str]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, sorted(values), group=group)
    return sorted({k for keys in gathered for k in keys})


def _is_dtensor(value: Any) -> bool:
    """Whether ``value`` is an fsdp shard (a DTensor). Read from ``sys.modules``: importing
    torch.distributed.tensor costs half a second (sympy), and nothing can be a DTensor before fsdp imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _empty_cache(device: torch.device) -> None:
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and hasattr(backend, "empty_cache"):
        backend.empty_cache()
