"""What fault tolerance is told: ElasticConfig, and the environment `lockstep run
--elastic` gives its workers."""

from __future__ import annotations

from dataclasses import dataclass

ENV_STORE = "LOCKSTEP_ELASTIC"
"""The job's store (HOST:PORT, or etcd://...); `lockstep run --elastic` sets it for its workers."""
ENV_INITIAL = "LOCKSTEP_ELASTIC_INITIAL"
"""How many workers the job starts with (the first membership waits for them)."""


@dataclass
class ElasticConfig:
    """How fault tolerance watches and waits. The defaults suit jobs on one or a few hosts."""

    heartbeat_s: float = 0.25
    """How often each worker tells the store it is alive."""
    dead_after_s: float = 3.0
    """A worker whose heartbeat stands still this long is gone."""
    collective_timeout_s: float = 15.0
    """How long a collective may wait: the time to notice a host that vanished without
    closing its connections (a dead process closes them, and is noticed at once)."""
    join_timeout_s: float = 300.0
    """How long the first membership waits for the job's workers, and a joiner to be let in."""
    max_retries: int = 5
    """Failures in a row at one step before the error is raised instead of regrouping."""
    check_every: int = 100
    """Compare the replicas' parameters every this many steps (0: never). See drift.py."""
    repair: bool = True
    """Repair a drifted replica from the majority (else raise DriftError)."""
