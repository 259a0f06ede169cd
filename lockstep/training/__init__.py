"""Training: the loop (trainer.py, async_trainer.py), its config (config.py), the data it
reads (sampler.py, batching.py), evaluation, checkpoints and resuming (checkpoint*.py,
tensorfile.py, resume.py), and what a run leaves behind (runlog.py, plots.py,
trackers.py, export.py)."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
