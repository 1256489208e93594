"""Rollout scheduling on a long-tailed workload with two rollout instances, three ways, in one run.

Two instance processes (one torch thread each, each its own built-in engine over the same tiny-qwen2
weights) serve the same requests three ways:

* ``fifo`` — fixed-size batches in arrival order, static batching (a batch runs until its longest
  sequence ends); the instances pull the next batch from one shared queue when they are free.
* ``length_aware`` — :class:`runtime.rollout.scheduling.Scheduler`: predicted lengths, quantile buckets,
  token-budget batches, long/short mixing into groups, queue-aware dispatch; static batching.
* ``continuous`` — the same plan, each instance feeding all its requests through one continuous
  batcher (a finished sequence's slot is refilled at the next step), longest first.

The workload emulates a model with long-tailed answers: every request has a hidden true response
length (heavy-tailed, capped at ``--max-new-tokens``) and is generated with eos ignored for exactly
that many tokens. The scheduler never sees the true lengths; its predictor is fed one earlier step's
observed lengths (true length +-20%), as at step 2 of a run. Figures per mode: generated tokens/s
(real response tokens / the busiest instance's CPU seconds — each instance is one thread, so this is
the throughput with a core per instance, and it does not move with the load other jobs put on a
shared machine; wall-clock tokens/s is printed too), padding ratio (1 - real / allocated token
positions, prefill and decode), skewness (max / mean instance busy CPU time), sorting wait (mean
request queue wait / mean instance busy time, both wall clock), and the speed-up over ``fifo``. Usage::

    .venv/bin/python bench/rollout_scheduling.py --quick
    .venv/bin/python bench/rollout_scheduling.py --requests 256 --max-new-tokens 256

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.rollout.scheduling import Request, Scheduler, bubble_metrics  # noqa: E402

INSTANCES = ("r0", "r1")


def instance_main(name: str, inbox: mp.Queue, shared: mp.Queue, outbox: mp.Queue, slots: int) -> None:
    """One rollout instance: builds its engine, then serves ``("static"|"continuous"|"pull", work)`` commands."""
    import torch

    torch.set_num_threads(1)
    from runtime.models import build_policy
    from runtime.rollout import Engine, SamplingParams
    from runtime.spec import ModelSpec

    model, tok = build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=0)
    engine = Engine(model, tok, "cpu", max_batch_size=slots, max_batch_tokens=1 << 30)
    params = SamplingParams(max_new_tokens=1024, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    warm = [[1] + [5] * (i % 16 + 4) for i in range(2 * slots)]
    engine.generate(warm, SamplingParams(64, ignore_eos=True), gen)  # warm-up: kernels for many shapes
    outbox.put(("ready", name))

    def run_requests(requests, refill, admitted):
        """Generate ``[(rid, prompt_ids, length)]``; record each request's admission time."""
        batcher = engine.batcher(params, gen, refill=refill)
        for rid, ids, length in requests:
            batcher.submit(ids, rid, max_new_tokens=length)
        busy = 0.0
        while not batcher.idle:
            t, c = time.time(), time.process_time()
            before = {s.tag for s in batcher.slots if s is not None}
            done = batcher.step()
            busy += time.process_time() - c
            wall[0] += time.time() - t
            for s in batcher.slots:
                if s is not None and s.tag not in before:
                    admitted[s.tag] = t
            for tag, _ in done:
                if tag not in before:  # admitted and finished in one step
                    admitted[tag] = t
        return batcher.stats, busy

    wall = [0.0]  # wall-clock busy time of the current command

    while True:
        cmd, work = inbox.get()
        if cmd == "stop":
            return
        admitted: dict = {}
        wall[0] = 0.0
        real = allocated = generated = 0
        busy = 0.0
        batches = []
        if cmd == "pull":  # fifo: take batches from the shared queue until the sentinel
            while (batch := shared.get()) is not None:
                batches.append(batch)
                stats, b = run_requests(batch, False, admitted)
                busy += b
                real, allocated, generated = (
                    real + stats.real_tokens,
                    allocated + stats.allocated_tokens,
                    generated + stats.generated_tokens,
                )
        else:
            groups = work
            if cmd == "continuous":  # every request of every group through one batcher, longest first
                flat = sorted((r for g in groups for b in g for r in b), key=lambda r: -r[3])
                runs = [([r[:3] for r in flat], True)]
            else:
                runs = [([r[:3] for r in b], False) for g in groups for b in g]
            for requests, refill in runs:
                stats, b = run_requests(requests, refill, admitted)
                busy += b
                real += stats.real_tokens
                allocated += stats.allocated_tokens
                generated += stats.generated_tokens
        outbox.put(("done", name, {"busy": busy, "real": real, "allocated": allocated,
                                   "generated": generated, "admitted": admitted, "end": time.time(), "wall": wall[0]}))  # fmt: skip


def make_workload(n: int, max_new: int, seed: int):
    """``[(rid, prompt_ids, true_length)]`` with heavy-tailed true lengths, and noisy past observations."""
    rng = random.Random(seed)
    work, past = [], []
    for rid in range(n):
        prompt = [1] + [rng.randint(4, 90) for _ in range(rng.randint(4, 16))]
        length = min(max_new, max(1, int(6 / (1 - rng.random()) ** 1.3)))
        work.append((rid, prompt, length))
        past.append(max(1, round(length * rng.uniform(0.8, 1.2))))
    return work, past


def run_mode(mode, work, past, procs, args):
    inboxes, shared, outbox = procs
    t0 = time.time()
    if mode == "fifo":
        for k in range(0, len(work), args.batch):
            shared.put(work[k : k + args.batch])
        for _ in INSTANCES:
            shared.put(None)
        for name in INSTANCES:
            inboxes[name].put(("pull", None))
    else:
        sched = Scheduler(list(INSTANCES), max_new_tokens=args.max_new_tokens,
                          max_batch_tokens=args.batch * (args.max_new_tokens + 17), max_batch_size=args.batch)  # fmt: skip
        for (rid, prompt, _), length in zip(work, past, strict=True):
            sched.predictor.observe(rid, "bench", len(prompt), length)
        by_id = {rid: (rid, prompt, length) for rid, prompt, length in work}
        requests = [Request(rid, rid, len(prompt), task="bench") for rid, prompt, _ in work]
        per_instance: dict[str, list] = {name: [] for name in INSTANCES}
        for _, inst, group in sched.plan(requests):
            per_instance[inst].append([[(*by_id[r.request_id], r.predicted) for r in b] for b in group])
        cmd = "continuous" if mode == "continuous" else "static"
        for name in INSTANCES:
            inboxes[name].put((cmd, per_instance[name]))
    reports = {}
    while len(reports) < len(INSTANCES):
        _, name, rep = outbox.get()
        reports[name] = rep
    makespan = max(r["end"] for r in reports.values()) - t0
    cpu_makespan = max(r["busy"] for r in reports.values())
    waits = [t - t0 for r in reports.values() for t in r["admitted"].values()]
    assert len(waits) == len(work), (len(waits), len(work))
    real = sum(r["real"] for r in reports.values())
    allocated = sum(r["allocated"] for r in reports.values())
    bubbles = bubble_metrics({n: r["busy"] for n, r in reports.items()}, real, allocated, [])
    # Waits are wall clock, so they are compared with wall-clock busy time.
    sorting_wait = bubble_metrics({n: r["wall"] for n, r in reports.items()}, 0, 0, waits)["sorting_wait"]
    generated = sum(r["generated"] for r in reports.values())
    assert generated == sum(length for _, _, length in work)
    return {
        "mode": mode,
        "generated_tokens": generated,
        "makespan_s": round(makespan, 3),
        "tokens_per_s_wall": round(generated / makespan, 1),
        "tokens_per_s": round(generated / cpu_makespan, 1),
        "padding_ratio": round(bubbles["padding_ratio"], 4),
        "skewness": round(bubbles["skewness"], 3),
        "sorting_wait": round(sorting_wait, 3),
        "busy_cpu_s": {n: round(r["busy"], 3) for n, r in reports.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="128 requests, lengths up to 128: well under a minute")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="FIFO batch size = engine slots")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_new_tokens = 128, 128
    work, past = make_workload(args.requests, args.max_new_tokens, args.seed)
    ctx = mp.get_context("spawn")
    inboxes = {name: ctx.Queue() for name in INSTANCES}
    shared, outbox = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=instance_main, args=(name, inboxes[name], shared, outbox, args.batch), daemon=True)
        for name in INSTANCES
    ]
    for p in procs:
        p.start()
    try:
        for _ in INSTANCES:
            assert outbox.get(timeout=120)[0] == "ready"
        results = {m: run_mode(m, work, past, (inboxes, shared, outbox), args) for m in
                   tuple(os.environ.get("ORDER", "fifo,length_aware,continuous").split(","))}  # fmt: skip
    finally:
        for name in INSTANCES:
            inboxes[name].put(("stop", None))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    base = results["fifo"]["tokens_per_s"]
    lengths = sorted(length for _, _, length in work)
    print(f"workload: {len(work)} requests, response lengths median {lengths[len(lengths) // 2]}, "
          f"p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]}; 2 instances x 1 thread, "
          f"{args.batch} slots each")  # fmt: skip
    for r in results.values():
        r["speedup_vs_fifo"] = round(r["tokens_per_s"] / base, 2)
        print(f"{r['mode']:<13} {r['tokens_per_s']:8.0f} tok/s per instance-CPU ({r['speedup_vs_fifo']:.2f}x fifo)  "
              f"padding {r['padding_ratio']:.3f}  skewness {r['skewness']:.3f}  "
              f"sorting wait {r['sorting_wait']:.3f}  wall {r['tokens_per_s_wall']:.0f} tok/s, "
              f"makespan {r['makespan_s']:.2f} s")  # fmt: skip
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} (shared machine; figures vary with load)")
    print(json.dumps({"bench": "rollout_scheduling", "requests": len(work), "max_new_tokens": args.max_new_tokens,
                      "slots": args.batch, "load_avg_1m": round(load, 2), "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
