"""Training that talks rarely: local SGD and DiLoCo (rounds.py), and the asynchronous
parameter server (paramserver.py)."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
