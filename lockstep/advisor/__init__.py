"""The scaling advisor: which mode a job should train in, predicted before it runs.
measure.py times the model and wire.py the job's collectives, once; predict.py turns them
into each mode's step time and memory; advise.py recommends one and says why.
costmodel.py is the alpha-beta model of each all-reduce algorithm beneath it."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
