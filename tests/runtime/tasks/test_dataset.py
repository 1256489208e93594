"""The dataset task: GSM8K-style rows from local jsonl / json / parquet / arrow files, prompts, the held-out
split, the chat template, and every kind of bad file or row as a TaskError naming the file and row."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import datasets
import pytest
from tokenizers import processors

from runtime.models.tokenizer import CharTokenizer
from runtime.spec import SpecError, TaskSpec, load_spec
from runtime.tasks import DatasetTask, TaskError, build_task

GSM8K_ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "48/2 = 24\n#### 72",
    },
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "12/60 = 0.2\n0.2*50 = 10\n#### 10"},
    {"question": "A book costs $1,000 less $1. Price?", "answer": "#### 999"},
    {"question": "What is -3 plus 1?", "answer": "#### -2"},
    {"question": "Half of one?", "answer": "#### 1/2"},
    {"question": "How many legs have 3 cats?", "answer": 12},  # a number, not a string
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def spec(path: Path, **fields) -> TaskSpec:
    return TaskSpec(name="dataset", path=str(path), **fields)


def texts(task) -> list[str]:
    return [p.text for p in task.train_prompts() + task.eval_prompts()]


def test_gsm8k_rows_become_prompts_scored_by_their_final_number(tmp_path):
    rows = [{**r, "answer": str(r["answer"])} for r in GSM8K_ROWS]
    task = build_task(spec(write_jsonl(tmp_path / "gsm8k.jsonl", rows), eval_size=1, seed=3))
    train, held = task.train_prompts(), task.eval_prompts()
    assert len(train) == 5 and len(held) == 1  # min(eval_size, rows // 5) held out
    assert [p.prompt_id for p in train + held] == list(range(6))
    assert sorted(texts(task)) == sorted(r["question"] for r in rows)  # each row once, the question as is
    natalia = next(p for p in train + held if p.text.startswith("Natalia"))
    assert natalia.answer == "48/2 = 24\n#### 72"  # the whole reference is kept (SFT trains on it)
    assert task.score(natalia, "She sold 24 in May, so 72 in all. #### 72") == (1.0, True)
    assert task.score(natalia, "The answer is 72.") == (1.0, True)
    assert task.score(natalia, "#### 24") == (0.0, False)
    assert task.score(natalia, "I cannot tell") == (0.0, False)


def test_the_split_is_seeded_and_an_eval_file_replaces_it(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS)
    a, b = build_task(spec(path, seed=1)), build_task(spec(path, seed=1))
    assert (a.train_prompts(), a.eval_prompts()) == (b.train_prompts(), b.eval_prompts())
    held = {p.text for p in build_task(spec(path, seed=1)).eval_prompts()}
    assert any({p.text for p in build_task(spec(path, seed=s)).eval_prompts()} != held for s in range(2, 12))
    evals = write_jsonl(tmp_path / "e.jsonl", GSM8K_ROWS[:3])
    task = build_task(spec(path, eval_path=str(evals), eval_size=2))
    assert [p.text for p in task.train_prompts()] == [r["question"] for r in GSM8K_ROWS]
    assert [p.text for p in task.eval_prompts()] == [r["question"] for r in GSM8K_ROWS[:2]]
    assert [p.prompt_id for p in task.eval_prompts()] == [6, 7]


def test_every_format_reads_the_same_prompts(tmp_path):
    rows = [{**r, "answer": str(r["answer"]), "extra": i} for i, r in enumerate(GSM8K_ROWS)]
    files = {
        "jsonl": write_jsonl(tmp_path / "t.jsonl", rows),
        "json": tmp_path / "t.json",
        "parquet": write_parquet(tmp_path / "t.parquet", rows),
    }
    files["json"].write_text(json.dumps(rows))  # one JSON array of rows
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    files["arrow"] = tmp_path / "saved" / "data-00000-of-00001.arrow"
    read = {fmt: build_task(spec(path, seed=4)) for fmt, path in files.items()}
    expected = read["jsonl"]
    for fmt, task in read.items():
        assert (task.train_prompts(), task.eval_prompts()) == (expected.train_prompts(), expected.eval_prompts()), fmt


def test_other_keys_and_a_system_prompt(tmp_path):
    rows = [{"problem": f"What is {i} + {i}?", "solution": f"\\boxed{{{2 * i}}}"} for i in range(5)]
    task = build_task(
        spec(
            write_jsonl(tmp_path / "m.jsonl", rows),
            prompt_key="problem",
            answer_key="solution",
            system_prompt="Be brief.",
        )
    )
    assert sorted(texts(task)) == [f"Be brief.\n\nWhat is {i} + {i}?" for i in range(5)]
    p = task.train_prompts()[0]
    assert task.score(p, f"\\boxed{{{p.answer[7:-1]}}}") == (1.0, True)


def test_no_network_is_touched_while_reading(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "t.parquet", GSM8K_ROWS[:5])

    def refuse(*args, **kwargs):
        raise AssertionError("the dataset task opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert len(texts(build_task(spec(path)))) == 5
    assert datasets.config.HF_HUB_OFFLINE is True


# ---- the chat template -------------------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def hf_model_dir(root: Path, template: str | None) -> Path:
    """A directory with a Hugging Face fast tokenizer built here (no download), with ``template`` if given."""
    hf = CharTokenizer().to_hf()
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(str(root))
    return root


def test_the_chat_template_wraps_system_and_user_messages(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS[:5])
    model = hf_model_dir(tmp_path / "model", TEMPLATE)
    task = build_task(spec(data, chat_template=True, system_prompt="Think."), model_path=str(model))
    assert sorted(texts(task)) == sorted(
        f"<|system|>Think.<|end|>\n<|user|>{r['question']}<|end|>\n<|assistant|>" for r in GSM8K_ROWS[:5]
    )
    plain = build_task(spec(data, chat_template=True), model_path=str(model))
    assert plain.train_prompts()[0].text.startswith("<|user|>")  # no system message without a system prompt


def test_a_template_that_writes_bos_loses_it_when_encoding_adds_one(tmp_path):
    hf = CharTokenizer().to_hf()
    hf._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    hf.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    hf.save_pretrained(str(tmp_path / "model"))
    data = write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS[:5])
    task = build_task(spec(data, chat_template=True), model_path=str(tmp_path / "model"))
    assert sorted(texts(task)) == sorted(f"[{r['question']}]" for r in GSM8K_ROWS[:5])  # encode_prompt adds it


@pytest.mark.parametrize(
    ("tokenizer", "problem"),
    [
        ("none", "the task was built without the model directory whose tokenizer it needs"),
        ("char", "has the character tokenizer, which has no chat template"),
        ("hf-without-template", "has no chat template"),
    ],
)
def test_a_chat_template_that_cannot_be_had_is_a_task_error(tmp_path, tokenizer, problem):
    data = write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS[:5])
    model: Path | None = tmp_path / "model"
    if tokenizer == "char":
        CharTokenizer().save(model)
    elif tokenizer == "hf-without-template":
        hf_model_dir(model, None)
    else:
        model = None
    with pytest.raises(TaskError, match="^task.chat_template: ") as err:
        build_task(spec(data, chat_template=True), model_path=None if model is None else str(model))
    assert problem in str(err.value)


def test_the_spec_refuses_a_chat_template_for_the_character_tokenizer():
    data = {"task": {"name": "dataset", "path": "t.jsonl", "chat_template": True}}
    with pytest.raises(SpecError) as err:
        load_spec(data)  # a built-in model: the character tokenizer
    assert [e["field"] for e in err.value.errors] == ["task.chat_template"]
    with pytest.raises(SpecError) as err:
        load_spec({**data, "model": {"builtin": None, "path": "/m", "tokenizer": "char"}})
    assert [e["field"] for e in err.value.errors] == ["task.chat_template"]
    assert load_spec({**data, "model": {"builtin": None, "path": "/m"}}).task.chat_template is True


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        ([{"question": "q"}], "row 2: no answer_key 'answer'"),
        ([{"answer": "#### 1"}], "row 2: no prompt_key 'question'"),
        ([{"question": 7, "answer": "#### 1"}], "row 2: prompt_key 'question' is a int, not a string"),
        ([{"question": "  ", "answer": "#### 1"}], "row 2: prompt_key 'question' is empty"),
        ([{"question": "q", "answer": "#### seven"}], "row 2: answer_key 'answer' holds no number: '#### seven'"),
        ([{"question": "q", "answer": True}], "row 2: answer_key 'answer' is a bool, not a string or number"),
        ([{"question": "q", "answer": [1]}], "row 2: answer_key 'answer' is a list, not a string or number"),
    ],
)
def test_a_bad_jsonl_row_names_the_file_and_row(tmp_path, rows, problem):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "first", "answer": "#### 1"}, *rows])
    with pytest.raises(TaskError) as err:
        build_task(spec(path))
    assert str(err.value) == f"task.path: {path} {problem}"


def test_a_bad_parquet_row_names_the_file_and_row(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]
    rows[16]["answer"] = None
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(TaskError) as err:
        build_task(spec(path))
    assert str(err.value) == f"task.path: {path} row 17: no answer_key 'answer'"


def test_a_file_without_the_named_key_names_its_columns(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [{"problem": "q", "answer": "#### 1"}] * 3)
    with pytest.raises(TaskError) as err:
        build_task(spec(path))
    assert str(err.value) == f"task.path: {path}: no column 'question' (prompt_key); its columns: problem, answer"
    evals = write_parquet(tmp_path / "eval.parquet", [{"question": "q", "solution": "#### 1"}])
    with pytest.raises(TaskError) as err:
        build_task(spec(write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS), eval_path=str(evals)))
    assert (
        str(err.value) == f"task.eval_path: {evals}: no column 'answer' (answer_key); its columns: question, solution"
    )


def test_missing_unreadable_empty_and_too_small_files(tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(TaskError, match=f"^task.path: no such file: {missing}$"):
        build_task(spec(missing))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(TaskError, match=rf"^task.path: {broken}: not a readable \.jsonl file \(.+\)$"):
        build_task(spec(broken))
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(TaskError, match=rf"^task.path: {not_parquet}: not a readable \.parquet file \(.+\)$"):
        build_task(spec(not_parquet))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TaskError, match=f"^task.path: {empty}: the file is empty$"):
        build_task(spec(empty))
    one = write_jsonl(tmp_path / "one.jsonl", GSM8K_ROWS[:1])
    with pytest.raises(TaskError, match="at least 2 rows are needed to split off eval prompts"):
        build_task(spec(one))


def test_an_unsupported_extension_is_a_spec_field_error_and_a_task_error(tmp_path):
    with pytest.raises(SpecError) as err:
        load_spec({"task": {"name": "dataset", "path": "train.csv"}})
    assert err.value.errors == [
        {
            "field": "task.path",
            "message": "Value error, 'train.csv': the dataset task reads files whose name ends in "
            ".jsonl, .json, .parquet, .arrow",
        }
    ]
    csv = tmp_path / "train.csv"
    csv.write_text("question,answer\nq,1\n")
    task_spec = TaskSpec.model_construct(**{**TaskSpec().model_dump(), "name": "dataset", "path": str(csv)})
    with pytest.raises(
        TaskError, match=f"^task.path: {csv}: the dataset task reads .jsonl, .json, .parquet, .arrow files$"
    ):
        DatasetTask(task_spec)
