"""Launching: the `lockstep` command (cli.py), `lockstep run` on torchrun's machinery
(run.py), `lockstep run --elastic` (elastic.py, and jobstore.py for the job's store), where
every worker starts (entry.py), and `lockstep env` (envreport.py)."""

from lockstep.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # lockstep.<package>.<module>, unimported
