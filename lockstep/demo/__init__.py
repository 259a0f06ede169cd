"""`lockstep demo` (demo.py) and the data and models the demo, the examples and the
benchmarks use (data.py, models.py): real datasets from installed packages, no downloads."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
