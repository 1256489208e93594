"""The files a spec names are checked at submit where the control plane sees them (jobs.spec_files).

After confinement allows a path: a dataset file that is missing, unreadable or without the named keys, and a
model directory without config.json, are 400s naming the field, with nothing stored; a path whose allowed root
is not on the control plane is accepted and left to the runtime's preflight; a path outside the team's roots
gets confinement's one message whether or not it exists. The rules are the runtime's: the last tests keep
each refusal here one the runtime makes too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rest_framework.test import APIClient

from jobs import handler, spec_files
from jobs.confinement import OUTSIDE_TEAM
from jobs.models import Allocation, Run
from runtime.models.loading import ModelError, check_model_path
from runtime.tasks.base import TaskError
from runtime.tasks.dataset import FIRST_RECORD_LIMIT, dataset_columns, read_dataset

pytestmark = pytest.mark.django_db

ROWS = [{"question": f"{i} + 1 =", "solution": f"#### {i + 1}"} for i in range(6)]  # no `answer` column


def _nothing_written() -> bool:
    return Run.objects.count() == 0 and Allocation.objects.count() == 0


def _fields(info) -> list[tuple[str, str]]:
    return [(e["field"], e["message"]) for e in info.value.errors]


def _dataset_spec(path, **task) -> dict:
    return {"resources": {"device": "cpu"}, "task": {"name": "dataset", "path": str(path), **task}}


def _model_spec(path) -> dict:
    return {"resources": {"device": "cpu"}, "model": {"builtin": None, "path": str(path)}}


def _refused(owner, experiment, spec) -> list[tuple[str, str]]:
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, spec)
    assert _nothing_written()
    return _fields(info)


@pytest.fixture
def data_root(team_a, tmp_path) -> Path:
    """Team A's data root, a directory the control plane sees."""
    root = (tmp_path / "team-a-data").resolve()
    root.mkdir()
    team_a.data_roots = [str(root)]
    team_a.save(update_fields=["data_roots"])
    return root


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_arrow_stream(path: Path, rows: list[dict]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_arrow_file(path: Path, rows: list[dict]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_json_array(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows, indent=2))
    return path


WRITERS = {
    "train.parquet": write_parquet,
    "train.arrow": write_arrow_stream,
    "file-format.arrow": write_arrow_file,
    "train.jsonl": write_jsonl,
    "train.json": write_json_array,
}


# --- refused at submit ------------------------------------------------------------------------------------


def test_a_missing_dataset_file_under_the_teams_data_root_is_refused_naming_its_field(owner, experiment, data_root):
    good = write_parquet(data_root / "train.parquet", [{"question": "1 + 1 =", "answer": "2"}] * 4)
    missing = data_root / "test.parquet"

    assert _refused(owner, experiment, _dataset_spec(data_root / "nope.parquet")) == [
        ("task.path", f"no such file: {data_root / 'nope.parquet'}")
    ]
    assert _refused(owner, experiment, _dataset_spec(good, eval_path=str(missing))) == [
        ("task.eval_path", f"no such file: {missing}")
    ]


def test_a_directory_named_as_the_dataset_file_is_refused(owner, experiment, data_root):
    (data_root / "dir.jsonl").mkdir()

    assert _refused(owner, experiment, _dataset_spec(data_root / "dir.jsonl")) == [
        ("task.path", f"no such file: {data_root / 'dir.jsonl'}")
    ]


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_dataset_file_without_the_answer_key_is_refused_with_its_columns(owner, experiment, data_root, name):
    path = WRITERS[name](data_root / name, ROWS)

    assert _refused(owner, experiment, _dataset_spec(path)) == [
        ("task.path", f"{path}: no column 'answer' (answer_key); its columns: question, solution")
    ]


def test_a_jsonl_file_without_the_prompt_key_is_refused(owner, experiment, data_root):
    path = write_jsonl(data_root / "train.jsonl", [{"problem": "1 + 1 =", "answer": "2"}] * 3)

    assert _refused(owner, experiment, _dataset_spec(path)) == [
        ("task.path", f"{path}: no column 'question' (prompt_key); its columns: problem, answer")
    ]


def test_the_keys_are_the_specs_own_and_the_eval_file_is_checked_too(owner, experiment, data_root):
    train = write_parquet(data_root / "train.parquet", ROWS)
    held_out = write_jsonl(data_root / "test.jsonl", [{"question": "1 + 1 =", "answer": "#### 2"}])
    spec = _dataset_spec(train, eval_path=str(held_out), answer_key="solution")

    assert _refused(owner, experiment, spec) == [
        ("task.eval_path", f"{held_out}: no column 'solution' (answer_key); its columns: question, answer")
    ]


def test_a_first_record_past_the_first_read_is_still_found(owner, experiment, data_root):
    """The first record is read a growing chunk at a time: one longer than the first chunk is read whole."""
    path = write_jsonl(data_root / "long.jsonl", [{"question": "x" * 200_000, "solution": "#### 1"}])

    assert _refused(owner, experiment, _dataset_spec(path)) == [
        ("task.path", f"{path}: no column 'answer' (answer_key); its columns: question, solution")
    ]


@pytest.mark.parametrize(
    "name,content,problem",
    [
        ("empty.jsonl", "", "the file is empty"),
        ("blank.jsonl", "\n\n", "no rows"),
        ("empty-array.json", "[ ]", "no rows"),
        ("broken.jsonl", '{"question": "1 + 1 =", "answer": \n', "not a readable .jsonl file (Expecting value in "),
        ("strings.jsonl", '["1 + 1 =", "2"]\n', "its first record is a JSON string, not an object of columns"),
        ("numbers.jsonl", "1\n2\n", "its first record is a JSON number, not an object of columns"),
        ("latin1.jsonl", b'{"question": "caf\xe9", "answer": "1"}\n', "not a readable .jsonl file (not UTF-8 text)"),
        ("text.parquet", "question,answer\n1 + 1 =,2\n", "not a readable .parquet file ("),
        ("text.arrow", "question,answer\n1 + 1 =,2\n", "not a readable .arrow file ("),
    ],
)
def test_an_unreadable_dataset_file_is_refused_naming_why(owner, experiment, data_root, name, content, problem):
    path = data_root / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())

    [(field, message)] = _refused(owner, experiment, _dataset_spec(path))

    assert field == "task.path"
    assert message.startswith(f"{path}: {problem}")


def test_a_model_path_without_config_json_is_refused(owner, experiment, data_root):
    (data_root / "qwen").mkdir()
    (data_root / "qwen" / "model.safetensors").write_bytes(b"weights")

    assert _refused(owner, experiment, _model_spec(data_root / "qwen")) == [
        ("model.path", f"{data_root / 'qwen'} has no config.json (not a Hugging Face model directory)")
    ]
    assert _refused(owner, experiment, _model_spec(data_root / "llama")) == [
        ("model.path", f"no such model directory: {data_root / 'llama'}")
    ]


def test_a_vllm_run_on_a_model_whose_head_size_vllms_cpu_attention_cannot_serve_is_refused(
    owner, experiment, data_root
):
    from runtime.vllm_support import head_dim_problem

    for name, hidden in (("heads16", 64), ("heads64", 256)):
        (data_root / name).mkdir()
        config = {"model_type": "qwen2", "hidden_size": hidden, "num_attention_heads": 4}
        (data_root / name / "config.json").write_text(json.dumps(config))
    vllm = {"rollout": {"engine": "vllm", "kv_cache_gib": 0.5}}

    refused = _refused(owner, experiment, {**_model_spec(data_root / "heads16"), **vllm})

    assert refused == [("model.path", head_dim_problem(data_root / "heads16", "cpu"))]
    assert "has head_dim 16" in refused[0][1] and "--preset vllm-cpu" in refused[0][1]
    handler.submit_run(owner, experiment, {**_model_spec(data_root / "heads64"), **vllm})  # head_dim 64: accepted
    handler.submit_run(owner, experiment, _model_spec(data_root / "heads16"))  # the built-in engine serves any
    assert head_dim_problem(data_root / "heads16", "cuda") is None  # GPU kernels: vLLM's own start-up check


def test_a_missing_model_in_the_teams_own_run_directory_is_refused(owner, experiment, run, tmp_path, settings):
    settings.TANDEM_CHECKPOINT_ROOT = (tmp_path / "runs").resolve()
    policy = settings.TANDEM_CHECKPOINT_ROOT / f"run-{run.pk}" / "checkpoints" / "step-4" / "policy"
    policy.parent.mkdir(parents=True)
    runs_before = Run.objects.count()

    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, _model_spec(policy))

    assert _fields(info) == [("model.path", f"no such model directory: {policy}")]
    assert Run.objects.count() == runs_before


def test_every_problem_of_the_spec_is_named_at_once(owner, experiment, data_root):
    spec = _dataset_spec(data_root / "train.jsonl", eval_path=str(data_root / "test.jsonl"))
    spec["model"] = {"builtin": None, "path": str(data_root / "model")}

    assert [field for field, _ in _refused(owner, experiment, spec)] == ["model.path", "task.path", "task.eval_path"]


# --- accepted ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_readable_dataset_with_the_named_keys_is_accepted(owner, experiment, data_root, name):
    path = WRITERS[name](data_root / name, ROWS)

    run, created = handler.submit_run(owner, experiment, _dataset_spec(path, answer_key="solution"))

    assert created
    assert run.resolved_spec["task"]["path"] == str(path)


def test_a_model_directory_with_config_json_and_a_jsonl_task_file_are_accepted(owner, experiment, data_root):
    (data_root / "qwen").mkdir()
    (data_root / "qwen" / "config.json").write_text("{}")
    rows = write_jsonl(data_root / "rows.jsonl", [{"prompt": "ab", "answer": "ba"}] * 3)  # rows are the runtime's
    spec = {**_model_spec(data_root / "qwen"), "task": {"name": "jsonl", "path": str(rows), "verifier": "exact"}}

    _run, created = handler.submit_run(owner, experiment, spec)

    assert created


def test_a_path_whose_root_is_not_on_the_control_plane_is_left_to_the_runtime(owner, experiment, team_a, tmp_path):
    hosts_only = tmp_path / "mounted-on-hosts"  # a data root the control plane does not mount
    team_a.data_roots = [str(tmp_path), str(hosts_only)]  # its parent is here: the innermost root decides
    team_a.save(update_fields=["data_roots"])
    spec = _dataset_spec(hosts_only / "train.parquet")
    spec["model"] = {"builtin": None, "path": str(hosts_only / "qwen")}

    _run, created = handler.submit_run(owner, experiment, spec)

    assert created


def test_a_first_record_longer_than_the_limit_is_not_judged(owner, experiment, data_root):
    path = write_jsonl(data_root / "huge.jsonl", [{"solution": "#### 1", "question": "x" * FIRST_RECORD_LIMIT}])

    _run, created = handler.submit_run(owner, experiment, _dataset_spec(path))

    assert created  # a record this long is the runtime's to read


# --- confinement first ------------------------------------------------------------------------------------


def test_a_path_outside_the_teams_roots_gets_one_message_whether_or_not_it_exists(
    owner, experiment, data_root, tmp_path
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    present = write_parquet(elsewhere / "train.parquet", ROWS)  # without the answer key, too

    for path in (present, elsewhere / "absent.parquet"):
        assert _refused(owner, experiment, _dataset_spec(path)) == [("task.path", OUTSIDE_TEAM)]


# --- the plan endpoint ------------------------------------------------------------------------------------


def test_the_plan_endpoint_refuses_with_the_submits_field_errors(owner, experiment, data_root):
    client = APIClient()
    client.force_authenticate(owner)
    bad = write_jsonl(data_root / "train.jsonl", [{"problem": "1 + 1 =", "answer": "2"}])
    expected = [
        {"field": "task.path", "message": f"{bad}: no column 'question' (prompt_key); its columns: problem, answer"}
    ]

    for endpoint in ("/api/runs/plan/", "/api/runs/"):
        reply = client.post(endpoint, {"experiment": "exp-a", "spec": _dataset_spec(bad)}, format="json")
        assert (reply.status_code, reply.json()) == (400, {"errors": expected})
    assert _nothing_written()


# --- in step with the runtime -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WRITERS))
def test_the_columns_read_at_submit_are_those_the_runtime_reads(tmp_path, name):
    path = WRITERS[name](tmp_path / name, ROWS)

    assert dataset_columns(str(path), "task.path") == ["question", "solution"]
    assert len(read_dataset(str(path), "task.path", "question", "solution")) == len(ROWS)
    with pytest.raises(TaskError, match=r"no column 'answer' \(answer_key\); its columns: question, solution"):
        read_dataset(str(path), "task.path", "question", "answer")


@pytest.mark.parametrize(
    "name,content",
    [
        ("blank.jsonl", "\n\n"),
        ("empty-array.json", "[ ]"),
        ("broken.jsonl", '{"question": "1 + 1 =", "answer": \n'),
        ("strings.jsonl", '["1 + 1 =", "2"]\n'),
        ("numbers.jsonl", "1\n2\n"),
        ("arrays.jsonl", "[1, 2]\n[3, 4]\n"),
        ("strings.json", '["1 + 1 =", "2"]'),
        ("latin1.jsonl", b'{"question": "caf\xe9", "answer": "1"}\n'),
        ("first-row-short.jsonl", '{"question": "1 + 1 ="}\n{"question": "2 + 2 =", "answer": "4"}\n'),
        ("text.parquet", "question,answer\n"),
        ("text.arrow", "question,answer\n"),
    ],
)
def test_what_the_submit_refuses_the_runtime_refuses_too(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())

    assert spec_files.dataset_file_problem(str(path), "task.path", "question", "answer") is not None
    with pytest.raises(TaskError):
        read_dataset(str(path), "task.path", "question", "answer")


@pytest.mark.parametrize("layout", ["missing", "empty", "config-is-a-directory", "model"])
def test_the_model_directory_rule_is_the_runtimes(tmp_path, layout):
    path = tmp_path / "model"
    if layout != "missing":
        path.mkdir()
    if layout == "config-is-a-directory":
        (path / "config.json").mkdir()
    if layout == "model":
        (path / "config.json").write_text("{}")

    try:
        check_model_path(path)
        runtime_says = None
    except ModelError as exc:
        runtime_says = str(exc).removeprefix("model.path: ")

    assert spec_files.model_dir_problem(path) == runtime_says
