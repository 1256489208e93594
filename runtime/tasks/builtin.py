"""Built-in synthetic tasks a tiny character-level model can learn, with long-tailed answer lengths.

Each prompt has a problem *size* drawn between ``min_len`` and ``max_len`` with probability
proportional to ``1 / (size - min_len + 1)`` (Zipf-like: most problems are short, a few are long),
which is what makes generation lengths — and so rollout batches — uneven, as in real RL workloads.

===========  ==================  ==========  =====================================
task         prompt              answer      answer length
===========  ==================  ==========  =====================================
reverse      ``reverse:abc=``    ``cba``     size
copy         ``copy:abc=``       ``abc``     size
repeat       ``repeat 3:ab=``    ``ababab``  size x pattern length (1-2)
arithmetic   ``47+85=``          ``132``     size or size+1 (two size-digit operands)
===========  ==================  ==========  =====================================

Letters come from ``a``-``j`` (a small alphabet keeps the tasks learnable by tiny models). Scoring is
exact match: reward 1.0 when the response equals the answer (surrounding whitespace ignored), else 0.0;
there is no partial credit. Train and eval prompts come from independent random streams of the same
distribution, so very small sizes can occur in both (there are only 10 one-letter strings).
"""

from __future__ import annotations

import random

from runtime.samples import Prompt
from runtime.tasks.base import Task
from runtime.tasks.verifiers import verify_exact

ALPHABET = "abcdefghij"


def draw_size(rng: random.Random, min_len: int, max_len: int) -> int:
    """A long-tailed size in [min_len, max_len]: P(size) proportional to 1 / (size - min_len + 1)."""
    sizes = range(min_len, max_len + 1)
    weights = [1.0 / (s - min_len + 1) for s in sizes]
    return rng.choices(sizes, weights=weights)[0]


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def make_reverse(rng: random.Random, size: int) -> tuple[str, str]:
    s = _letters(rng, size)
    return f"reverse:{s}=", s[::-1]


def make_copy(rng: random.Random, size: int) -> tuple[str, str]:
    s = _letters(rng, size)
    return f"copy:{s}=", s


def make_repeat(rng: random.Random, size: int) -> tuple[str, str]:
    pattern = _letters(rng, rng.choice((1, 2)))
    return f"repeat {size}:{pattern}=", pattern * size


def make_arithmetic(rng: random.Random, size: int) -> tuple[str, str]:
    low = 0 if size == 1 else 10 ** (size - 1)
    a, b = rng.randint(low, 10**size - 1), rng.randint(low, 10**size - 1)
    return f"{a}+{b}=", str(a + b)


GENERATORS = {"reverse": make_reverse, "copy": make_copy, "repeat": make_repeat, "arithmetic": make_arithmetic}


class BuiltinTask(Task):
    """One of the synthetic tasks in GENERATORS, sized and seeded by a TaskSpec."""

    def __init__(self, name: str, train_size: int, eval_size: int, min_len: int, max_len: int, seed: int):
        super().__init__(verify_exact)
        if name not in GENERATORS:
            raise ValueError(f"task.name: unknown built-in task {name!r}; choose one of {', '.join(GENERATORS)}")
        self.name = name
        self.train_size, self.eval_size = train_size, eval_size
        self.min_len, self.max_len, self.seed = min_len, max_len, seed

    def _draw(self, stream: str, count: int, first_id: int) -> list[Prompt]:
        rng = random.Random(f"{self.name}:{self.seed}:{stream}")  # string seeds are stable across processes
        make = GENERATORS[self.name]
        prompts = []
        for i in range(count):
            size = draw_size(rng, self.min_len, self.max_len)
            text, answer = make(rng, size)
            prompts.append(Prompt(prompt_id=first_id + i, text=text, answer=answer, size=size))
        return prompts

    def _build(self) -> tuple[list[Prompt], list[Prompt]]:
        return self._draw("train", self.train_size, 0), self._draw("eval", self.eval_size, self.train_size)
