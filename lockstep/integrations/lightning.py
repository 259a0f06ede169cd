"""A Lightning strategy: Lightning's loop, checkpoints and logging over lockstep's wrapper.

    import lightning as L
    from lockstep.integrations.lightning import LockstepStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=LockstepStrategy(lockstep.SyncConfig(compress="bf16")))
    trainer.fit(model, train_loader)

Importing this module also registers the name: `L.Trainer(strategy="lockstep")`. For the
older `pytorch_lightning` package, the same strategy is lockstep.integrations.pytorch_lightning.
What it does, and what differs from DDPStrategy: strategy.py.
"""

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lockstep.integrations.strategy import LockstepMixin


class LockstepStrategy(LockstepMixin, DDPStrategy):
    __doc__ = LockstepMixin.__doc__


LockstepStrategy.register_strategies(StrategyRegistry)
