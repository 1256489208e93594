"""Memory of an async run's process tree on one host: what its extra processes share, side by side in one run.

Three configurations of the same async run (a char-vocabulary Qwen2 checkpoint of ``--hidden`` x ``--layers``,
``--instances`` rollout processes, ``--steps`` steps), interleaved over ``--rounds``:

* ``fresh+copy`` — the fork server a fresh interpreter (a library caller of ``runtime.pipeline.run``) and every
  rollout instance with an engine of its own, which copies each published version out of the shared buffer
  (``TANDEM_SHARED_WEIGHTS=copy``): how async ran before.
* ``forked+copy`` — ``python -m runtime run``: the fork server a fork of the run's own process
  (``runtime.processes.fork_server_here``), instances still copying.
* ``forked+in_place`` — ``python -m runtime run`` as it runs by default: the instances' engines compute on the
  shared buffer's tensors in place (one copy of the weights on the host).

Every 0.1 s the bench reads ``/proc/<pid>/smaps_rollup`` of each process of the run's tree: the tree's PSS
(shared pages divided among their sharers: what the tree costs the host) and each rollout process's USS (its
private pages). It reports the peaks, the run's steady samples/s (steps after the first two), and the ratios
against ``fresh+copy``. The weights alone are ``weights_mib`` (float32).

Usage::

    .venv/bin/python bench/async_memory.py --quick    # small model, 1 instance, one round (under a minute)
    .venv/bin/python bench/async_memory.py            # the recorded figure

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
import threading
from pathlib import Path
from typing import Any

from harness import children

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("fresh+copy", "forked+copy", "forked+in_place")
LIBRARY_RUN = (
    "import sys\n"
    "from runtime.pipeline import run\n"
    "from runtime.spec import load_spec\n"
    "run(load_spec(sys.argv[1], sys.argv[2:]))\n"
)


def make_model(directory: Path, hidden: int, layers: int) -> float:
    """A randomly initialised char-vocabulary Qwen2 checkpoint; returns its float32 weights' MiB."""
    sys.path.insert(0, str(ROOT))
    import torch

    from runtime.models import CharTokenizer, save_hf
    from runtime.models.configs import DecoderConfig
    from runtime.models.loading import plain_decoder

    tok = CharTokenizer()
    heads = max(2, hidden // 64)
    config = DecoderConfig(
        model_type="qwen2",
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    torch.manual_seed(0)
    model = plain_decoder(config, torch.float32)
    save_hf(model, tok, directory)
    return sum(p.numel() for p in model.parameters()) * 4 / 2**20


def spec_file(path: Path, model_dir: Path, out: Path, instances: int, steps: int) -> None:
    spec = {
        "name": "async-memory",
        "seed": 0,
        "output_dir": str(out),
        "model": {"path": str(model_dir), "tokenizer": "char"},
        "task": {"name": "reverse", "min_len": 1, "max_len": 6, "train_size": 1024, "eval_size": 8},
        "algorithm": {"name": "grpo", "group_size": 4, "off_policy": "decoupled"},
        "trainer": {"lr": 1e-4},
        "rollout": {"max_new_tokens": 12},
        "pipeline": {"mode": "async", "steps": steps, "prompts_per_step": 8, "max_policy_lag": 1, "eval_interval": 0},
        "resources": {"rollout_workers": instances, "threads_per_process": 1},
        "checkpoint": {"interval": 0, "keep_last": 1},
        "metrics": {"progress_bar": False},
    }
    path.write_text(json.dumps(spec))


def _smaps(pid: int) -> dict[str, int]:
    """kB figures of /proc/<pid>/smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


class TreeSampler:
    """Peak PSS of a process tree, and the peak USS of each of its processes whose command line or parent marks a
    rollout instance (the children of the fork server), read every ``interval`` seconds on a thread."""

    def __init__(self, root: int, interval: float = 0.1):
        self.root, self.interval = root, interval
        self.peak_pss_kb = 0
        self.rollout_uss_kb: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.is_set():
            pss, frontier = 0, [(self.root, 0)]
            while frontier:
                pid, depth = frontier.pop()
                try:
                    figures = _smaps(pid)
                except OSError:
                    continue
                pss += figures["Pss"]
                # root -> fork server -> rollout processes (depth 2); the resource tracker has no children
                if depth == 2:
                    uss = figures["Private_Clean"] + figures["Private_Dirty"]
                    self.rollout_uss_kb[pid] = max(self.rollout_uss_kb.get(pid, 0), uss)
                frontier += [(c, depth + 1) for c in children(pid)]
            self.peak_pss_kb = max(self.peak_pss_kb, pss)
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def run_config(config: str, spec: Path, out: Path) -> dict[str, Any]:
    fork, weights = config.split("+")
    env = {**os.environ, "TANDEM_SHARED_WEIGHTS": weights, "PYTHONPATH": str(ROOT)}
    if fork == "fresh":  # a library caller: the fork server is a fresh interpreter
        cmd = [sys.executable, "-c", LIBRARY_RUN, str(spec), f"output_dir={out}"]
    else:
        cmd = [sys.executable, "-m", "runtime", "run", str(spec), f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    _, err = proc.communicate()
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{config}: the run failed:\n{err[-2000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "time/step" in r]
    steady = steps[2:] or steps
    return {
        "peak_tree_pss_mib": sampler.peak_pss_kb / 1024,
        "rollout_uss_mib": sum(sampler.rollout_uss_kb.values()) / 1024,
        "rollout_processes": len(sampler.rollout_uss_kb),
        "samples_per_s": statistics.mean(r["throughput/samples_per_s"] for r in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, one instance, one round")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.instances, args.steps, args.rounds = 256, 4, 1, 5, 1

    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-async-memory-") as tmp:
        model_dir = Path(tmp) / "model"
        weights_mib = make_model(model_dir, args.hidden, args.layers)
        print(f"model: hidden {args.hidden}, {args.layers} layers, {weights_mib:.1f} MiB of float32 weights")
        for r in range(args.rounds):
            order = CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))
            for config in order:
                spec = Path(tmp) / f"{config}-{r}.json"
                out = Path(tmp) / f"{config}-{r}"
                spec_file(spec, model_dir, out, args.instances, args.steps)
                figures = run_config(config, spec, out)
                results[config].append(figures)
                print(
                    f"round {r} {config:16s} tree PSS {figures['peak_tree_pss_mib']:7.1f} MiB, rollout USS "
                    f"{figures['rollout_uss_mib']:7.1f} MiB ({figures['rollout_processes']} processes), "
                    f"{figures['samples_per_s']:6.1f} samples/s"
                )

    def median(config: str, key: str) -> float:
        return statistics.median(f[key] for f in results[config])

    base = "fresh+copy"
    summary: dict[str, Any] = {
        "hidden": args.hidden,
        "layers": args.layers,
        "instances": args.instances,
        "weights_mib": weights_mib,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    for config in CONFIGS:
        pss, uss, rate = (median(config, k) for k in ("peak_tree_pss_mib", "rollout_uss_mib", "samples_per_s"))
        summary[config] = {
            "peak_tree_pss_mib": pss,
            "rollout_uss_mib": uss,
            "samples_per_s": rate,
            "pss_vs_fresh_copy": pss / median(base, "peak_tree_pss_mib"),
            "samples_per_s_vs_fresh_copy": rate / median(base, "samples_per_s"),
        }
        print(
            f"{config:16s} tree PSS {pss:7.1f} MiB ({summary[config]['pss_vs_fresh_copy']:.2f}x), rollout USS "
            f"{uss:7.1f} MiB, {rate:6.1f} samples/s ({summary[config]['samples_per_s_vs_fresh_copy']:.2f}x)"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
