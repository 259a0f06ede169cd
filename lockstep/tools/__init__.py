"""Tools beside the training path: the emulated cluster (cluster.py), etcd members, a real
Ray cluster, and the benchmarks' helpers (bench.py)."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
