"""What the runtime and the platform agree on, written down once.

A platform-managed run crosses the boundary between the two halves in a few
places: the role processes the platform launches (their names, the environment
they read, the exit codes they end with), the files they leave in the run
directory for the platform to read (the rollout endpoint, the reporter's
spool), the ingest API they report to, and the commands that ride back on its
replies. Each of those facts lives here and both halves import it: ``jobs``
imports only this module and ``runtime.spec`` from the runtime. Two rules are
whole here rather than named: the ingest batch's schema (the reporter checks
each record against it, the platform every body) and checkpoint retention
(``retained``: the runtime's rotation and the platform's retention task).

Standard library and pydantic only (and no import of another runtime module),
so the platform's web processes import it without torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, GetPydanticSchema, StringConstraints, ValidationError
from pydantic_core import core_schema

# --- role processes ------------------------------------------------------------------------------------

# The platform's names for a run's role processes (RunRole.name, the TANDEM_ROLE variable).
TRAINER_ROLE = "trainer-0"  # the leader: it runs the pipeline, reports, and takes the run's commands
TRAINER_PREFIX = "trainer-"  # + index: trainer-0, then the trainer ranks on further hosts
ROLLOUT_PREFIX = "rollout-"  # + index: the remote rollout roles (resources.rollout_hosts)
EVALUATOR_ROLE = "evaluator"  # the remote evaluator (resources.remote_evaluator)
MAX_ROLE_NAME = 100  # characters; the platform's column holds no more

# ``python -m runtime role <kind>``: what each platform role process runs.
ROLE_KINDS = ("trainer", "trainer-ranks", "rollout", "evaluator")

# How a runtime process ends; the platform decides from the code what happens next.
EXIT_OK = 0
EXIT_FAILED = 1  # the run failed while working (a restart may help)
EXIT_BAD_INPUT = 2  # bad input found before any work started: a restart cannot help
EXIT_NO_TRAINER = 3  # a rollout role found no trainer to serve for pipeline.rollout_reconnect_s

# The environment a role process reads (the token never travels on a command line).
ENV_PLATFORM_URL = "TANDEM_PLATFORM_URL"
ENV_RUN_TOKEN = "TANDEM_RUN_TOKEN"
ENV_RUN_ID = "TANDEM_RUN_ID"
ENV_ATTEMPT = "TANDEM_ATTEMPT"
ENV_ROLE = "TANDEM_ROLE"
ENV_HOST_NAME = "TANDEM_HOST_NAME"
ENV_HEARTBEAT_S = "TANDEM_HEARTBEAT_S"
ENV_HOST_ADDRESS = "TANDEM_HOST_ADDRESS"  # the address the trainer advertises to rollout roles
ENV_ROLLOUT_KEY = "TANDEM_ROLLOUT_KEY"  # the run's shared secret on the trainer <-> rollout link
ENV_RANKS = "TANDEM_RANKS"  # the global trainer ranks a trainer-ranks role runs
ENV_LOCAL_RANKS = "TANDEM_LOCAL_RANKS"  # the leader's own ranks when the group spans hosts

# --- the run directory -----------------------------------------------------------------------------------

ENDPOINT_FILE = "rollout-endpoint.json"  # where the trainer tells rollout roles its address
COMMANDS_FILE = "commands.jsonl"  # command ids a role has acted on (each is acted on once)
SPOOL_DIR = "spool"  # <workdir>/spool/attempt-<n>/: what an attempt's reporter has not delivered yet
SPOOL_FILE = "spool.jsonl"  # records, one JSON object a line, in the order they were reported
CURSOR_FILE = "cursor.json"  # {"offset": bytes of the spool acknowledged by the platform}
TOKEN_FILE = "token"  # the run token the spool was written with (mode 0600)


def spool_dir(workdir: Path, attempt: int) -> Path:
    return Path(workdir) / SPOOL_DIR / f"attempt-{attempt}"


def line_start(fh: Any, pos: int) -> int:
    """Offset just after the last newline before byte ``pos`` of a binary file (0 if none)."""
    while pos > 0:
        step = min(4096, pos)
        fh.seek(pos - step)
        chunk = fh.read(step)
        idx = chunk.rfind(b"\n")
        if idx >= 0:
            return pos - step + idx + 1
        pos -= step
    return 0


def end_of_last_line(path: Path) -> int:
    """Offset just after the last newline of ``path`` (0 if none): a torn last line is not a record."""
    with open(path, "rb") as fh:
        return line_start(fh, fh.seek(0, os.SEEK_END))


def undelivered(directory: str | Path) -> list[dict[str, Any]]:
    """What a reporter's spool still holds undelivered, read only (nothing moves): for a supervisor that
    replays the spool of a process that ended while the platform was unreachable."""
    spool, cursor = Path(directory) / SPOOL_FILE, Path(directory) / CURSOR_FILE
    if not spool.exists():
        return []
    try:
        offset = int(json.loads(cursor.read_text())["offset"]) if cursor.exists() else 0
    except (ValueError, KeyError, TypeError):
        offset = 0  # resending is safe (idempotent keys), skipping is not
    size = end_of_last_line(spool)
    if offset > size:
        offset = 0
    with open(spool, "rb") as fh:
        fh.seek(offset)
        return [json.loads(line) for line in fh.read(size - offset).splitlines() if line.strip()]


# --- how a run ends, what it leaves, what the platform acts on -----------------------------------------

# trainer-0's last stdout line is {"outcome": <one of these>, "steps": n, "checkpoint": path}; the platform
# completes, cancels or requeues the run by it.
OUTCOME_COMPLETED = "completed"
OUTCOME_STOPPED = "stopped"
OUTCOME_PREEMPTED = "preempted"
OUTCOME_CANCELLED = "cancelled"
OUTCOME_OF_COMMAND = {"stop": OUTCOME_STOPPED, "preempt": OUTCOME_PREEMPTED, "cancel": OUTCOME_CANCELLED}

# Events the platform acts on (any other kind is only stored and streamed).
EVENT_CHECKPOINT = "checkpoint"  # payload step, path, weight_version, size, metrics: a checkpoint record
EVENT_RESUME = "resume"  # payload step: a restarted attempt's points after it replace the earlier attempt's
EVENT_ROLLBACK = "rollback"  # payload set_aside: checkpoints moved under CHECKPOINT_DIR/REWOUND_DIR

# The checkpoints of a run: <run dir>/CHECKPOINT_DIR/step-%08d/, its Hugging Face export in POLICY_DIR.
CHECKPOINT_DIR = "checkpoints"
REWOUND_DIR = "rewound"  # under CHECKPOINT_DIR: the checkpoints of a timeline a rollback abandoned
POLICY_DIR = "policy"
ADAPTER_DIR = "adapter"  # under POLICY_DIR: a LoRA run's PEFT adapter directory (runtime.models.lora)


# --- metric names --------------------------------------------------------------------------------------
# Every key a runtime component reports is one of METRICS (a name and its one-line meaning); the platform
# charts and summarises them by these names. Use the constants, not string literals.

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
ACCURACY = "accuracy"
EVAL_ACCURACY = "eval/accuracy"
LOSS_POLICY = "loss/policy"
LOSS_VALUE = "loss/value"
LOSS_KL = "loss/kl"
ENTROPY = "entropy"
KL_REF = "kl_ref"
CLIP_FRACTION = "clip_fraction"
GRAD_NORM = "grad_norm"
LR = "lr"
RESPONSE_LEN_MEAN = "response_len/mean"
RESPONSE_LEN_MAX = "response_len/max"
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
QUEUE_DEPTH = "queue/depth"
QUEUE_WATERMARK = "queue/watermark"
SAMPLES_DROPPED_STALE = "samples/dropped_stale"
GEN_TOKENS_PER_S = "throughput/gen_tokens_per_s"
TRAIN_TOKENS_PER_S = "throughput/train_tokens_per_s"
SAMPLES_PER_S = "throughput/samples_per_s"
TIME_GENERATE = "time/generate"
TIME_TRAIN = "time/train"
TIME_WEIGHT_SYNC = "time/weight_sync"
TIME_WAIT = "time/wait"
BUBBLE_TRAINER = "bubble/trainer"
PADDING_RATIO = "train/padding_ratio"
COMPUTED_TOKENS_RATIO = "train/computed_tokens_ratio"
SHARED_PREFIX_SHARE = "train/shared_prefix"
PACKED_SHARE = "train/packed"
CONSISTENCY_DIFF_MEAN = "consistency/logprob_diff_mean"
CONSISTENCY_DIFF_MAX = "consistency/logprob_diff_max"
CONSISTENCY_KL = "consistency/kl"
WEIGHTS_VERSION = "weights/version"
ROLLOUT_PADDING = "rollout/padding_ratio"
ROLLOUT_SKEWNESS = "rollout/skewness"
ROLLOUT_SORTING_WAIT = "rollout/sorting_wait"
ROLLOUT_ACTIVE = "rollout/active_instances"
SAMPLES_DROPPED_REWARD = "samples/dropped_reward"
# workload gym (runtime/workloads/gym)
EVAL_RETURN_MEAN = "eval/return_mean"
EVAL_RETURN_MIN = "eval/return_min"
EVAL_RETURN_MAX = "eval/return_max"
EVAL_WEIGHTS_VERSION = "eval/weights_version"
EPISODE_RETURN_MEAN = "episode/return_mean"
EPISODE_RETURN_MIN = "episode/return_min"
EPISODE_RETURN_MAX = "episode/return_max"
EPISODE_LENGTH_MEAN = "episode/length_mean"
EPISODES = "episode/count"
ENV_STEPS = "env/steps"
ENV_STEPS_PER_S = "throughput/env_steps_per_s"
APPROX_KL = "approx_kl"
LOSS_TD = "loss/td"
TD_ERROR = "td_error"
Q_MEAN = "q/mean"
EPSILON = "epsilon"
TARGET_SYNCS = "target/syncs"
TARGET_SYNC_EVENTS = "target/sync_events"
TARGET_SYNC_WAIT = "time/target_sync_wait"
REPLAY_SIZE = "replay/size"

METRICS: dict[str, str] = {
    REWARD_MEAN: "Mean reward of the samples trained on in this step.",
    REWARD_STD: "Standard deviation of those rewards.",
    ACCURACY: "Fraction of this step's samples the task's verifier judged correct.",
    EVAL_ACCURACY: "Greedy accuracy on the held-out prompts (reported on evaluation steps only).",
    LOSS_POLICY: "Clipped-surrogate policy loss (after loss aggregation).",
    LOSS_VALUE: "Critic (value-function) loss; PPO only.",
    LOSS_KL: "KL penalty term added to the loss: kl_coef x the k3 estimate against the reference.",
    ENTROPY: "Mean per-token entropy of the policy on this step's responses (nats).",
    KL_REF: "Mean per-token k3 estimate of KL(policy || reference) (nats).",
    CLIP_FRACTION: "Fraction of response tokens whose probability ratio hit the clip range.",
    GRAD_NORM: "Global gradient norm before clipping.",
    LR: "Policy learning rate used by this step's optimizer update.",
    RESPONSE_LEN_MEAN: "Mean response length of this step's samples (tokens).",
    RESPONSE_LEN_MAX: "Longest response of this step's samples (tokens).",
    STALENESS_MEAN: "Mean over this step's samples of (trainer weight version - sample version).",
    STALENESS_MAX: "Largest such lag in this step; never above pipeline.max_policy_lag.",
    QUEUE_DEPTH: "Samples waiting in the sample queue when the trainer took its batch.",
    QUEUE_WATERMARK: "High-water mark: most samples the queue held since the previous step.",
    SAMPLES_DROPPED_STALE: "Samples discarded for exceeding max_policy_lag, cumulative over the run.",
    GEN_TOKENS_PER_S: "Response tokens generated per second of generation time.",
    TRAIN_TOKENS_PER_S: "Tokens (prompt + response) trained on per second of training time.",
    SAMPLES_PER_S: "Samples consumed per second of wall-clock step time.",
    TIME_GENERATE: "Seconds spent generating in this step (by the role that reports it).",
    TIME_TRAIN: "Seconds the trainer spent computing (forward, backward, optimizer) in this step.",
    TIME_WEIGHT_SYNC: "Seconds spent publishing / loading new weights in this step.",
    TIME_WAIT: "Seconds the trainer spent waiting for samples in this step.",
    BUBBLE_TRAINER: "Trainer bubble fraction: time/wait divided by the trainer's step time (0..1).",
    PADDING_RATIO: "Padding tokens / all tokens in the training micro-batches (wasted compute).",
    COMPUTED_TOKENS_RATIO: "Tokens the training forwards computed (padding included) / the samples' prompt and "
    "response tokens: below 1 where a group's prompt ran once for all its samples.",
    SHARED_PREFIX_SHARE: "Share of the training micro-batches that run a group's prompt once for several of its "
    "samples (packed rows sharing it, or the shared-prefix layout).",
    PACKED_SHARE: "Share of the training micro-batches in the packed (padding-free) layout.",
    CONSISTENCY_DIFF_MEAN: "Mean |engine logprob - trainer logprob| over the step's response tokens.",
    CONSISTENCY_DIFF_MAX: "Largest such difference in this step.",
    CONSISTENCY_KL: "Per-token k3 estimate of KL(engine || trainer) on the engine's sampled tokens.",
    WEIGHTS_VERSION: "Version of the trainer's weights after this step.",
    ROLLOUT_PADDING: "Async: 1 - real / allocated token positions the rollout engines computed this step.",
    ROLLOUT_SKEWNESS: "Async: max / mean busy seconds of the active rollout instances this step (1 = even).",
    ROLLOUT_SORTING_WAIT: "Async: mean seconds a ready group waited for an engine slot / mean instance busy time.",
    ROLLOUT_ACTIVE: "Async: rollout instances taking new work (dynamic parallelism follows the queue watermark).",
    SAMPLES_DROPPED_REWARD: "Samples dropped because the reward service gave no reward after retries, cumulative.",
    EVAL_RETURN_MEAN: "Gym: mean undiscounted return of the evaluation agent's greedy episodes (evaluation steps).",
    EVAL_RETURN_MIN: "Gym: lowest such return.",
    EVAL_RETURN_MAX: "Gym: highest such return.",
    EVAL_WEIGHTS_VERSION: "Gym: weight version the evaluation ran with (async: it may arrive steps after its step).",
    EPISODE_RETURN_MEAN: "Gym: mean undiscounted return of the episodes that ended in this step's segments.",
    EPISODE_RETURN_MIN: "Gym: lowest such return.",
    EPISODE_RETURN_MAX: "Gym: highest such return.",
    EPISODE_LENGTH_MEAN: "Gym: mean length (env steps) of those episodes.",
    EPISODES: "Gym: episodes that ended in this step's segments (the return metrics are absent when 0).",
    ENV_STEPS: "Gym: environment steps the learner has trained on since the start of the run, cumulative.",
    ENV_STEPS_PER_S: "Gym: environment steps sampled per second of sampling time.",
    APPROX_KL: "Gym PPO: mean k3 estimate of KL(behaviour || updated policy) over the step's minibatches.",
    LOSS_TD: "Gym DQN: Huber loss of the TD errors, mean over the step's updates.",
    TD_ERROR: "Gym DQN: mean |Q(s, a) - target| over the step's updates.",
    Q_MEAN: "Gym DQN: mean Q-value of the actions taken in the sampled transitions.",
    EPSILON: "Gym DQN: exploration rate the samplers get with this step's weights.",
    TARGET_SYNCS: "Gym DQN: target-network syncs (hard copies or Polyak updates) since the start, cumulative.",
    TARGET_SYNC_EVENTS: "Gym DQN: target-network syncs made in this step (one event each; 0 when none).",
    TARGET_SYNC_WAIT: "Gym DQN: seconds this step's updates were held up by target syncs (background: ~0).",
    REPLAY_SIZE: "Gym DQN: transitions held in the replay buffer.",
}

# Device telemetry (runtime/telemetry.py): a series per role, device and field, named
# ``device/<role>/<device>/<field>``: <role> the reporting role (trainer-0 outside the platform too), <device>
# ``cpu`` (the role's process and its host) or ``cuda<i>`` / ``npu<i>`` (the role's i-th visible device).
# Reported with the step in progress when a sample was taken, each sample once. Not in METRICS: the names
# are made per run; DEVICE_METRICS gives each field's meaning.
DEVICE_PREFIX = "device/"
DEVICE_UTIL = "util"
DEVICE_MEM_USED = "mem_used_bytes"
DEVICE_MEM_PEAK = "mem_peak_bytes"
DEVICE_POWER = "power_w"
DEVICE_TEMP = "temp_c"
DEVICE_HOST_MEM_USED = "host_mem_used_bytes"
DEVICE_HOST_MEM_TOTAL = "host_mem_total_bytes"

DEVICE_METRICS: dict[str, str] = {
    DEVICE_UTIL: "Utilisation, percent: cpu the role's process's share of all the host's cores; an accelerator the "
    "driver's busy figure (NVML's GPU utilisation, the NPU's AI-core usage).",
    DEVICE_MEM_USED: "Memory in use, bytes: cpu the process's resident set; cuda the device's used memory (NVML, all "
    "processes); npu the memory torch_npu has allocated for this process.",
    DEVICE_MEM_PEAK: "Highest memory in use so far, bytes: cpu the process's peak resident set (getrusage); cuda the "
    "highest sampled used memory; npu torch_npu's peak allocated memory.",
    DEVICE_POWER: "Accelerators: power draw in watts, where the driver reports it.",
    DEVICE_TEMP: "Accelerators: temperature in degrees Celsius, where the driver reports it.",
    DEVICE_HOST_MEM_USED: "cpu: the host's memory in use (total - available), bytes.",
    DEVICE_HOST_MEM_TOTAL: "cpu: the host's total memory, bytes.",
}


def device_metric(role: str, device: str, field: str) -> str:
    """``device/<role>/<device>/<field>``, the name of one telemetry series."""
    if field not in DEVICE_METRICS:
        raise ValueError(f"{field!r} is not a device metric field ({', '.join(DEVICE_METRICS)})")
    return f"{DEVICE_PREFIX}{role}/{device}/{field}"


def split_device_metric(name: str) -> tuple[str, str, str] | None:
    """``(role, device, field)`` of a telemetry series name, or None for any other metric."""
    if not name.startswith(DEVICE_PREFIX):
        return None
    parts = name[len(DEVICE_PREFIX) :].split("/")
    if len(parts) != 3 or not all(parts) or parts[2] not in DEVICE_METRICS:
        return None
    return parts[0], parts[1], parts[2]


# Gradient communication per trainer rank (runtime/train/parallel.py ``CommClock``): a series per rank and
# field, named ``comm/rank<k>/<field>`` (k the trainer rank, 0 the leader), reported by trainer-0 with every
# train step of a group of two or more ranks (one rank communicates nothing and reports none). Seconds,
# summed over the step's reducing backwards (each policy and critic update). Wall time on CPU (gloo);
# device time between events on an accelerator. Not in METRICS: the names depend on the run's ranks.
# Only the first COMM_MAX_RANKS ranks report (a larger group would overflow a point).
COMM_PREFIX = "comm/"
COMM_MAX_RANKS = 128  # ranks >= this report none: a point holds MAX_METRICS_PER_POINT metrics at most
COMM_GRAD = "grad_s"
COMM_GRAD_WAIT = "grad_wait_s"

COMM_METRICS: dict[str, str] = {
    COMM_GRAD: "Seconds this rank had gradient communication in flight in this step (ddp: each bucket's all-reduce "
    "from its issue to its completion, overlapping buckets counted once; fsdp: its reduce-scatters).",
    COMM_GRAD_WAIT: "Seconds of it not hidden behind backward compute: a blocking collective's whole time (fsdp on "
    "CPU), else per backward from the last collective's issue to the last one's completion.",
}


def comm_metric(rank: int, field: str) -> str:
    """``comm/rank<k>/<field>``, the name of one trainer rank's communication series."""
    if field not in COMM_METRICS:
        raise ValueError(f"{field!r} is not a communication metric field ({', '.join(COMM_METRICS)})")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"a trainer rank is an integer >= 0, got {rank!r}")
    return f"{COMM_PREFIX}rank{rank}/{field}"


def split_comm_metric(name: str) -> tuple[int, str] | None:
    """``(rank, field)`` of a communication series name, or None for any other metric."""
    if not name.startswith(COMM_PREFIX):
        return None
    parts = name[len(COMM_PREFIX) :].split("/")
    if len(parts) != 2 or parts[1] not in COMM_METRICS or not parts[0].startswith("rank"):
        return None
    digits = parts[0][len("rank") :]
    if not digits.isascii() or not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
        return None
    return int(digits), parts[1]


# --- the ingest API --------------------------------------------------------------------------------------

METRICS_PATH = "/api/ingest/metrics"
HEARTBEAT_PATH = "/api/ingest/heartbeat"
COMMAND_RESULT_PATH = "/api/ingest/command_result"


# The batch a reporter POSTs to METRICS_PATH, and the rules the platform holds every body to before it
# stores anything (PostgreSQL's limits among them: no U+0000 in text or jsonb, 64-bit integers).
MAX_POINTS = 10_000  # per batch; the reporter sends 500
MAX_EVENTS = 10_000
MAX_METRICS_PER_POINT = 1_000
MAX_METRIC_NAME = 200
MAX_EVENT_KIND = 50
MAX_STEP = 2**62  # fits BIGINT with room; no real run gets near it
MAX_TIME = 32_503_680_000  # year 3000 in Unix seconds: later "times" are garbage, and overflow datetime
INT_RANGE = (-(2**63), 2**63 - 1)  # integers PostgreSQL can compare as numbers without surprises
_NO_NUL = r"^[^\x00]*$"


def _json_number(error: str, low: int | None = None, high: int | None = None) -> Any:
    """A JSON number in [low, high] (unbounded when None): an integer (never a bool) within INT_RANGE,
    kept an integer, or a finite float.

    Built from pydantic-core parts so a batch's thousands of values are checked without a Python call
    each; one error (``error``) per bad value, at the value's own location."""
    as_int = core_schema.int_schema(
        strict=True,
        ge=INT_RANGE[0] if low is None else max(low, INT_RANGE[0]),
        le=INT_RANGE[1] if high is None else min(high, INT_RANGE[1]),
    )
    # A strict float takes integers too (10**30 would pass as 1e30): only a real float goes this way.
    as_float = core_schema.chain_schema(
        [core_schema.is_instance_schema(float), core_schema.float_schema(allow_inf_nan=False, ge=low, le=high)]
    )
    # Floats first: most metric values are floats, and a failed first try is what costs.
    schema = core_schema.union_schema(
        [as_float, as_int], mode="left_to_right", custom_error_type=error, custom_error_message=error
    )
    return GetPydanticSchema(lambda _type, _handler: schema)


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(v) for v in value)
    return False


def _payload(value: dict[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if _holds_nul(value):
        raise ValueError("holds a NUL character")
    return value


def _role(value: str | None) -> str:
    return (value or "").strip()


Count = Annotated[int, Field(ge=0, le=MAX_STEP)]
UnixTime = Annotated[float, _json_number("unix_time", 0, MAX_TIME)]
MetricName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_METRIC_NAME, pattern=_NO_NUL)]
MetricValue = Annotated[float, _json_number("metric_value")]


class IngestPoint(BaseModel):
    """One step's metrics. ``time`` absent: the platform's time of arrival. ``seq``: the reporter's."""

    model_config = ConfigDict(strict=True)

    seq: Count | None = None
    step: Count
    time: UnixTime | None = None
    metrics: Annotated[dict[MetricName, MetricValue | None], Field(max_length=MAX_METRICS_PER_POINT)]


class IngestEvent(BaseModel):
    """One event; ``seq`` is its idempotency key within the reporting role's attempt."""

    model_config = ConfigDict(strict=True)

    seq: Count
    kind: Annotated[str, StringConstraints(min_length=1, max_length=MAX_EVENT_KIND, pattern=_NO_NUL)]
    payload: Annotated[dict[str, Any] | None, AfterValidator(_payload)] = Field(default_factory=dict)
    time: UnixTime | None = None


class IngestBatch(BaseModel):
    """The body of a POST to METRICS_PATH. ``run`` and ``attempt`` may be left out (the token's then)."""

    model_config = ConfigDict(strict=True)

    run: str | int | None = None
    attempt: Count | None = None
    role: Annotated[
        Annotated[str, StringConstraints(max_length=MAX_ROLE_NAME, pattern=_NO_NUL)] | None, AfterValidator(_role)
    ] = ""
    points: Annotated[list[IngestPoint], Field(max_length=MAX_POINTS)] = []
    events: Annotated[list[IngestEvent], Field(max_length=MAX_EVENTS)] = []


# What a refused body is told, by where the problem is (indices are ``[]``): the rule of that field.
_COUNT_RULE = "must be a non-negative integer"
_TIME_RULE = "must be a Unix time in seconds"
_METRICS_RULE = "must be an object of name: number"
_FIELD_RULES = {
    ("run",): "must be the run's id",
    ("attempt",): _COUNT_RULE,
    ("role",): f"must be a string of 0 to {MAX_ROLE_NAME} characters",
    ("points",): "must be a list",
    ("points", "[]"): "must be an object with step and metrics",
    ("points", "[]", "seq"): _COUNT_RULE,
    ("points", "[]", "step"): _COUNT_RULE,
    ("points", "[]", "time"): _TIME_RULE,
    ("points", "[]", "metrics"): _METRICS_RULE,
    ("events",): "must be a list",
    ("events", "[]"): "must be an object with seq and kind",
    ("events", "[]", "seq"): _COUNT_RULE,
    ("events", "[]", "time"): _TIME_RULE,
    ("events", "[]", "kind"): f"must be a string of 1 to {MAX_EVENT_KIND} characters",
    ("events", "[]", "payload"): "must be an object (no NUL characters)",
}
_TOO_LONG = {
    ("points",): lambda n: f"at most {MAX_POINTS} points per batch, got {n}",
    ("events",): lambda n: f"at most {MAX_EVENTS} events per batch, got {n}",
    ("points", "[]", "metrics"): lambda n: f"at most {MAX_METRICS_PER_POINT} metrics per point",
}


def field_name(loc: Iterable[str | int]) -> str:
    """``("points", 3, "step")`` -> ``points[3].step``."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def _problem(error: Mapping[str, Any]) -> dict[str, str]:
    loc = tuple(error["loc"])
    if not loc:
        return {"field": "body", "message": "must be a JSON object"}
    if len(loc) >= 4 and loc[0] == "points" and loc[2] == "metrics":  # a metric's name or value
        if loc[4:5] == ("[key]",):
            return {
                "field": field_name(loc[:3]),
                "message": f"metric names must have 1 to {MAX_METRIC_NAME} characters (no NUL)",
            }
        return {"field": field_name(loc[:4]), "message": "must be a finite number or null"}
    shape = tuple("[]" if isinstance(part, int) else part for part in loc)
    # The longest known prefix: a union's member names (``int``, ``function-after[...]``) may follow.
    while shape and shape not in _FIELD_RULES:
        shape = shape[:-1]
    where = loc[: len(shape)]
    if error["type"] == "too_long" and shape in _TOO_LONG:
        return {"field": field_name(where), "message": _TOO_LONG[shape](error["ctx"]["actual_length"])}
    return {"field": field_name(where), "message": _FIELD_RULES.get(shape, "is not valid")}


def problems_of(exc: ValidationError) -> list[dict[str, str]]:
    """A refused body's problems, each named by its field (``points[3].step``) with the field's rule."""
    out: list[dict[str, str]] = []
    for error in exc.errors(include_url=False, include_context=True, include_input=False):
        problem = _problem(error)
        if problem not in out:  # a field's rule once, however many ways it was broken
            out.append(problem)
    return out


def read_batch(body: Any) -> tuple[IngestBatch | None, list[dict[str, str]]]:
    """An ingest body checked against the schema: (the batch, []) or (None, its problems)."""
    try:
        return IngestBatch.model_validate(body), []
    except ValidationError as exc:
        return None, problems_of(exc)


def record_problems(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """Problems the platform would find in one spooled record (a point has ``step``, an event ``kind``),
    each field named within the record (``metrics.reward``): a reporter refuses such a record instead of
    spooling it, where it would hold up every later record."""
    section = "points" if "step" in record else "events"
    problems = read_batch({section: [record]})[1]
    return [{**p, "field": p["field"].removeprefix(f"{section}[0]").lstrip(".") or "record"} for p in problems]


def batch_body(records: list[dict[str, Any]], run: str, attempt: int, role: str) -> dict[str, Any]:
    """The ingest body (an IngestBatch's fields) for spooled ``records`` (points carry ``step``, events ``kind``)."""
    return {
        "run": run,
        "attempt": attempt,
        "role": role,
        "points": [r for r in records if "step" in r],
        "events": [r for r in records if "kind" in r],
    }


# --- commands --------------------------------------------------------------------------------------------

# What the runtime acts on. The platform's own kinds add ``fork`` (a new run; the runtime never sees it).
RUNTIME_COMMANDS = ("pause", "resume", "stop", "preempt", "cancel", "rollback", "set_params")

# What a run may change between two steps without a restart (``set_params``).
LIVE_PARAMS = ("pipeline.max_policy_lag", "pipeline.eval_interval", "trainer.lr")


def live_param_problems(params: Any) -> list[dict[str, str]]:
    """Field errors of a ``set_params`` command's ``params`` (each field named from the command's ``args``):
    not a non-empty mapping, or names outside LIVE_PARAMS. The values are each side's to check against
    the spec (the platform validates the run's spec with them in place, the runtime its live spec)."""
    if not isinstance(params, dict) or not params:
        return [{"field": "params", "message": f"give at least one of {', '.join(LIVE_PARAMS)}"}]
    allowed = ", ".join(LIVE_PARAMS)
    return [
        {"field": f"params.{key}", "message": f"not a live parameter; allowed: {allowed}"}
        for key in params
        if key not in LIVE_PARAMS
    ]


# --- checkpoint retention --------------------------------------------------------------------------------

Key = TypeVar("Key")


def retained(
    checkpoints: Iterable[tuple[Key, int, Mapping[str, Any]]],
    keep_last: int,
    best_metric: str | None = None,
    best_mode: Literal["max", "min"] = "max",
) -> set[Key]:
    """Keys of the checkpoints the ``checkpoint`` policy keeps, from ``(key, step, metrics)`` of each:
    the newest ``keep_last`` by step, and with ``best_metric`` the best by it (``best_checkpoint``)
    however old. Among equal steps the later one in ``checkpoints`` counts as newer.

    The runtime rotates its checkpoint directory by this alone; the platform keeps the pinned and
    in-use ones besides (jobs.checkpoints)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    ordered = sorted(checkpoints, key=lambda c: c[1])  # stable: input order breaks ties of step
    keep = {key for key, _, _ in ordered[-keep_last:]}
    if best_metric is not None:
        best = best_checkpoint(ordered, best_metric, best_mode)
        if best is not None:
            keep.add(best)
    return keep


def best_checkpoint(
    checkpoints: Iterable[tuple[Key, int, Mapping[str, Any]]], metric: str, mode: Literal["max", "min"] = "max"
) -> Key | None:
    """Key of the best checkpoint by ``metric`` (``mode`` max or min) of ``(key, step, metrics)``, or None.
    Ties go to the newer (higher step, then later in ``checkpoints``); one without a finite number for
    the metric is never the best."""
    if mode not in ("max", "min"):
        raise ValueError(f"best_mode must be 'max' or 'min', got {mode!r}")
    sign = 1 if mode == "max" else -1
    scored = [
        (sign * metrics[metric], step, position, key)
        for position, (key, step, metrics) in enumerate(checkpoints)
        if _finite_number(metrics.get(metric))
    ]
    return max(scored, key=lambda s: s[:3])[3] if scored else None


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
