"""The math verifier: pull the final answer out of a completion and compare it with the reference as a number.

Used by the ``dataset`` task (runtime.tasks.dataset) for GSM8K- and MATH-style data. The reference goes
through the same extraction as the completion, so a GSM8K answer ``"... so she sold 72 clips. #### 72"``
(Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems", arXiv:2110.14168: the number after
``####`` is the final answer) and a plain ``"72"`` or ``72`` both mean 72.

Extraction — the first rule whose span holds a number wins:

1. ``#### x``: the text after the last ``####``, to the end of its line (GSM8K).
2. ``\\boxed{x}``: the content of the last ``\\boxed{...}``, nested braces balanced (the MATH convention,
   Hendrycks et al. 2021, arXiv:2103.03874).
3. ``the answer is x`` (also ``answer: x``, ``answer = x``; any case): the text after the last one, to the end
   of its line.
4. The last number anywhere in the text.

Within a span of rules 1-3, the span itself when the whole of it reads as a number, else its first number.

Normalisation before reading a number: Unicode minus, ``$`` and ``\\$``, LaTeX spacing (``\\,``, ``\\!``,
``{,}``) and ``\\%`` are dropped; ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``) becomes ``a/b``. A number is
an optional sign (not glued to a preceding word or digit, so ``5-3`` holds 5 and 3), then a fraction of
integers ``a/b``, or digits with optional thousands separators (``1,234``: groups of exactly three) and an
optional decimal part. A leading ``+``, a trailing period and a percent sign are not part of the value
(``50%`` reads 50, as GSM8K writes percentages). Not read: scientific notation, mixed numbers (``1 1/2``),
words (``seven``), expressions (``2+3``).

Comparison: equal as exact rationals (``0.5 == 1/2``, ``1,000 == 1000.0``); else, unless both are integers,
within a relative tolerance of 1e-6 (absolute 1e-9), so a rounded decimal needs about seven significant
digits (``0.33`` is not 1/3, ``0.3333333`` is).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

REL_TOL = 1e-6
ABS_TOL = 1e-9

# A sign only where it cannot be a binary minus or part of a word: "5-3" is 5 and 3, "x=-3" holds -3.
_SIGN = r"(?:(?<![\w.)\]}])[-+])?"
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(rf"{_SIGN}(?:\d+\s*/\s*\d+(?![\d]|[.,]\d)|(?:{_DIGITS}))(?!\d)")
_WHOLE = re.compile(rf"[-+]?(?:\d+/\d+|{_DIGITS})")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?", re.IGNORECASE)


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\\$", "").replace("$", "")
    for mark in ("\\,", "\\!", "{,}", "\\%", "\\ "):
        text = text.replace(mark, "," if mark == "{,}" else "")
    return _FRAC.sub(r"\1/\2", text)


def _value(token: str) -> Fraction | None:
    """The exact value of one number token (commas, spaces around ``/`` and a leading ``+`` removed)."""
    token = token.replace(",", "").replace(" ", "")
    try:
        value = Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def read_number(span: str) -> Fraction | None:
    """The span as a number when the whole of it is one (``" $1,234. "``, ``"50%"``), else its first number."""
    text = _normalise(span).strip().rstrip(".").strip().removesuffix("%").strip()
    if _WHOLE.fullmatch(text):
        return _value(text)
    for match in _NUMBER.finditer(_normalise(span)):
        value = _value(match.group())
        if value is not None:
            return value
    return None


def last_number(text: str) -> Fraction | None:
    """The last number written anywhere in ``text``."""
    values = [_value(m.group()) for m in _NUMBER.finditer(_normalise(text))]
    values = [v for v in values if v is not None]
    return values[-1] if values else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces close, nested ones balanced."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for j in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : j]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try an earlier one
    return None


def _line_after(text: str, end: int) -> str:
    return text[end:].split("\n", 1)[0]


def extract_answer(text: str) -> Fraction | None:
    """The final answer of a completion or a reference, by the rules in the module docstring; None if none."""
    spans: list[str] = []
    hashes = text.rfind("####")
    if hashes >= 0:
        spans.append(_line_after(text, hashes + 4))
    boxed = _last_boxed(text)
    if boxed is not None:
        spans.append(boxed)
    phrases = list(_ANSWER_IS.finditer(text))
    if phrases:
        spans.append(_line_after(text, phrases[-1].end()))
    for span in spans:
        value = read_number(span)
        if value is not None:
            return value
    return last_number(text)


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    """Exactly equal; or, unless both are integers, within REL_TOL / ABS_TOL as floats."""
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # two integers: no tolerance (a large count off by one is wrong)
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)


def verify_math(response: str, answer: str) -> bool:
    """Whether the completion's final answer equals the reference's (both extracted the same way)."""
    expected = extract_answer(answer)
    got = extract_answer(response)
    return expected is not None and got is not None and numbers_equal(got, expected)
