"""The math verifier: which final answer it reads from a completion, and when two answers are equal."""

from __future__ import annotations

from fractions import Fraction

import pytest

from runtime.tasks.math_verify import extract_answer, read_number, verify_math

F = Fraction

# (completion or reference, the final answer the verifier reads)
EXTRACTED = [
    # GSM8K's marker: the number after the last ####
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72", F(72)),
    ("#### 1,234", F(1234)),
    ("#### -5", F(-5)),
    ("#### +7", F(7)),
    ("#### 72.", F(72)),
    ("#### $18.50", F(37, 2)),
    ("#### 3/4", F(3, 4)),
    ("#### 3/4.", F(3, 4)),
    ("#### 50%", F(50)),
    ("#### \\boxed{9}", F(9)),
    ("first #### 1\nthen #### 2", F(2)),  # the last marker
    ("#### \nthe answer is 8", F(8)),  # an empty marker falls through to the next rule
    ("#### 4 then rambling about 100", F(4)),  # the first number of the marker's line
    # \boxed{}: the last one, nested braces balanced, LaTeX fractions
    ("so \\boxed{\\frac{1}{2}}", F(1, 2)),
    ("\\boxed{\\dfrac{3}{4}}", F(3, 4)),
    ("\\boxed{{12}}", F(12)),
    ("\\boxed{1} and then \\boxed{2}", F(2)),
    ("\\boxed{2} but \\boxed{3", F(2)),  # the last one never closes: the one before it
    ("\\boxed{x = -3}", F(-3)),
    ("\\boxed{18\\text{ dollars}}", F(18)),
    ("\\boxed{\\$1{,}000}", F(1000)),
    ("\\boxed{5\\%}", F(5)),
    ("the boxed answer is 3 but \\boxed{4}", F(4)),  # boxed outranks the phrase
    # "the answer is"
    ("The answer is 42.", F(42)),
    ("So the final ANSWER: 7 apples, not 9", F(7)),
    ("answer = \u22123", F(-3)),  # Unicode minus
    ("the answer is 5 dollars.\nCheck: 5 + 1 = 6", F(5)),  # the phrase's line, not the last number
    # the last number
    ("She has 3 apples and buys 4 more, so 7", F(7)),
    ("5-3=2", F(2)),
    ("0.5", F(1, 2)),
    (".25", F(1, 4)),
    ("-0.75", F(-3, 4)),
    ("1,234,567", F(1234567)),
    ("1,2,3", F(3)),  # not thousands groups: three numbers
    ("12,34", F(34)),
    ("x2", F(2)),
    ("72", F(72)),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTED)
def test_the_final_answer_read_from_a_text(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text", ["", "no number here", "#### ", "\\boxed{}", "\\boxed{x}", "the answer is seven", "$.", "1/0"]
)
def test_a_text_without_a_number_has_no_answer(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    ("span", "expected"),
    [(" $1,234. ", F(1234)), ("+3", F(3)), ("50%", F(50)), ("2/4", F(1, 2)), ("about 6 or 7", F(6)), ("x", None)],
)
def test_a_span_reads_whole_or_by_its_first_number(span, expected):
    assert read_number(span) == expected


# (completion, reference, correct)
VERDICTS = [
    ("The answer is 72", "Natalia sold ... #### 72", True),
    ("#### 72", "72", True),
    ("\\boxed{72}", "72", True),
    ("#### 1,000", "1000", True),
    ("#### 1000.0", "#### 1,000", True),
    ("#### 0.5", "1/2", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("#### 0.3333333", "1/3", True),  # within the relative tolerance
    ("#### 0.33", "1/3", False),
    ("#### 1000.1", "1000", False),
    ("#### -5", "5", False),
    ("#### +5", "5", True),
    ("#### 50%", "50", True),
    ("#### 71", "#### 72", False),
    ("I do not know", "#### 72", False),
    ("#### 72", "no number in the reference", False),
    ("72 is wrong, it is 73", "73", True),
    ("\\boxed{72} then I ramble 5", "72", True),
    ("12345678901234567890", "12345678901234567891", False),  # big integers compare exactly
]


@pytest.mark.parametrize(("completion", "reference", "correct"), VERDICTS)
def test_verdicts(completion, reference, correct):
    assert verify_math(completion, reference) is correct
