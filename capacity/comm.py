"""Closed forms for the pipeline's communication: gradient all-reduce, weight publication, sample transfer.

All follow the alpha-beta (latency-bandwidth) model: a message of ``n`` bytes over a link costs
``alpha + n / beta``. The collective algorithms and their costs are those of Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1), 2005),
section 4:

* ring all-reduce (a reduce-scatter then an all-gather, ``p - 1`` steps each):
  ``2 (p - 1) alpha + 2 (p - 1) / p * n / beta`` — the issue's "latency + 2(N-1)/N * bytes /
  bandwidth", with its latency term written out as the ring's ``2 (p - 1)`` message latencies
  (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC
  69(2), 2009, show the bandwidth term is optimal);
* reduce-scatter and all-gather alone: ``(p - 1) alpha + (p - 1) / p * n / beta`` each;
* broadcast: the better of a binomial tree, ``ceil(log2 p) (alpha + n / beta)``, and van de
  Geijn's scatter + all-gather for long messages, ``(ceil(log2 p) + p - 1) alpha + 2 (p - 1) / p *
  n / beta`` (MPICH switches between them by message size).

Ranks spanning nodes use the hierarchical (two-level) all-reduce: a reduce-scatter inside each node,
an all-reduce of each device's ``1/g`` share across nodes (each device on its own inter-node link,
as in rail-optimised clusters), and an all-gather inside each node (Jia et al., "Highly scalable
deep learning training system with mixed-precision", 2018, section 3.3; NCCL's and HCCL's
hierarchical algorithms).

Sharded (ZeRO-3 / FSDP) training moves parameters and gradients with one reduce-scatter and two
all-gathers per update, 1.5x the all-reduce's volume (Rajbhandari et al., "ZeRO: memory
optimizations toward training trillion parameter models", SC 2020, section 7.2.2).

A :class:`CommPlan` keeps the inter-node bytes apart from the rest, so the simulation can send them
through a link shared with other traffic (comm-domain sharing) while the rest stays a closed form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity.costs import Link


@dataclass(frozen=True)
class Topology:
    """Devices grouped into nodes: ``devices_per_node`` share the intra-node link's fabric."""

    devices_per_node: int
    intra: Link
    inter: Link

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node


@dataclass(frozen=True)
class CommPlan:
    """A communication's cost split so the inter-node bandwidth term can be shared with other traffic.

    ``time = other_s + inter_bytes / inter_bandwidth``: ``other_s`` holds every latency and the
    intra-node part; ``inter_bytes`` is what crosses one device's inter-node link.
    """

    other_s: float
    inter_bytes: float = 0.0

    def time_s(self, inter: Link) -> float:
        return self.other_s + self.inter_bytes / inter.bandwidth_bytes_per_s

    def __add__(self, other: CommPlan) -> CommPlan:
        return CommPlan(self.other_s + other.other_s, self.inter_bytes + other.inter_bytes)


NOTHING = CommPlan(0.0)


def ring_allreduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks`` peers: ``2(p-1) alpha + 2(p-1)/p * n / beta``."""
    if ranks <= 1:
        return 0.0
    steps = ranks - 1
    return 2 * steps * link.latency_s + 2 * steps / ranks * nbytes / link.bandwidth_bytes_per_s


def ring_reduce_scatter_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring reduce-scatter (or all-gather) of ``nbytes``: ``(p-1) alpha + (p-1)/p * n / beta``."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * nbytes / link.bandwidth_bytes_per_s


ring_allgather_s = ring_reduce_scatter_s  # the same cost: the reduce-scatter run backwards


def broadcast_s(nbytes: float, participants: int, link: Link) -> float:
    """Broadcast from one of ``participants`` to the others: the better of a binomial tree and
    scatter + all-gather."""
    return _broadcast_plan(nbytes, participants, link).time_s(link)


def _broadcast_plan(nbytes: float, participants: int, link: Link) -> CommPlan:
    """The broadcast over ``link`` split into latencies and bandwidth bytes (the cheaper algorithm)."""
    if participants <= 1:
        return NOTHING
    rounds = math.ceil(math.log2(participants))
    tree = CommPlan(rounds * link.latency_s, rounds * nbytes)
    scatter_allgather = CommPlan(
        (rounds + participants - 1) * link.latency_s, 2 * (participants - 1) / participants * nbytes
    )
    return min(tree, scatter_allgather, key=lambda plan: plan.time_s(link))


def _spread(ranks: int, topo: Topology) -> tuple[int, int]:
    """(devices per node used, nodes) for ``ranks`` placed from device 0. A last node only partly
    filled is counted as full: the ring's step count is that of the fullest node."""
    per_node = min(ranks, topo.devices_per_node)
    return per_node, math.ceil(ranks / topo.devices_per_node)


def allreduce_plan(nbytes: float, ranks: int, topo: Topology) -> CommPlan:
    """Gradient all-reduce over ``ranks`` data-parallel ranks: a ring inside one node, hierarchical
    (intra reduce-scatter, inter all-reduce of a ``1/g`` share, intra all-gather) across nodes."""
    if ranks <= 1:
        return NOTHING
    g, nodes = _spread(ranks, topo)
    if nodes == 1:
        return CommPlan(ring_allreduce_s(nbytes, ranks, topo.intra))
    intra = 2 * ring_reduce_scatter_s(nbytes, g, topo.intra)
    share = nbytes / g
    inter_latency = 2 * (nodes - 1) * topo.inter.latency_s
    return CommPlan(intra + inter_latency, 2 * (nodes - 1) / nodes * share)


def reduce_scatter_plan(nbytes: float, ranks: int, topo: Topology) -> CommPlan:
    """Reduce-scatter (or all-gather) over ``ranks``: in one node a ring; across nodes an intra ring
    on the whole message, then the inter ring on each device's ``1/g`` share."""
    if ranks <= 1:
        return NOTHING
    g, nodes = _spread(ranks, topo)
    intra = ring_reduce_scatter_s(nbytes, g, topo.intra)
    if nodes == 1:
        return CommPlan(intra)
    share = nbytes / g
    return CommPlan(intra + (nodes - 1) * topo.inter.latency_s, (nodes - 1) / nodes * share)


def sharded_update_plan(nbytes: float, ranks: int, topo: Topology) -> CommPlan:
    """One update of sharded (ZeRO-3 / FSDP) training: gather the parameters for the forward and the
    backward, reduce-scatter the gradients."""
    one = reduce_scatter_plan(nbytes, ranks, topo)
    return one + one + one


def scatter_plan(nbytes: float, ranks: int, topo: Topology) -> CommPlan:
    """The leader cuts ``nbytes`` into ``ranks`` shards and sends one to each other rank; the shards
    for its own node (intra link) and for other nodes (inter link) go out in parallel."""
    if ranks <= 1:
        return NOTHING
    g, _ = _spread(ranks, topo)
    share = nbytes / ranks
    intra = (g - 1) * topo.intra.time_s(share)
    remote = ranks - g
    if remote == 0:
        return CommPlan(intra)
    # the parallel parts overlap: the longer decides; the inter part's bytes stay shareable
    inter_latency = remote * topo.inter.latency_s
    inter_bytes = remote * share
    inter_alone = inter_latency + inter_bytes / topo.inter.bandwidth_bytes_per_s
    if intra >= inter_alone:
        return CommPlan(intra)
    return CommPlan(inter_latency, inter_bytes)


PUBLICATIONS = ("unicast", "broadcast", "hierarchical")


def publication_plan(nbytes: float, sender: int, receivers: list[int], topo: Topology, kind: str) -> CommPlan:
    """One weight version from device ``sender`` to the devices ``receivers``.

    * ``unicast``: a send per receiver (the runtime's pushes: over the link, or a broadcast group
      of its own per instance); those on the sender's node over the intra link, the others over its
      inter link, the two in parallel.
    * ``broadcast``: one broadcast among all, over the slowest link involved.
    * ``hierarchical``: a broadcast across nodes to one receiver per node, then a broadcast inside
      each node (in parallel).
    """
    if kind not in PUBLICATIONS:
        raise ValueError(f"publication {kind!r} is not one of {PUBLICATIONS}")
    if not receivers:
        return NOTHING
    home = topo.node_of(sender)
    local = [r for r in receivers if topo.node_of(r) == home]
    remote = [r for r in receivers if topo.node_of(r) != home]
    if kind == "unicast":
        intra = len(local) * topo.intra.time_s(nbytes)
        if not remote:
            return CommPlan(intra)
        inter_latency, inter_bytes = len(remote) * topo.inter.latency_s, len(remote) * nbytes
        if intra >= inter_latency + inter_bytes / topo.inter.bandwidth_bytes_per_s:
            return CommPlan(intra)
        return CommPlan(inter_latency, inter_bytes)
    if kind == "broadcast":
        if not remote:
            return CommPlan(broadcast_s(nbytes, 1 + len(receivers), topo.intra))
        return _broadcast_plan(nbytes, 1 + len(receivers), topo.inter)
    nodes: dict[int, int] = {}
    for r in remote:
        nodes[topo.node_of(r)] = nodes.get(topo.node_of(r), 0) + 1
    across = _broadcast_plan(nbytes, 1 + len(nodes), topo.inter) if nodes else NOTHING
    inside = max(
        [broadcast_s(nbytes, 1 + len(local), topo.intra)] + [broadcast_s(nbytes, n, topo.intra) for n in nodes.values()]
    )
    return across + CommPlan(inside)


def distqueue_load_factor(tp: int = 1, pp: int = 1, cp: int = 1) -> float:
    """Share of the sample queue's requests left with hierarchical transfer: one rank of each
    model-parallel group (tensor x pipeline x context parallel) reads the queue and relays to the
    rest of its group over the group's own links, instead of every rank reading it. Expert
    parallelism does not divide it (expert-parallel ranks hold different data). The issue's anchor:
    a TP8/EP4/PP16 layout leaves 1/128 of the load (MindSpeed-RL's TransferDock; the Tandem design's
    DistQueue)."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 1.0 / (tp * pp * cp)


TRANSFERS = ("leader", "flat")


def queue_takes_per_step(ranks: int, transfer: str) -> int:
    """Requests the trainer makes of the sample queue per step: ``leader`` (the runtime's
    hierarchical transfer: rank 0 takes the batch and scatters it) one; ``flat`` one per rank."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer {transfer!r} is not one of {TRANSFERS}")
    return 1 if transfer == "leader" else ranks
