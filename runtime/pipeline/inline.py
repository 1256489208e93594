"""The ``sync`` and ``colocated`` modes: generation and training alternate in the trainer's process.

``sync`` copies the new weights into the engine's own weights after every step. ``colocated`` runs the
engine on the trainer's devices: with the built-in engine and ddp it generates with the trainer's own
parameters (zero copy, ``RunSpec.engine_shares_policy``); otherwise (vLLM, or an fsdp-sharded module)
the engine receives the full published state after every step. While generating, the optimizer state
can be offloaded (``pipeline.offload_optimizer``); a colocated vLLM engine sleeps (KV cache released,
weights in host memory) while the trainer trains and wakes — weights, then the new state, then the KV
cache — before it generates or evaluates. The loop's step boundary, checkpoints and directives are the
shared ``runtime.pipeline.driver.RunContext``'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from runtime import metrics as M
from runtime.contract import QUEUE_DEPTH, QUEUE_WATERMARK, SAMPLES_DROPPED_REWARD, TIME_GENERATE, TIME_WAIT
from runtime.pipeline.driver import PipelineError, RunContext, pack_queue
from runtime.sample_queue import SampleQueue

REWARD_ROUNDS = 3  # rounds of fresh prompts a step asks for while the reward service drops groups


class InlineMode:
    """sync and colocated: generation and training alternate in this process."""

    def __init__(self, ctx: RunContext):
        spec = ctx.spec
        self.ctx = ctx
        self.colocated = spec.pipeline.mode == "colocated"
        self.shares_policy = spec.engine_shares_policy  # the engine reads the trainer's own parameters
        self.offload = self.colocated and spec.pipeline.offload_optimizer
        self.worker = ctx.workload.inline_generator(spec, ctx.models, ctx.task, ctx.device, self.colocated)
        self.engine = self.worker.engine
        # vLLM gives an accelerator back to training; on cpu it has no sleep mode (host memory holds both)
        self.sleeps = self.colocated and spec.rollout.engine == "vllm" and self.engine.sleep_mode
        self.publish(initial=True)

    def publish(self, initial: bool = False) -> int:
        """The trainer's weights as its version, to the weight service and the engine (the full state unless
        the engine shares the trainer's module; a sleeping engine loads it when it wakes)."""
        ctx = self.ctx
        state = None if self.shares_policy else ctx.trainer.publish_state()
        version = ctx.weights.version if initial else ctx.weights.publish(state, version=ctx.trainer.version)
        self.engine.update_weights(state, version)
        return version

    @contextmanager
    def generating(self) -> Iterator[None]:
        """The device is generation's: optimizer state offloaded (if asked) before a sleeping engine wakes
        and allocates its KV cache, the engine asleep again before the optimizer state comes back."""
        trainer = self.ctx.trainer
        if self.offload:
            trainer.offload_optimizer()
        if self.sleeps:
            self.engine.wake_up()
        try:
            yield
        finally:
            if self.sleeps:
                self.engine.sleep()
            if self.offload:
                trainer.reload_optimizer()

    def run(self) -> dict[str, Any]:
        ctx, spec, trainer = self.ctx, self.ctx.spec, self.ctx.trainer
        P = spec.items_per_step

        step = ctx.start_step
        if ctx.eval_due(step):
            self.evaluate(step)
            ctx.eval_step = step
        ctx.publish_status(step)
        while step < spec.pipeline.steps:
            timer = M.StepTimer()
            started = time.perf_counter()
            with timer.section("generate"), self.generating():
                samples, gen_tokens = self.generate(P, step)
            with timer.section("train"):
                trained = trainer.train_step(samples, step)
            with timer.section("weight_sync"):
                self.publish()
            step += 1
            split = timer.lap()
            split[TIME_WAIT] = split[TIME_GENERATE]  # lock-step: the trainer idles while generating
            ctx.trace["consumed"].append(sorted({s.group_id for s in samples}))
            ctx.last_metrics = ctx.step_metrics(trained, split, time.perf_counter() - started, samples, gen_tokens)
            ctx.last_metrics[QUEUE_DEPTH] = 0
            ctx.last_metrics[QUEUE_WATERMARK] = len(samples)
            if self.worker.reward is not None:  # the run's reward-service counters so far
                ctx.last_metrics.update(self.worker.reward.metrics())
                ctx.last_metrics[SAMPLES_DROPPED_REWARD] = len(self.worker.dropped) * spec.algorithm.group_size
            ctx.reporters.report(step, ctx.last_metrics)
            ctx.publish_status(step)
            nxt = ctx.boundary(step, self)
            if nxt is None:
                break
            step = nxt
        return ctx.finish(step)

    def generate(self, prompts: int, step: int) -> tuple[list[Any], int]:
        """This step's samples: ``prompts`` groups, minus groups the reward service dropped, which are
        replaced with fresh prompts for up to ``REWARD_ROUNDS`` rounds (a step trains on what it got)."""
        ctx, samples, tokens, missing = self.ctx, [], 0, prompts
        for _ in range(REWARD_ROUNDS):
            items = ctx.source.next(missing, min_version=ctx.weights.version)
            before = len(self.worker.dropped)
            with torch.no_grad():
                got, n = self.worker.generate(items)
            samples.extend(got)
            tokens += n
            missing = len(self.worker.dropped) - before
            if not missing:
                break
        ctx.trace["reward_dropped"] = list(self.worker.dropped)
        if not samples:
            raise PipelineError(
                f"step {step + 1}: the reward service at reward.url gave no reward for any sample in "
                f"{REWARD_ROUNDS} rounds of prompts; see the reward/* metrics"
            )
        return sorted(samples, key=lambda s: s.sample_id), tokens

    # ---- _Mode ----
    def evaluate(self, step: int) -> None:  # at the step boundary, timed apart from the step (time/eval)
        with self.generating():
            metrics = self.ctx.run_eval(self.engine)
        self.ctx.record_eval(step, metrics)

    def checkpoint(self, step: int) -> None:
        empty = pack_queue(SampleQueue(1).snapshot(), self.ctx.workload)
        self.ctx.save_checkpoint(step, {"queue": empty, "in_flight": []})

    def forget_in_flight(self) -> None:
        pass  # nothing is generated between steps

    def restore(self, state: dict[str, Any], offset: int) -> None:
        self.publish()

    def params_changed(self) -> None:
        pass  # eval_interval and lr are read where used; the lag bound means nothing in lock-step

    def tick(self) -> None:
        pass
