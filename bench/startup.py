"""Start-up: seconds from launching ``python -m runtime run`` to the end of its first step, children spawned
(fresh interpreters) vs forked from the fork server (``runtime/processes.py``), side by side.

Each round runs, interleaved, ``examples/grpo-<mode>.yaml`` for 2 steps with ``TANDEM_START_METHOD=spawn`` and
with the default (forkserver), for each mode; the end of the first step is read from the run's
``metrics.jsonl`` (its wall-clock ``time``). Sync starts no child: it shows what the fork server costs a run
that does not use it (none: it is not started then). Medians over the rounds; the machine's load beside them.

Usage::

    .venv/bin/python bench/startup.py --quick      # async only, one round (under a minute)
    .venv/bin/python bench/startup.py --rounds 3   # the recorded figure

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("spawn", "forkserver")


def first_step_s(mode: str, method: str, out: Path) -> float:
    """Seconds from launch to the end of step 1 of a fresh ``python -m runtime run``."""
    env = {**os.environ, "TANDEM_START_METHOD": method}
    overrides = [f"output_dir={out}", "pipeline.steps=2", "pipeline.eval_interval=0", "checkpoint.interval=0"]
    launched = time.time()
    subprocess.run(
        [sys.executable, "-m", "runtime", "run", f"examples/grpo-{mode}.yaml", *overrides],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "time/step" in r)  # a step's line (events and evaluations have none)
    return float(first["time"]) - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="async only, one round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = ("async",) if args.quick else ("sync", "async")
    rounds = 1 if args.quick else args.rounds

    seconds: dict[str, dict[str, list[float]]] = {m: {k: [] for k in METHODS} for m in modes}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for r in range(rounds):
            for mode in modes:
                for method in METHODS if r % 2 == 0 else reversed(METHODS):  # alternate who goes first
                    s = first_step_s(mode, method, Path(tmp) / f"{mode}-{method}-{r}")
                    seconds[mode][method].append(s)
                    print(f"round {r + 1} {mode:>5} {method:>10}: first step ends {s:.2f} s after launch")
    figures = {
        mode: {
            **{f"{method}_s": statistics.median(v) for method, v in by.items()},
            "forkserver_over_spawn": statistics.median(by["forkserver"]) / statistics.median(by["spawn"]),
            "runs": by,
        }
        for mode, by in seconds.items()
    }
    for mode, f in figures.items():
        print(
            f"{mode}: spawn {f['spawn_s']:.2f} s, forkserver {f['forkserver_s']:.2f} s "
            f"({f['forkserver_over_spawn']:.2f}x)"
        )
    print(json.dumps({"load_before": load_before, "load_after": os.getloadavg()[0], "rounds": rounds, **figures}))


if __name__ == "__main__":
    main()
