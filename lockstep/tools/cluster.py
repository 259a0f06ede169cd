"""An emulated cluster on one machine: K "hosts" as Linux network namespaces on a bridge,
each host's link rate-limited with `tc tbf`, so multi-host jobs and slow networks can be
run and measured for real.

    with Cluster(hosts=2, bandwidth="100mbit") as cluster:
        cluster.run([["lockstep", "run", "-n", "2", ...], [...]])  # one command per host

    lockstep cluster --hosts 2 --bandwidth 1gbit -- lockstep run -n 2 --nnodes 2 \\
        --node-rank {host} --rdzv-endpoint {host0}:29400 train.py

Each host has its own network stack: processes on one host reach each other over their own
loopback (fast, like a real machine), and other hosts over their link (shaped in both
directions). Everything is torn down on every exit path -- a failing command, an exception,
Ctrl-C or SIGTERM. Needs root (CAP_NET_ADMIN) and iproute2; `cluster_available()` says
whether this machine can make one, and why not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from lockstep.cores import HOST_CORES, machine_cores
from lockstep.logs import get_logger
from lockstep.tools.etcd_members import EtcdMembers, Member
from lockstep.tools.hostprocs import stream_all, wait_all

log = get_logger(__name__)

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_NETNS_ETC = "/etc/netns"  # iproute2's per-namespace /etc: `ip netns exec` mounts its files


def parse_bandwidth(text: str) -> float:
    """'100mbit' -> 1e8 bits per second."""
    match = _RATE.match(text.strip().lower())
    if not match:
        raise ValueError(f"bandwidth {text!r}: give a rate like 100mbit, 1gbit or 10gbit")
    return float(match.group(1)) * _BITS[match.group(2)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def _subnets_claimed() -> Iterator[None]:
    """Held while a cluster picks its subnet and takes it: two clusters built at once (by
    two test processes, say) must not both pick one -- the same /24 on two bridges breaks
    routing for both."""
    with open("/run/lockstep-cluster-subnets.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _free_subnet(preferred: int) -> str:
    """The first 10.213.x (x from `preferred` on) that no address on this machine is in."""
    taken = set(re.findall(r"inet 10\.213\.(\d+)\.", _ip("-o", "-4", "addr", "show").stdout))
    for step in range(250):
        if str(x := (preferred + step) % 250) not in taken:
            return f"10.213.{x}"
    raise RuntimeError("every subnet 10.213.0-249.0/24 is taken: 250 clusters at once?")


def cluster_available() -> str | None:
    """None if network namespaces can be made here; otherwise the reason they cannot."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"lockstep-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def host_cores(hosts: int) -> int:
    """Each of `hosts` emulated hosts' share of this machine's cores (at least one): every
    host shares them, and left to count them all, each host's workers ran as many threads
    as the machine has cores -- on 2 hosts over 2 cores OpenMP's threads waited on each
    other: the char-GPT's forward took 137 ms a step instead of 77, and DiLoCo's outer step,
    6 ms, was timed at 580."""
    return max(1, machine_cores() // hosts)


@dataclass
class Cluster:
    """K emulated hosts. Use as a context manager: created on enter, removed on exit."""

    hosts: int = 2
    bandwidth: str | None = "1gbit"
    """Per-host link rate in each direction ("100mbit", "1gbit", ...); None: unshaped."""
    etcd: int = 0
    """Run an etcd member on each of the first `etcd` hosts (3: any one host may go): the
    job store that `{etcd}` names in commands (lockstep/elastic/etcd.py)."""
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    """Short id in every interface and namespace name, so clusters do not collide."""

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise ValueError(f"hosts must be 1..250, got {self.hosts}")
        self.rate_bps = parse_bandwidth(self.bandwidth) if self.bandwidth else None
        # 10.213.x.0/24, x from the tag; _create moves it on if another cluster has it.
        self.subnet = f"10.213.{int(self.tag, 16) % 250}"
        self.bridge = f"lsb{self.tag}"
        self._made: list[str] = []  # what exists, for teardown
        self.etcd_members: EtcdMembers | None = None
        if not 0 <= self.etcd <= self.hosts:
            raise ValueError(f"etcd members must be 0..{self.hosts} (one per host)")

    # ---- names ----------------------------------------------------------------------

    def netns(self, host: int) -> str:
        return f"lockstep-{self.tag}-h{host}"

    def interface(self, host: int) -> str:
        """The host's network interface inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"lsv{self.tag}n{host}"

    def _outside(self, host: int) -> str:
        """The host's end of its link on the bridge."""
        return f"lsv{self.tag}h{host}"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def sent_bytes(self, host: int) -> int:
        """Bytes `host` has sent on its link so far (its bridge end's receive counter)."""
        return int(Path(f"/sys/class/net/{self._outside(host)}/statistics/rx_bytes")
                   .read_text())

    # ---- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = cluster_available()
        if reason is not None:
            raise RuntimeError(f"cannot build an emulated cluster: {reason}")
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):  # SIGTERM should unwind through __exit__
            signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _create(self) -> None:
        # Each item is recorded before it is made: a SIGTERM arriving between the two must
        # not leave behind something teardown never heard of (deleting one that was not
        # made yet fails quietly).
        self._made.append(f"link:{self.bridge}")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        # This machine on the bridge too (.254), so it can reach the hosts' services: the
        # etcd members' health, say (the hosts reach each other the same way with or without)
        with _subnets_claimed():
            self.subnet = _free_subnet(int(self.subnet.rsplit(".", 1)[1]))
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        for host in range(self.hosts):
            self._create_host(host)
        if self.etcd:
            self.etcd_members = EtcdMembers(
                [Member(f"h{h}", self.address(h)) for h in range(self.etcd)],
                spawn=lambda h, command: self.popen(h, command, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL))
            self.etcd_members.__enter__()
        log.info("cluster %s: %d hosts on %s.0/24, links %s", self.tag, self.hosts, self.subnet,
                 self.bandwidth or "unshaped")

    def _create_host(self, host: int) -> None:
        ns, inside, outside = self.netns(host), self.interface(host), self._outside(host)
        self._made.append(f"netns:{ns}")
        _ip("netns", "add", ns)
        self._made.append(f"link:{outside}")
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self._write_hosts(ns)
        if self.rate_bps:  # shape both directions: what the host sends and what it receives
            self._shape(["ip", "netns", "exec", ns], inside)
            self._shape([], outside)

    def _write_hosts(self, ns: str) -> None:
        """The host's /etc/hosts: the machine's, plus a name for every address of the cluster.
        `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts. Without it, looking up
        a peer's address asks a DNS server the namespace cannot reach, and torch warns on
        every connection ("The hostname of the client socket cannot be retrieved")."""
        folder = os.path.join(_NETNS_ETC, ns)
        if not os.path.isdir(_NETNS_ETC):
            self._made.append(f"dir:{_NETNS_ETC}")  # removed at teardown only if empty
            os.makedirs(_NETNS_ETC, exist_ok=True)
        if os.path.lexists(folder):  # not ours: never written into, never removed
            raise RuntimeError(f"lockstep cluster: {folder} already exists and was not made "
                               "by this cluster; remove it if it is left from another run")
        self._made.append(f"dir:{folder}")
        os.mkdir(folder)
        self._made.append(f"file:{folder}/hosts")
        with open("/etc/hosts") as machine:
            ours = machine.read().rstrip("\n")
        # torch's stores listen on IPv6 sockets: peers show as ::1 and ::ffff:a.b.c.d.
        named = [("127.0.0.1", "localhost"), ("::1", "localhost")] + \
            [(self.address(h), self.netns(h)) for h in range(self.hosts)]
        lines = [f"{ip} {name}" for ip, name in named] + \
            [f"::ffff:{ip} {name}" for ip, name in named if "." in ip]
        with open(os.path.join(folder, "hosts"), "w") as hosts:
            hosts.write(f"{ours}\n# lockstep cluster {self.tag}\n" + "\n".join(lines) + "\n")

    def _shape(self, prefix: list[str], device: str, bandwidth: str | None = None) -> None:
        bandwidth = bandwidth or self.bandwidth
        assert bandwidth is not None
        # tbf lets a full bucket's bytes through at the veth's own speed, which a real link
        # of this rate never does. A millisecond of traffic still reaches the rate (tbf's
        # timer is high-resolution; a quarter of one did not: 0.59 of 1 Gbit/s); the 10 ms it
        # held before refilled during a small model's compute, and the MNIST CNN's 828 KB
        # all-reduce crossed a "1 Gbit/s" link in 1.3 ms after a 7 ms pause, not 6.4.
        # (At least a few full frames, for slow links.)
        burst = max(8 * 1024, int(parse_bandwidth(bandwidth) / 8 / 1000))
        subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                        "rate", bandwidth, "burst", str(burst), "latency", "50ms"],
                       check=True, capture_output=True, text=True)

    def limit(self, host: int, bandwidth: str) -> None:
        """Shape one host's link to `bandwidth` both ways (a slower link than the others')."""
        self._shape(["ip", "netns", "exec", self.netns(host)], self.interface(host), bandwidth)
        self._shape([], self._outside(host), bandwidth)

    def teardown(self) -> None:
        """Kill every process left in the hosts and delete every link and namespace made.
        Safe to call twice; each step is attempted even if an earlier one fails."""
        if self.etcd_members is not None:  # (its data folder, which the namespaces do not hold)
            self.etcd_members.__exit__()
            self.etcd_members = None
        for item in reversed(self._made):
            kind, name = item.split(":", 1)
            if kind == "netns":
                self._kill_inside(name)
                _ip("netns", "del", name, check=False)
            elif kind == "link":
                _ip("link", "del", name, check=False)
            else:  # only what was made: a file, a folder once empty (another cluster's
                with contextlib.suppress(OSError):  # may still be in /etc/netns)
                    (os.unlink if kind == "file" else os.rmdir)(name)
        self._made.clear()

    def kill_host(self, host: int) -> None:
        """Every process on `host` dies at once (SIGKILL), as when the machine goes."""
        self._kill_inside(self.netns(host))

    def cut_link(self, host: int, cut: bool = True) -> None:
        """Take `host`'s link down (its processes live on, unreachable), or up again."""
        _ip("link", "set", self._outside(host), "down" if cut else "up")

    @staticmethod
    def _kill_inside(ns: str) -> None:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    # ---- running commands -------------------------------------------------------------

    def env(self, host: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for a process on `host`: Gloo bound to the host's link, and the
        host's share of this machine's cores for its workers' threads (HOST_CORES)."""
        return {HOST_CORES: str(host_cores(self.hosts)), **os.environ,
                "GLOO_SOCKET_IFNAME": self.interface(host), "LOCKSTEP_HOST": str(host),
                "LOCKSTEP_HOST0": self.address(0), **(extra or {})}

    def popen(self, host: int, command: Sequence[str], extra_env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.netns(host), *command],
                                env=self.env(host, extra_env), text=True, **kwargs)  # type: ignore[call-overload]

    def run(self, commands: Sequence[Sequence[str]], timeout: float = 600.0,
            extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
        """Run commands[i] on host i, all at once; wait for all. If one fails, the others
        are stopped (a job cannot finish without a host). Placeholders as in `expand`."""
        if len(commands) != self.hosts:
            raise ValueError(f"{len(commands)} commands for {self.hosts} hosts")
        procs = [self.popen(h, self.expand(cmd, h), extra_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE) for h, cmd in enumerate(commands)]
        return wait_all(procs, timeout)

    def stream(self, commands: Sequence[Sequence[str]], timeout: float = 600.0,
               extra_env: dict[str, str] | None = None) -> list[int]:
        """Like `run`, but every host's output is printed as it comes, each line prefixed
        by its host (`[host 1] ...`), stdout to stdout and stderr to stderr, the hosts
        interleaved. Returns the exit codes. Python output is unbuffered so lines come live."""
        if len(commands) != self.hosts:
            raise ValueError(f"{len(commands)} commands for {self.hosts} hosts")
        env = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"), **(extra_env or {})}
        procs = [self.popen(h, self.expand(cmd, h), env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=1) for h, cmd in enumerate(commands)]
        return stream_all(procs, [f"[host {h}] " for h in range(self.hosts)], timeout)

    def run_job(self, nproc: int, script: str, args: Sequence[str], port: int = 29400,
                timeout: float = 1800.0) -> list[subprocess.CompletedProcess[str]]:
        """Run one `lockstep run` job over every host: `nproc` workers each, rendezvous on
        host 0. Returns each host's launcher result."""
        job = [sys.executable, "-m", "lockstep.launch.cli", "run", "-n", str(nproc), "--nnodes",
               str(self.hosts), "--node-rank", "{host}", "--rdzv-endpoint",
               f"{{host0}}:{port}", "--local-addr", "{addr}", script, *args]
        return self.run([job] * self.hosts, timeout=timeout)

    def expand(self, command: Sequence[str], host: int) -> list[str]:
        """Fill in `{host}` (this host's index), `{addr}` (its address), `{host0}` (host
        0's address, where a rendezvous can live) and `{etcd}` (the etcd members' endpoint,
        etcd://..., with `etcd=`)."""
        etcd = self.etcd_members.address if self.etcd_members else "{etcd}"
        return [part.replace("{host}", str(host)).replace("{addr}", self.address(host))
                .replace("{host0}", self.address(0)).replace("{etcd}", etcd)
                for part in command]


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """`lockstep cluster --hosts K --bandwidth R -- COMMAND...`: run COMMAND on every host."""
    import argparse

    parser = argparse.ArgumentParser(prog="lockstep cluster", description=main.__doc__)
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="per-host link rate in each direction, e.g. 100mbit, 1gbit, or "
                        "'none' for unshaped (default 1gbit)")
    parser.add_argument("--etcd", type=int, default=0, metavar="K",
                        help="start an etcd member on each of the first K hosts (3 survives "
                        "any one host's loss); {etcd} in the command names them")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="run on every host; {host}, {addr}, {host0} and {etcd} are "
                        "filled in")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run on every host, after --")
    bandwidth = None if args.bandwidth == "none" else args.bandwidth
    with Cluster(args.hosts, bandwidth, etcd=args.etcd) as cluster:
        codes = cluster.stream([command] * args.hosts)
    return max(codes, key=abs, default=0)
