"""The job's store in etcd, so that no one host holds it: `--rdzv-endpoint etcd://A,B,C`.

A TCPStore lives in one launcher's process; when that host goes, the members can no longer
agree on anything. etcd keeps every key on a majority of its members (Raft): with three
members any one can die -- the first host's included -- and the store still answers.

This module speaks etcd's v3 API through the JSON gateway every etcd >= 3.4 serves --
plain HTTP from the standard library, no client package, and no torch: the launcher finds
its run of the job (join_job) and starts its workers before it loads torch. Each request
goes to the member that answered last; a member that does not answer (its host is gone, its
link cut, it lost the majority) is passed over for the next. etcd's reads are linearizable
by default, so any member's answer is the current one. etcdstore.py is the c10d Store over
it that quorum.py, heartbeat.py and Gloo's rendezvous use.
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
from typing import Any

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


def holds(key: bytes, value: bytes) -> dict[str, Any]:
    """A transaction's comparison: the key's value is `value`."""
    return {"key": _b64(key), "target": "VALUE", "value": _b64(value)}


def unchanged(key: bytes, record: dict[str, Any]) -> dict[str, Any]:
    """A transaction's comparison: the key is as it was when `record` was read."""
    return {"key": _b64(key), "target": "MOD", "mod_revision": record["mod_revision"]}


def value_of(record: dict[str, Any]) -> bytes:
    """A key's value, from its record (etcd leaves an empty value out)."""
    return base64.b64decode(record.get("value", ""))


def range_request(key: bytes) -> dict[str, Any]:
    """A transaction's request: read the key."""
    return {"request_range": {"key": _b64(key)}}


def put_request(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


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


def join_job(address: str, job: str) -> tuple[str, LauncherLease, bool]:
    """The run of `job` this launcher's workers belong to: the live one if any launcher of
    it is alive, else a new one (the previous run's keys, lockstep's own, are deleted).
    Returns the address of its store (etcdstore.EtcdStore, or store.connect, opens it), this
    launcher's lease, and whether this launcher started the run.

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
    return f"{SCHEME}{','.join(endpoints)}/{prefix}", lease, started
