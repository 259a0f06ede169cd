"""The job's store in etcd as a c10d Store (etcd.py: the HTTP client underneath).

`EtcdStore` offers what TCPStore does (set, get, add, check, compare_set, wait,
delete_key, num_keys), so quorum.py, heartbeat.py and Gloo's rendezvous use it unchanged.
Atomic updates are etcd transactions: `add` compares the key's revision, `compare_set` its
value, and each retries or reports accordingly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep.elastic.etcd import (
    EtcdClient,
    absent,
    holds,
    put_request,
    range_request,
    unchanged,
    value_of,
)


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


_KEPT: list[EtcdStore] = []


class EtcdStore(dist.Store):
    """A c10d Store over keys under `prefix` in etcd (see the module docstring)."""

    def __init__(self, endpoints: Sequence[str], prefix: str, timeout: timedelta,
                 patience: timedelta | None = None) -> None:
        """`timeout`: how long a wait for a key may take; `patience`: how long a request
        goes on asking when no member answers (default: `timeout`)."""
        super().__init__()  # (the c10d trampoline needs it)
        self.client = EtcdClient(endpoints, (patience or timeout).total_seconds())
        self.prefix = prefix.encode()
        self.set_timeout(timeout)
        # A PrefixStore or a process group holds only the C++ half; once Python lets go of
        # this object its methods are gone ("pure virtual function" from the heartbeat's
        # thread). C++ never says when it lets go, so a store lives as long as the process
        # -- cheaply: it holds no connection, only the members' addresses.
        _KEPT.append(self)

    def _key(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def set(self, key: str, value: str | bytes) -> None:
        self.client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        """The value, waiting for the key up to the store's timeout (as TCPStore does)."""
        return value_of(self._await([key])[0])

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            found = self.client.get(full)
            if found is not None and amount == 0:  # a read: no write, no revision spent
                return int(value_of(found) or 0)
            if found is None:
                compare, new = absent(full), amount
            else:
                compare, new = unchanged(full, found), int(value_of(found) or 0) + amount
            if self.client.transact(compare, [put_request(full, str(new).encode())],
                                    []).get("succeeded"):
                return new  # else another worker added in between: read again

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's rule: set `desired` if the value is `expected` (b"": the key is absent);
        returns the value now held -- or `expected` if the key is absent and `expected` is
        not empty."""
        full, want, new = self._key(key), _bytes(expected), _bytes(desired)
        compare = absent(full) if not want else holds(full, want)
        answer = self.client.transact(compare, [put_request(full, new)], [range_request(full)])
        if answer.get("succeeded"):
            return new
        kvs = answer["responses"][0]["response_range"].get("kvs")
        return value_of(kvs[0]) if kvs else want

    def check(self, keys: list[str]) -> bool:
        return all(self.client.get(self._key(key)) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, timeout)

    def _await(self, keys: list[str], timeout: timedelta | None = None
               ) -> list[dict[str, Any]]:
        """The keys' records once every one exists (read once each round: `get` needs no
        second read after the wait), waiting up to `timeout` (the store's)."""
        limit = (timeout or self.timeout).total_seconds()  # type: ignore[attr-defined]
        deadline, pause = time.monotonic() + limit, 0.002
        while True:
            found = [self.client.get(self._key(key)) for key in keys]
            if all(record is not None for record in found):
                return found  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"etcd store: wait timeout after {limit * 1000:.0f}"
                                          f"ms, keys: {keys}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self._key(key)) > 0

    def num_keys(self) -> int:
        return self.client.count(self.prefix)

    # c10d's Python-store trampoline looks these two up by their C++ names: without them a
    # PrefixStore over this store (every caller's) failed "pure virtual function".
    deleteKey = delete_key
    getNumKeys = num_keys
