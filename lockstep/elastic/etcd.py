"""The job's store in etcd, so that no one host holds it: `--rdzv-endpoint etcd://A,B,C`.

A TCPStore lives in one launcher's process; when that host goes, the members can no longer
agree on anything. etcd keeps every key on a majority of its members (Raft): with three
members any one can die -- the first host's included -- and the store still answers.

`EtcdStore` is a c10d Store (what TCPStore offers: set, get, add, check, compare_set,
wait, delete_key, num_keys), so quorum.py, heartbeat.py and Gloo's rendezvous use it
unchanged. It speaks etcd's v3 API through the JSON gateway every etcd >= 3.4 serves --
plain HTTP from the standard library, no client package. Each request goes to the member
that answered last; a member that does not answer (its host is gone, its link cut, it lost
the majority) is passed over for the next. etcd's reads are linearizable by default, so any
member's answer is the current one. Atomic updates are etcd transactions: `add` compares
the key's revision, `compare_set` its value, and retries or reports accordingly.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

SCHEME = "etcd://"
REQUEST_TIMEOUT_S = 2.0
"""How long one member may take to answer before the next is asked: a member cut off from
the majority holds a request until etcd's own timeout (~7 s), far longer."""


class EtcdUnavailable(RuntimeError):
    """No member of the etcd cluster answered."""


def parse(address: str) -> tuple[list[str], str]:
    """'etcd://h1:2379,h2:2379/some/prefix/' -> (['h1:2379', 'h2:2379'], 'some/prefix/')."""
    if not address.startswith(SCHEME):
        raise ValueError(f"{address!r} is not an etcd address (etcd://HOST:PORT,...[/PREFIX])")
    members, _, prefix = address[len(SCHEME):].partition("/")
    endpoints = [m.strip() for m in members.split(",") if m.strip()]
    if not endpoints or any(":" not in m for m in endpoints):
        raise ValueError(f"{address!r}: give the etcd members as HOST:PORT,HOST:PORT,...")
    return endpoints, prefix


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdClient:
    """etcd's v3 JSON API over HTTP, with fail-over between members. Keys are bytes."""

    def __init__(self, endpoints: Sequence[str], patience_s: float = 0.0) -> None:
        self.endpoints = list(endpoints)
        self.patience_s = patience_s
        self._answered = 0  # the member that answered last: asked first

    def call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """Ask the members in turn, round after round for `patience_s`, until one answers:
        a worker whose link was cut for a while finds the store again when it returns
        (and, left out meanwhile, joins again) rather than giving up at once."""
        deadline, pause = time.monotonic() + self.patience_s, 0.1
        while True:
            try:
                return self._ask_each(method, json.dumps(body).encode())
            except EtcdUnavailable:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def _ask_each(self, method: str, data: bytes) -> dict[str, Any]:
        problems = []
        for attempt in range(len(self.endpoints)):
            index = (self._answered + attempt) % len(self.endpoints)
            request = urllib.request.Request(f"http://{self.endpoints[index]}/v3/{method}", data,
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                    answer: dict[str, Any] = json.loads(reply.read())
            except urllib.error.HTTPError as error:
                if error.code < 500:  # our request is wrong: asking another will not help
                    raise RuntimeError(f"etcd {method}: {error.read().decode()[:300]}") from None
                problems.append(f"{self.endpoints[index]}: HTTP {error.code}")
                continue
            except (urllib.error.URLError, OSError) as error:  # down, cut off, or too slow
                problems.append(f"{self.endpoints[index]}: {getattr(error, 'reason', error)}")
                continue
            self._answered = index
            return answer
        raise EtcdUnavailable(f"no etcd member answered ({'; '.join(problems)})")

    def get(self, key: bytes) -> dict[str, Any] | None:
        """The key's record (value, mod_revision, ...), or None if it is absent."""
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs")
        return kvs[0] if kvs else None

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.call("kv/put", put_request(key, value, lease)["request_put"])

    def count(self, prefix: bytes) -> int:
        return int(self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(_end(prefix)),
                                          "count_only": True}).get("count", 0))

    def delete(self, key: bytes, prefix: bool = False) -> int:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_end(key))
        return int(self.call("kv/deleterange", body).get("deleted", 0))

    def transact(self, compare: dict[str, Any], success: list[dict[str, Any]],
                 failure: list[dict[str, Any]]) -> dict[str, Any]:
        """One transaction: if `compare` holds, the `success` requests, else `failure`."""
        return self.call("kv/txn", {"compare": [compare], "success": success,
                                    "failure": failure})

    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": ttl_s})["ID"])

    def keep_alive(self, lease: int) -> None:
        self.call("lease/keepalive", {"ID": str(lease)})

    def revoke(self, lease: int) -> None:
        self.call("lease/revoke", {"ID": str(lease)})


def _end(prefix: bytes) -> bytes:
    """The end of the key range that starts with `prefix` (etcd's range_end)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def absent(key: bytes) -> dict[str, Any]:
    """A transaction's comparison: the key does not exist."""
    return {"key": _b64(key), "target": "CREATE", "create_revision": "0"}


def unchanged(key: bytes, record: dict[str, Any]) -> dict[str, Any]:
    """A transaction's comparison: the key is as it was when `record` was read."""
    return {"key": _b64(key), "target": "MOD", "mod_revision": record["mod_revision"]}


def value_of(record: dict[str, Any]) -> bytes:
    """A key's value, from its record (etcd leaves an empty value out)."""
    return base64.b64decode(record.get("value", ""))


def put_request(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


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
        compare = absent(full) if not want else \
            {"key": _b64(full), "target": "VALUE", "value": _b64(want)}
        answer = self.client.transact(compare, [put_request(full, new)],
                                      [{"request_range": {"key": _b64(full)}}])
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


# ---- which run of a job a launcher joins -------------------------------------------------

LAUNCHER_TTL_S = 3
"""A launcher's lease: its key vanishes this long after its host does."""


class LauncherLease:
    """This launcher's key under its run, kept alive by a daemon thread while it runs: a
    run with no live launcher is over (finished, or every host of it died)."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.id = client.grant(LAUNCHER_TTL_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="lockstep-etcd-lease",
                                        daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(LAUNCHER_TTL_S / 3):
            with contextlib.suppress(RuntimeError):  # no member answers now: try again
                self.client.keep_alive(self.id)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self.client.revoke(self.id)  # the key goes now, not in LAUNCHER_TTL_S


def join_job(address: str, job: str, timeout: timedelta
             ) -> tuple[EtcdStore, str, LauncherLease, bool]:
    """The run of `job` this launcher's workers belong to: the live one if any launcher of
    it is alive, else a new one (the previous run's keys, lockstep's own, are deleted).
    Returns its store, the address workers connect to, this launcher's lease, and whether
    this launcher started the run.

    Keys: <prefix><job>/run names the current run; <prefix><job>/launchers/<run>/<lease> are
    the live launchers; the run's store lives under <prefix><job>/runs/<run>/. A new run is
    named and its first launcher registered in one transaction, so a launcher that sees the
    run also sees that it is alive -- two launchers starting together agree on one run."""
    endpoints, root = parse(address)
    client = EtcdClient(endpoints)
    base = f"{root or 'lockstep/'}{job}/".encode()
    lease = LauncherLease(client)
    me = str(lease.id).encode()
    while True:
        current = client.get(base + b"run")
        run = value_of(current) if current else b""
        if current and client.count(base + b"launchers/" + run + b"/"):
            client.put(base + b"launchers/" + run + b"/" + me, b"", lease.id)
            started = False
            break
        new = uuid.uuid4().hex.encode()
        compare = absent(base + b"run") if current is None else unchanged(base + b"run", current)
        if client.transact(compare, [put_request(base + b"run", new),
                                     put_request(base + b"launchers/" + new + b"/" + me, b"",
                                                 lease.id)], []).get("succeeded"):
            if run:  # a run nobody is left in: its keys are ours to remove
                client.delete(base + b"runs/" + run + b"/", prefix=True)
            run, started = new, True
            break  # (else another launcher started a run just now: join it)
    prefix = (base + b"runs/" + run + b"/").decode()
    return (EtcdStore(endpoints, prefix, timeout),
            f"{SCHEME}{','.join(endpoints)}/{prefix}", lease, started)
