"""The alpha-beta cost model: its formulas, and a probe over a real Gloo link."""

from __future__ import annotations

import dataclasses

import pytest

import lockstep
from lockstep.advisor import costmodel
from lockstep.advisor.costmodel import HostCost, LinkCost
from lockstep.comm.topology import Topology
from lockstep.testing import World

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


def test_tree_messages_leaving_one_host_take_turns_on_its_link() -> None:
    # 4 ranks, 2 per host: on the way down, 0 -> 2 and 1 -> 3 both leave host 0 at once
    # and take turns on its link (on the way up, 2 -> 0 waits for 0 to sum 1 anyway).
    # Edges inside a host are free.
    size, free = 4 * MB, LinkCost(alpha=0.0, beta=0.0, gamma=0.0, beta_one_way=0.0)
    message = 1e-4 + size * 5e-10
    assert costmodel.tree_time(LINK, 4, size, free, 2) == pytest.approx(
        4 * message + 3 * size * 1e-10)  # 1 sums 3, then 0 sums 1 and 2


HOST = HostCost(fixed=2e-4, sizes=(2 * MB, 8 * MB, 32 * MB), seconds=(1e-4, 8e-4, 6.4e-3))


def test_the_host_stage_reproduces_its_probes_and_interpolates_between_them() -> None:
    # At a probed size, what was measured; between two, a straight line; beyond the ends,
    # the nearest end's seconds per byte.
    assert HOST.time(8 * MB) == pytest.approx(2e-4 + 8e-4)
    assert HOST.time(4 * MB) == pytest.approx(2e-4 + 1e-4 + (2 / 6) * 7e-4)
    assert HOST.time(16 * MB) == pytest.approx(2e-4 + 8e-4 + (8 / 24) * 5.6e-3)
    assert HOST.time(MB) == pytest.approx(2e-4 + 0.5e-4)
    assert HOST.time(64 * MB) == pytest.approx(2e-4 + 2 * 6.4e-3)
    times = [HOST.time(n * MB) for n in (0, 1, 2, 3, 5, 8, 13, 32, 50)]
    assert times == sorted(times)
    assert costmodel.predict("shm", 16 * MB, 2, 2, LINK, host=HOST) == HOST.time(16 * MB)
    single = HostCost(fixed=1e-4, sizes=(MB,), seconds=(1e-3,))
    assert single.time(4 * MB) == pytest.approx(1e-4 + 4e-3)


def test_the_host_stage_refuses_probes_it_cannot_interpolate() -> None:
    with pytest.raises(ValueError, match="one time per probed size"):
        HostCost(fixed=1e-4, sizes=(MB, 2 * MB), seconds=(1e-3,))
    with pytest.raises(ValueError, match="positive and ascending"):
        HostCost(fixed=1e-4, sizes=(2 * MB, MB), seconds=(1e-3, 2e-3))
    with pytest.raises(ValueError, match="must be positive"):
        HostCost(fixed=1e-4, sizes=(MB,), seconds=(0.0,))


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
    host = costmodel.probe_host(Topology.build(world.rank, world.world_size, 2),
                                sizes=(MB, 4 * MB))
    return (host.fixed, *host.seconds)


def test_host_probe_times_the_shared_memory_stage(world2: World) -> None:
    for fixed, *seconds in world2.run(check_host_probe):
        assert 0 < fixed < 0.1            # barriers well within 100 ms
        assert len(seconds) == 2
        assert all(0 < t < 0.04 for t in seconds)  # 4 MB faster than 100 MB/s
