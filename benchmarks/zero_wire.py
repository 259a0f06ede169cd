"""ZeRO with its collectives in fewer bits, over a slow link: bytes and time per step.

Two emulated hosts, one process each, joined at 100 Mbit/s (`--bandwidth`), train the
char-GPT (1.8M parameters; batches of 16 sequences of 64 characters, AdamW) with ZeRO
stages 2 and 3, each with its reduce-scatters and gathers in full precision, bf16 and
int8 (ShardConfig(wire=...), sharding/compressed.py). For each: the median time per step
over rounds that run every mode in turn (the order reversed every other round), and the
bytes host 0 put on its link per step (its interface's counter, read around each step).
Prints ratios against plain ZeRO of the same stage. Whether they still learn: the ZeRO
variants of benchmarks/convergence.py. Needs root.

    python benchmarks/zero_wire.py [--bandwidth 100mbit] [--rounds 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import lockstep
from lockstep.demo.models import CharGPT
from lockstep.tools.bench import run_on_cluster, time_modes
from lockstep.tools.cluster import cluster_available

VOCAB, BLOCK, BATCH = 80, 64, 16
MODES = {f"ZeRO-{stage} {wire}": (stage, wire) for stage in (2, 3)
         for wire in ("full", "bf16", "int8")}


def link_counter() -> Callable[[], int]:
    """This host's bytes sent so far (the link Gloo is bound to)."""
    path = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")
    return lambda: int(path.read_text())


def worker(rounds: int, steps: int, out: Path) -> None:
    world = lockstep.init()
    torch.set_num_threads(1)
    sent_now = link_counter()
    generator = torch.Generator().manual_seed(world.rank)
    tokens = torch.randint(VOCAB, (BATCH, BLOCK + 1), generator=generator)
    made, sent = {}, {name: [0, 0] for name in MODES}  # bytes, steps
    for name, (stage, wire) in MODES.items():
        torch.manual_seed(0)
        model = lockstep.shard(CharGPT(VOCAB, BLOCK), stage, wire=wire)
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)

        def step(model: lockstep.ShardedDataParallel = model, optimizer: object = optimizer,
                 counted: list[int] = sent[name]) -> None:
            before = sent_now()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()  # type: ignore[attr-defined]
            optimizer.zero_grad()  # type: ignore[attr-defined]
            counted[0] += sent_now() - before
            counted[1] += 1

        step()  # the first forward records stage 3's gathering order
        made[name] = step
    for counted in sent.values():
        counted[:] = [0, 0]
    times = time_modes(made, rounds, steps)
    if world.is_main:
        out.write_text(json.dumps({"times": times, "sent": {k: v[0] / v[1]
                                                            for k, v in sent.items()}}))
    world.shutdown()


def report(result: dict[str, dict[str, float]], bandwidth: str) -> None:
    times = {k: statistics.median(v) for k, v in result["times"].items()}
    sent = result["sent"]
    print(f"\nchar-GPT under ZeRO, 2 hosts x 1 process at {bandwidth}")
    print(f"{'mode':16s} {'s/step':>8s} {'MB/step':>8s} {'time vs full':>13s} "
          f"{'bytes vs full':>14s}")
    for name in MODES:
        full = name.rsplit(" ", 1)[0] + " full"
        print(f"{name:16s} {times[name]:8.3f} {sent[name] / 1e6:8.2f} "
              f"{times[name] / times[full]:12.2f}x {sent[full] / sent[name]:12.2f}x fewer")
    for stage in (2, 3):
        ratio = sent[f"ZeRO-{stage} full"] / sent[f"ZeRO-{stage} int8"]
        print(f"ZeRO-{stage} int8: {ratio:.2f}x fewer bytes per step than plain ZeRO-{stage} "
              f"(goal >= 3x), {times[f'ZeRO-{stage} int8'] / times[f'ZeRO-{stage} full']:.2f}x "
              "its time per step")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="runs/bench/zero_wire.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out).resolve()
    if args.worker:
        worker(args.rounds, args.steps, out)
        return 0
    reason = cluster_available()
    if reason is not None:
        print(f"benchmarks/zero_wire.py needs an emulated cluster: {reason}")
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run_on_cluster(args.bandwidth, 1, os.path.abspath(__file__),
                            ["--worker", "--rounds", str(args.rounds), "--steps",
                             str(args.steps), "--out", str(out)], 29460, out)
    if result is None:
        return 1
    report(result, args.bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
