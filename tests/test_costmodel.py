"""The alpha-beta cost model: its formulas, and a probe over a real Gloo link."""

from __future__ import annotations

import dataclasses

import pytest

import lockstep
from lockstep import costmodel
from lockstep.costmodel import HostCost, LinkCost
from lockstep.testing import World
from lockstep.topology import Topology

# Round numbers so the expected times can be written out by hand.
LINK = LinkCost(alpha=1e-4, beta=1e-9, gamma=1e-10, beta_one_way=5e-10)
MB = 1 << 20


def test_ring_is_the_textbook_formula() -> None:
    n, size = 4, 8 * MB
    expected = 2 * 3 * 1e-4 + 2 * 3 / 4 * size * 1e-9 + 3 / 4 * size * 1e-10
    assert costmodel.predict("ring", size, n, n, LINK) == pytest.approx(expected)
    assert costmodel.predict("native", size, n, n, LINK) == pytest.approx(expected)
    assert costmodel.ring_time(LINK, 1, size) == 0.0


def test_tree_of_two_is_one_message_up_a_sum_and_one_down() -> None:
    size = 4 * MB
    message = 1e-4 + size * 5e-10  # one way: the reverse direction is idle
    assert costmodel.predict("tree", size, 2, 2, LINK) == pytest.approx(
        2 * message + size * 1e-10)


def test_tree_parent_takes_its_children_one_after_the_other() -> None:
    size = MB
    message, summing = 1e-4 + size * 5e-10, size * 1e-10
    # Three ranks: the root sums child 1 then child 2, then sends to each in turn.
    assert costmodel.tree_time(LINK, 3, size) == pytest.approx(4 * message + 2 * summing)
    times = [costmodel.tree_time(LINK, n, size) for n in (2, 3, 4, 7, 8)]
    assert times == sorted(times)


HOST = HostCost(fixed=2e-4, per_byte=2e-10, per_byte_cached=5e-11, local_world_size=2,
                cache_bytes=32 * MB)


def test_the_host_stage_is_charged_the_cached_rate_when_its_buffers_fit_half_the_cache() -> None:
    # Two ranks' buffers of 4 MB (8 MB) fit in 16 MB; of 16 MB (32 MB) they do not.
    assert HOST.time(4 * MB) == pytest.approx(2e-4 + 4 * MB * 5e-11)
    assert HOST.time(16 * MB) == pytest.approx(2e-4 + 16 * MB * 2e-10)
    assert costmodel.predict("shm", 16 * MB, 2, 2, LINK, host=HOST) == HOST.time(16 * MB)


def test_hierarchical_is_the_host_stage_plus_a_ring_among_hosts() -> None:
    size = 16 * MB
    assert costmodel.predict("hierarchical", size, 4, 2, LINK, host=HOST) == \
        pytest.approx(HOST.time(size) + costmodel.ring_time(LINK, 2, size))
    with pytest.raises(ValueError, match="needs the host stage"):
        costmodel.predict("shm", size, 2, 2, LINK)
    with pytest.raises(ValueError, match="no cost model"):
        costmodel.predict("carrier-pigeon", size, 4, 2, LINK)


def test_bus_bandwidth_is_what_each_link_carried() -> None:
    # 2(N-1)/N * S / t: for two ranks, the bucket's size per second.
    assert costmodel.bus_bandwidth(MB, 1.0, 2) == MB
    assert costmodel.bus_bandwidth(MB, 1.0, 4) == 1.5 * MB


def check_probe() -> tuple[float, ...]:
    lockstep.init()
    link = costmodel.probe(0, 1, large_bytes=MB, repeats=2)
    return dataclasses.astuple(link)


def test_probe_measures_a_real_link_and_every_rank_agrees(world2: World) -> None:
    first, second = world2.run(check_probe)
    assert first == second  # rank 0's measurement, broadcast
    alpha, beta, gamma, beta_one_way = first
    assert 0 < alpha < 0.1            # loopback answers well within 100 ms
    assert 0 < beta < 1e-7            # faster than 10 MB/s
    assert 0 < beta_one_way < 1e-7
    assert 0 < gamma < 1e-8           # summing faster than 100 MB/s


def check_host_probe() -> tuple[float, ...]:
    world = lockstep.init()
    host = costmodel.probe_host(Topology.build(world.rank, world.world_size, 2))
    return host.fixed, host.per_byte, host.per_byte_cached


def test_host_probe_times_the_shared_memory_stage(world2: World) -> None:
    for fixed, per_byte, per_byte_cached in world2.run(check_host_probe):
        assert 0 < fixed < 0.1            # barriers well within 100 ms
        assert 0 < per_byte < 1e-8        # faster than 100 MB/s
        assert 0 < per_byte_cached < 1e-8
