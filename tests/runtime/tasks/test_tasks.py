"""Tasks: deterministic prompt sets with long-tailed sizes, verifiers, JSONL loading and its errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from runtime.spec import TaskSpec
from runtime.tasks import TaskError, build_task, draw_size
from runtime.tasks.verifiers import last_boxed, last_number, verify_boxed, verify_exact, verify_numeric


@pytest.mark.parametrize("name", ["reverse", "copy", "repeat", "arithmetic"])
def test_builtin_prompts_are_deterministic_with_stable_ids(name):
    spec = TaskSpec(name=name, train_size=200, eval_size=20, seed=5)
    a, b = build_task(spec), build_task(spec)
    assert a.train_prompts() == b.train_prompts()
    assert a.eval_prompts() == b.eval_prompts()
    assert [p.prompt_id for p in a.train_prompts()] == list(range(200))
    assert [p.prompt_id for p in a.eval_prompts()] == list(range(200, 220))
    other = build_task(TaskSpec(name=name, train_size=200, eval_size=20, seed=6))
    assert other.train_prompts() != a.train_prompts()


@pytest.mark.parametrize("name", ["reverse", "copy", "repeat", "arithmetic"])
def test_builtin_answers_are_right_and_scored(name):
    task = build_task(TaskSpec(name=name, train_size=300, min_len=1, max_len=6))
    for p in task.train_prompts():
        assert 1 <= p.size <= 6
        if name == "reverse":
            assert p.text == f"reverse:{p.answer[::-1]}="
        elif name == "copy":
            assert p.text == f"copy:{p.answer}="
        elif name == "repeat":
            n, pattern = p.text[len("repeat ") : -1].split(":")
            assert p.answer == pattern * int(n) and int(n) == p.size
        else:
            a, b = p.text[:-1].split("+")
            assert int(p.answer) == int(a) + int(b) and len(a) == p.size
        assert task.score(p, p.answer) == (1.0, True)
        assert task.score(p, f" {p.answer}\n") == (1.0, True)
        assert task.score(p, p.answer + "x") == (0.0, False)
        assert task.score(p, "") == (0.0, False)


def test_sizes_are_long_tailed():
    task = build_task(TaskSpec(name="reverse", train_size=4000, min_len=2, max_len=9))
    counts = Counter(p.size for p in task.train_prompts())
    assert set(counts) == set(range(2, 10))
    # P(size) ~ 1/(size - min + 1): the shortest size is far more common than the longest, all appear.
    assert counts[2] > 3 * counts[9]
    assert counts[2] > counts[3] > counts[5]
    assert len(next(p for p in task.train_prompts() if p.size == 9).answer) == 9


def test_draw_size_bounds():
    import random

    rng = random.Random(0)
    assert {draw_size(rng, 3, 3) for _ in range(20)} == {3}
    assert {draw_size(rng, 1, 4) for _ in range(500)} == {1, 2, 3, 4}


def test_exact_verifier():
    assert verify_exact("  a  b\n", "a b")
    assert not verify_exact("ab", "a b")


def test_numeric_verifier():
    assert verify_numeric("the answer is 42", "42")
    assert verify_numeric("so x = 1,234.0", "1234")
    assert verify_numeric("-3.5", "-3.50")
    assert not verify_numeric("42 then 43", "42")
    assert not verify_numeric("no number", "42")
    assert last_number("a 1e3 b") == 1000.0


def test_boxed_verifier():
    assert verify_boxed(r"so \boxed{12}", "12")
    assert verify_boxed(r"\boxed{1} no, \boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}")
    assert verify_boxed(r"\boxed{ 0.50 }", "0.5")
    assert verify_boxed(r"$\boxed{x + 1}$", "x+1")
    assert not verify_boxed("12", "12")  # an unboxed answer does not count
    assert not verify_boxed(r"\boxed{13}", "12")
    assert last_boxed(r"\boxed{a{b}c") is None


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_task_split_and_scoring(tmp_path):
    rows = [{"prompt": f"What is {i}+{i}?", "answer": 2 * i, "source": "x"} for i in range(20)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    task = build_task(TaskSpec(name="jsonl", path=str(path), verifier="numeric", eval_size=10, seed=1))
    train, evals = task.train_prompts(), task.eval_prompts()
    assert len(evals) == 4  # min(eval_size, rows // 5)
    assert len(train) == 16
    assert {p.text for p in train}.isdisjoint({p.text for p in evals})
    assert [p.prompt_id for p in train + evals] == list(range(20))
    p = evals[0]
    assert task.score(p, f"it is {p.answer}") == (1.0, True)
    assert task.score(p, "it is -1") == (0.0, False)
    same = build_task(TaskSpec(name="jsonl", path=str(path), verifier="numeric", eval_size=10, seed=1))
    assert same.eval_prompts() == evals


def test_jsonl_eval_path(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p1", "answer": "a"}, {"prompt": "p2", "answer": "b"}])
    held = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "q", "answer": r"\boxed{3}"}])
    task = build_task(TaskSpec(name="jsonl", path=str(train), eval_path=str(held), verifier="boxed"))
    assert [p.text for p in task.train_prompts()] == ["p1", "p2"]
    assert [(p.prompt_id, p.text) for p in task.eval_prompts()] == [(2, "q")]
    assert task.score(task.eval_prompts()[0], r"\boxed{3}") == (1.0, True)


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"answer": "1"}', "missing `prompt`"),
        ('{"prompt": "p"}', "missing `answer`"),
        ('{"prompt": "", "answer": "1"}', "`prompt` must be a non-empty string"),
        ('{"prompt": "p", "answer": [1]}', "`answer` must be a string or a number"),
        ('{"prompt": "p", "answer": "seven"}', "is not a number"),
    ],
)
def test_bad_jsonl_rows_name_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": 1}, "", line])
    with pytest.raises(TaskError, match=message) as err:
        build_task(TaskSpec(name="jsonl", path=str(path), verifier="numeric"))
    assert f"{path}:3:" in str(err.value)


def test_missing_or_empty_jsonl(tmp_path):
    with pytest.raises(TaskError, match="task.path: no such file"):
        build_task(TaskSpec(name="jsonl", path=str(tmp_path / "nope.jsonl")))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TaskError, match="no rows"):
        build_task(TaskSpec(name="jsonl", path=str(empty)))
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(TaskError, match="at least 2 rows"):
        build_task(TaskSpec(name="jsonl", path=str(one)))
