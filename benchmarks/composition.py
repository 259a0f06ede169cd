"""The composition sweep: every parallel mode x every PAIR of features, on 2 ranks.

tests/test_composition.py checks each feature alone in CI; this runs the same cells (its
run_cell, reference and expectations) for pairs of features, a few minutes' work, and
prints how each ended: exact (matches the single-process reference), approximate (ran,
replicas identical, loss down), refused (at config or wrap time, with the reason) -- or
BROKEN, with what went wrong. Pairs left out: two compressors, two precisions, both compile
orders.

    python benchmarks/composition.py                 # the whole sweep
    python benchmarks/composition.py --modes native zero3 --features join accumulate clip
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lockstep.testing import World, WorldError
from tests.test_composition import (
    FEATURES,
    MODES,
    build_config,
    expectation,
    run_cell,
)

APART = [{"wire-bf16", "powersgd"}, {"wire-bf16", "topk"}, {"powersgd", "topk"},
         {"precision-bf16", "precision-fp16"}, {"compile", "compile-outer"}]


def pairs(features: list[str]) -> list[str]:
    chosen = [f for f in features if f != "plain"]
    return [f"{a}+{b}" for a, b in itertools.combinations(chosen, 2) if {a, b} not in APART]


def judge(world: World, mode: str, feature: str) -> tuple[str, str]:
    """(verdict, detail) for one cell: exact, approximate, refused-config, refused-wrap, or
    BROKEN."""
    outcome, where = expectation(mode, feature)
    if where == "config":
        try:
            build_config(mode, feature)
        except ValueError as error:
            return "refused-config", str(error)[:100]
        return "BROKEN", "accepted by the config, expected a refusal"
    try:
        results = world.run(run_cell, mode, feature, deadline_s=90)
    except WorldError as error:
        return "BROKEN", str(error).strip().splitlines()[-1][:200]
    refused = {r.get("refused") for r in results}
    if refused != {None}:
        verdict = f"refused-{results[0].get('refused')}"
        ok = outcome == "refused" and refused == {where}
        return (verdict if ok else "BROKEN"), results[0].get("why", "")[:200]
    if outcome == "refused":
        return "BROKEN", f"ran; expected a refusal at {where} time"
    if len({r["digest"] for r in results}) != 1:
        return "BROKEN", "replicas differ"
    if outcome == "exact" and results[0]["gap"] >= 1e-9:
        return "BROKEN", f"{results[0]['gap']:.2e} off the single-process reference"
    if outcome == "approximate" and results[0]["after"] >= results[0]["before"]:
        return "BROKEN", f"loss did not go down: {results[0]}"
    return outcome, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--features", nargs="+", default=list(FEATURES))
    args = parser.parse_args()
    tally: Counter[str] = Counter()
    broken = []
    started = time.perf_counter()
    with World(2) as world:
        for mode in args.modes:
            for feature in pairs(args.features):
                verdict, detail = judge(world, mode, feature)
                tally[verdict] += 1
                print(f"{mode:13s} {feature:32s} {verdict:15s} {detail[:90]}", flush=True)
                if verdict == "BROKEN":
                    broken.append((mode, feature, detail))
    print(f"\n{sum(tally.values())} cells in {time.perf_counter() - started:.0f} s: " +
          ", ".join(f"{n} {v}" for v, n in sorted(tally.items())))
    for mode, feature, detail in broken:
        print(f"BROKEN {mode} {feature}: {detail}")


if __name__ == "__main__":
    main()
