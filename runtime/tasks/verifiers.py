"""Rule verifiers: does a response carry the reference answer? Each is ``verify(response, answer) -> bool``.

- ``exact``: equal after trimming and collapsing whitespace.
- ``numeric``: the last number in the response equals the answer's number (relative tolerance 1e-6;
  thousands separators allowed).
- ``boxed``: the content of the last ``\\boxed{...}`` in the response (braces balanced) equals the answer
  (itself boxed or plain), compared as numbers when both parse as numbers, else as text without spaces
  and surrounding ``$``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def normalize_text(text: str) -> str:
    return " ".join(text.split())


def parse_number(text: str) -> float | None:
    """The text as a number (``1,234.5`` allowed), or None."""
    text = text.strip().replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def last_number(text: str) -> float | None:
    """The last number written in ``text``, or None."""
    matches = _NUMBER.findall(text)
    return parse_number(matches[-1]) if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` with nested braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed


def _numbers_equal(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def verify_exact(response: str, answer: str) -> bool:
    return normalize_text(response) == normalize_text(answer)


def verify_numeric(response: str, answer: str) -> bool:
    expected = parse_number(answer)
    got = last_number(response)
    return expected is not None and got is not None and _numbers_equal(got, expected)


def _canonical_math(text: str) -> str:
    return "".join(text.split()).strip("$")


def verify_boxed(response: str, answer: str) -> bool:
    got = last_boxed(response)
    if got is None:
        return False
    expected = last_boxed(answer)
    expected = answer if expected is None else expected
    a, b = parse_number(got), parse_number(expected)
    if a is not None and b is not None:
        return _numbers_equal(a, b)
    return _canonical_math(got) == _canonical_math(expected)


VERIFIERS: dict[str, Callable[[str, str], bool]] = {
    "exact": verify_exact,
    "numeric": verify_numeric,
    "boxed": verify_boxed,
}


def get_verifier(name: str) -> Callable[[str, str], bool]:
    if name not in VERIFIERS:
        raise ValueError(f"task.verifier: unknown verifier {name!r}; choose one of {', '.join(VERIFIERS)}")
    return VERIFIERS[name]
