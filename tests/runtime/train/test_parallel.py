"""Training strategies (runtime.train.parallel): DDP and FSDP2 over two gloo ranks give the same training,
FSDP2 shards the training state, mixed precision keeps float32 master weights, gradient checkpointing
recomputes layers without changing the update."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from runtime.contract import (
    COMM_GRAD,
    COMM_GRAD_WAIT,
    COMM_METRICS,
    COMM_PREFIX,
    COMPUTED_TOKENS_RATIO,
    GRAD_NORM,
    LOSS_POLICY,
    PACKED_SHARE,
    SHARED_PREFIX_SHARE,
    comm_metric,
    split_comm_metric,
)
from runtime.train.batches import make_micro_batches
from runtime.train.parallel import CommClock, decoder_layers, training_state_bytes
from runtime.train.trainer import Trainer
from tests.runtime.train.test_trainer import _free_port, _policy, _samples, _spec

torch.set_num_threads(1)

TWO_RANKS = ("resources.trainer_devices=2", "trainer.lr=0.001", "trainer.micro_batch_tokens=48")


def _uneven_shard(step: int, rank: int) -> list:
    """Rank 0 takes 9 of the step's 12 samples, rank 1 the other 3: the ranks run different micro-batch counts."""
    samples = _samples(3, 4, seed=step)
    return samples[:9] if rank == 0 else samples[9:]


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _strategies_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        results = {}
        layouts = ("packed", "padded", "auto")  # auto: a group's samples share their prompt in a packed row
        for strategy, layout in ((strategy, layout) for layout in layouts for strategy in ("ddp", "fsdp")):
            policy, tok = _policy()
            spec = _spec(
                *TWO_RANKS, "trainer.updates_per_step=2", f"trainer.strategy={strategy}", f"trainer.layout={layout}"
            )
            trainer = Trainer(spec, policy, tok, "cpu", process_group=dist.group.WORLD)
            metrics = [trainer.train_step(_uneven_shard(step, rank), step) for step in range(3)]
            results[strategy if layout == "packed" else f"{strategy}-{layout}"] = {
                "metrics": metrics,
                "scored": trainer.score_logprobs(_uneven_shard(3, rank)),
                "published": trainer.publish_state(),
            }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # neither rank tears the group down while the other still talks on it
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_and_fsdp_give_the_same_losses_and_scores_on_uneven_shards(tmp_path):
    counts = [len(make_micro_batches([s.num_tokens for s in _uneven_shard(0, r)], 48)) for r in range(2)]
    assert counts[0] > counts[1]  # the short rank runs padding micro-batches in both strategies

    mp.spawn(_strategies_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    ddp, fsdp = ranks[0]["ddp"], ranks[0]["fsdp"]
    assert ddp["metrics"][0][PACKED_SHARE] == fsdp["metrics"][0][PACKED_SHARE] == 1.0
    assert (
        ranks[0]["ddp-padded"]["metrics"][0][PACKED_SHARE] == ranks[0]["fsdp-padded"]["metrics"][0][PACKED_SHARE] == 0
    )
    for strategy in ("ddp", "fsdp"):
        shared = ranks[0][f"{strategy}-auto"]["metrics"][0]
        assert shared[PACKED_SHARE] == 1.0 and shared[SHARED_PREFIX_SHARE] > 0, strategy
        assert shared[COMPUTED_TOKENS_RATIO] < ddp["metrics"][0][COMPUTED_TOKENS_RATIO]
    # packed, right-padded and prompt-sharing micro-batches, under either strategy: the same training
    others = [fsdp] + [ranks[0][f"{s}-{layout}"] for layout in ("padded", "auto") for s in ("ddp", "fsdp")]
    for other in others:
        for step, (a, b) in enumerate(zip(ddp["metrics"], other["metrics"], strict=True)):
            for key in (LOSS_POLICY, GRAD_NORM):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
    for step, b in enumerate(fsdp["metrics"]):
        assert ranks[1]["fsdp"]["metrics"][step][LOSS_POLICY] == b[LOSS_POLICY]  # global metrics on every rank
    for r in range(2):
        for other in ("fsdp", "ddp-auto", "fsdp-auto"):
            for a, b in zip(ranks[r]["ddp"]["scored"], ranks[r][other]["scored"], strict=True):
                assert b == pytest.approx(a, abs=1e-4), other
    # fsdp gathers the full weights onto rank 0 only, under the names ddp publishes
    assert ranks[1]["fsdp"]["published"] == {}
    assert set(fsdp["published"]) <= set(ddp["published"]) and "model.embed_tokens.weight" in fsdp["published"]
    for name, value in fsdp["published"].items():
        assert not isinstance(value, DTensor) and value.shape == ddp["published"][name].shape, name


def _state_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        results = {}
        for label, overrides in {
            "ddp": ("trainer.strategy=ddp",),
            "fsdp": ("trainer.strategy=fsdp",),
            "fsdp-bf16": ("trainer.strategy=fsdp", "trainer.mixed_precision=bf16"),
        }.items():
            policy, tok = _policy()
            trainer = Trainer(_spec(*TWO_RANKS, *overrides), policy, tok, "cpu", process_group=dist.group.WORLD)
            measured: dict = {}
            forward_dtypes: list = []
            trainer.optimizer.register_step_pre_hook(
                lambda opt, args, kwargs, t=trainer, m=measured: m.update(training_state_bytes(t.policy, opt))
            )
            proj = decoder_layers(trainer.policy)[0].mlp.down_proj
            proj.register_forward_hook(lambda mod, args, out, seen=forward_dtypes: seen.append(out.dtype))
            for step in range(2):  # the second step's optimizer step sees gradients and optimizer state
                trainer.train_step(_samples(3, 4, seed=step)[rank::world], step)
            results[label] = {
                "bytes": measured,
                "forward_dtypes": set(forward_dtypes),
                "param_dtypes": {p.dtype for p in trainer.policy.parameters()},
                "state_dtypes": {
                    v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"
                },
            }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # neither rank tears the group down while the other still talks on it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_state(tmp_path_factory):
    out = tmp_path_factory.mktemp("state")
    mp.spawn(_state_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_fsdp_holds_about_half_of_ddps_training_state_per_rank_at_two_ranks(two_rank_state):
    for rank in two_rank_state:
        ddp, fsdp = rank["ddp"]["bytes"], rank["fsdp"]["bytes"]
        assert ddp["grads"] == ddp["params"]
        assert ddp["optimizer"] == pytest.approx(2 * ddp["params"], rel=0.01)  # AdamW: two moments (and steps)
        whole, shard = sum(ddp.values()), sum(fsdp.values())
        assert shard <= whole / 2 * 1.1, (shard, whole)
        assert shard >= whole / 2 * 0.9, (shard, whole)  # a shard, not a lost part


@pytest.mark.slow
def test_fsdp_bf16_computes_in_bf16_on_float32_master_weights(two_rank_state):
    for rank in two_rank_state:
        assert rank["fsdp"]["forward_dtypes"] == {torch.float32}
        got = rank["fsdp-bf16"]
        assert got["forward_dtypes"] == {torch.bfloat16}
        assert got["param_dtypes"] == {torch.float32} and got["state_dtypes"] == {torch.float32}


def test_ddp_bf16_autocasts_on_float32_master_weights():
    policy, tok = _policy()
    trainer = Trainer(_spec("trainer.mixed_precision=bf16", "trainer.lr=0.001"), policy, tok, "cpu")
    seen: list = []
    decoder_layers(policy)[0].mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer.train_step(_samples(2, 4), 0)
    assert set(seen) == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())  # it trained


def test_gradient_checkpointing_checkpoints_every_layer_and_gives_the_same_update_packed():
    results = {}
    for on in (False, True):  # in the packed layout (test_packed compares it with padded rows)
        policy, tok = _policy()
        spec = _spec("trainer.lr=0.001", f"trainer.gradient_checkpointing={on}", "trainer.layout=packed")
        trainer = Trainer(spec, policy, tok, "cpu")
        assert not trainer.shared_prefix_allowed  # layout packed; checkpointing would drop the prompt cache's graph
        checkpointed = []
        for layer in decoder_layers(policy):
            run = layer._gradient_checkpointing_func if on else None  # HF sets it only when enabled
            if run is not None:
                layer._gradient_checkpointing_func = lambda *a, run=run, seen=checkpointed, **k: (
                    seen.append(1) or run(*a, **k)
                )
        trainer.train_step(_samples(2, 4), 0)
        results[on] = (len(checkpointed), {k: v.clone() for k, v in policy.state_dict().items()})
    (plain_count, plain), (ckpt_count, ckpt) = results[False], results[True]
    assert plain_count == 0 and ckpt_count == len(decoder_layers(_policy()[0]))  # one micro-batch, every layer
    for name, value in plain.items():
        torch.testing.assert_close(ckpt[name], value, rtol=0, atol=1e-6, msg=name)


def test_the_hand_written_gradient_all_reduce_is_gone():
    assert not hasattr(Trainer, "_all_reduce_grads")


# ---------------------------------------------------------------- gradient communication per rank


def _comm_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        results = {}
        for strategy in ("ddp", "fsdp"):
            policy, tok = _policy()
            spec = _spec(*TWO_RANKS, "trainer.updates_per_step=2", f"trainer.strategy={strategy}")
            trainer = Trainer(spec, policy, tok, "cpu", process_group=dist.group.WORLD)
            results[strategy] = [trainer.train_step(_uneven_shard(step, rank), step) for step in range(2)]
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_reports_its_gradient_communication_time_under_ddp_and_fsdp(tmp_path):
    mp.spawn(_comm_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for strategy in ("ddp", "fsdp"):
        for step, metrics in enumerate(ranks[0][strategy]):
            comm = {k: v for k, v in metrics.items() if k.startswith(COMM_PREFIX)}
            assert set(comm) == {comm_metric(r, f) for r in range(2) for f in COMM_METRICS}, (strategy, step)
            for r in range(2):
                in_flight, waited = comm[comm_metric(r, COMM_GRAD)], comm[comm_metric(r, COMM_GRAD_WAIT)]
                assert math.isfinite(in_flight) and in_flight > 0, (strategy, step, r)
                assert math.isfinite(waited) and 0 <= waited <= in_flight + 1e-9, (strategy, step, r)
            # the step's reduction gives every rank all of them
            assert {k: ranks[1][strategy][step][k] for k in comm} == comm
            assert all(split_comm_metric(k) is not None for k in comm)


def test_a_single_rank_reports_no_communication():
    policy, tok = _policy()
    trainer = Trainer(_spec("trainer.micro_batch_tokens=48"), policy, tok, "cpu")
    metrics = trainer.train_step(_uneven_shard(0, 0), 0)
    assert not [k for k in metrics if k.startswith(COMM_PREFIX)]


def test_the_comm_clock_counts_overlapping_spans_once_and_waits_from_the_last_issue():
    clock = CommClock(torch.device("cpu"))
    clock.mark = iter([0.0, 1.0, 3.0, 4.0, 3.5, 10.0, 10.0, 12.0]).__next__  # type: ignore[method-assign]
    clock.begin()
    a = clock.start()  # 0.0
    b = clock.start()  # 1.0
    clock.stop(a)  # 3.0: a is [0, 3]
    c = clock.start()  # 4.0
    clock.stop(b)  # 3.5: b is [1, 3.5]
    clock.stop(c)  # 10.0: c is [4, 10]
    clock.begin()
    d = clock.start(blocking=True)  # 10.0
    clock.stop(d)  # 12.0
    in_flight, waited = clock.take()  # type: ignore[misc]
    assert in_flight == pytest.approx(3.5 + 6.0 + 2.0)  # [0, 3.5] and [4, 10], then [10, 12]
    assert waited == pytest.approx((10.0 - 4.0) + 2.0)  # last issue to last completion; a blocking span whole
    assert clock.take() is None  # taken once
