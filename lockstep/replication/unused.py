"""Parameters that got no gradient in a synchronised backward: an error by default, as in
torch's DDP; with `find_unused=True`, a parameter unused on every rank is left without a
gradient, as in one process."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep import comm


class UnusedParameterError(RuntimeError):
    """A trainable parameter got no gradient in a synchronised backward."""


def unused_error(names: Sequence[str], unready: list[int],
                 group: comm.Group) -> UnusedParameterError:
    listed = ", ".join(f"'{names[i]}'" for i in unready[:8])
    more = f" and {len(unready) - 8} more" if len(unready) > 8 else ""
    return UnusedParameterError(
        f"rank {comm.rank_of(group)}: {len(unready)} parameter(s) received no gradient in "
        f"this backward: {listed}{more}. If some parameters are legitimately unused on some "
        "steps, wrap with DataParallel(..., find_unused=True); if they are never used, "
        "freeze them (requires_grad_(False)) or remove them.")


def drop_globally_unused(params: Sequence[torch.nn.Parameter], used: bytearray,
                         emptied: list[int], group: comm.Group) -> None:
    """A parameter unused on every rank keeps `.grad = None`, as in one process, so the
    optimizer skips it (a zero gradient would still move it through momentum/decay).
    `used`: this rank's bitmap; `emptied`: the parameters given a zero slot this backward.
    Every rank calls it at the same point (an all-reduce of the bitmap)."""
    everywhere = comm.control_tensor(used, group)
    comm.all_reduce(everywhere, "all-reduce of the used-parameter bitmap", group)
    used_anywhere = everywhere.tolist()
    for index in emptied:
        if used_anywhere[index] == 0:
            params[index].grad = None
