"""lockstep where users already train: each module adapts lockstep to one framework's seam,
imported only by those who use it (the framework is an optional extra, never a dependency).

- `lockstep.integrations.lightning`: `LockstepStrategy`, a Lightning strategy (Lightning's
  loop, checkpoints and logging; lockstep's wrapper, watchdog, compression and ZeRO).
- Ray Train and Hugging Face Accelerate need no adapter: their workers call
  `lockstep.init()`, which adopts the process group they made (README, "Where users already train").
"""
