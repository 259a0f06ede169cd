"""The job's store: where a fault-tolerant job's workers agree (quorum.py) and beat
(heartbeat.py). A TCPStore hosted by the job's first launcher (HOST:PORT), or etcd's
replicated keys (etcd://HOST:PORT,... -- see etcd.py and etcdstore.py), which no one
host's loss takes away. This module is the one place that connects to it and says, in
words, when it is gone.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from lockstep.elastic import etcd
from lockstep.elastic.config import ENV_STORE
from lockstep.elastic.etcdstore import EtcdStore

PREFIX = "lockstep/elastic/"


class StoreGone(RuntimeError):
    """The job's store does not answer: the members can no longer agree on anything, so a
    failure cannot be survived (training without failures goes on)."""


def store_gone(address: str, error: BaseException) -> StoreGone:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if address.startswith(etcd.SCHEME):
        return StoreGone(f"the job's store in etcd at {address} does not answer ({first}): "
                         "a majority of the etcd members must be up and reachable")
    return StoreGone(f"the job's store at {address} does not answer ({first}): the launcher "
                     "that hosts it (the job's first `lockstep run --elastic`) has exited or "
                     "cannot be reached")


def connect(address: str, timeout: timedelta, patience: timedelta | None = None
            ) -> dist.Store:
    """The job's store at HOST:PORT (a launcher hosts it) or etcd://... (etcd.py), where a
    request goes on asking for `patience` while no member answers (a cut link)."""
    if address.startswith(etcd.SCHEME):
        endpoints, prefix = etcd.parse(address)
        return EtcdStore(endpoints, prefix, timeout, patience)
    host, _, port = address.rpartition(":")
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=timeout)
    except (RuntimeError, OSError) as error:  # DistNetworkError, DistStoreError
        raise store_gone(address, error) from None


def job_address(address: str | None) -> str:
    """The job's store, HOST:PORT or etcd://...: as given, else what `lockstep run
    --elastic` set."""
    found = address or os.environ.get(ENV_STORE)
    if not found:
        raise RuntimeError(f"lockstep.Elastic: no job store: launch with `lockstep run "
                           f"--elastic`, or set {ENV_STORE}=HOST:PORT")
    return found


