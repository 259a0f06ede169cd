"""Drop-in: three real DDP scripts, run under torchrun with DDP and with lockstep swapped in
by their one import line, take the same per-step losses (examples/ddp_dropin/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from benchmarks.dropin import ROOT, SCRIPTS, max_difference, run_script

SWITCH = re.compile(r"^if os\.environ\.get\(['\"]DROPIN['\"]\) == ['\"]lockstep['\"]:\n"
                    r"    from lockstep import DataParallel as (\w+)\n"
                    r"else:\n"
                    r"    from torch\.nn\.parallel import DistributedDataParallel(?: as (\w+))?\n",
                    re.MULTILINE)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_import_is_the_only_difference(name: str) -> None:
    source = (ROOT / "examples" / "ddp_dropin" / SCRIPTS[name].file).read_text()
    switches = SWITCH.findall(source)
    assert len(switches) == 1, "expected exactly one DROPIN import switch"
    ours, theirs = switches[0]
    assert ours == (theirs or "DistributedDataParallel"), "both imports bind the same name"
    rest = SWITCH.sub("", source)
    assert "DROPIN'" not in rest and 'DROPIN"' not in rest, "DROPIN is read only in the switch"
    assert lockstep_uses(rest) == set(), \
        "outside the switch, a script never mentions lockstep"


def lockstep_uses(source: str) -> set[str]:
    """The lockstep modules a script's code imports or names (docstrings aside)."""
    uses = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            uses.add(node.module)
        elif isinstance(node, ast.Import):
            uses.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Name):
            uses.add(node.id)
    return {use for use in uses if use.split(".")[0] == "lockstep"}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_lockstep_gives_ddps_per_step_losses(name: str, tmp_path: Path) -> None:
    ddp = run_script(name, "ddp", quick=True, work=tmp_path / "ddp", timeout=180)
    ours = run_script(name, "lockstep", quick=True, work=tmp_path / "lockstep", timeout=180)
    assert len(ddp["losses"]) >= 3
    difference = max_difference(ddp["losses"], ours["losses"])
    assert difference <= 1e-5, f"per-step losses differ by up to {difference:.2e}"
    # Stricter, and true of a faithful drop-in: at 2 ranks in fp32 DDP's x/2 + y/2 and a
    # sum-then-halve are the same floats, so the runs agree bitwise. A difference means other
    # arithmetic, e.g. all-reducing every micro-step where DDP accumulates locally
    # (require_backward_grad_sync ignored: 2.4e-7 at step 9 of the nanoGPT run).
    assert difference == 0.0, f"per-step losses differ by up to {difference:.2e}"
