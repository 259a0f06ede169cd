"""The job's store in etcd (lockstep/elastic/etcd.py): a real 3-member etcd cluster on this
machine. The store keeps TCPStore's semantics through the loss of any one member, two
launchers starting together agree on one run, and a fault-tolerant job goes on through a
worker's kill and an etcd member's -- every batch once, the weights one process's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lockstep.elastic import etcd
from lockstep.elastic.etcdstore import EtcdStore
from lockstep.elastic.store import connect
from lockstep.tools.etcd_members import EtcdMembers
from tests.test_elastic import _check_history, _kill_and_rejoin, _reference


@pytest.fixture(scope="module")
def members() -> Iterator[EtcdMembers]:
    with EtcdMembers.local(3) as started:
        yield started


def _store(members: EtcdMembers, prefix: str, timeout_s: float = 5.0,
           patience_s: float = 0.5) -> EtcdStore:
    endpoints, _ = etcd.parse(members.address)
    return EtcdStore(endpoints, prefix, timedelta(seconds=timeout_s),
                          timedelta(seconds=patience_s))


@pytest.mark.parametrize("wrapped", [False, True], ids=["itself", "under-a-prefix-store"])
def test_the_store_keeps_tcpstores_rules(members: EtcdMembers, wrapped: bool) -> None:
    """Every caller (quorum, heartbeat, Gloo) holds it inside a PrefixStore, which reaches
    it through C++: delete_key and num_keys failed there once ("pure virtual function")."""
    store: dist.Store = _store(members, f"rules-{wrapped}/")
    if wrapped:
        store = dist.PrefixStore("p/", store)
    store.set("a", "x")
    assert store.get("a") == b"x" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.add("n", 0) == 5
    assert store.add("fresh", 0) == 0 and store.check(["fresh"])  # as TCPStore: created
    # compare_set: b"" means absent; the answer is the value held after the call
    assert store.compare_set("c", "", "v1") == b"v1"
    assert store.compare_set("c", "", "v2") == b"v1"
    assert store.compare_set("c", "v1", "v3") == b"v3"
    assert store.compare_set("missing", "q", "r") == b"q" and not store.check(["missing"])
    assert store.num_keys() == 4 and store.delete_key("c") and not store.delete_key("c")
    waited = r"wait timeout after 300ms, keys: \['(p//)?late'\]"
    with pytest.raises(dist.DistStoreError, match=waited):
        store.wait(["late"], timedelta(seconds=0.3))
    threading.Timer(0.2, lambda: store.set("late", "1")).start()
    assert store.get("late") == b"1"  # get waits for the key, as TCPStore's does


def test_adds_from_many_threads_are_atomic(members: EtcdMembers) -> None:
    store = _store(members, "atomic/")

    def bump() -> None:
        for _ in range(15):
            store.add("count", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("count", 0) == 60


def test_a_process_group_forms_over_it(members: EtcdMembers) -> None:
    """Gloo's rendezvous through the Python store: a group of its own (this pytest process
    may hold a default group already), its pair's address exchanged through etcd."""
    store = dist.PrefixStore("pg", _store(members, "group/"))
    group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    value = torch.ones(3)
    group.allreduce([value]).wait()
    assert value.tolist() == [1.0, 1.0, 1.0]
    assert _store(members, "group/").num_keys() > 0  # what Gloo wrote went to etcd


def test_two_launchers_starting_together_join_one_run_and_the_next_starts_afresh(
        members: EtcdMembers) -> None:
    timeout = timedelta(seconds=5)
    joined: list[tuple[str, etcd.LauncherLease, bool]] = []
    launchers = [threading.Thread(target=lambda: joined.append(
        etcd.join_job(members.address, "together"))) for _ in range(2)]
    for t in launchers:
        t.start()
    for t in launchers:
        t.join()
    assert joined[0][0] == joined[1][0] and sorted(j[2] for j in joined) == [False, True]
    first_run = connect(joined[0][0], timeout)
    first_run.set("left-by-the-run", "1")
    for _, lease, _ in joined:
        lease.close()
    address, lease, started = etcd.join_job(members.address, "together")
    try:  # nobody was left in the old run: a new one, and the old one's keys are gone
        assert started and address != joined[0][0]
        assert not connect(address, timeout).check(["left-by-the-run"])
        assert not first_run.check(["left-by-the-run"])
    finally:
        lease.close()


def test_the_store_answers_while_any_one_member_is_down() -> None:
    with EtcdMembers.local(3) as own:
        # Patient for an election's length: the member killed may have been the leader, and
        # on a loaded machine the other two took over 0.5 s to elect one (CI under load)
        store = _store(own, "failover/", patience_s=15)
        store.set("k", "before")
        own.kill(0)  # the member asked first
        assert store.get("k") == b"before"
        store.set("k", "after")
        assert store.add("n", 1) == 1 and store.compare_set("k", "after", "x") == b"x"
        own.kill(2)  # two of three down: no majority, and etcd rightly refuses to answer
        with pytest.raises(etcd.EtcdUnavailable, match="no etcd member answered"):
            _store(own, "failover/").set("k", "no majority")
        # A patient store (a worker's, cut off for a while) asks again until they are back
        patient, done = _store(own, "failover/", patience_s=60), []
        asking = threading.Thread(target=lambda: done.append(patient.add("n", 1)))
        asking.start()
        own.restart(2)
        asking.join(timeout=60)
        assert done == [2]


def test_a_job_goes_on_through_a_workers_kill_and_an_etcd_members(
        tmp_path: Path) -> None:
    """The kill/rejoin audit of test_elastic with the store in a 3-member etcd: after the
    worker's kill, the etcd member every worker asks first is killed too; the joiner is
    still let in, and the final weights are one process's."""
    steps = 60
    with EtcdMembers.local(3) as own:
        run = _kill_and_rejoin(tmp_path, ["--steps", str(steps), "--pace", "0.04",
                                          "--hold-at", "30"], kill_at=8,
                               endpoint=own.address, before_rejoin=lambda: own.kill(0))
    finals = _check_history(run, steps, 12)
    for final in finals:
        for got, want in zip(final["params"], _reference(steps, 12), strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       rtol=1e-9, atol=1e-11)
    assert "3 -> 2 workers, continuing at step" in run["stderr"]
    assert "joined, state sent from rank 0; 2 -> 3 workers" in run["stderr"]
