"""LockstepStrategy for the `pytorch_lightning` package (Lightning before its rename):

    import pytorch_lightning as pl
    from lockstep.integrations.pytorch_lightning import LockstepStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2,
                         strategy=LockstepStrategy(lockstep.SyncConfig(compress="bf16")))
    trainer.fit(model, train_loader)

Importing this module also registers the name: `pl.Trainer(strategy="lockstep")`. For the
`lightning` package, the same strategy is lockstep.integrations.lightning.
What it does, and what differs from DDPStrategy: strategy.py.
"""

from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from lockstep.integrations.strategy import LockstepMixin


# (the mixin is typed against `lightning`; this package has its own, identical classes)
class LockstepStrategy(LockstepMixin, DDPStrategy):  # type: ignore[misc]
    __doc__ = LockstepMixin.__doc__


LockstepStrategy.register_strategies(StrategyRegistry)
