"""Projection from one device to four supernodes (issue 17): model predictions, not measurements.

Runs the scaling sweep of :mod:`capacity.projection` on costs derived from published hardware
figures (an Ascend 910C supernode of the CloudMatrix384 class; 8-NPU Ascend 910B servers for the
comm-domain comparison), for Qwen2.5-7B and -32B, in sync, async and colocated modes, and:

* writes PNGs into ``docs/scaling/`` (``--out``): samples/s and scaling efficiency against devices,
  where each mode's step time goes as it scales (the bottleneck), the 1-to-4-supernode efficiency
  beside StaleSync's, and shared against isolated comm domains;
* prints markdown tables of the predictions;
* prints as its last line one JSON object with every row.

Three grids:

* ``main``: the supernode preset, both models, the three modes, 1 device to 4 supernodes, isolated
  comm domains, async publishing weights hierarchically (across supernodes, then inside each);
* ``unicast``: async as the runtime publishes today (a send per rollout instance), 7B, shared and
  isolated comm domains;
* ``servers``: async 7B on 8-NPU servers (inter-server RoCE past 8 devices), both publications,
  shared and isolated, up to 384 devices: where the Tandem design saw training communication slow
  down past a few dozen cards.

Usage::

    .venv/bin/python bench/capacity_projection.py --quick     # under a minute, 7B, fewer sizes, no plots
    .venv/bin/python bench/capacity_projection.py             # every grid and the plots (a few minutes)

matplotlib is a benchmark-only dependency (``requirements-bench.txt``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capacity.projection import (  # noqa: E402
    DEVICE_COUNTS,
    SUPERNODE,
    SUPERNODE_SIZE,
    Grid,
    Row,
    Workload,
    balanced_share,
    efficiency_between,
    sweep,
)

STALESYNC = {"async": 0.91, "lock-step": 0.85}
"""StaleSync's scaling efficiency from 1 to 4 supernodes (as issue 17 quotes it)."""
SERVERS = "ascend-910b"
SERVER_DEVICES = (2, 4, 8, 16, 32, 64, 128, 384)
SPLIT_KEYS = ("generate", "wait", "train", "allreduce", "weight_sync", "switch", "transfer")
COLORS = {
    "generate": "#4c72b0",
    "wait": "#8fb0e0",
    "train": "#dd8452",
    "allreduce": "#c44e52",
    "weight_sync": "#8172b3",
    "switch": "#937860",
    "transfer": "#55a868",
}
MODE_STYLE = {"sync": ("#c44e52", "o"), "colocated": ("#937860", "s"), "async": ("#4c72b0", "^")}


def grids(quick: bool) -> dict[str, Grid]:
    if quick:
        devices = (1, 2, 8, 64, SUPERNODE_SIZE)
        return {
            "main": Grid(models=("7b",), devices=devices),
            "servers": Grid(
                hardware=(SERVERS,),
                models=("7b",),
                modes=("async",),
                devices=(2, 8, 64),
                shared_comm_domain=(False, True),
                weight_publications=("unicast",),
            ),
        }
    return {
        "main": Grid(devices=DEVICE_COUNTS),
        "unicast": Grid(
            models=("7b",),
            modes=("async",),
            devices=DEVICE_COUNTS,
            shared_comm_domain=(False, True),
            weight_publications=("unicast",),
        ),
        "servers": Grid(
            hardware=(SERVERS,),
            models=("7b",),
            modes=("async",),
            devices=SERVER_DEVICES,
            shared_comm_domain=(False, True),
            weight_publications=("unicast", "hierarchical"),
        ),
    }


def series(rows: list[Row], **match: object) -> list[Row]:
    return sorted((r for r in rows if all(getattr(r, k) == v for k, v in match.items())), key=lambda r: r.devices)


def markdown_table(rows: list[Row]) -> str:
    head = (
        "| model | mode | publication | comm | devices | T / R | samples/s | per device | efficiency | step s "
        "| generate / wait | train | all-reduce | weight sync | bottleneck |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        s = r.time_split
        lines.append(
            f"| {r.model} | {r.mode} | {r.publication} | {r.comm} | {r.devices:,} | {r.trainer_ranks} / "
            f"{r.rollout_instances if r.mode == 'async' else '(same)'} | {r.samples_per_s:,.1f} | "
            f"{r.samples_per_s_per_device:.3f} | {r.efficiency:.3f} | {r.step_time_s:.1f} | "
            f"{s['generate'] + s['wait']:.1f} | {s['train']:.1f} | {s['allreduce']:.2f} | {s['weight_sync']:.2f} | "
            f"{r.bottleneck} |"
        )
    return "\n".join(lines)


def stalesync_comparison(rows: list[Row]) -> dict[str, dict[str, float]]:
    """1 to 4 supernodes, per model and mode (async: both publications where swept)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.hardware != SUPERNODE or r.devices != 4 * SUPERNODE_SIZE or r.comm != "isolated":
            continue
        key = f"{r.model} {r.mode}" + (f" ({r.publication})" if r.mode == "async" else "")
        out[key] = {
            "efficiency_1_to_4_supernodes": efficiency_between(rows, r.series, SUPERNODE_SIZE, 4 * SUPERNODE_SIZE),
            "efficiency_from_smallest": r.efficiency,
        }
    return out


# ---- plots (matplotlib only here) ----


def plot_all(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    models = sorted({r.model for r in rows if r.hardware == SUPERNODE}, key=lambda m: int(m.rstrip("b")))

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    def supernode_marks(ax: Any) -> None:
        for k in (1, 2, 4):
            ax.axvline(k * SUPERNODE_SIZE, color="#999", lw=0.6, ls=":")

    def curves(ax: Any, model: str, field: str) -> None:
        for mode, (color, marker) in MODE_STYLE.items():
            pub = "hierarchical" if mode == "async" else "local"
            s = series(rows, hardware=SUPERNODE, model=model, mode=mode, comm="isolated", publication=pub)
            if s:
                label = {"async": "async (hierarchical publication)", "sync": "sync (under colocated)"}.get(mode, mode)
                ax.plot([r.devices for r in s], [getattr(r, field) for r in s], marker=marker, color=color, label=label)
        s = series(rows, hardware=SUPERNODE, model=model, mode="async", comm="isolated", publication="unicast")
        if s:
            ax.plot(
                [r.devices for r in s],
                [getattr(r, field) for r in s],
                marker="^",
                ls="--",
                color="#4c72b0",
                alpha=0.6,
                label="async (unicast publication: the runtime today)",
            )

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        curves(ax, model, "samples_per_s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        supernode_marks(ax)
        ax.set_title(f"Qwen2.5-{model.upper()}: samples/s (model prediction)")
        ax.set_xlabel("devices (910C; dotted: 1, 2, 4 supernodes)")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=8)
    save(fig, "samples_per_s.png")

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        curves(ax, model, "efficiency")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.2)
        ax.axhline(1.0, color="#333", lw=0.6)
        supernode_marks(ax)
        ax.set_title(f"Qwen2.5-{model.upper()}: scaling efficiency (prediction)")
        ax.set_xlabel("devices")
        ax.set_ylabel("samples/s per device / that of the smallest size")
        ax.legend(fontsize=8, loc="lower left")
    save(fig, "efficiency.png")

    panels = [(m, mode, "hierarchical" if mode == "async" else "local") for m in models for mode in MODE_STYLE]
    panels += [(m, "async", "unicast") for m in models if series(rows, model=m, mode="async", publication="unicast")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), squeeze=False)
    fig.subplots_adjust(hspace=0.7)
    for ax, (model, mode, pub) in zip(axes[:, 0], panels, strict=True):
        s = series(rows, hardware=SUPERNODE, model=model, mode=mode, comm="isolated", publication=pub)
        labels = [f"{r.devices:,}" for r in s]
        bottom = [0.0] * len(s)
        for key in SPLIT_KEYS:
            share = [r.time_split[key] / r.step_time_s for r in s]
            ax.bar(labels, share, bottom=bottom, color=COLORS[key], label=key)
            bottom = [b + x for b, x in zip(bottom, share, strict=True)]
        for i, r in enumerate(s):
            ax.text(i, 1.02, r.bottleneck, ha="center", fontsize=7)
        ax.set_ylim(0, 1.15)
        ax.set_ylabel("share of step")
        ax.set_title(f"{model} {mode}" + (f" ({pub} publication)" if mode == "async" else ""), fontsize=9)
    axes[0, 0].legend(ncol=7, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.6))
    axes[-1, 0].set_xlabel("devices (bottleneck above each bar)")
    save(fig, "bottleneck.png")

    stale = stalesync_comparison(rows)
    if stale:
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(stale) + ["StaleSync async", "StaleSync lock-step"]
        values = [v["efficiency_1_to_4_supernodes"] for v in stale.values()] + [
            STALESYNC["async"],
            STALESYNC["lock-step"],
        ]
        colors = ["#4c72b0" if "async" in n else "#c44e52" for n in names]
        bars = ax.barh(names, values, color=colors)
        for bar, name in zip(bars, names, strict=True):
            if name.startswith("StaleSync"):
                bar.set_hatch("//")
                bar.set_alpha(0.6)
        for i, v in enumerate(values):
            ax.text(v + 0.01, i, f"{v:.0%}", va="center", fontsize=8)
        ax.set_xlim(0, 1.15)
        ax.set_xlabel("samples/s per device at 4 supernodes / at 1 supernode")
        ax.set_title("1 to 4 supernodes: predicted (solid) vs StaleSync's reported (hatched)")
        save(fig, "stalesync.png")

    comm_panels = [(hw, pub) for hw in (SERVERS, SUPERNODE) for pub in ("unicast", "hierarchical")]
    comm_panels = [(hw, pub) for hw, pub in comm_panels if series(rows, hardware=hw, publication=pub, comm="shared")]
    if comm_panels:
        fig, axes = plt.subplots(2, len(comm_panels), figsize=(4.5 * len(comm_panels), 7), squeeze=False)
        for j, (hw, pub) in enumerate(comm_panels):
            for comm, ls in (("isolated", "-"), ("shared", "--")):
                s = series(rows, hardware=hw, model="7b", mode="async", publication=pub, comm=comm)
                x = [r.devices for r in s]
                axes[0, j].plot(x, [r.time_split["allreduce"] for r in s], ls=ls, marker="o", label=comm)
                axes[1, j].plot(x, [r.samples_per_s_per_device for r in s], ls=ls, marker="o", label=comm)
            where = "8-NPU 910B servers" if hw == SERVERS else "910C supernodes"
            axes[0, j].set_title(f"async 7B, {where}\n{pub} publication", fontsize=9)
            axes[0, j].set_ylabel("all-reduce s per step")
            axes[1, j].set_ylabel("samples/s per device")
            for i in (0, 1):
                axes[i, j].set_xscale("log")
                axes[i, j].legend(fontsize=8)
            axes[1, j].set_ylim(bottom=0)
            axes[1, j].set_xlabel("devices")
        save(fig, "comm_domain.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="7B, fewer sizes, no plots: under a minute")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "scaling", help="where the PNGs go")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--sim-steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=2)
    args = parser.parse_args()

    workload = Workload()
    started = time.perf_counter()
    rows: list[Row] = []

    def progress(row: Row) -> None:
        print(
            f"  {row.hardware} {row.model} {row.mode:9} {row.publication:12} {row.comm:8} {row.devices:>5} devices: "
            f"{row.samples_per_s:10.1f} samples/s, {row.bottleneck}",
            file=sys.stderr,
            flush=True,
        )

    for name, grid in grids(args.quick).items():
        print(f"grid {name}: {len(grid.points())} points", file=sys.stderr, flush=True)
        rows += sweep(grid, workload, sim_steps=args.sim_steps, warmup_steps=args.warmup_steps, on_row=progress)
    elapsed = time.perf_counter() - started

    shares = {
        f"{hw} {m}": balanced_share(hw, m, workload)
        for hw, m in sorted({(r.hardware, r.model) for r in rows if r.mode == "async"})
    }
    print("# Scaling projection: model predictions, not measurements\n")
    print(f"workload: {workload}\nasync training share (searched at 64 devices): {shares}\n")
    for title, pick in (
        ("Supernode (910C), isolated comm domains", lambda r: r.hardware == SUPERNODE and r.comm == "isolated"),
        ("Supernode (910C), shared comm domain", lambda r: r.hardware == SUPERNODE and r.comm == "shared"),
        ("8-NPU servers (910B)", lambda r: r.hardware == SERVERS),
    ):
        chosen = [r for r in rows if pick(r)]
        if chosen:
            print(f"## {title}\n\n{markdown_table(chosen)}\n")
    stale = stalesync_comparison(rows)
    if stale:
        print("## 1 to 4 supernodes (StaleSync: async 91%, lock-step 85%)\n")
        for key, value in stale.items():
            print(f"- {key}: {value['efficiency_1_to_4_supernodes']:.1%}")
        print()
    plots: list[str] = []
    if not (args.quick or args.no_plots):
        plots = [str(p.relative_to(ROOT)) for p in plot_all(rows, args.out)]
        print("plots: " + ", ".join(plots) + "\n")
    print(f"{len(rows)} simulations in {elapsed:.1f} s\n")
    print(
        json.dumps(
            {
                "bench": "capacity_projection",
                "kind": "model prediction, not a measurement",
                "quick": args.quick,
                "sweep_s": round(elapsed, 1),
                "async_training_share": shares,
                "stalesync": {"reported": STALESYNC, "predicted": stale},
                "plots": plots,
                "rows": [
                    {
                        "hardware": r.hardware,
                        "model": r.model,
                        "mode": r.mode,
                        "publication": r.publication,
                        "comm": r.comm,
                        "devices": r.devices,
                        "trainer_ranks": r.trainer_ranks,
                        "rollout_instances": r.rollout_instances,
                        "samples_per_s": round(r.samples_per_s, 3),
                        "efficiency": round(r.efficiency, 4),
                        "step_time_s": round(r.step_time_s, 3),
                        "time_split": {k: round(v, 4) for k, v in r.time_split.items()},
                        "bottleneck": r.bottleneck,
                    }
                    for r in rows
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
