"""Replication: every rank a full replica, gradients averaged as backward runs.

The path of one gradient: replica.py (DataParallel: the forward that arms the backward)
-> reducer.py (readiness hooks, buckets launched in order, the end of backward) ->
reduction.py (how a bucket travels: the seam that algorithms.py, hostreduce.py and
compress.py implement). Around it: bucket planning (buckets.py), non-finite gradients,
join, SyncBatchNorm, DDP's arguments, mixed precision."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
