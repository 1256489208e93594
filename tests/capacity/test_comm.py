"""The communication closed forms, computed by hand."""

from __future__ import annotations

import pytest

from capacity.comm import (
    Topology,
    allreduce_plan,
    broadcast_s,
    distqueue_load_factor,
    publication_plan,
    queue_takes_per_step,
    ring_allreduce_s,
    ring_reduce_scatter_s,
    sharded_update_plan,
)
from capacity.costs import Link

NVLINK = Link(bandwidth_bytes_per_s=100e9, latency_s=5e-6)
NIC = Link(bandwidth_bytes_per_s=25e9, latency_s=2e-5)
TOPO = Topology(devices_per_node=8, intra=NVLINK, inter=NIC)
GB = 1e9


def test_ring_all_reduce_is_2_n_minus_1_latencies_plus_2_n_minus_1_over_n_of_the_bytes():
    # 8 ranks, 1 GB: 14 latencies + 14/8 GB at 100 GB/s
    assert ring_allreduce_s(GB, 8, NVLINK) == pytest.approx(14 * 5e-6 + 1.75 * GB / 100e9, rel=1e-15)
    assert ring_allreduce_s(GB, 2, NVLINK) == pytest.approx(2 * 5e-6 + 1.0 * GB / 100e9, rel=1e-15)


def test_one_rank_all_reduces_nothing():
    assert ring_allreduce_s(GB, 1, NVLINK) == 0.0
    assert allreduce_plan(GB, 1, TOPO).time_s(NIC) == 0.0


def test_reduce_scatter_is_half_an_all_reduce():
    assert 2 * ring_reduce_scatter_s(GB, 8, NVLINK) == pytest.approx(ring_allreduce_s(GB, 8, NVLINK), rel=1e-15)


def test_all_reduce_inside_one_node_is_the_ring_over_the_intra_node_link():
    assert allreduce_plan(GB, 8, TOPO).time_s(NIC) == pytest.approx(ring_allreduce_s(GB, 8, NVLINK), rel=1e-15)


def test_all_reduce_across_nodes_is_hierarchical():
    # 4 nodes of 8: intra reduce-scatter + inter ring on 1/8 of the bytes + intra all-gather
    plan = allreduce_plan(GB, 32, TOPO)

    intra = 2 * (7 * 5e-6 + 7 / 8 * GB / 100e9)
    inter = 2 * 3 * 2e-5 + 2 * 3 / 4 * (GB / 8) / 25e9
    assert plan.time_s(NIC) == pytest.approx(intra + inter, rel=1e-15)
    assert plan.inter_bytes == pytest.approx(2 * 3 / 4 * GB / 8, rel=1e-15)  # what a shared link carries


def test_sharded_training_moves_one_and_a_half_times_the_all_reduce_volume():
    plan = sharded_update_plan(GB, 32, TOPO)
    assert plan.inter_bytes == pytest.approx(1.5 * allreduce_plan(GB, 32, TOPO).inter_bytes, rel=1e-15)


def test_broadcast_takes_the_cheaper_of_a_binomial_tree_and_scatter_allgather():
    # one large message to 7 others: scatter + all-gather, (3 + 7) latencies + 2 * 7/8 of the bytes
    assert broadcast_s(GB, 8, NVLINK) == pytest.approx(10 * 5e-6 + 1.75 * GB / 100e9, rel=1e-15)
    # a tiny message: the tree's three rounds are cheaper
    assert broadcast_s(8.0, 8, NVLINK) == pytest.approx(3 * (5e-6 + 8.0 / 100e9), rel=1e-15)
    assert broadcast_s(GB, 1, NVLINK) == 0.0


def test_unicast_publication_sends_each_receiver_its_copy():
    local = publication_plan(GB, 0, [1, 2], TOPO, "unicast")
    assert local.time_s(NIC) == pytest.approx(2 * NVLINK.time_s(GB), rel=1e-15)
    # receivers on other nodes: their copies share the sender's NIC (which outlasts the two local copies)
    remote = publication_plan(GB, 0, [1, 2, 8, 16], TOPO, "unicast")
    assert remote.time_s(NIC) == pytest.approx(2 * 2e-5 + 2 * GB / 25e9, rel=1e-15)


def test_hierarchical_publication_crosses_each_node_boundary_once():
    receivers = [8 + i for i in range(8)] + [16 + i for i in range(8)]  # two other nodes, 8 receivers each

    flat = publication_plan(GB, 0, receivers, TOPO, "broadcast")
    tiered = publication_plan(GB, 0, receivers, TOPO, "hierarchical")

    assert flat.time_s(NIC) == pytest.approx(broadcast_s(GB, 17, NIC), rel=1e-15)
    assert tiered.time_s(NIC) == pytest.approx(broadcast_s(GB, 3, NIC) + broadcast_s(GB, 8, NVLINK), rel=1e-15)
    assert tiered.time_s(NIC) < flat.time_s(NIC)


def test_distqueue_load_for_a_tp8_ep4_pp16_layout_is_one_in_128():
    assert distqueue_load_factor(tp=8, pp=16) == 1 / 128  # expert parallelism does not divide it
    assert distqueue_load_factor() == 1.0
    with pytest.raises(ValueError, match="tp"):
        distqueue_load_factor(tp=0)


def test_the_leader_takes_once_and_flat_transfer_once_per_rank():
    assert queue_takes_per_step(16, "leader") == 1
    assert queue_takes_per_step(16, "flat") == 16
