"""Lightning with DDPStrategy and with LockstepStrategy, in turn, in one 2-process job
(Lightning's own launcher: `python tests/lightning_job.py OUT.json`). One world serves every
check: each fit() is a fresh model from the same seed on real MNIST digits (float64, so
that "the same" can mean 1e-9); rank 0 writes each run's per-step losses, final weights'
difference from DDP's, and what the checkpoint held, to OUT.json for the test to judge.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.demo.data import mnist
from lockstep.integrations.lightning import LockstepStrategy


def lightning_classes(pl: Any) -> tuple[Any, Any]:
    """The module and the callback, for a Lightning package (`lightning` or
    `pytorch_lightning`: each checks that what it is given is its own)."""

    class Classifier(pl.LightningModule):
        def __init__(self, optimizer: str = "sgd") -> None:
            super().__init__()
            self.optimizer_name = optimizer
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(),
                                     nn.Linear(64, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> Any:
            if self.optimizer_name == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, 20, gamma=0.5)
            if self.optimizer_name == "warmup":  # a chain: its inner schedulers step too
                schedule = torch.optim.lr_scheduler.SequentialLR(
                    optimizer, [torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=10),
                                schedule], milestones=[10])
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule,
                                                             "interval": "step"}}


    class Losses(pl.Callback):
        """Rank 0's loss at every step, and what trained: the wrapper and the optimizer."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.wrapper = self.optimizer = ""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.wrapper = type(trainer.strategy.model).__name__
            self.optimizer = type(trainer.strategy.optimizers[0]).__name__

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any,
                               batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

    return Classifier, Losses


Classifier, Losses = lightning_classes(L)


class TwoBackwards(L.LightningModule):
    """Manual optimization, as a GAN's: two models, two backwards per training_step, each
    touching one model only (DDP needs find_unused_parameters for it)."""

    def __init__(self, optimizer: str = "") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
        self.b = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        total = torch.zeros(())
        for model, optimizer in zip((self.a, self.b), self.optimizers(), strict=True):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            total = total + loss.detach()
        return {"loss": total}

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (self.a, self.b)]


def fit(strategy: Any, optimizer: str = "adamw", epochs: int = 1, accumulate: int = 1,
        resume: str | None = None, save: str | None = None, pl: Any = L,
        module: Any = None, **trainer_args: Any) -> tuple[Any, Any]:
    pl.seed_everything(0, verbose=False)
    classes, callback = (Classifier, Losses) if pl is L else lightning_classes(pl)
    module = module or classes
    model, losses = module(optimizer), callback()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true",
                        max_epochs=epochs, accumulate_grad_batches=accumulate,
                        callbacks=[losses], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_args)
    trainer.fit(model, DataLoader(TRAIN, batch_size=32, shuffle=True, drop_last=True),
                ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return losses, model


def compare(run: tuple[Any, Any], ddp: tuple[Any, Any],
            skip: int = 0) -> dict[str, Any]:
    """How far a run is from DDP's: its losses (DDP's from step `skip` on) and weights."""
    (losses, model), (ddp_losses, ddp_model) = run, ddp
    return {"loss_gap": max(abs(a - b) for a, b in zip(losses.losses,
                                                          ddp_losses.losses[skip:],
                                                          strict=True)),
            "steps": len(losses.losses), "weights_gap": weights_gap(model, ddp_model),
            "wrapper": losses.wrapper, "optimizer": losses.optimizer}


def weights_gap(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(),
                                                          strict=True))


def optimizer_gap(a: str, b: str) -> float:
    """The largest difference between two checkpoints' optimizer states (momenta)."""
    sa, sb = (torch.load(p, weights_only=True)["optimizer_states"][0]["state"] for p in (a, b))
    assert sa.keys() == sb.keys(), (sorted(sa), sorted(sb))
    return max((sa[i][k] - sb[i][k]).abs().max().item()
               for i in sa for k in sa[i] if torch.is_tensor(sa[i][k]) and sa[i][k].dim())


def main(out: str) -> None:
    report: dict[str, Any] = {}
    folder = Path(out).with_suffix(".checkpoints")  # every rank reads them; rank 0 writes

    def ckpt(name: str) -> str:
        return str(folder / name)

    ddp = fit("ddp", save=ckpt("ddp.ckpt"))
    for name, parallel in PARALLEL.items():
        report[name] = compare(fit(LockstepStrategy(parallel), save=ckpt(f"{name}.ckpt")), ddp)
    # Resuming (the second epoch): DDP's checkpoint under ZeRO-3, ZeRO-3's under plain sync,
    # against DDP resumed from its own.
    ddp_resumed = fit("ddp", epochs=2, resume=ckpt("ddp.ckpt"))
    for name, parallel, start in [("zero3_from_ddp", PARALLEL["zero3"], "ddp.ckpt"),
                                  ("sync_from_zero3", PARALLEL["sync"], "zero3.ckpt")]:
        report[name] = compare(fit(LockstepStrategy(parallel), epochs=2, resume=ckpt(start)),
                               ddp_resumed)
    # Gradient accumulation (no_sync), SGD with momentum.
    report["accumulate"] = compare(fit("lockstep", "sgd", accumulate=2),  # (registered name)
                                   fit("ddp", "sgd", accumulate=2))
    report["zero1_warmup"] = compare(fit(LockstepStrategy(lockstep.ShardConfig(stage=1)),
                                         "warmup"), fit("ddp", "warmup"))
    report["manual"] = compare(fit(LockstepStrategy(lockstep.SyncConfig(find_unused=True)),
                                   module=TwoBackwards),
                               fit("ddp_find_unused_parameters_true", module=TwoBackwards))
    try:
        fit(LockstepStrategy(PARALLEL["zero2"]), gradient_clip_val=1.0)
    except ValueError as e:
        report["clip_refused"] = str(e)
    # The same strategy for the older `pytorch_lightning` package.
    import pytorch_lightning

    from lockstep.integrations.pytorch_lightning import LockstepStrategy as OldPackageStrategy
    report["pytorch_lightning"] = compare(
        fit(OldPackageStrategy(PARALLEL["zero2"]), pl=pytorch_lightning), ddp)
    report["watchdog_world"] = lockstep.init().world_size
    if torch.distributed.get_rank() == 0:
        _write(out, report, ckpt)


def _write(out: str, report: dict[str, Any], ckpt: Any) -> None:
    for name in PARALLEL:
        report[name]["optimizer_gap"] = optimizer_gap(ckpt(f"{name}.ckpt"), ckpt("ddp.ckpt"))
    Path(out).write_text(json.dumps(report, indent=1))


TRAIN = TensorDataset(*(t[:2048] for t in mnist()[0].tensors))  # 32 steps an epoch at 2 x 32
PARALLEL = {"sync": lockstep.SyncConfig(), "zero2": lockstep.ShardConfig(stage=2),
            "zero3": lockstep.ShardConfig(stage=3)}

if __name__ == "__main__":
    main(sys.argv[1])
