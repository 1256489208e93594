"""Metric names, reporters, the step timer, consistency and bubble metrics."""

from __future__ import annotations

import io
import json
import math

import pytest

from runtime import contract
from runtime import metrics as M
from runtime.contract import METRICS
from runtime.metrics import (
    JsonlReporter,
    MultiReporter,
    ProgressReporter,
    Reporter,
    ReporterError,
    StepTimer,
    bubble_fraction,
    build_reporters,
    consistency_metrics,
    format_progress,
    read_jsonl,
)
from runtime.spec import MetricsSpec

CONTRACT_NAMES = """reward/mean reward/std accuracy eval/accuracy loss/policy loss/value loss/kl entropy kl_ref
clip_fraction grad_norm lr response_len/mean response_len/max staleness/mean staleness/max queue/depth
queue/watermark samples/dropped_stale throughput/gen_tokens_per_s throughput/train_tokens_per_s
throughput/samples_per_s time/generate time/train time/weight_sync time/wait bubble/trainer train/padding_ratio
train/computed_tokens_ratio train/shared_prefix train/packed
consistency/logprob_diff_mean consistency/logprob_diff_max consistency/kl weights/version""".split()
# the rollout bubbles and dynamic parallelism of the multi-instance rollout, and reward-service drops
CONTRACT_NAMES += """rollout/padding_ratio rollout/skewness rollout/sorting_wait rollout/active_instances
samples/dropped_reward""".split()
# workload gym: evaluation and episode returns, env steps, and the PPO / DQN learners' own
CONTRACT_NAMES += """eval/return_mean eval/return_min eval/return_max episode/return_mean episode/return_min
episode/return_max episode/length_mean episode/count env/steps throughput/env_steps_per_s approx_kl loss/td
td_error q/mean epsilon target/syncs replay/size""".split()
# workload gym: the roles (issue 16): target-sync events and wait, the version an evaluation ran with
CONTRACT_NAMES += "target/sync_events time/target_sync_wait eval/weights_version".split()


def test_metric_names_are_exactly_the_contract_ones_with_meanings():
    assert sorted(METRICS) == sorted(CONTRACT_NAMES)
    assert all(isinstance(v, str) and v.endswith(".") and "\n" not in v for v in METRICS.values())
    constants = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str) and v in METRICS}
    assert constants == set(METRICS)  # each name has its constant


def test_per_rank_communication_names_round_trip_and_stay_out_of_metrics():
    # trainer ranks' gradient communication (runtime.train.parallel.CommClock): comm/rank<k>/<field>
    assert sorted(contract.COMM_METRICS) == ["grad_s", "grad_wait_s"]
    assert all(v.endswith(".") and "\n" not in v for v in contract.COMM_METRICS.values())
    assert contract.comm_metric(3, contract.COMM_GRAD) == "comm/rank3/grad_s"
    assert contract.split_comm_metric("comm/rank12/grad_wait_s") == (12, "grad_wait_s")
    for other in ("comm/rank1/nonsense", "comm/rank/grad_s", "comm/rank01/grad_s", "comm/0/grad_s", "reward/mean"):
        assert contract.split_comm_metric(other) is None, other
    with pytest.raises(ValueError):
        contract.comm_metric(0, "watts")
    with pytest.raises(ValueError):
        contract.comm_metric(-1, contract.COMM_GRAD)
    assert not [name for name in METRICS if name.startswith(contract.COMM_PREFIX)]
    # every rank's fields fit one ingest point beside the step's other metrics
    assert 2 * contract.COMM_MAX_RANKS + len(METRICS) <= contract.MAX_METRICS_PER_POINT


# ---------------------------------------------------------------- JSONL


def test_jsonl_lines_parse_and_hold_step_time_metrics(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    r = JsonlReporter(path)
    r.report(1, {"reward/mean": 0.5, "weights/version": 1, "lr": float("nan")})
    r.event("checkpoint", {"step": 1, "path": tmp_path, "loss": float("inf")})
    r.report(2, {"reward/mean": 0.75})
    # flushed per line: readable before close
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert set(first) == {"step", "time", "reward/mean", "weights/version", "lr"}
    assert (first["step"], first["reward/mean"], first["weights/version"], first["lr"]) == (1, 0.5, 1, None)
    assert isinstance(first["weights/version"], int)
    assert json.loads(lines[1])["payload"] == {"step": 1, "path": str(tmp_path), "loss": None}
    r.close()
    steps, events = read_jsonl(path)
    assert [s["step"] for s in steps] == [1, 2]
    assert [e["event"] for e in events] == ["checkpoint"]


def test_jsonl_resume_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    r = JsonlReporter(path)
    r.report(1, {"accuracy": 0.1})
    r.close()
    r = JsonlReporter(path)
    r.report(2, {"accuracy": 0.2})
    r.close()
    steps, _ = read_jsonl(path)
    assert [(s["step"], s["accuracy"]) for s in steps] == [(1, 0.1), (2, 0.2)]


def test_jsonl_resume_at_cursor_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    r = JsonlReporter(path)
    r.report(1, {"accuracy": 0.1})
    r.report(2, {"accuracy": 0.2})
    cursor = r.cursor()  # saved with the checkpoint of step 2
    r.report(3, {"accuracy": 0.3})  # written, then the run crashed
    r.close()

    r = JsonlReporter(path, truncate_at=cursor)
    r.report(3, {"accuracy": 0.33})
    r.close()
    steps, _ = read_jsonl(path)
    assert [(s["step"], s["accuracy"]) for s in steps] == [(1, 0.1), (2, 0.2), (3, 0.33)]


def test_jsonl_torn_last_line_is_removed_on_reopen(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0, "accuracy": 0.5}\n{"step": 2, "ti')
    steps, _ = read_jsonl(path)
    assert [s["step"] for s in steps] == [1]
    r = JsonlReporter(path)
    r.report(2, {"accuracy": 0.6})
    r.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_jsonl_bad_cursor_and_bad_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    with pytest.raises(ReporterError, match="cannot resume at byte 99; the file has 12 bytes"):
        JsonlReporter(path, truncate_at=99)
    assert path.read_text() == '{"step": 1}\n'  # untouched
    r = JsonlReporter(path)
    with pytest.raises(ReporterError, match=r"metric 'accuracy': 'high' is not a number"):
        r.report(2, {"accuracy": "high"})
    with pytest.raises(ReporterError, match=r"\['step'\] are reserved"):
        r.report(2, {"step": 3})
    r.close()
    assert path.read_text() == '{"step": 1}\n'


def test_jsonl_accepts_tensor_and_numpy_scalars(tmp_path):
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    r = JsonlReporter(tmp_path / "m.jsonl")
    r.report(1, {"loss/policy": torch.tensor(0.25), "grad_norm": np.float32(2.0), "queue/depth": np.int64(3)})
    r.close()
    (rec,), _ = read_jsonl(tmp_path / "m.jsonl")
    assert (rec["loss/policy"], rec["grad_norm"], rec["queue/depth"]) == (0.25, 2.0, 3.0)


# ---------------------------------------------------------------- progress line


def test_format_progress_full_and_sparse():
    m = {
        "reward/mean": 0.425,
        "accuracy": 0.375,
        "staleness/mean": 0.5,
        "staleness/max": 1,
        "throughput/gen_tokens_per_s": 1234.4,
        "throughput/samples_per_s": 2.54,
        "loss/policy": 0.1,
    }
    assert format_progress(12, 50, m) == (
        "step 12/50 | reward 0.425 | acc 0.375 | stale 0.50/1 | gen 1234 tok/s | 2.5 samples/s"
    )
    assert format_progress(3, None, {"eval/accuracy": 0.5}) == "step 3 | eval 0.500"
    assert format_progress(5, 10, {"reward/mean": float("nan")}, bar_width=10, eta_s=75) == (
        "[#####.....] step 5/10 | reward - | eta 1m15s"
    )


def test_progress_plain_lines_when_not_a_tty():
    out = io.StringIO()
    p = ProgressReporter(total_steps=4, stream=out)
    p.report(1, {"reward/mean": 0.5})
    p.event("eval", {"step": 1, "eval/accuracy": 0.25})
    p.report(2, {"reward/mean": 0.75})
    p.close()
    assert out.getvalue() == ("step 1/4 | reward 0.500\n[eval] step=1 eval/accuracy=0.25\nstep 2/4 | reward 0.750\n")


def test_progress_redraws_in_place_on_a_tty():
    clock = iter([0.0, 10.0, 20.0])
    out = io.StringIO()
    p = ProgressReporter(total_steps=4, stream=out, tty=True, clock=lambda: next(clock))
    p.report(1, {"accuracy": 0.125})
    p.report(2, {})
    p.event("checkpoint", {"step": 2})
    p.report(3, {})
    p.close()
    first = "[#####...............] step 1/4 | acc 0.125"
    second = "[##########..........] step 2/4 | eta 0m20s"
    third = "[###############.....] step 3/4 | eta 0m10s"
    assert out.getvalue() == (
        "\r" + first + "\r" + second.ljust(len(first)) + "\n[checkpoint] step=2\n" + "\r" + third + "\n"
    )


# ---------------------------------------------------------------- fan-out and construction


class Recorder:
    def __init__(self, fail_close: bool = False):
        self.calls: list = []
        self.fail_close = fail_close

    def report(self, step, metrics):
        self.calls.append(("report", step, dict(metrics)))

    def event(self, kind, payload):
        self.calls.append(("event", kind, dict(payload)))

    def close(self):
        self.calls.append(("close",))
        if self.fail_close:
            raise OSError("disk gone")


def test_multi_reporter_fans_out_and_closes_everything():
    a, b = Recorder(fail_close=True), Recorder()
    multi = MultiReporter([a, b])
    assert isinstance(multi, Reporter) and isinstance(a, Reporter)
    multi.report(1, {"lr": 0.1})
    multi.event("resume", {"step": 1})
    with pytest.raises(OSError, match="disk gone"):
        multi.close()
    expected = [("report", 1, {"lr": 0.1}), ("event", "resume", {"step": 1}), ("close",)]
    assert a.calls == expected and b.calls == expected


def test_build_reporters_from_spec(tmp_path):
    out = io.StringIO()
    multi = build_reporters(MetricsSpec(), tmp_path, total_steps=3, stream=out)
    assert [type(r) for r in multi.reporters] == [ProgressReporter, JsonlReporter]
    multi.report(1, {"reward/mean": 1.0})
    multi.close()
    assert out.getvalue() == "step 1/3 | reward 1.000\n"
    assert [s["step"] for s in read_jsonl(tmp_path / "metrics.jsonl")[0]] == [1]

    none = build_reporters(MetricsSpec(progress_bar=False, jsonl=False), tmp_path / "x")
    assert none.reporters == []


# ---------------------------------------------------------------- timer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_timer_split_sums_sections():
    clock = FakeClock()
    t = StepTimer(clock=clock)
    with t.section("generate"):
        clock.now += 2.0
    with t.section("train"):
        clock.now += 1.5
    with t.section("generate"):
        clock.now += 0.5
    t.add("weight_sync", 0.25)
    assert t.split() == {"time/generate": 2.5, "time/train": 1.5, "time/weight_sync": 0.25, "time/wait": 0.0}
    assert sum(t.split().values()) == clock.now - 100.0 + 0.25
    assert t.lap()["time/train"] == 1.5
    assert t.split() == {"time/generate": 0.0, "time/train": 0.0, "time/weight_sync": 0.0, "time/wait": 0.0}


def test_timer_counts_a_section_that_raised_and_rejects_bad_input():
    clock = FakeClock()
    t = StepTimer(clock=clock)
    with pytest.raises(RuntimeError), t.section("wait"):
        clock.now += 3.0
        raise RuntimeError("boom")
    assert t.split()["time/wait"] == 3.0
    with pytest.raises(ValueError, match="no '/'"):
        with t.section("a/b"):
            pass
    with pytest.raises(ValueError, match="negative duration"):
        t.add("train", -1)


def test_timer_with_the_real_clock_is_nonnegative():
    t = M.Timer()
    with t.section("eval"):
        sum(range(1000))
    assert t.split()["time/eval"] >= 0.0


# ---------------------------------------------------------------- consistency and bubble


def test_consistency_on_hand_computed_values():
    engine = [[-1.0, -2.0], [-0.5]]
    trainer = [[-1.0, -1.5], [-0.7]]
    got = consistency_metrics(engine, trainer)
    # deltas (trainer - engine): 0, +0.5, -0.2
    k3 = [0.0, (math.exp(0.5) - 1) - 0.5, (math.exp(-0.2) - 1) + 0.2]
    assert got["consistency/logprob_diff_mean"] == pytest.approx(0.7 / 3, abs=1e-15)
    assert got["consistency/logprob_diff_max"] == 0.5
    assert got["consistency/kl"] == pytest.approx(sum(k3) / 3, rel=1e-12)
    assert got["consistency/kl"] == pytest.approx(0.0558173, abs=1e-6)  # (0.1487213 + 0.0187308) / 3


def test_consistency_identical_and_empty():
    same = [[-0.1, -3.0], [-2.0]]
    assert consistency_metrics(same, same) == {
        "consistency/logprob_diff_mean": 0.0,
        "consistency/logprob_diff_max": 0.0,
        "consistency/kl": 0.0,
    }
    assert consistency_metrics([], []) == consistency_metrics([[]], [[]]) == consistency_metrics(same, same)


def test_consistency_tiny_differences_stay_positive():
    got = consistency_metrics([[-1.0]], [[-1.0 + 1e-7]])
    assert got["consistency/kl"] == pytest.approx(0.5e-14, rel=1e-6)


def test_consistency_shape_mismatch_names_the_sequence():
    with pytest.raises(ValueError, match="engine_logprobs has 2 sequences, trainer_logprobs 1"):
        consistency_metrics([[0.0], [0.0]], [[0.0]])
    with pytest.raises(ValueError, match="sequence 1: engine has 2 logprobs, trainer 1"):
        consistency_metrics([[0.0], [0.0, 0.0]], [[0.0], [0.0]])


def test_consistency_zero_probability_token_is_infinite_kl():
    got = consistency_metrics([[-1.0]], [[-math.inf]])
    assert got["consistency/kl"] == math.inf
    assert consistency_metrics([[-1000.0]], [[0.0]])["consistency/kl"] == math.inf


def test_bubble_fraction():
    assert bubble_fraction(1.0, 4.0) == 0.25
    assert bubble_fraction(0.0, 0.0) == 0.0
    assert bubble_fraction(5.0, 4.0) == 1.0
    with pytest.raises(ValueError, match="durations must be >= 0"):
        bubble_fraction(-1.0, 4.0)
