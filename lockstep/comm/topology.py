"""Which ranks share a host, and the process groups that follow from it.

torchrun numbers ranks host by host: host h runs ranks h*L .. h*L+L-1, where L is
LOCAL_WORLD_SIZE. The planning here is pure (integers in, integers out); `Topology.build`
creates the groups, which every rank must do together and in the same order.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from lockstep import comm


def this_host() -> str:
    """This process's host as the job names it: the launcher's LOCKSTEP_HOST (the emulated
    cluster's hosts share one machine's hostname), else the hostname."""
    return os.environ.get("LOCKSTEP_HOST") or socket.gethostname()


def host_of(rank: int, local_world_size: int) -> int:
    return rank // local_world_size


def ranks_on_host(host: int, local_world_size: int) -> list[int]:
    return list(range(host * local_world_size, (host + 1) * local_world_size))


def peers_across_hosts(local_rank: int, hosts: int, local_world_size: int) -> list[int]:
    """The ranks with this local rank on every host: the group that carries slice
    `local_rank` between hosts in a hierarchical all-reduce."""
    return [h * local_world_size + local_rank for h in range(hosts)]


def check_layout(world_size: int, local_world_size: int) -> None:
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"world size {world_size} is not a whole number of hosts of "
                         f"{local_world_size} processes (LOCAL_WORLD_SIZE); hierarchical and "
                         "shm reduction need the same number of processes on every host")


@dataclass
class Topology:
    """This rank's place among hosts, with its intra-host and cross-host groups."""

    rank: int
    world_size: int
    local_world_size: int
    local_group: comm.Group = None
    """The ranks on this host."""
    cross_group: comm.Group = None
    """The ranks with this local rank on every host."""

    @property
    def hosts(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def host(self) -> int:
        return host_of(self.rank, self.local_world_size)

    @classmethod
    def build(cls, rank: int, world_size: int, local_world_size: int,
              host_only: bool = False) -> Topology:
        """Create the groups. Collective: every rank calls it with the same layout.

        `host_only`: the caller works inside one host and issues its collectives from one
        thread (shm): there the job's own group is the host's, and no group is made -- each
        one would cost a wrapper, built anew for every membership of lockstep.Elastic, its
        making and its connecting barrier. (Hierarchical keeps groups of its own: its
        worker thread waits at the host's barriers while the main thread uses the job's.)"""
        check_layout(world_size, local_world_size)
        topo = cls(rank, world_size, local_world_size)
        if host_only and topo.hosts == 1:
            return topo  # local_group None: the job's group; no cross-host leg
        for host in range(topo.hosts):  # every rank creates every group, in one order
            group = comm.new_group(ranks_on_host(host, local_world_size))
            if host == topo.host:
                topo.local_group = group
        for local in range(local_world_size):
            group = comm.new_group(peers_across_hosts(local, topo.hosts, local_world_size))
            if local == topo.local_rank:
                topo.cross_group = group
        return topo
