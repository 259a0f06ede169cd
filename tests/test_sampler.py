"""ShardedSampler: coverage, disjointness, padding, epochs and resume -- no processes."""

from collections import Counter

import pytest

from lockstep.training.sampler import ShardedSampler


def shards(length, world_size, **kwargs):
    return [list(ShardedSampler(range(length), rank=r, world_size=world_size, **kwargs))
            for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("length", [1, 5, 12, 13, 100])
def test_every_sample_is_seen_and_ranks_get_equal_counts(length, world_size):
    parts = shards(length, world_size)
    assert len({len(p) for p in parts}) == 1
    assert set().union(*parts) == set(range(length))
    counts = Counter(i for p in parts for i in p)
    padding = sum(len(p) for p in parts) - length
    assert padding == (-length) % world_size if length >= world_size else padding >= 0
    assert sum(c - 1 for c in counts.values()) == padding  # only padding repeats


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_slices_are_disjoint_when_length_divides(world_size):
    parts = shards(12 * world_size, world_size)
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == 12 * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_drop_last_drops_the_tail_and_never_repeats(world_size):
    parts = shards(11, world_size, drop_last=True)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 11 - 11 % world_size
    assert all(len(p) == 11 // world_size for p in parts)


def test_dataset_smaller_than_world_wraps():
    parts = shards(2, 5)
    assert all(len(p) == 1 for p in parts)
    assert set().union(*parts) == {0, 1}


def test_epoch_advances_by_itself_without_set_epoch():
    sampler = ShardedSampler(range(50), rank=0, world_size=2, seed=3)
    first, second = list(sampler), list(sampler)
    assert first != second
    assert sampler.epoch == 1


def test_set_epoch_is_respected_and_reproducible():
    a = ShardedSampler(range(50), rank=1, world_size=2, seed=3)
    b = ShardedSampler(range(50), rank=1, world_size=2, seed=3)
    a.set_epoch(4)
    b.set_epoch(4)
    epoch4 = list(a)
    assert epoch4 == list(b)
    a.set_epoch(4)
    assert list(a) == epoch4  # the same epoch set again replays it
    c = ShardedSampler(range(50), rank=1, world_size=2, seed=4)
    c.set_epoch(4)
    assert list(c) != list(b)


def test_no_shuffle_keeps_dataset_order():
    assert shards(6, 2, shuffle=False) == [[0, 2, 4], [1, 3, 5]]


def global_stream(length, world_size, seed, epoch, take_per_rank=None, state=None):
    """What all ranks draw together, in global order, optionally from a saved state."""
    samplers = [ShardedSampler(range(length), rank=r, world_size=world_size, seed=seed)
                for r in range(world_size)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        else:
            s.set_epoch(epoch)
    iters = [iter(s) for s in samplers]
    drawn = []
    steps = take_per_rank if take_per_rank is not None else len(samplers[0])
    for _ in range(steps):
        drawn.extend(next(it) for it in iters)
    return drawn, samplers[0]


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 3), (3, 2), (4, 1)])
def test_resume_mid_epoch_at_any_world_size_neither_repeats_nor_skips(before, after):
    length = 97
    head, sampler = global_stream(length, before, seed=7, epoch=2, take_per_rank=9)
    state = sampler.state_dict()
    assert state["epoch"] == 2 and state["position"] == 9 * before
    tail, _ = global_stream(length, after, seed=7, epoch=2, state=state)
    uninterrupted, _ = global_stream(length, before, seed=7, epoch=2)
    assert head == uninterrupted[: len(head)]
    assert set(head + tail) == set(range(length))
    assert len(set(head) & set(tail[: length - len(head)])) == 0
    assert tail[: length - len(head)] == [i for i in uninterrupted[len(head):length]]


def test_state_after_a_complete_pass_points_at_the_next_epoch():
    sampler = ShardedSampler(range(10), rank=0, world_size=3, seed=0)
    list(sampler)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0


def test_resumed_epoch_then_continues_normally():
    sampler = ShardedSampler(range(20), rank=0, world_size=2, seed=1)
    sampler.load_state_dict({**sampler.state_dict(), "position": 10})
    assert len(list(sampler)) == 5
    assert len(list(sampler)) == 10 and sampler.epoch == 1


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        ShardedSampler([], rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 3"):
        ShardedSampler(range(4), rank=3, world_size=2)
    sampler = ShardedSampler(range(4), rank=0, world_size=1)
    with pytest.raises(ValueError, match="dataset of 5"):
        sampler.load_state_dict({**sampler.state_dict(), "dataset_len": 5})
