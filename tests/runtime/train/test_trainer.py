"""The trainer on a tiny real model: micro-batching, data parallelism, learning, state, offload."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.contract import (
    ACCURACY,
    CLIP_FRACTION,
    CONSISTENCY_DIFF_MAX,
    CONSISTENCY_DIFF_MEAN,
    ENTROPY,
    GRAD_NORM,
    KL_REF,
    LOSS_KL,
    LOSS_POLICY,
    LOSS_VALUE,
    LR,
    METRICS,
    PADDING_RATIO,
    RESPONSE_LEN_MAX,
    RESPONSE_LEN_MEAN,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    TRAIN_TOKENS_PER_S,
)
from runtime.models import ValueModel, build_policy, token_logprobs
from runtime.samples import Sample
from runtime.spec import ModelSpec, load_spec
from runtime.train.algos import Algorithm, adamw_update
from runtime.train.algos.grpo import policy_loss
from runtime.train.batches import make_micro_batches, padded_tokens, padding_ratio
from runtime.train.trainer import Trainer, TrainerError

torch.set_num_threads(1)


def _spec(*overrides: str):
    return load_spec({"seed": 3}, ["rollout.temperature=1.0", *overrides])


def _policy(seed: int = 0):
    return build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=seed)


def _samples(n_prompts: int = 3, group: int = 4, seed: int = 0, version: int = 0) -> list[Sample]:
    """Synthetic samples: random prompts and responses of varied lengths, rewards mixed within every group,
    behaviour log-probs drawn at random (fill them from the policy with `_on_policy` when that matters)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = torch.randint(4, 100, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen).tolist()
        for g in range(group):
            n = int(torch.randint(1, 14, (1,), generator=gen))
            response = torch.randint(4, 100, (n,), generator=gen).tolist()
            out.append(
                Sample(
                    sample_id=p * group + g,
                    prompt_id=p,
                    group_id=100 + p,
                    prompt_ids=[1, *prompt],
                    response_ids=response,
                    logprobs=(-torch.rand(n, generator=gen) * 4 - 3).tolist(),
                    versions=[version] * n,
                    finish_reason="stop",
                    reward=float(g % 2),
                    correct=bool(g % 2),
                )
            )
    return out


def _on_policy(trainer: Trainer, samples: list[Sample]) -> list[Sample]:
    for s, logp in zip(samples, trainer.score_logprobs(samples), strict=True):
        s.logprobs = logp
    return samples


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- micro-batching


def test_make_micro_batches_sorts_by_length_and_respects_budget():
    lengths = [10, 2, 9, 3]
    batches = make_micro_batches(lengths, token_budget=20)
    assert batches == [[0, 2], [3, 1]]
    assert padded_tokens(lengths, batches) == 2 * 10 + 2 * 3
    assert padding_ratio(lengths, batches) == pytest.approx(1 - 24 / 26)
    # One micro-batch for everything: 4 rows of 10 tokens, 24 real.
    assert make_micro_batches(lengths, 10_000) == [[0, 2, 3, 1]]
    assert padding_ratio(lengths, [[0, 2, 3, 1]]) == pytest.approx(0.4)
    # A sequence over the budget still gets a micro-batch of its own.
    assert make_micro_batches([50, 3], 16) == [[0], [1]]
    assert make_micro_batches([], 16) == []


def test_train_step_reports_padding_ratio_of_its_micro_batches():
    policy, tok = _policy()
    trainer = Trainer(_spec("trainer.micro_batch_tokens=20", "trainer.layout=padded"), policy, tok, "cpu")
    trainer.shared_prefix_allowed = False  # the padded layout's accounting (test_batches, test_packed: the others)
    samples = _samples(1, 4)
    for s, total in zip(samples, [10, 2, 9, 3], strict=True):
        s.prompt_ids, s.response_ids = s.prompt_ids[:1], list(range(4, 3 + total))
        s.logprobs, s.versions = [-1.0] * (total - 1), [0] * (total - 1)
    got = trainer.train_step(samples, step=0)
    assert got[PADDING_RATIO] == pytest.approx(1 - 24 / 26, abs=1e-12)


CAPTURED: list[dict[str, torch.Tensor]] = []


def _capture_then_step(ctx):
    CAPTURED.append({n: p.grad.detach().clone() for n, p in ctx.model.named_parameters() if p.grad is not None})
    return adamw_update(ctx)


def capture_grpo():
    return Algorithm(name="capture", loss_fn=policy_loss, update_fn=_capture_then_step)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_give_the_same_gradients_as_one_full_batch(agg):
    samples = _samples(3, 4)
    grads = []
    for budget in (16, 1_000_000):
        CAPTURED.clear()
        policy, tok = _policy()
        spec = _spec(
            f"algorithm.name={__name__}:capture_grpo",
            f"algorithm.loss_agg={agg}",
            f"trainer.micro_batch_tokens={budget}",
        )
        trainer = Trainer(spec, policy, tok, "cpu")
        trainer.train_step(copy.deepcopy(samples), step=0)
        (captured,) = CAPTURED
        grads.append(captured)
    small, full = grads
    assert small.keys() == full.keys() and len(full) > 0
    for name in full:
        torch.testing.assert_close(small[name], full[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in full.values())


# --------------------------------------------------------------------------- learning


def _mean_logprob(trainer: Trainer, samples: list[Sample]) -> float:
    scored = trainer.score_logprobs(samples)
    return sum(sum(x) / len(x) for x in scored) / len(scored)


def test_a_few_steps_on_a_fixed_batch_raise_logprob_of_rewarded_responses():
    policy, tok = _policy()
    trainer = Trainer(_spec("trainer.lr=0.001"), policy, tok, "cpu")
    samples = _on_policy(trainer, _samples(3, 4))
    good = [s for s in samples if s.reward > 0]
    bad = [s for s in samples if s.reward == 0]
    good_before, bad_before = _mean_logprob(trainer, good), _mean_logprob(trainer, bad)
    for step in range(5):
        for s in samples:
            s.versions = [trainer.version] * len(s.response_ids)
        metrics = trainer.train_step(_on_policy(trainer, samples), step)
    good_after, bad_after = _mean_logprob(trainer, good), _mean_logprob(trainer, bad)
    assert good_after > good_before + 0.1
    assert bad_after < bad_before - 0.1
    assert metrics[REWARD_MEAN] == 0.5
    assert metrics[ACCURACY] == 0.5
    assert metrics[GRAD_NORM] > 0
    assert 0 < metrics[ENTROPY] < 5
    assert trainer.version == 5


def test_train_step_metrics_on_policy_consistency_and_staleness():
    policy, tok = _policy()
    trainer = Trainer(_spec(), policy, tok, "cpu")
    samples = _on_policy(trainer, _samples(2, 4))
    got = trainer.train_step(samples, step=0)
    # The engine here is the trainer's own scorer: the two agree to float rounding.
    assert got[CONSISTENCY_DIFF_MAX] < 1e-4
    assert got[STALENESS_MEAN] == 0.0 and got[STALENESS_MAX] == 0.0
    assert got[CLIP_FRACTION] == 0.0  # first and only update: ratio is exactly 1
    assert got[RESPONSE_LEN_MAX] == max(len(s.response_ids) for s in samples)
    assert got[RESPONSE_LEN_MEAN] == pytest.approx(sum(len(s.response_ids) for s in samples) / len(samples))
    assert got[LR] == pytest.approx(1e-4)
    assert TRAIN_TOKENS_PER_S in got
    assert set(got) <= set(METRICS)
    # Two steps later, samples made by version 0 (one token by version 1) are 2 versions behind.
    trainer.train_step(_samples(2, 4, seed=1, version=1), step=1)
    stale = _samples(2, 4, seed=2, version=0)
    stale[0].versions[-1] = 1
    got = trainer.train_step(stale, step=2)
    assert got[STALENESS_MAX] == 2.0 and got[STALENESS_MEAN] == 2.0
    assert CONSISTENCY_DIFF_MEAN not in got  # no sample of the current version to compare


def test_decoupled_correction_changes_nothing_on_policy():
    samples = _samples(2, 4)
    results = []
    for mode in ("none", "decoupled"):
        policy, tok = _policy()
        trainer = Trainer(_spec(f"algorithm.off_policy={mode}", "trainer.updates_per_step=2"), policy, tok, "cpu")
        trainer.train_step(_on_policy(trainer, copy.deepcopy(samples)), step=0)
        results.append(_params(policy))
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_kl_to_reference_only_with_positive_coef_and_a_reference():
    policy, tok = _policy()
    ref = copy.deepcopy(policy)
    samples = _samples(2, 4)
    got = Trainer(_spec("algorithm.kl_coef=0.1"), policy, tok, "cpu", ref_policy=ref).train_step(samples, 0)
    assert got[KL_REF] == 0.0  # first update: policy == reference, exactly
    assert got[LOSS_KL] == 0.0
    policy, tok = _policy()
    got = Trainer(_spec("algorithm.kl_coef=0.0"), policy, tok, "cpu", ref_policy=ref).train_step(samples, 0)
    assert KL_REF not in got and LOSS_KL not in got
    policy, tok = _policy()
    trainer = Trainer(_spec("algorithm.kl_coef=0.1", "trainer.lr=0.01"), policy, tok, "cpu", ref_policy=ref)
    trainer.train_step(samples, 0)
    got = trainer.train_step(samples, 1)
    assert got[KL_REF] > 0  # the policy moved away from the reference


def test_updates_per_step_follow_the_warmup_schedule():
    policy, tok = _policy()
    trainer = Trainer(
        _spec("trainer.updates_per_step=2", "trainer.warmup_steps=4", "trainer.lr=0.001"), policy, tok, "cpu"
    )
    got = trainer.train_step(_samples(2, 4), step=0)
    assert got[LR] == pytest.approx(0.001 * 2 / 4)  # the second update of the step
    got = trainer.train_step(_samples(2, 4, seed=1), step=1)
    assert got[LR] == pytest.approx(0.001)  # update 4 of 4: warm-up complete
    assert trainer.scheduler.last_epoch == 4


# --------------------------------------------------------------------------- plug-in


PLUGIN_CALLS: list[int] = []


def _reinforce(batch, config):
    return -batch.advantages * batch.logprobs * batch.mask, {}


def _sgd(ctx):
    PLUGIN_CALLS.append(ctx.step)
    with torch.no_grad():
        for p in ctx.model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    ctx.model.zero_grad(set_to_none=True)
    return {"grad_norm": 0.0}


def make_reinforce_sgd():
    return _reinforce, _sgd


def test_plugin_loss_and_update_step_drive_training():
    samples = _samples(2, 4)
    policy, tok = _policy()
    twin = copy.deepcopy(policy)
    PLUGIN_CALLS.clear()
    trainer = Trainer(
        _spec(f"algorithm.name={__name__}:make_reinforce_sgd", "trainer.micro_batch_tokens=32"), policy, tok, "cpu"
    )
    trainer.train_step(samples, step=7)
    assert PLUGIN_CALLS == [7]
    # By hand on the twin: token-mean of -A * logp over all response tokens, one SGD step of 0.5.
    rewards = torch.tensor([s.reward for s in samples]).view(2, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
    total = 0.0
    for s, a in zip(samples, adv.tolist(), strict=True):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = token_logprobs(twin, ids, torch.ones_like(ids))[0, len(s.prompt_ids) - 1 :]
        total = total + (-a * logp).sum()
    (total / sum(len(s.response_ids) for s in samples)).backward()
    with torch.no_grad():
        for p in twin.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    for (name, got), want in zip(policy.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- state and offload


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_state_dict_roundtrip_continues_bit_identically(algo):
    overrides = [f"algorithm.name={algo}", "trainer.updates_per_step=2", "trainer.warmup_steps=3", "trainer.lr=0.001"]

    def make(seed):
        policy, tok = _policy(seed)
        critic = ValueModel.from_policy(policy) if algo == "ppo" else None
        return Trainer(_spec(*overrides), policy, tok, "cpu", critic=critic)

    batches = [_samples(2, 4, seed=s) for s in range(4)]
    first = make(0)
    for step in range(2):
        first.train_step(copy.deepcopy(batches[step]), step)
    saved = copy.deepcopy(first.state_dict())
    for step in range(2, 4):
        first.train_step(copy.deepcopy(batches[step]), step)

    second = make(seed=99)  # different initial weights: everything must come from the state
    second.load_state_dict(saved)
    assert second.version == 2
    for step in range(2, 4):
        second.train_step(copy.deepcopy(batches[step]), step)
    a, b = first.state_dict(), second.state_dict()
    for key in ("policy", "critic") if algo == "ppo" else ("policy",):
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"
    assert a["scheduler"] == b["scheduler"]


def test_load_state_dict_names_what_is_missing():
    policy, tok = _policy()
    trainer = Trainer(_spec(), policy, tok, "cpu")
    before = _params(policy)
    with pytest.raises(TrainerError, match="missing optimizer, scheduler"):
        trainer.load_state_dict({"version": 3, "policy": {}})
    assert trainer.version == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_optimizer_offload_roundtrip():
    batches = [_samples(2, 4, seed=s) for s in range(2)]
    policy, tok = _policy()
    twin_policy = copy.deepcopy(policy)
    trainer = Trainer(_spec("trainer.lr=0.001"), policy, tok, "cpu")
    twin = Trainer(_spec("trainer.lr=0.001"), twin_policy, tok, "cpu")
    trainer.train_step(copy.deepcopy(batches[0]), 0)
    twin.train_step(copy.deepcopy(batches[0]), 0)

    state = next(iter(trainer.optimizer.state.values()))
    before = {k: (v.clone(), v.data_ptr()) for k, v in state.items()}
    trainer.offload_optimizer()
    assert trainer.optimizer_offloaded
    for k, v in next(iter(trainer.optimizer.state.values())).items():
        assert v.device.type == "cpu"
        assert v.data_ptr() != before[k][1]  # fresh host storage, the device copy released
        assert torch.equal(v, before[k][0])
    trainer.reload_optimizer()
    assert not trainer.optimizer_offloaded
    for k, v in next(iter(trainer.optimizer.state.values())).items():
        assert torch.equal(v, before[k][0])

    trainer.offload_optimizer()  # train_step reloads by itself
    trainer.train_step(copy.deepcopy(batches[1]), 1)
    twin.train_step(copy.deepcopy(batches[1]), 1)
    assert not trainer.optimizer_offloaded
    for (name, got), want in zip(policy.state_dict().items(), twin_policy.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


# --------------------------------------------------------------------------- PPO


def test_ppo_trains_policy_and_critic_and_critic_loss_falls():
    policy, tok = _policy()
    critic = ValueModel.from_policy(policy)
    trainer = Trainer(_spec("algorithm.name=ppo", "trainer.critic_lr=0.003"), policy, tok, "cpu", critic=critic)
    policy_before, critic_before = _params(policy), _params(critic)
    samples = _samples(2, 4)
    losses = [trainer.train_step(copy.deepcopy(samples), step)[LOSS_VALUE] for step in range(6)]
    assert losses[-1] < losses[0] * 0.7
    assert any(not torch.equal(policy_before[k], v) for k, v in policy.state_dict().items())
    assert any(not torch.equal(critic_before[k], v) for k, v in critic.state_dict().items())


def test_bad_input_is_a_clear_error():
    policy, tok = _policy()
    with pytest.raises(TrainerError, match="algorithm.name: ppo needs a critic"):
        Trainer(_spec("algorithm.name=ppo"), policy, tok, "cpu")
    trainer = Trainer(_spec(), policy, tok, "cpu")
    before = _params(policy)
    samples = _samples(1, 4)
    samples[2].logprobs = samples[2].logprobs[:-1]
    with pytest.raises(TrainerError, match="sample 2: .* logprobs for .* response tokens"):
        trainer.train_step(samples, 0)
    assert trainer.version == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_score_logprobs_match_unpadded_scoring():
    policy, tok = _policy()
    trainer = Trainer(_spec("trainer.micro_batch_tokens=40"), policy, tok, "cpu")
    samples = _samples(2, 3)
    scored = trainer.score_logprobs(samples)
    for s, got in zip(samples, scored, strict=True):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            want = token_logprobs(policy, ids, torch.ones_like(ids))[0, len(s.prompt_ids) - 1 :]
        assert got == pytest.approx(want.tolist(), abs=1e-5)


# --------------------------------------------------------------------------- data parallelism


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DP_OVERRIDES = ("trainer.lr=0.001", "trainer.micro_batch_tokens=48", "algorithm.kl_coef=0.05")


def _dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        policy, tok = _policy()
        trainer = Trainer(
            _spec(*DP_OVERRIDES), policy, tok, "cpu", ref_policy=copy.deepcopy(policy), process_group=dist.group.WORLD
        )
        metrics = []
        for step in range(2):
            # Disjoint shards; interleaving splits every GRPO group across the two ranks.
            shard = _samples(3, 4, seed=step)[rank::world]
            metrics.append(trainer.train_step(shard, step))
        torch.save({"policy": _params(policy), "metrics": metrics}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_data_parallel_equals_single_process_on_the_union(tmp_path):
    mp.spawn(_dp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    policy, tok = _policy()
    trainer = Trainer(_spec(*DP_OVERRIDES), policy, tok, "cpu", ref_policy=copy.deepcopy(policy))
    single = [trainer.train_step(_samples(3, 4, seed=step), step) for step in range(2)]

    initial = _policy()[0].state_dict()
    for name, value in ranks[0]["policy"].items():
        assert torch.equal(value, ranks[1]["policy"][name]), name  # ranks agree exactly
        # Two AdamW steps of lr 1e-3 move every tensor by ~2e-3; summing gradients in another order
        # may differ in the last bits, which Adam's normalisation can grow to ~1e-5 on near-zero gradients.
        assert (value - initial[name]).abs().max() > 1e-3, name
        torch.testing.assert_close(value, policy.state_dict()[name], rtol=0, atol=2e-5, msg=name)
    for key in (REWARD_MEAN, RESPONSE_LEN_MEAN, RESPONSE_LEN_MAX, LOSS_POLICY, GRAD_NORM, KL_REF):
        assert ranks[0]["metrics"][1][key] == pytest.approx(single[1][key], rel=1e-4, abs=1e-7), key
        assert ranks[0]["metrics"][1][key] == ranks[1]["metrics"][1][key], key


@pytest.mark.parametrize("mode", ["none", "decoupled", "truncated"])
def test_each_off_policy_mode_trains_on_stale_samples(mode):
    policy, tok = _policy()
    trainer = Trainer(_spec(f"algorithm.off_policy={mode}", "trainer.updates_per_step=2"), policy, tok, "cpu")
    before = _params(policy)
    # Behaviour log-probs far below the policy's (~ -4.6): a stale sampler.
    got = trainer.train_step(_samples(2, 4), step=0)
    assert all(torch.isfinite(torch.tensor(v)) for v in got.values())
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
    # Only `truncated` takes the ratio against the behaviour policy, which is far from 1 here.
    assert (got[CLIP_FRACTION] > 0.3) == (mode == "truncated")
