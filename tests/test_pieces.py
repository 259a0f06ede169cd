"""A large shard stepped in pieces: the same bits as stepping it whole, for every optimizer
that is split, and the whole-tensor path wherever splitting would not be the same."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lockstep.sharding.pieces import PiecewiseStep

PIECE = 1000
KINDS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                              weight_decay=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5,
                                                      centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
}


def shards(seed: int) -> list[nn.Parameter]:
    """A shard 3.5 pieces long (the last one short) and one smaller than a piece."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3 * PIECE + PIECE // 2, generator=g)),
            nn.Parameter(torch.randn(PIECE // 3, generator=g))]


def give_gradients(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("kind", KINDS)
def test_pieces_step_to_the_same_bits_as_the_whole(kind: str) -> None:
    make = KINDS[kind]
    whole, split = shards(0), shards(0)
    plain, inner = make(whole), make(split)
    stepping = PiecewiseStep(inner, make, piece_numel=PIECE)
    for step in range(5):
        give_gradients(whole, step)
        give_gradients(split, step)
        plain.step()
        stepping.step()
        for optimizer in (plain, inner):  # as a scheduler would: on the inner optimizer
            optimizer.param_groups[0]["lr"] *= 0.7
    assert stepping.stepper is not None, "never split"  # the first step makes the state
    assert stepping.last_pieces == 4 + 1
    for p, q in zip(whole, split):
        assert torch.equal(p, q)
        for key, value in plain.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(inner.state[q][key])), key


def test_a_closure_runs_before_the_pieces_are_cut() -> None:
    """The closure recomputes the gradients (torch runs it first): the pieces must step
    those, not the ones it replaced."""
    make = KINDS["adamw"]
    whole, split = shards(0), shards(0)
    plain, inner = make(whole), make(split)
    stepping = PiecewiseStep(inner, make, piece_numel=PIECE)
    for step in range(3):
        for params, optimizer in ((whole, plain), (split, stepping)):
            give_gradients(params, step)
            optimizer.step(lambda params=params, step=step:
                           give_gradients(params, 50 + step) or 1.0)
    assert stepping.stepper is not None
    for p, q in zip(whole, split):
        assert torch.equal(p, q)


def test_what_would_not_split_steps_whole() -> None:
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
                 lambda ps: torch.optim.SGD(ps, lr=0.1),  # no state: one pass anyway
                 lambda ps: torch.optim.LBFGS(ps)):
        params = shards(1)
        stepping = PiecewiseStep(make(params), make, piece_numel=PIECE)
        for step in range(2):
            give_gradients(params, step)
            stepping.step((lambda: 0.0) if isinstance(stepping.inner, torch.optim.LBFGS)
                          else None)
        assert stepping.stepper is None
