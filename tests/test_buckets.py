"""Bucket planning is a pure function of sizes: tested here without processes."""

import pytest

from lockstep.replication.buckets import (
    MB,
    ParamSlot,
    arrival_order,
    plan_buckets,
    reverse_registration_order,
)


def slots(sizes, dtype="torch.float32", element_size=4):
    return [ParamSlot(i, n, dtype, element_size) for i, n in enumerate(sizes)]


def test_reverse_registration_order_fills_last_layer_first():
    plan = plan_buckets([slots([10, 20, 30])[i] for i in reverse_registration_order(3)],
                        cap_bytes=MB, first_cap_bytes=MB)
    assert [b.param_indices for b in plan] == [(2, 1, 0)]
    assert plan[0].offsets == (0, 30, 50) and plan[0].numel == 60


def test_first_bucket_is_small_and_later_ones_use_the_cap():
    sizes = [256 * 1024] * 10  # 1 MiB each in fp32
    plan = plan_buckets(slots(sizes), cap_bytes=4 * MB, first_cap_bytes=MB)
    assert [len(b.param_indices) for b in plan] == [1, 4, 4, 1]
    covered = [i for b in plan for i in b.param_indices]
    assert covered == list(range(10))


def test_a_parameter_bigger_than_the_cap_gets_its_own_bucket():
    plan = plan_buckets(slots([10, 10_000_000, 10]), cap_bytes=MB, first_cap_bytes=MB)
    assert [b.param_indices for b in plan] == [(0,), (1,), (2,)]


def test_buckets_never_mix_dtypes_and_keep_fill_order():
    mixed = [ParamSlot(0, 100, "torch.float32", 4), ParamSlot(1, 100, "torch.float16", 2),
             ParamSlot(2, 100, "torch.float32", 4), ParamSlot(3, 100, "torch.float16", 2)]
    plan = plan_buckets(mixed, cap_bytes=MB, first_cap_bytes=MB)
    assert [(b.dtype, b.param_indices) for b in plan] == [
        ("torch.float32", (0, 2)), ("torch.float16", (1, 3))]


@pytest.mark.parametrize("cap_mb", [0.001, 0.1, 1, 25])
def test_every_parameter_is_placed_once_with_contiguous_offsets(cap_mb):
    sizes = [7, 1000, 3, 250_000, 12, 64 * 64, 1]
    plan = plan_buckets(slots(sizes), cap_bytes=int(cap_mb * MB), first_cap_bytes=int(MB / 8))
    placed = sorted(i for b in plan for i in b.param_indices)
    assert placed == list(range(len(sizes)))
    for bucket in plan:
        expected, total = [], 0
        for i in bucket.param_indices:
            expected.append(total)
            total += sizes[i]
        assert list(bucket.offsets) == expected and bucket.numel == total


def test_arrival_order_appends_missing_parameters_in_reverse_registration_order():
    assert arrival_order([1, 3], 5) == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError):
        arrival_order([1, 1], 3)


def test_invalid_cap_is_rejected():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(slots([1]), cap_bytes=0)
