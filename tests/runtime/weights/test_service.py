"""WeightService: monotonic versions, zero-copy co-location, shared-memory subscribers, rollback."""

from __future__ import annotations

import pytest
import torch

from runtime.weights.service import WeightError, WeightService, WeightSubscriber, copy_into


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), value), "b": torch.full((2,), -value)}


def test_versions_increase_and_refuse_going_back():
    svc = WeightService(keep=2)
    assert svc.publish(_state(1.0)) == 1
    assert svc.publish(_state(2.0)) == 2
    assert svc.publish(_state(3.0), version=10) == 10
    with pytest.raises(WeightError, match="not newer"):
        svc.publish(_state(4.0), version=10)
    assert svc.version == 10
    assert svc.versions() == [2, 10]  # keep=2


def test_colocated_publish_is_zero_copy():
    model = torch.nn.Linear(2, 2)
    svc = WeightService(keep=0)
    before = model.weight.data_ptr()
    assert svc.publish(None) == 1
    assert svc.versions() == [] and model.weight.data_ptr() == before


def test_history_is_a_copy_not_a_view():
    svc = WeightService(keep=3)
    state = _state(1.0)
    svc.publish(state)
    state["w"].fill_(99.0)
    assert torch.equal(svc.state(1)["w"], torch.full((3, 2), 1.0))


def test_rollback_republishes_under_a_new_version():
    svc = WeightService(keep=3)
    for v in (1.0, 2.0, 3.0):
        svc.publish(_state(v))
    new, weights = svc.rollback(1)
    assert new == 4 and svc.version == 4
    assert torch.equal(weights["w"], _state(1.0)["w"])
    assert torch.equal(svc.state(4)["b"], _state(1.0)["b"])
    with pytest.raises(WeightError, match="not kept"):
        svc.rollback(0)
    assert svc.version == 4


def test_subscriber_switches_only_at_the_boundary_it_chooses():
    svc = WeightService(keep=1)
    sub = WeightSubscriber(svc.shared_handle(_state(0.0)), current_version=0)
    target = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}

    def apply(st, version):
        for k, v in st.items():
            target[k].copy_(v)

    svc.publish(_state(1.0))
    svc.publish(_state(2.0))
    assert (sub.current_version, sub.latest_version) == (0, 2)
    assert torch.equal(target["w"], torch.zeros(3, 2))  # nothing moves until the boundary
    assert sub.switch(apply) == 2
    assert torch.equal(target["w"], _state(2.0)["w"]) and sub.current_version == 2
    assert sub.switch(apply) is None


def test_shared_publish_requires_weights_and_matching_names():
    svc = WeightService()
    svc.shared_handle(_state(0.0))
    with pytest.raises(WeightError, match="needs the weights"):
        svc.publish(None)
    with pytest.raises(WeightError, match="differ from the shared buffer"):
        svc.publish({"w": torch.zeros(3, 2)})
    assert svc.version == 0


def _child(shared, out):
    sub = WeightSubscriber(shared, current_version=0)
    model = torch.nn.Linear(3, 2)
    assert sub.wait_for(3, timeout=60)
    version = sub.switch(copy_into(model))
    # plain lists: a tensor sent through a queue lives in the sender's shared memory, gone once it exits
    out.put((version, model.weight.tolist(), model.bias.tolist()))


def test_spawned_rollout_process_receives_published_version():
    ctx = torch.multiprocessing.get_context("spawn")
    model = torch.nn.Linear(3, 2)
    svc = WeightService(keep=0)
    shared = svc.shared_handle(model.state_dict(), ctx)
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(shared, out))
    proc.start()
    for v in (1.0, 2.0, 3.0):
        svc.publish({"weight": torch.full((2, 3), v), "bias": torch.full((2,), v)})
    version, weight, bias = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert version == 3 and weight == [[3.0] * 3] * 2 and bias == [3.0, 3.0]


class _CountingSubscriber(WeightSubscriber):
    """Counts its looks at the buffer's version."""

    looks = 0

    @property
    def latest_version(self) -> int:
        self.looks += 1
        return super().latest_version


def test_a_throttled_reader_backs_off_while_it_waits_and_still_sees_a_new_version():
    svc = WeightService(keep=0)
    shared = svc.shared_handle(_state(0.0))
    sub = _CountingSubscriber(shared, current_version=0)
    assert sub.wait_for(1, timeout=0.3) is False
    # the interval doubles from 1 ms to 16 ms: about 23 looks in 0.3 s (a busy machine sleeps longer: fewer);
    # a fixed 2 ms poll looked 150 times, each a wake-up taken from the trainer's cores
    assert 2 <= sub.looks <= 30
    svc.publish(_state(1.0))
    sub.looks = 0
    assert sub.wait_for(1, timeout=0.3) is True and sub.looks == 1  # already there: no sleep at all


# ---- the shared buffer's layout and in-place readers ----


def _layer_state(value: float) -> dict[str, torch.Tensor]:
    """A decoder layer's projections in module order, biases after each weight (state_dict order)."""
    state = {}
    for proj, rows in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2), ("o_proj", 3)):
        state[f"layers.0.self_attn.{proj}.weight"] = torch.full((rows, 3), value)
        if proj != "o_proj":
            state[f"layers.0.self_attn.{proj}.bias"] = torch.full((rows,), -value)
    state["layers.0.norm.weight"] = torch.ones(3, dtype=torch.float64)  # another dtype: a storage of its own
    return state


def test_the_shared_layout_puts_siblings_same_named_parameters_side_by_side_in_one_storage():
    like = _layer_state(1.0)
    shared = WeightService().shared_handle(like).tensors
    assert list(shared) == list(like)  # the caller's names and order
    assert all(torch.equal(shared[k], v) and shared[k].is_shared() for k, v in like.items())

    def where(name: str) -> tuple[int, int]:
        t = shared[f"layers.0.self_attn.{name}"]
        return t.untyped_storage().data_ptr(), t.storage_offset()

    storage, offset = where("q_proj.weight")
    assert where("k_proj.weight") == (storage, offset + 12)  # q is 4 x 3
    assert where("v_proj.weight") == (storage, offset + 12 + 6)
    _, bias = where("q_proj.bias")
    assert where("k_proj.bias") == (storage, bias + 4) and where("v_proj.bias") == (storage, bias + 6)
    assert shared["layers.0.norm.weight"].untyped_storage().data_ptr() != storage


def _wait_until(condition, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_publish_waits_for_the_step_an_in_place_reader_is_in_and_then_writes():
    import os
    import threading

    svc = WeightService(keep=0)
    shared = svc.shared_handle(_state(0.0), readers=2)
    waiting_on: list[int] = []
    svc.on_wait = waiting_on.append  # called while the publish waits on a reader inside a step
    sub = WeightSubscriber(shared)
    with sub.reading(1) as version:
        assert version == 0
        publisher = threading.Thread(target=svc.publish, args=(_state(1.0),))
        publisher.start()
        _wait_until(lambda: bool(waiting_on))  # the publish holds the lock and waits for this step
        assert set(waiting_on) == {os.getpid()}
        assert torch.equal(shared.tensors["w"], torch.zeros(3, 2)) and int(shared.meta[0]) == 0  # unwritten
        assert publisher.is_alive()
    publisher.join(timeout=60)
    assert not publisher.is_alive()
    assert torch.equal(shared.tensors["w"], torch.ones(3, 2)) and int(shared.meta[0]) == 1
    with sub.reading(1) as version:
        assert version == 1 and sub.current_version == 0  # current once the step is over
    assert sub.current_version == 1


def test_the_slot_of_a_reader_that_died_inside_a_step_is_freed_for_the_next_publish():
    svc = WeightService(keep=0)
    shared = svc.shared_handle(_state(0.0), readers=2)
    dead = 2**22 + 7  # no such pid here: a reader killed mid-step left its mark
    shared.meta[3] = dead
    svc.reader_gone(12345)  # another pid: nothing of it to free
    assert int(shared.meta[3]) == dead
    svc.reader_gone(dead)
    assert int(shared.meta[3]) == 0
    assert svc.publish(_state(2.0)) == 1 and torch.equal(shared.tensors["b"], torch.full((2,), -2.0))


def test_a_reader_slot_outside_the_buffers_is_refused():
    shared = WeightService().shared_handle(_state(0.0), readers=1)
    with pytest.raises(WeightError, match="reader slot 1 is not one of the buffer's 1"):
        with WeightSubscriber(shared).reading(1):
            pass


def test_a_tied_parameter_is_one_view_under_both_names():
    embed = torch.arange(6.0).view(3, 2)
    shared = WeightService().shared_handle({"embed.weight": embed, "head.weight": embed, "b": torch.ones(2)}).tensors
    assert shared["embed.weight"].data_ptr() == shared["head.weight"].data_ptr()  # a reader binding both stays tied
    assert torch.equal(shared["head.weight"], embed) and shared["b"].data_ptr() != shared["embed.weight"].data_ptr()
