"""Remote rollout instances: processes of their own that connect to the trainer over TCP.

The link's parts are tested on their own (authentication, the endpoint file, newest-wins weight
pushes); then whole runs with real remote processes (``python -m runtime rollout``): one beside a
local instance, one killed mid-run and replaced, one that outlives its trainer and reconnects to the
trainer resumed from its checkpoint. Every group is accounted for exactly once throughout.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save as save_weights

from runtime.contract import ENDPOINT_FILE
from runtime.control import Control
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.rollout.link import (
    Endpoint,
    LinkError,
    Refused,
    RemotePeer,
    RolloutListener,
    connect,
    decode_weights,
    read_endpoint,
    write_endpoint,
)
from runtime.rollout.remote import NetSubscriber
from runtime.spec import SpecError, load_spec
from tests.runtime.helpers import assert_each_group_once, derived, remote_rollout, tiny_spec

ROOT = Path(__file__).resolve().parents[3]
BASE = derived(
    seed=7,
    pipeline={
        "mode": "async",
        "max_policy_lag": 0,
        "on_lag_exceeded": "throttle",
        "queue_capacity": 32,
        "steps": 6,
        "rollout_listen": "127.0.0.1:0",
        "rollout_reconnect_s": 60,
    },
    resources={"rollout_workers": 1, "remote_rollout_workers": 1, "threads_per_process": 1},
    checkpoint={"interval": 0},
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _spec_file(spec, tmp_path: Path, name: str = "spec.yaml", **changes) -> Path:
    data = spec.resolved()
    for dotted, value in changes.items():
        section, field = dotted.split("__")
        data[section][field] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _accounted_once(trace):
    return assert_each_group_once(
        trace["consumed"], trace["dropped"], trace.get("reward_dropped", []), trace["leftover"]
    )


# ---- the link's parts ---------------------------------------------------------------------------------


def test_only_a_holder_of_the_key_gets_a_hello_through():
    hellos = []

    def admit(conn, hello):
        hellos.append(hello)
        return ("rank 9 is not a remote rollout rank of this run", False)

    listener = RolloutListener("127.0.0.1:0", b"the-key", admit)
    listener.start()
    try:
        endpoint = Endpoint("127.0.0.1", listener.port, "n")
        with pytest.raises((LinkError, EOFError, OSError)):
            connect(endpoint, b"another-key", {"rank": 9})
        deadline = time.monotonic() + 5
        while listener.rejected < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.rejected == 1 and hellos == []  # nothing of the impostor was unpickled
        with pytest.raises(Refused) as refused:
            connect(endpoint, b"the-key", {"rank": 9})
        assert str(refused.value) == "rank 9 is not a remote rollout rank of this run"
        assert refused.value.retry is False
        assert hellos == [{"rank": 9}]
    finally:
        listener.close()


def test_a_client_that_does_not_speak_the_protocol_is_dropped_without_blocking_others():
    admitted = []
    listener = RolloutListener("127.0.0.1:0", b"k", lambda conn, hello: admitted.append(hello) or ("no", False))
    listener.start()
    try:
        silent = socket.create_connection(("127.0.0.1", listener.port))  # never answers the challenge
        with pytest.raises(Refused):
            connect(Endpoint("127.0.0.1", listener.port, "n"), b"k", {"rank": 1})
        assert admitted == [{"rank": 1}]  # served while the silent one still hangs in its handshake
        silent.close()
    finally:
        listener.close()


def test_connections_beyond_the_handshake_limit_are_closed_at_once():
    listener = RolloutListener("127.0.0.1:0", b"k", lambda conn, hello: ("no", False), max_handshakes=1)
    listener.start()
    endpoint = Endpoint("127.0.0.1", listener.port, "n")
    try:
        silent = socket.create_connection(("127.0.0.1", listener.port))  # holds the one handshake slot
        time.sleep(0.2)
        with pytest.raises((LinkError, EOFError, OSError)):  # closed before any challenge
            connect(endpoint, b"k", {"rank": 1})
        assert listener.rejected == 1
        silent.close()  # its handshake fails at once, and the slot is free again
        deadline = time.monotonic() + 10
        while True:
            try:
                connect(endpoint, b"k", {"rank": 1})
            except Refused:
                break  # authenticated and heard: refused by `admit`, as it says
            except (LinkError, EOFError, OSError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        listener.close()


def test_the_endpoint_file_is_private_atomic_and_says_when_the_run_ended(tmp_path):
    path = tmp_path / "run" / ENDPOINT_FILE
    assert read_endpoint(path) is None
    write_endpoint(path, Endpoint("10.0.0.5", 4242, "abc", b"secret"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_endpoint(path) == Endpoint("10.0.0.5", 4242, "abc", b"secret")
    write_endpoint(path, Endpoint("10.0.0.5", 4243, "def"))
    assert read_endpoint(path) == Endpoint("10.0.0.5", 4243, "def", None)
    assert [p.name for p in path.parent.iterdir()] == [ENDPOINT_FILE]  # no temporary file left
    path.write_text('{"address": "10.0.0.5", "po')  # half-written by another writer: not an endpoint yet
    assert read_endpoint(path) is None
    write_endpoint(path, None)
    assert read_endpoint(path) == "ended"


def test_a_peer_gets_work_in_order_and_the_newest_weights_first():
    ours, theirs = socket.socketpair()
    trainer_end, instance_end = Connection(ours.detach()), Connection(theirs.detach())
    peer = RemotePeer(trainer_end, rank=1, pid=0, host="h")
    state = {"w": torch.arange(4, dtype=torch.float32)}
    with peer._cond:  # hold the sender: everything below queues up behind it
        for version in (1, 2, 3):
            peer.push_weights(version, lambda v=version: save_weights({"w": state["w"] * v}))
        for n in range(3):
            peer.put((0, [n]))
        peer.set_epoch(4)
    received = [instance_end.recv() for _ in range(5)]
    assert received[0][0] == "weights" and received[0][1][0] == 3  # versions 1 and 2 were never sent
    assert torch.equal(decode_weights(received[0][1][1])["w"], state["w"] * 3)
    assert received[1:] == [("work", (0, [0])), ("work", (0, [1])), ("work", (0, [2])), ("epoch", 4)]
    peer.put(None)  # stop: sent after what is queued
    assert instance_end.recv() == ("stop", None)
    instance_end.close()
    peer.gone()
    peer.join(timeout=5)
    assert not peer.is_alive() and peer.exitcode == 0


def test_the_net_subscriber_switches_to_the_newest_offer_once():
    sub = NetSubscriber()
    applied = []
    assert sub.switch(lambda s, v: applied.append(v)) is None and sub.latest_version == -1
    assert sub.wait_for(0, timeout=0.01) is False
    sub.offer(3, {})
    sub.offer(5, {})
    assert sub.wait_for(5, timeout=0.01) is True
    assert sub.switch(lambda s, v: applied.append(v)) == 5
    assert sub.switch(lambda s, v: applied.append(v)) is None
    assert applied == [5] and sub.current_version == 5


def test_remote_instances_are_checked_in_the_spec():
    with pytest.raises(SpecError) as err:
        load_spec(derived(pipeline={"mode": "sync"}, resources={"remote_rollout_workers": 1}))
    assert err.value.errors[0]["field"] == "resources.remote_rollout_workers"
    with pytest.raises(SpecError) as err:
        load_spec(derived(pipeline={"mode": "async"}, resources={"rollout_workers": 0}))
    assert err.value.errors[0]["field"] == "resources.rollout_workers"
    with pytest.raises(SpecError) as err:
        load_spec(derived(pipeline={"mode": "async", "rollout_listen": "nohost"}))
    assert err.value.errors[0]["field"] == "pipeline.rollout_listen"
    spec = load_spec(derived(pipeline={"mode": "async"}, resources={"rollout_workers": 0, "remote_rollout_workers": 2}))
    assert spec.resources.all_rollout_workers == 2 and spec.resources.total_devices == 3


def test_an_index_outside_the_run_is_bad_input(tmp_path):
    spec = tiny_spec(tmp_path, "bad-index", BASE)
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "rollout", str(_spec_file(spec, tmp_path)), "--index", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --index: 1 is not a remote rollout instance of this run (resources.remote_rollout_workers=1)"
    )


# ---- whole runs with remote processes -------------------------------------------------------------------


@pytest.mark.slow
def test_a_remote_instance_works_beside_a_local_one_and_a_mismatched_one_is_refused(tmp_path):
    spec = tiny_spec(tmp_path, "remote", BASE)
    out = tmp_path / "remote"
    remote = remote_rollout(_spec_file(spec, tmp_path), 0, tmp_path / "remote.log")  # the key: from the endpoint file
    other = _spec_file(spec, tmp_path, "other.yaml", rollout__temperature=0.5)
    state: dict = {}

    def stop(step, metrics):
        if step == 1:  # a second instance under the same index but another sampling temperature
            bad = remote_rollout(other, 0, tmp_path / "bad.log")
            state["bad"] = bad.wait(timeout=120)
            # the good one started first, but a busy machine may not have it connected yet: the rest of
            # the run must see it serve, so hold the trainer until it is in
            deadline = time.monotonic() + 120
            while "connected to the trainer" not in (tmp_path / "remote.log").read_text():
                assert remote.poll() is None and time.monotonic() < deadline, (tmp_path / "remote.log").read_text()
                time.sleep(0.05)
        return False

    try:
        result = run(spec, stop=stop)
        assert remote.wait(timeout=60) == 0  # told the run ended
    finally:
        remote.kill()
    assert state["bad"] == 2
    assert "its spec differs from the trainer's" in (tmp_path / "bad.log").read_text()
    trace = result["trace"]
    assert {rank for _, rank, _ in trace["issued_to"]} == {0, 1}
    assert [len(s) for s in trace["consumed"]] == [4] * 6
    _accounted_once(trace)
    steps, events = read_jsonl(out / "metrics.jsonl")
    connected = [e["payload"] for e in events if e["event"] == "rollout_connected"]
    assert [e["rank"] for e in connected] == [1] and connected[0]["pid"] == remote.pid
    assert all(r["rollout/active_instances"] == 2 for r in steps)
    assert sum(r["rollout/instance/1/busy_s"] for r in steps) > 0  # it did generate
    assert read_endpoint(out / ENDPOINT_FILE) == "ended"


@pytest.mark.slow
def test_a_killed_remote_instance_is_replaced_by_a_new_process_and_nothing_is_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ROLLOUT_KEY", "k" * 64)  # as the platform gives it: both sides, not in the file
    spec = tiny_spec(tmp_path, "replace", BASE, resources__rollout_workers=0)
    spec_path = _spec_file(spec, tmp_path)
    control = Control()
    procs = [remote_rollout(spec_path, 0, tmp_path / "first.log")]

    def stop(step, metrics):
        if step == 2:
            remote = control.status()["rollout_remote"]
            assert [(r["rank"], r["pid"]) for r in remote] == [(0, procs[0].pid)]
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait(timeout=30)
            procs.append(remote_rollout(spec_path, 0, tmp_path / "second.log"))
        return False

    try:
        result = run(spec, control=control, stop=stop)
        assert procs[1].wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    assert "KEY" not in (tmp_path / "replace" / ENDPOINT_FILE).read_text().upper()
    _, events = read_jsonl(tmp_path / "replace" / "metrics.jsonl")
    assert [(e["event"], e["payload"].get("pid")) for e in events if e["event"].startswith("rollout_")][1:] == [
        ("rollout_connected", procs[0].pid),
        ("rollout_disconnected", None),
        ("rollout_connected", procs[1].pid),
    ]
    gone = next(e["payload"] for e in events if e["event"] == "rollout_disconnected")
    assert gone["rank"] == 0 and gone["reason"] == "its connection closed" and gone["reissued"] >= 1
    trace = result["trace"]
    assert [len(s) for s in trace["consumed"]] == [4] * 6
    _accounted_once(trace)


@pytest.mark.slow
def test_an_instance_that_connects_the_moment_the_trainer_listens_is_admitted_with_its_weights(tmp_path, monkeypatch):
    """A remote instance waiting for the endpoint file connects as soon as it appears. The trainer is held
    right after it starts listening until that instance's hello was answered, so the admission meets the
    trainer at its earliest point: the weights it is admitted with must already be kept (they were not: the
    hello failed in the listener, and the rank served without its ``rollout_connected`` event)."""
    from runtime.pipeline.remote_peers import RemotePeers

    spec = tiny_spec(tmp_path, "early", BASE)
    answered = threading.Event()
    listen, admit = RemotePeers.listen, RemotePeers.admit

    def admit_and_tell(self, conn, hello):
        try:
            return admit(self, conn, hello)
        finally:
            answered.set()

    def listen_and_hold(self):
        listen(self)
        assert answered.wait(120), "the waiting remote instance never said hello"

    monkeypatch.setattr(RemotePeers, "admit", admit_and_tell)
    monkeypatch.setattr(RemotePeers, "listen", listen_and_hold)
    remote = remote_rollout(_spec_file(spec, tmp_path), 0, tmp_path / "remote.log")
    try:
        result = run(spec)
        assert remote.wait(timeout=60) == 0, (tmp_path / "remote.log").read_text()
    finally:
        remote.kill()
    _, events = read_jsonl(tmp_path / "early" / "metrics.jsonl")
    connected = [e["payload"] for e in events if e["event"] == "rollout_connected"]
    assert [(e["rank"], e["pid"]) for e in connected] == [(1, remote.pid)]
    assert {rank for _, rank, _ in result["trace"]["issued_to"]} == {0, 1}
    _accounted_once(result["trace"])


@pytest.mark.slow
def test_a_remote_instance_outlives_its_trainer_and_serves_the_resumed_one(tmp_path):
    spec = tiny_spec(tmp_path, "outlive", BASE, pipeline__steps=8, checkpoint__interval=2, resources__rollout_workers=0)
    spec_path = _spec_file(spec, tmp_path)
    out = tmp_path / "outlive"
    remote = remote_rollout(spec_path, 0, tmp_path / "remote.log")
    trainer_cmd = [sys.executable, "-m", "runtime", "run", str(spec_path)]
    try:
        first = subprocess.Popen(trainer_cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step-00000004").is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        first.kill()  # the trainer dies mid-run: no stop reaches the instance
        first.wait(timeout=30)
        assert read_endpoint(out / ENDPOINT_FILE) not in (None, "ended")
        resumed = subprocess.run(
            [*trainer_cmd, "--resume", str(out / "checkpoints")], cwd=ROOT, capture_output=True, text=True, timeout=180
        )
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert remote.wait(timeout=60) == 0
    finally:
        remote.kill()
    log = (tmp_path / "remote.log").read_text()
    assert log.count("rank 0: connected to the trainer") == 2
    assert "the trainer went away; waiting for it to come back" in log
    steps, _ = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 9))


@pytest.mark.slow
def test_a_silent_remote_instance_is_cut_off_and_its_index_served_by_a_new_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ROLLOUT_KEY", "s" * 64)
    spec = tiny_spec(tmp_path, "silent", BASE, resources__rollout_workers=0, rollout__hang_timeout_s=3)
    spec_path = _spec_file(spec, tmp_path)
    procs = [remote_rollout(spec_path, 0, tmp_path / "first.log")]

    def stop(step, metrics):
        if step == 2:
            procs.append(remote_rollout(spec_path, 0, tmp_path / "second.log"))
            deadline = time.monotonic() + 90
            while "rank 0 is still connected" not in (tmp_path / "second.log").read_text():
                assert time.monotonic() < deadline, "the second instance was never told to wait"
                time.sleep(0.1)
            os.kill(procs[0].pid, signal.SIGSTOP)  # alive but silent: no heartbeat, no result
        return False

    try:
        result = run(spec, stop=stop)
        assert procs[1].wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    _, events = read_jsonl(tmp_path / "silent" / "metrics.jsonl")
    gone = [e["payload"] for e in events if e["event"] == "rollout_disconnected"]
    assert [(g["rank"], g["reason"]) for g in gone] == [
        (0, "sent nothing for rollout.hang_timeout_s=3 s and was killed")
    ]
    connected = [e["payload"]["pid"] for e in events if e["event"] == "rollout_connected"]
    assert connected == [procs[0].pid, procs[1].pid]
    assert "the trainer cannot take rank 0 yet: rank 0 is still connected" in (tmp_path / "second.log").read_text()
    assert "rank 0: connected to the trainer" in (tmp_path / "second.log").read_text()
    _accounted_once(result["trace"])


def test_weights_with_tied_tensors_are_serialised_for_the_link():
    from runtime.rollout.link import WeightBlobs

    shared = torch.arange(6, dtype=torch.float32).view(2, 3)
    state = {"embed.weight": shared, "head.weight": shared, "norm.weight": torch.ones(3)}  # tied, as HF ties them
    blobs = WeightBlobs(keep=1)
    got = decode_weights(blobs.get(5, state))
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    assert blobs.get(5, {}) is blobs.get(5, {})  # serialised once per version
    blobs.get(6, state)
    assert list(blobs._blobs) == [6]  # the newest `keep` versions only


def test_weights_for_a_vllm_engine_cross_the_link_in_its_dtype():
    from runtime.rollout.link import WeightBlobs
    from runtime.spec import load_spec
    from runtime.workloads.llm.models import engine_weight_dtype

    state = {"w": torch.randn(64, 64), "steps": torch.tensor([3])}
    bf16 = decode_weights(WeightBlobs(dtype=torch.bfloat16).get(1, state))
    assert bf16["w"].dtype == torch.bfloat16 and torch.equal(bf16["w"], state["w"].to(torch.bfloat16))
    assert bf16["steps"].dtype == torch.int64  # only floating-point tensors move
    assert len(WeightBlobs(dtype=torch.bfloat16).get(1, state)) < 0.6 * len(WeightBlobs().get(1, state))
    vllm = {"rollout": {"engine": "vllm"}, "model": {"path": "m"}}
    assert engine_weight_dtype(load_spec({**vllm, "trainer": {"mixed_precision": "bf16"}})) == torch.bfloat16
    assert engine_weight_dtype(load_spec(vllm)) == torch.float32
    assert engine_weight_dtype(load_spec({})) is None  # the built-in engine takes what the trainer publishes


@pytest.mark.slow
def test_a_failing_trainer_leaves_its_remote_instances_waiting_for_its_restart(tmp_path):
    spec = tiny_spec(tmp_path, "fails", BASE, resources__rollout_workers=0)
    remote = remote_rollout(_spec_file(spec, tmp_path), 0, tmp_path / "remote.log")

    def stop(step, metrics):
        if step == 2:
            raise RuntimeError("the trainer fails here")
        return False

    try:
        with pytest.raises(RuntimeError, match="the trainer fails here"):
            run(spec, stop=stop)
        deadline = time.monotonic() + 30
        while "the trainer went away; waiting for it to come back" not in (tmp_path / "remote.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert remote.poll() is None  # still alive: no stop was sent, a restarted trainer will find it
        assert read_endpoint(tmp_path / "fails" / ENDPOINT_FILE) not in (None, "ended")
    finally:
        remote.kill()


def test_both_ends_of_a_link_probe_a_silent_peer_with_tcp_keepalive():
    """A peer whose host vanished sends no FIN: keepalive probes find it out instead of it holding its rank."""
    accepted = []

    def admit(conn, hello):
        accepted.append(conn)
        conn.send(("welcome", {}))

    listener = RolloutListener("127.0.0.1:0", b"k", admit)
    listener.start()
    try:
        conn, _ = connect(Endpoint("127.0.0.1", listener.port, "n"), b"k", {"rank": 0})
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        for end in (conn, accepted[0]):
            sock = socket.socket(fileno=os.dup(end.fileno()))
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            finally:
                sock.close()
        conn.close()
        accepted[0].close()
    finally:
        listener.close()


# ---- weights by torch.distributed broadcast (pipeline.remote_weight_sync: broadcast) -------------------


def test_a_broadcast_group_of_its_own_delivers_every_tensor_bit_for_bit():
    import threading

    from runtime.weights.broadcast import BroadcastReceiver, BroadcastSender, manifest_of

    embed = torch.randn(7, 3)
    versions = [
        {"embed": embed, "head": embed, "norm": torch.randn(3).to(torch.bfloat16), "steps": torch.arange(4)},
        {"embed": embed * 2, "head": embed * 2, "norm": torch.ones(3).to(torch.bfloat16), "steps": torch.arange(4) + 1},
    ]
    sender = BroadcastSender("gloo", torch.device("cpu"), timeout_s=30)
    received: list[dict] = []

    def instance():
        receiver = BroadcastReceiver("127.0.0.1", sender.welcome, "gloo", torch.device("cpu"), timeout_s=30)
        for state in versions:
            received.append(receiver.receive(manifest_of(state)))

    thread = threading.Thread(target=instance)
    thread.start()
    for state in versions:
        sender.send(state)
    thread.join(timeout=60)
    assert not thread.is_alive() and len(received) == 2
    for sent, got in zip(versions, received, strict=True):
        assert list(got) == list(sent)
        for name in sent:
            assert got[name].dtype == sent[name].dtype and torch.equal(got[name], sent[name])
    # each connection's group meets under a key prefix of its own, sent only on the authenticated link
    assert sender.welcome["prefix"] != BroadcastSender("gloo", torch.device("cpu"), 5).prefix
    # and its store closes with the connection (no port left open per reconnect)
    port = sender.store.port
    sender.close()
    gc.collect()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.slow
def test_remote_instances_get_their_weights_by_broadcast_when_asked(tmp_path):
    from runtime.contract import CONSISTENCY_DIFF_MAX, WEIGHTS_VERSION

    spec = tiny_spec(tmp_path, "bcast", BASE, resources__rollout_workers=0, pipeline__remote_weight_sync="broadcast")
    out = tmp_path / "bcast"
    remote = remote_rollout(_spec_file(spec, tmp_path), 0, tmp_path / "remote.log")
    try:
        result = run(spec)
        assert remote.wait(timeout=60) == 0  # told the run ended
    finally:
        remote.kill()
    trace = result["trace"]
    assert [len(s) for s in trace["consumed"]] == [4] * 6
    _accounted_once(trace)
    steps, events = read_jsonl(out / "metrics.jsonl")
    connected = [e["payload"] for e in events if e["event"] == "rollout_connected"]
    assert [(e["rank"], e["weight_sync"]) for e in connected] == [(0, "broadcast")]
    # every sample came from the remote instance with max_policy_lag 0: generated with exactly the weights
    # the trainer published, so its log-probabilities agree with the trainer's up to float rounding
    assert max(r[CONSISTENCY_DIFF_MAX] for r in steps) < 1e-3
    assert [r[WEIGHTS_VERSION] for r in steps] == list(range(1, 7))
