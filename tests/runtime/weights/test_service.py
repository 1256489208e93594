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
