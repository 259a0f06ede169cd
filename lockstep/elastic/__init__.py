"""Training that survives failures: a worker that dies does not stop the job, and one
started later joins it at a step boundary.

job.py        Elastic: run_step redoes an interrupted step among the survivors
config.py     ElasticConfig: how it watches and waits
membership.py who is in the world now; its default group, made afresh per epoch
quorum.py     quorums and joiners through the job's store
heartbeat.py  who is alive (heartbeats), and which joiners may come in
store.py      the job's store: connecting to it, and saying when it is gone
etcd.py       etcd's HTTP API, and which run of a job a launcher joins there
etcdstore.py  the job's store in etcd, as a c10d Store
terms.py      what a joiner must agree on with the job
failures.py   which errors mean a peer is gone
handover.py   a live peer's state, sent to a joiner over the network
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time each name loads on first use
    from lockstep.elastic.config import ElasticConfig
    from lockstep.elastic.failures import membership_failure
    from lockstep.elastic.job import Elastic, batch_slice

# Loaded on first use (PEP 562): the elastic launcher reads config.py's names, and starts
# its workers, before anything here loads torch (launch/elastic.py says why).
_WHERE = {"Elastic": "lockstep.elastic.job", "ElasticConfig": "lockstep.elastic.config",
          "batch_slice": "lockstep.elastic.job",
          "membership_failure": "lockstep.elastic.failures"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lockstep.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


__all__ = ["Elastic", "ElasticConfig", "batch_slice", "membership_failure"]
