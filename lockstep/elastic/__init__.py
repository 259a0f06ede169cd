"""Training that survives failures: a worker that dies does not stop the job, and one
started later joins it at a step boundary.

job.py        Elastic: run_step redoes an interrupted step among the survivors
config.py     ElasticConfig: how it watches and waits
membership.py who is in the world now; its default group, made afresh per epoch
quorum.py     quorums and joiners through the job's store
heartbeat.py  who is alive (heartbeats), and which joiners may come in
store.py      the job's store: connecting to it, and saying when it is gone
terms.py      what a joiner must agree on with the job
failures.py   which errors mean a peer is gone
handover.py   a live peer's state, sent to a joiner over the network
"""

from lockstep.elastic.config import ElasticConfig
from lockstep.elastic.failures import membership_failure
from lockstep.elastic.job import Elastic, batch_slice

__all__ = ["Elastic", "ElasticConfig", "batch_slice", "membership_failure"]
