"""The scaling advisor: its model of a step (pure arithmetic on made-up measurements),
what it recommends and why, and `lockstep advise` on a real Trainer script."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lockstep import comm
from lockstep.advisor.advise import Advice
from lockstep.advisor.measure import ModelCost, _back_to_back_s, _slowest_rank_s
from lockstep.advisor.predict import (
    EXACT,
    PERIODIC,
    ROUNDED,
    Mode,
    Prediction,
    _pipeline,
    modes,
    predict,
    predict_all,
)
from lockstep.advisor.wire import WireCost, measure_wire
from lockstep.replication.sync import SyncConfig
from lockstep.sharding.sharded import ShardConfig
from lockstep.testing import World

MS = 1e-3
# A 256x256 weight and its bias: the bias's gradient is ready 5 ms into backward, the
# weight's at its end (20 ms).
MODEL = ModelCost(forward_s=10 * MS, backward_s=20 * MS, optimizer_s=2 * MS, outer_s=1 * MS,
                  ready_s=(20 * MS, 5 * MS), shapes=((256, 256), (256,)), element_size=4,
                  state_bytes=2 * 4 * (256 * 256 + 256), unit_numels=(256 * 256 + 256,),
                  compress_s={"bf16": 0.1 * MS, "powersgd": 1 * MS, "topk": 1 * MS})
PARAM_BYTES = 4 * (256 * 256 + 256)


ALL_KINDS = ["all-reduce native", "all-reduce ring", "all-reduce tree", "all-reduce shm",
             "all-reduce native bf16", "all-reduce native fp16", "reduce-scatter", "all-gather",
             "shard gather"]


def wire(beta: float, alpha: float = 1e-4) -> WireCost:
    """Every collective alpha + S beta: timed at two sizes, a line between them."""
    line = {1: alpha + beta, 1 << 30: alpha + (1 << 30) * beta}
    return WireCost({kind: line for kind in ALL_KINDS}, 2, 1)


SLOW, FAST = wire(1e-6), wire(1e-11, 1e-6)  # about 8 Mbit/s, and memory speed


def test_timed_sizes_are_read_as_timed_and_between_them_on_a_line() -> None:
    timed = WireCost({"all-gather": {1000: 1.0, 3000: 2.0}}, 2, 1)
    assert timed.time("all-gather", 3000) == 2.0
    assert timed.time("all-gather", 2000) == pytest.approx(1.5)
    assert timed.time("all-gather", 10) == 1.0      # below: at least the smallest's time
    assert timed.time("all-gather", 6000) == pytest.approx(4.0)  # above: the largest's rate
    assert WireCost({"all-gather": {1: 1.0}}, 1, 1).time("all-gather", 5) == 0.0  # alone


def test_a_bucket_starts_once_ready_and_its_predecessor_done() -> None:
    # 0.1 MB buckets: the bias (1 KB, ready at 5 ms) goes alone, then the weight (256 KB,
    # ready at 20 ms) once the bias's all-reduce is done.
    mode = Mode("small buckets", EXACT, SyncConfig(bucket_mb=0.1))
    bias_done = 5 * MS + SLOW.all_reduce("native", 1024)
    weight_done = max(bias_done, 20 * MS) + SLOW.all_reduce("native", 256 * 1024)
    got = predict(mode, MODEL, SLOW)
    assert got.step_s == pytest.approx(10 * MS + weight_done + 2 * MS)
    assert got.compute_s == pytest.approx(32 * MS)
    assert got.wire_bytes == PARAM_BYTES
    # On a fast link the bias's reduction hides in backward and the weight's adds little.
    fast = predict(mode, MODEL, FAST)
    assert fast.step_s == pytest.approx(32 * MS + FAST.all_reduce("native", 256 * 1024))


def test_communication_beside_backward_slows_it_by_the_measured_interference() -> None:
    # The bias's all-reduce (~1 ms, from 5 ms in) runs inside backward, which loses half of
    # it; the weight's starts as backward ends, beside nothing.
    mode = Mode("small buckets", EXACT, SyncConfig(bucket_mb=0.1))
    slowed = replace(MODEL, interference=0.5)
    bias, weight = (SLOW.all_reduce("native", n) for n in (1024, 256 * 1024))
    assert predict(mode, slowed, SLOW).step_s == pytest.approx(
        10 * MS + 20 * MS + 0.5 * bias + weight + 2 * MS)
    # ZeRO-1's reductions run beside backward too; a mode whose communication runs beside
    # no compute is predicted as before.
    zero1 = Mode("ZeRO-1", EXACT, ShardConfig(stage=1, bucket_mb=0.1))
    assert predict(zero1, slowed, SLOW).step_s > predict(zero1, MODEL, SLOW).step_s
    for name in ("local SGD H=8", "DiLoCo H=50", "ZeRO-3"):
        before, after = (next(p for p in predict_all(m, SLOW, 1e12) if p.mode.name == name)
                         for m in (MODEL, slowed))
        assert after.step_s == before.step_s


def test_backward_and_the_communication_beside_it_settle_where_they_agree() -> None:
    # A 30 ms bucket ready 5 ms into a 20 ms backward, at 0.5 s lost per second: backward
    # settles at s = 20 + 0.5 (s - 5 s / 20), 32 ms; the bucket began at 5 ms stretched to
    # 8 and ends at 38; the last one, ready at 32, waits for it and takes 1 ms more.
    assert _pipeline([5 * MS, 20 * MS], [30 * MS, 1 * MS], 20 * MS, 0.5) == \
        pytest.approx(39 * MS)
    assert _pipeline([5 * MS, 20 * MS], [30 * MS, 1 * MS], 20 * MS) == pytest.approx(36 * MS)


def slowest_rows(rows_by_rank: list[list[list[float]]]) -> list[list[float]]:
    return _slowest_rank_s(torch.tensor(rows_by_rank[comm.rank_of()],
                                        dtype=torch.float64)).tolist()


def test_each_step_counts_at_its_slowest_rank_s_own_row(world2: World) -> None:
    # Step 0: rank 0 is slower in forward, rank 1 in backward, and rank 0's step is the
    # longer (7 against 5): its row counts, not the 3 + 5 + 1 of no rank's step. Step 1:
    # a tie, the two rows' mean.
    rows = [[[2.0, 4.0, 1.0, 0.5], [1.0, 1.0, 1.0, 0.5]],
            [[3.0, 1.0, 1.0, 0.25], [2.0, 0.0, 1.0, 0.25]]]
    for got in world2.run(slowest_rows, rows):
        assert got == [[2.0, 4.0, 1.0, 0.5], [1.5, 0.5, 1.0, 0.375]]


def back_to_back(sleep_s: list[float]) -> float:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pause = sleep_s[comm.rank_of()]

    def loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(pause)
        return torch.nn.functional.mse_loss(net(x), y)

    batches = iter(lambda: (torch.ones(3, 4), torch.zeros(3, 2)), None)
    return _back_to_back_s(model, optimizer, loss, batches, steps=5)


def test_steps_back_to_back_count_at_the_slowest_rank(world2: World) -> None:
    # Rank 1's steps take 40 ms more: both ranks read its pace, not their own.
    for got in world2.run(back_to_back, [0.0, 0.04]):
        assert 0.04 <= got < 0.5


def test_periodic_modes_pay_one_model_all_reduce_every_h_steps() -> None:
    by_name = {p.mode.name: p for p in predict_all(MODEL, SLOW, memory_bytes=1e12)}
    sync_once = SLOW.all_reduce("native", PARAM_BYTES)
    assert by_name["local SGD H=8"].step_s == pytest.approx(32 * MS + sync_once / 8)
    assert by_name["DiLoCo H=50"].step_s == pytest.approx(32 * MS + (sync_once + MS) / 50)
    assert by_name["DiLoCo H=50"].wire_bytes == pytest.approx(PARAM_BYTES / 50)


def test_zero_stages_hold_what_zero_says() -> None:
    by_name = {p.mode.name: p for p in predict_all(MODEL, FAST, memory_bytes=1e12)}
    p = g = PARAM_BYTES
    s = MODEL.state_bytes
    assert by_name["sync native"].state_bytes == p + g + s
    assert by_name["ZeRO-1"].state_bytes == p + g + s / 2
    assert by_name["ZeRO-2"].state_bytes == p + (g + s) / 2
    assert by_name["ZeRO-3"].state_bytes == (p + g + s) / 2
    assert by_name["DiLoCo H=50"].state_bytes == p + g + s + 2 * p  # its anchor, momentum
    assert by_name["sync topk"].state_bytes == p + g + s + g  # error feedback
    # Stages 1-2 step half the optimizer and then gather the parameters.
    assert by_name["ZeRO-2"].compute_s == pytest.approx(31 * MS)


def test_zero_on_one_host_gathers_through_shared_memory_as_its_default_does() -> None:
    # One host of 2 CPU ranks: ZeRO's default (algorithm="auto") gathers through host
    # memory, here 10x faster than through the sockets; "native" and 2 hosts keep them.
    sockets = {1: 1 * MS, 1 << 30: 1000 * MS}
    timed = {"reduce-scatter": sockets, "all-reduce native": sockets, "shard gather": sockets,
             "shard gather shm": {1: 0.1 * MS, 1 << 30: 100 * MS}}
    one_host, two_hosts = WireCost(timed, 2, 2), WireCost(timed, 2, 1)
    unit = 4 * MODEL.unit_numels[0]
    for stage in (2, 3):
        shared = predict(Mode("", EXACT, ShardConfig(stage=stage)), MODEL, one_host).step_s
        native = predict(Mode("", EXACT, ShardConfig(stage=stage, algorithm="native")), MODEL,
                         one_host).step_s
        across = predict(Mode("", EXACT, ShardConfig(stage=stage)), MODEL, two_hosts).step_s
        gathers = 1 if stage == 2 else 2  # after the step; before forward and in backward
        saved = gathers * (one_host.time("shard gather", unit) -
                           one_host.time("shard gather shm", unit))
        assert native - shared == pytest.approx(saved) and across == pytest.approx(native)
    # Where the ranks could not map each other's memory, the shared kind was not timed
    del timed["shard gather shm"]
    assert predict(Mode("", EXACT, ShardConfig(stage=3)), MODEL, WireCost(timed, 2, 2)).step_s \
        == pytest.approx(native)


def test_zero_on_one_host_sums_its_gradients_through_shared_memory_too() -> None:
    # Stage 3 on a CPU pays every collective in line: through host memory its two gathers
    # and its reduce-scatter of each unit cost what the staged kinds were timed at.
    sockets, memory = {1: 1 * MS, 1 << 30: 1000 * MS}, {1: 0.1 * MS, 1 << 30: 100 * MS}
    timed = {"reduce-scatter": sockets, "all-reduce native": sockets, "shard gather": sockets,
             "shard gather shm": memory, "staged reduce-scatter": memory,
             "staged all-reduce": memory}
    one_host, unit = WireCost(timed, 2, 2), 4 * MODEL.unit_numels[0]
    step = {algorithm: predict(Mode("", EXACT, ShardConfig(stage=3, algorithm=algorithm)),
                               MODEL, one_host).step_s for algorithm in ("auto", "native")}
    saved = 3 * (one_host.time("reduce-scatter", unit) - one_host.time("shard gather shm", unit))
    assert step["native"] - step["auto"] == pytest.approx(saved)
    for stage in (1, 2):  # each bucket reduced, and gathered after the step, from memory
        auto, native = (predict(Mode("", EXACT, ShardConfig(stage=stage, algorithm=a)), MODEL,
                                one_host).step_s for a in ("auto", "native"))
        assert auto < native


def test_on_a_gpu_the_default_is_the_backend_s_own_all_reduce() -> None:
    # shm and hierarchical sum in host memory: a GPU job on one host is offered neither,
    # and its default, algorithm="auto", is predicted as what it resolves to there: native.
    gpu = replace(MODEL, device="cuda")
    timed = {kind: {1: 1 * MS, 1 << 30: 1000 * MS} for kind in ALL_KINDS}
    names = [p.mode.name for p in predict_all(gpu, WireCost(timed, 2, 2), 1e12)]
    assert "sync native" in names and "sync shm" not in names
    cpu = [p.mode.name for p in predict_all(MODEL, WireCost(timed, 2, 2), 1e12)]
    assert "sync shm" in cpu
    default = Advice(gpu, WireCost(timed, 2, 2), predict_all(gpu, WireCost(timed, 2, 2), 1e12),
                     64, 1e12).default
    assert default.mode.name == "sync native"


ON_HOST = ("shard gather shm", "staged reduce-scatter", "staged all-reduce")


def measure_on_host() -> dict[str, dict[int, float]]:
    wire = measure_wire([(kind, 1 << 20) for kind in ON_HOST], local_world_size=2,
                        budget_s=0.02)
    return wire.timed


def test_the_shared_memory_collectives_are_timed_on_the_job_s_own_ranks(world2: World) -> None:
    for timed in world2.run(measure_on_host):
        assert set(timed) == set(ON_HOST)
        assert all(list(t) == [1 << 20] and 0 < t[1 << 20] < 1.0 for t in timed.values())


def timed_on(link: WireCost) -> ModelCost:
    """MODEL with PowerSGD and TopK as measure.py times them: through the job's own group,
    their collectives on `link` included (rank 4: P and Q of 256 x 4, the bias whole;
    TopK 1%: 657 values and their indices, each all-gathered)."""
    powersgd = sum(link.all_reduce("native", 4 * n) for n in (1024, 1024, 256))
    topk = 2 * link.time("all-gather", 2 * 657 * 4)
    return replace(MODEL, compress_s={"bf16": 0.1 * MS, "powersgd": 1 * MS + powersgd,
                                      "topk": 1 * MS + topk})


def test_powersgd_and_topk_take_what_they_were_timed_at() -> None:
    """Their seconds hold their wire already (the waits at their small collectives too):
    the link's timings add nothing to them."""
    for name in ("sync powersgd", "sync topk"):
        steps = {predict(next(m for m in modes(2, 1) if m.name == name), MODEL, link).step_s
                 for link in (SLOW, FAST)}
        assert len(steps) == 1  # one bucket, sent once backward ends: nothing hides it
        assert steps.pop() == pytest.approx(32 * MS + MODEL.compress_s[name.split()[1]])


def advice(link: WireCost, memory_bytes: float = 1e12) -> Advice:
    model = timed_on(link)
    return Advice(model, link, predict_all(model, link, memory_bytes), 64, memory_bytes)


def test_the_most_faithful_mode_within_5_percent_of_the_fastest_is_recommended() -> None:
    def chosen(**step_ms: float) -> str:
        fidelity = {"sync_native": EXACT, "ZeRO_2": EXACT, "sync_bf16": ROUNDED,
                    "DiLoCo": PERIODIC}
        found = [Prediction(Mode(name.replace("_", " "), fidelity[name], None), ms * MS,
                            ms * MS, 0.0, 0.0) for name, ms in step_ms.items()]
        return Advice(MODEL, SLOW, found, 64, 1e12).recommended.mode.name

    assert chosen(sync_native=100, sync_bf16=60, DiLoCo=58) == "sync bf16"
    assert chosen(sync_native=100, sync_bf16=60, DiLoCo=55) == "DiLoCo"
    # Among exact modes the default stays unless another is more than 5% faster.
    assert chosen(sync_native=100, ZeRO_2=96, DiLoCo=95) == "sync native"
    assert chosen(sync_native=100, ZeRO_2=90, DiLoCo=89) == "ZeRO 2"


def test_a_fast_link_keeps_the_default() -> None:
    fast = advice(FAST)
    assert fast.recommended.mode.name == "sync native"
    assert any("keep the default" in r for r in fast.reasons())
    assert "<- recommended" in next(line for line in fast.table().splitlines()
                                    if line.startswith("sync native"))


def test_a_slow_link_trades_exactness_for_speed_and_says_so() -> None:
    slow = advice(SLOW)
    chosen = slow.recommended
    assert chosen.mode.fidelity == PERIODIC
    fastest = min(p.step_s for p in slow.predictions)
    assert chosen.step_s <= 1.05 * fastest
    sync = slow.prediction("sync native")
    said = " ".join(slow.reasons())
    assert f"sync would spend {sync.comm_share:.0%} of each step communicating" in said
    assert f"{sync.step_s / chosen.step_s:.2f}x as fast as sync" in said
    assert "replicas train apart between syncs" in said


def test_a_model_that_fits_only_sharded_gets_zero() -> None:
    # Per rank: sync holds p + g + s = 4p, ZeRO-2 2.5p, ZeRO-3 2p.
    tight = advice(FAST, memory_bytes=2.2 * PARAM_BYTES)
    assert tight.recommended.mode.name == "ZeRO-3"
    assert not tight.prediction("sync native").fits
    assert "only sharded modes fit" in " ".join(tight.reasons())
    assert "does not fit" in next(line for line in tight.table().splitlines()
                                  if line.startswith("ZeRO-2"))


TRAINER_SCRIPT = """
import torch, lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn
train, test = mnist()
config = lockstep.TrainConfig(global_batch_size=64, epochs=1, run_dir={run_dir!r})
lockstep.Trainer(small_cnn, lambda p: torch.optim.AdamW(p), train, test, config=config).fit()
print("TRAINED")
"""


def test_lockstep_advise_measures_a_trainer_script_instead_of_training_it(
        tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT.format(run_dir=str(tmp_path / "run")))
    result = subprocess.run([sys.executable, "-m", "lockstep.launch.cli", "advise", "-n", "2",
                             "--json", str(tmp_path / "advice.json"), str(script)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TRAINED" not in result.stdout and not (tmp_path / "run").exists()
    record = json.loads((tmp_path / "advice.json").read_text())
    assert record["samples_per_step"] == 64 and record["world_size"] == 2
    assert {m["mode"] for m in record["modes"]} >= {"sync native", "sync shm", "ZeRO-3",
                                                    "DiLoCo H=50"}
    assert all(m["step_ms"] > 0 for m in record["modes"])
    assert 0.0 <= record["interference"] <= 1.0
    state = {m["mode"]: m["state_bytes"] for m in record["modes"]}
    assert state["ZeRO-3"] < state["ZeRO-2"] < state["ZeRO-1"] < state["sync native"]
    assert f"recommended: {record['recommended']}: " in result.stdout


def test_lockstep_advise_says_so_when_no_worker_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """A script with its own loop never asks for advice: the launcher says what would
    (the launch itself stands in here: its workers would write nothing)."""
    from lockstep.launch import cli

    monkeypatch.setattr(cli, "run", lambda spec: 0)
    plain = tmp_path / "plain.py"
    plain.write_text("import lockstep\nlockstep.init()\n")
    assert cli.main(["advise", "-n", "2", str(plain)]) == 1
    assert "lockstep.advise(model, batches" in capsys.readouterr().err
