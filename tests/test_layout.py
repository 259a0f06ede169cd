"""The package's shape, checked: no import cycles, layers that depend one way, modules and
functions of a size a reader can hold, and README imports that exist. Source reading (the
README check imports the modules it names), no processes."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lockstep"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, known: set[str]) -> set[str]:
    """lockstep modules `path` imports anywhere: at module level, inside functions, and
    under `if TYPE_CHECKING:` (a cycle of types is a cycle of design too)."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from package import module` imports the module; `from module import name`,
            # the module itself.
            modules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            targets.update(modules or {node.module})
    return {t for t in targets if t in known}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Some import cycle among the package's modules, or None. A package importing its
    own submodules (its __init__ re-exporting them) is not a cycle of behaviour."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue  # a package's __init__ importing its submodules
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for name, path in _modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, too_long


# Each subpackage's place in the one direction dependencies run: communication <-
# replication <- sharding / low-communication <- elastic / advisor <- training <- launch
# and tools <- the public package <- the demo <- the command line (which dispatches to all of them).
# Siblings at one level stay apart; the leaf utilities (logs, lazy, eager, optim, seeding, cores)
# sit below everything, the test harness on top.
LEVELS = {"lockstep.logs": 0, "lockstep.lazy": 0, "lockstep.eager": 0, "lockstep.optim": 0,
          "lockstep.seeding": 0, "lockstep.cores": 0,
          "lockstep.comm": 1, "lockstep.replication": 2, "lockstep.sharding": 3,
          "lockstep.lowcomm": 3, "lockstep.elastic": 4,
          "lockstep.advisor": 4,  # predictions of every mode, which the Trainer can ask for
          "lockstep.training": 5,  # the one loop: survival (elastic) plugs into it
          "lockstep.launch": 6, "lockstep.integrations": 6,  # others' loops over ours
          "lockstep.tools": 6, "lockstep": 7, "lockstep.demo": 8, "lockstep.launch.cli": 9,
          "lockstep.launch.envreport": 9, "lockstep.testing": 10}


def _layer(module: str) -> str:
    return max((name for name in LEVELS if module == name or module.startswith(name + ".")),
               key=len)


def test_dependencies_run_one_way() -> None:
    wrong = []
    for module, imported in _graph().items():
        here = _layer(module)
        for target in imported:
            there = _layer(target)
            lower = LEVELS[there] < LEVELS[here]
            siblings = {here, there} <= {"lockstep.launch", "lockstep.tools"} or \
                {here, there} <= {"lockstep.launch.cli", "lockstep.launch.envreport"}
            if not (there == here or lower or siblings):
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert not wrong, wrong


def test_the_readmes_imports_exist() -> None:
    """Every `from lockstep... import name` in the README's Python blocks names a module
    and a name that exist: a layout change must carry the documentation with it."""
    import importlib
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    wrong = []
    for line in (line for block in blocks for line in block.splitlines()):
        found = re.match(r"from (lockstep[\w.]*) import ([\w, ]+)", line.strip())
        if not found:
            continue
        module = importlib.import_module(found.group(1))
        for name in (n.strip().split(" as ")[0] for n in found.group(2).split(",")):
            if not hasattr(module, name):
                wrong.append(line.strip())
    assert blocks and not wrong, wrong


def test_a_worker_start_loads_neither_the_compiler_nor_distributed_checkpoint() -> None:
    """torch._dynamo (2.3 s of CPU to import) and torch.distributed.checkpoint (1.4 s) load
    only when used: a compile, a checkpoint of a plain module. Before, every process that
    imported lockstep's wrappers paid both -- 3.4 s of a worker's start against 0.3 s now,
    on top of torch's own 2.2 s; the suite starts a few hundred workers."""
    import subprocess
    import sys

    probe = ("import sys, lockstep, lockstep.replication.replica, lockstep.sharding.gather, "
             "lockstep.training.checkpoint, lockstep.launch.run, lockstep.testing; "
             "lockstep.Trainer, lockstep.Elastic, lockstep.shard; "
             "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.checkpoint') "
             "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]", loaded
