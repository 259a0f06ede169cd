"""Sharding (ZeRO stages 1-3), applied from outside: `lockstep.shard(module, stage)`
(sharded.py) lays parameters out in flat groups (zero.py), gathers them just in time at
stage 3 (gather.py), and checkpoints in a layout any stage and world size loads
(reshard.py)."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
