"""The vLLM adapter's own logic, driven against a stand-in of the vllm package with vllm 0.30.0's signatures
(the main environment has no vLLM): request streaming and collection, per-token versions across a weight
update, weight loading calls, sleep / wake-up order, seeds. What vLLM itself computes is tested against its CPU
build in tests/vllm/."""

from __future__ import annotations

import pytest
import torch

from runtime.models import CharTokenizer
from runtime.rollout.sampling import SamplingParams
from runtime.rollout.vllm_adapter import LOAD_WEIGHTS, WORKER_EXTENSION, VLLMEngine
from runtime.rollout.vllm_worker import PolicyWeightLoader
from tests.runtime.rollout import vllm_standin


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm_standin.install(monkeypatch)
    return vllm_standin


def engine(max_batch_size: int = 8, sleep_mode: bool = False) -> VLLMEngine:
    return VLLMEngine("/models/policy", CharTokenizer(), "cuda", max_batch_size=max_batch_size, sleep_mode=sleep_mode)


def calls(eng: VLLMEngine, *names: str) -> list[tuple]:
    return [c for c in eng.llm.calls if c[0] in names]


def test_vllm_is_started_for_rl_generation(fake_vllm):
    eng = VLLMEngine(
        "/models/policy", CharTokenizer(), "cuda:0", dtype="bfloat16", seed=5, gpu_memory_utilization=0.7,
        max_batch_size=12, sleep_mode=True,
    )  # fmt: skip
    assert eng.llm.kwargs == {
        "model": "/models/policy",
        "dtype": "bfloat16",
        "seed": 5,
        "gpu_memory_utilization": 0.7,
        "max_num_seqs": 12,
        "enable_sleep_mode": True,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "async_scheduling": False,
    }


def test_a_device_other_than_the_first_visible_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="first device visible"):
        VLLMEngine("/models/policy", CharTokenizer(), "cuda:1")


def test_generate_returns_n_completions_per_prompt_in_prompt_order_with_logprobs_and_versions(fake_vllm):
    eng = engine()
    eng.update_weights(None, 3)
    prompts = [[1, 10, 11], [1, 12, 13, 14, 15, 16, 17]]  # the stand-in answers a k-token prompt in k tokens
    out = eng.generate(prompts, SamplingParams(max_new_tokens=5, n=2), torch.Generator().manual_seed(0))
    assert [c.prompt_index for c in out] == [0, 0, 1, 1]
    assert [len(c.token_ids) for c in out] == [3, 3, 5, 5]
    assert [c.finish_reason for c in out] == ["stop", "stop", "length", "length"]
    assert [c.token_ids[-1] for c in out[:2]] == [vllm_standin.EOS] * 2
    for c in out:
        assert c.logprobs == [pytest.approx(-0.01 * t) for t in c.token_ids]
        assert c.versions == [3] * len(c.token_ids)
    assert eng.stats.completed == 4 and eng.stats.generated_tokens == 16
    assert eng.stats.allocated_tokens == eng.stats.real_tokens == 16 + 2 * (3 + 7)


def test_each_sequence_is_a_request_streamed_with_its_own_seed_drawn_from_the_generator(fake_vllm):
    eng = engine()
    params = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, stop_ids=(5,), n=3)
    first = eng.generate([[1, 10]], params, torch.Generator().manual_seed(42))
    again = eng.generate([[1, 10]], params, torch.Generator().manual_seed(42))
    other = eng.generate([[1, 10]], params, torch.Generator().manual_seed(43))
    assert [c.token_ids for c in first] == [c.token_ids for c in again] != [c.token_ids for c in other]
    adds = calls(eng, "add_request")
    assert len(adds) == 9 and len({rid for _, rid in adds}) == 9  # one request per sequence, unique ids
    sent = eng.sampling_params(params, 4, 123)
    assert (sent.n, sent.max_tokens, sent.seed, sent.logprobs, sent.detokenize) == (1, 4, 123, 0, False)
    assert (sent.temperature, sent.top_p, sent.top_k) == (0.7, 0.9, 0)  # 0: top-k off in vLLM as here
    assert sent.stop_token_ids == [CharTokenizer().eos_id, 5]
    assert sent.output_kind == fake_vllm.RequestOutputKind.DELTA


def test_the_batcher_adds_requests_as_slots_free_up_a_group_at_once(fake_vllm):
    eng = engine(max_batch_size=4)
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    b.submit_group([([1, 10, 11], ("a", j)) for j in range(3)])  # 3 tokens each
    b.submit_group([([1, 12, 13, 14, 15], ("b", j)) for j in range(3)])  # does not fit beside group a
    assert b.wants_more() is False
    done = b.step()
    assert b.admitted == [("a", 0), ("a", 1), ("a", 2)] and b.num_live == 3 and b.num_waiting == 3
    done += b.step() + b.step()
    assert sorted(tag for tag, _ in done) == [("a", 0), ("a", 1), ("a", 2)] and b.num_live == 0
    b.admitted.clear()
    while not b.idle:
        done += b.step()
    assert b.admitted == [("b", 0), ("b", 1), ("b", 2)]
    assert len(done) == 6 and all(len(c.token_ids) == (3 if t[0] == "a" else 5) for t, c in done)


def test_cancel_aborts_live_requests_in_vllm_and_forgets_waiting_ones(fake_vllm):
    eng = engine(max_batch_size=2)
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    for tag in ("old", "old", "new"):
        b.submit([1, 10, 11, 12], tag)
    b.step()
    assert b.cancel(lambda tag: tag == "old") == 2
    added = [rid for _, rid in calls(eng, "add_request")]
    assert calls(eng, "abort_request") == [("abort_request", added[:2])]
    done = []
    while not b.idle:
        done += b.step()
    assert [tag for tag, _ in done] == ["new"]


def test_tokens_after_a_weight_update_carry_the_new_version_and_the_state_is_loaded_into_the_workers(fake_vllm):
    eng = engine()
    b = eng.batcher(SamplingParams(max_new_tokens=6))
    b.submit([1] + [10] * 9, "x")  # 6 tokens, no eos
    b.step()
    b.step()
    state = {"model.embed_tokens.weight": torch.ones(2, 2)}
    eng.update_weights(state, 7)  # between steps: applied at once
    (rpc,) = calls(eng, "collective_rpc")
    assert rpc[1] == LOAD_WEIGHTS and [n for n, _ in rpc[2][0]] == ["model.embed_tokens.weight"]
    assert torch.equal(rpc[2][0][0][1], state["model.embed_tokens.weight"])
    done = []
    while not b.idle:
        done += b.step()
    (_, completion), = done  # fmt: skip
    assert completion.versions == [0, 0, 7, 7, 7, 7]


def test_an_update_arriving_during_a_step_is_applied_when_the_step_ends(fake_vllm):
    eng = engine()
    b = eng.batcher(SamplingParams(max_new_tokens=4))
    b.submit([1] + [10] * 9, "x")
    eng.llm.llm_engine.during_step = lambda: eng.update_weights({"w": torch.zeros(1)}, 1)
    b.step()
    eng.llm.llm_engine.during_step = None
    assert eng.version == 1 and len(calls(eng, "collective_rpc")) == 1  # loaded after the step, not inside it
    assert calls(eng, "step", "collective_rpc")[-2:] == [("step",), calls(eng, "collective_rpc")[0]]
    done = []
    while not b.idle:
        done += b.step()
    assert done[0][1].versions == [0, 1, 1, 1]


def test_colocated_sleep_stages_the_update_and_wake_up_loads_it_between_weights_and_kv_cache(fake_vllm):
    eng = engine(sleep_mode=True)
    eng.sleep()
    eng.update_weights({"w": torch.zeros(1)}, 4)
    assert eng.version == 0 and not calls(eng, "collective_rpc")  # nothing loaded into a sleeping engine
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[1, 10]], SamplingParams(max_new_tokens=2))
    eng.wake_up()
    order = [c[:2] for c in calls(eng, "sleep", "wake_up", "collective_rpc")]
    assert calls(eng, "sleep") == [("sleep", 1, "abort")]
    assert order == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("collective_rpc", LOAD_WEIGHTS),
        ("wake_up", ["kv_cache"]),
    ]
    assert eng.version == 4
    assert eng.generate([[1, 10]], SamplingParams(max_new_tokens=2))[0].versions == [4, 4]


def test_a_wake_up_without_a_newer_state_loads_nothing(fake_vllm):
    eng = engine(sleep_mode=True)
    eng.sleep()
    eng.wake_up()
    assert [c[:2] for c in calls(eng, "sleep", "wake_up", "collective_rpc")] == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
    ]


def test_only_a_colocated_engine_sleeps(fake_vllm):
    with pytest.raises(RuntimeError, match="without sleep mode"):
        engine(sleep_mode=False).sleep()


def test_a_version_only_update_keeps_the_staged_state(fake_vllm):
    eng = engine(sleep_mode=True)
    eng.sleep()
    eng.update_weights({"w": torch.zeros(1)}, 4)
    eng.update_weights(None, 5)
    eng.wake_up()
    assert eng.version == 5 and len(calls(eng, "collective_rpc")) == 1


def test_tokens_are_tagged_with_the_step_that_sampled_them_because_async_scheduling_is_off(fake_vllm):
    eng = engine()
    assert eng.llm.llm_engine.async_scheduling is False  # the stand-in lags a step behind when it is on
    b = eng.batcher(SamplingParams(max_new_tokens=3))
    b.submit([1] + [10] * 9, "x")
    b.step()
    assert (b.num_live, b.stats.generated_tokens) == (1, 1)  # the first step's token came back in that step


def test_vllm_ids_and_aborts_use_the_callers_request_id_not_vllms_internal_one(fake_vllm):
    eng = engine()
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    b.submit([1, 10, 11, 12], "x")
    b.step()
    (rid,) = b._live
    assert rid.startswith("tandem-") and calls(eng, "add_request") == [("add_request", rid)]
    assert b.cancel(lambda tag: True) == 1
    assert calls(eng, "abort_request") == [("abort_request", [rid])] and eng.llm.llm_engine.running == {}


@pytest.mark.parametrize("reason", ["error", "abort", "repetition"])
def test_a_finish_reason_other_than_stop_or_length_is_an_error_not_a_sample(fake_vllm, reason):
    eng = engine()
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    b.submit([1, 10, 11, 12], "x")
    b.step()
    (rid,) = b._live
    eng.llm.llm_engine.end_next_step(rid, reason)
    with pytest.raises(RuntimeError, match=f"finish_reason '{reason}'"):
        b.step()
    assert eng.stats.completed == 0


def test_a_temperature_vllm_cannot_sample_at_is_refused_naming_the_spec_field(fake_vllm):
    eng = engine()
    with pytest.raises(ValueError, match="rollout.temperature 2.5 is above 2.0"):
        eng.generate([[1, 10]], SamplingParams(max_new_tokens=2, temperature=2.5))
    assert not calls(eng, "add_request")
    assert eng.generate([[1, 10]], SamplingParams(max_new_tokens=2, temperature=2.0))  # the bound itself is taken


def test_sleeping_with_requests_in_flight_is_refused(fake_vllm):
    eng = engine(sleep_mode=True)
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    b.submit([1, 10, 11, 12], "x")
    b.step()
    with pytest.raises(RuntimeError, match="requests in flight"):
        eng.sleep()
    assert not calls(eng, "sleep") and not eng.asleep


def test_the_worker_extension_adds_only_its_load_method_and_loads_through_vllms_layerwise_reload():
    # vLLM refuses an extension with an attribute its worker already has: ours brings one method only
    assert [a for a in dir(PolicyWeightLoader) if not a.startswith("__")] == [LOAD_WEIGHTS]
    loaded = []

    class Worker(PolicyWeightLoader):  # vLLM's Worker.reload_weights (tests/vllm/ runs the real one)
        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            assert is_checkpoint_format  # Hugging Face names and layouts, not the kernels' packed ones
            loaded.extend(name for name, _ in weights_iterator)

    getattr(Worker(), LOAD_WEIGHTS)([("model.embed_tokens.weight", torch.ones(2, 2))])
    assert loaded == ["model.embed_tokens.weight"]


def test_requests_carry_their_admission_version_as_cache_salt_and_an_update_resets_the_cache(fake_vllm):
    eng = engine(max_batch_size=2)
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    b.submit([1, 10, 11, 12], "old")
    b.step()
    eng.update_weights({"w": torch.ones(2, dtype=torch.float64)}, 3)
    b.submit([1, 10, 11, 12], "new")
    while not b.idle:
        b.step()
    salts = eng.llm.llm_engine.salts
    assert list(salts.values()) == ["v0", "v3"]  # no request reuses KV cached under another version
    assert calls(eng, "reset_prefix_cache") == [("reset_prefix_cache",)]
    (_, _, (weights,)) = calls(eng, "collective_rpc")[0]
    assert weights[0][1].dtype == torch.float32  # converted to the engine's dtype (the stand-in's float32)
    assert eng.last_update["bytes"] == 8


def test_a_failure_inside_vllms_step_ends_the_batcher_with_an_error_naming_vllm(fake_vllm):
    from runtime.rollout.vllm_batcher import VLLMEngineError

    eng = engine()
    b = eng.batcher(SamplingParams(max_new_tokens=8))
    b.submit([1, 10, 11], "x")

    def dies():
        raise RuntimeError("EngineCore died unexpectedly")

    eng.llm.llm_engine.during_step = dies
    with pytest.raises(VLLMEngineError, match="vLLM's engine failed in a step: RuntimeError: EngineCore died"):
        b.step()
    eng.llm.llm_engine.during_step = None
    eng.update_weights(None, 1)  # the step's end ran: the engine is not left mid-step
    assert eng.version == 1
