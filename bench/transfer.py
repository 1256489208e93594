"""Sample transfer between a rollout process and the trainer: packed vs padded bytes, and messages with and
without aggregation, in one run.

1. *Bytes*: the same long-tailed samples (prompt lengths 16-256, response lengths heavy-tailed up to
   ``--max-new-tokens``) serialised two ways with ``torch.save``: packed (``runtime.sample_queue.pack_samples``:
   flat tensors + lengths, what the pipeline sends) and padded (rows padded to the longest prompt and
   response, plus the attention masks a padded format needs). Target: packed <= 20% of padded.
2. *Messages*: a real sender process streams finished GRPO groups through a real pipe to this process,
   as a rollout instance does, (a) one message per group, (b) through ``runtime.rollout.transfer.Aggregator``
   (``--max-bytes`` or ``--window-s``, whichever first), and (c) aggregated with each message's bytes
   in shared memory (``ShmCourier``), the pipe carrying a reference; figures: groups/s and
   messages/s delivered, and the receiver's CPU seconds per group (the trainer's cost).

    .venv/bin/python bench/transfer.py --quick
    .venv/bin/python bench/transfer.py

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from runtime.sample_queue import pack_samples, unpack_samples  # noqa: E402
from runtime.samples import Sample  # noqa: E402

GROUP = 4


def long_tailed_samples(n: int, max_new: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(16, 256)
        rlen = min(max_new, max(1, int(rng.paretovariate(1.2) * 24)))
        out.append(
            Sample(
                sample_id=i,
                prompt_id=i // GROUP,
                group_id=i // GROUP,
                prompt_ids=[rng.randrange(32000) for _ in range(plen)],
                response_ids=[rng.randrange(32000) for _ in range(rlen)],
                logprobs=[-rng.random() for _ in range(rlen)],
                versions=[7] * rlen,
                finish_reason="stop",
                reward=float(rng.random() < 0.5),
            )
        )
    return out


def padded(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The padded alternative: [N, longest] rows of ids, log-probs, versions, and masks."""
    n = len(samples)
    pw = max(len(s.prompt_ids) for s in samples)
    rw = max(len(s.response_ids) for s in samples)
    prompt = torch.zeros(n, pw, dtype=torch.int64)
    prompt_mask = torch.zeros(n, pw, dtype=torch.bool)
    resp = torch.zeros(n, rw, dtype=torch.int64)
    logp = torch.zeros(n, rw, dtype=torch.float64)
    vers = torch.zeros(n, rw, dtype=torch.int64)
    resp_mask = torch.zeros(n, rw, dtype=torch.bool)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        prompt[i, :p] = torch.tensor(s.prompt_ids)
        prompt_mask[i, :p] = True
        resp[i, :r] = torch.tensor(s.response_ids)
        logp[i, :r] = torch.tensor(s.logprobs, dtype=torch.float64)
        vers[i, :r] = torch.tensor(s.versions)
        resp_mask[i, :r] = True
    reward = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    return {"prompt": prompt, "prompt_mask": prompt_mask, "response": resp, "logprobs": logp, "versions": vers,
            "response_mask": resp_mask, "reward": reward}  # fmt: skip


def saved_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return len(buf.getvalue())


def bytes_phase(samples: list[Sample]) -> dict:
    packed = saved_bytes(pack_samples(samples))
    pad = saved_bytes(padded(samples))
    assert unpack_samples(pack_samples(samples)) == samples  # the packed form loses nothing
    return {"samples": len(samples), "packed_bytes": packed, "padded_bytes": pad, "packed_over_padded": packed / pad}


def sender(conn, groups: list[list[Sample]], aggregate: bool, max_bytes: int, window_s: float, shm: bool) -> None:
    torch.set_num_threads(1)
    import os

    from runtime.rollout.transfer import Aggregator, ShmCourier, sample_nbytes
    from runtime.rollout.wire import to_bytes

    courier = ShmCourier(f"tandem-bench-{os.getpid()}-") if shm else None

    def send(batch: list[list[Sample]]) -> None:
        flat = [s for g in batch for s in g]
        blob = to_bytes(pack_samples(flat))
        conn.send(("samples", 0, (courier.wrap(blob) if courier else blob, {"groups": len(batch)})))

    agg: Aggregator[list[Sample]] = Aggregator(max_bytes, window_s, sample_nbytes)
    for g in groups:
        if not aggregate:
            send([g])
            continue
        agg.add(g)
        if agg.due():
            send(agg.flush())
    if len(agg):
        send(agg.flush())
    conn.send(None)
    conn.close()


def message_phase(groups: list[list[Sample]], aggregate: bool, max_bytes: int, window_s: float, shm: bool) -> dict:
    from runtime.rollout.transfer import ShmCourier
    from runtime.rollout.wire import from_bytes

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=sender, args=(send, groups, aggregate, max_bytes, window_s, shm))
    proc.start()
    send.close()
    first = recv.recv()  # the sender is up (spawn start-up is not timed)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    messages, got = 1, first[2][1]["groups"]
    unpack_samples(from_bytes(ShmCourier.unwrap(first[2][0])))
    while True:
        msg = recv.recv()
        if msg is None:
            break
        ref, info = msg[2]
        unpack_samples(from_bytes(ShmCourier.unwrap(ref)))  # what the trainer's receiver does with each message
        messages += 1
        got += info["groups"]
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    proc.join()
    assert got == len(groups)
    return {
        "groups": got,
        "messages": messages,
        "groups_per_s": got / wall,
        "messages_per_s": messages / wall,
        "receiver_cpu_ms_per_group": 1000 * cpu / got,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and groups: well under a minute")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=20000)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--max-bytes", type=int, default=1 << 20, help="pipeline.transfer_max_bytes")
    ap.add_argument("--window-s", type=float, default=0.05, help="pipeline.transfer_window_s")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.samples, args.groups = 1024, 4000
    torch.set_num_threads(1)

    b = bytes_phase(long_tailed_samples(args.samples, args.max_new_tokens, args.seed))
    print(f"bytes: packed {b['packed_bytes']:,} vs padded {b['padded_bytes']:,} = {b['packed_over_padded']:.1%}")
    # short responses: where per-message overhead matters most
    small = long_tailed_samples(args.groups * GROUP, 32, args.seed + 1)
    for s in small:
        s.prompt_ids = s.prompt_ids[:24]
    groups = [small[i : i + GROUP] for i in range(0, len(small), GROUP)]
    single = message_phase(groups, False, args.max_bytes, args.window_s, shm=False)
    agg = message_phase(groups, True, args.max_bytes, args.window_s, shm=False)
    agg_shm = message_phase(groups, True, args.max_bytes, args.window_s, shm=True)
    for name, r in (("one message per group", single), ("aggregated", agg), ("aggregated, shared memory", agg_shm)):
        print(
            f"{name:>22}: {r['groups_per_s']:9,.0f} groups/s in {r['messages_per_s']:8,.0f} messages/s; "
            f"receiver {r['receiver_cpu_ms_per_group']:.3f} ms CPU per group"
        )
    speedup = agg["groups_per_s"] / single["groups_per_s"]
    print(f"aggregation: {speedup:.1f}x groups/s, {single['messages'] / agg['messages']:.0f}x fewer messages")
    print(f"shared memory vs pipe (aggregated): {agg_shm['groups_per_s'] / agg['groups_per_s']:.2f}x groups/s")
    print(
        json.dumps(
            {
                "bytes": b,
                "single": single,
                "aggregated": agg,
                "aggregated_shared_memory": agg_shm,
                "shared_memory_over_pipe_groups_per_s": agg_shm["groups_per_s"] / agg["groups_per_s"],
                "aggregated_over_single_groups_per_s": speedup,
                "targets": {"packed_over_padded_max": 0.2},
            }
        )
    )


if __name__ == "__main__":
    main()
