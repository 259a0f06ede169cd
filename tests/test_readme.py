"""Every command the README (and an example's docstring) shows works as written: each one is
read by the real parser of what it runs -- `lockstep`'s, torchrun's, the example script's own
-- each `--set` is applied to a real TrainConfig, each script, make target and pip extra
exists; the quick commands (`lockstep --version`, `lockstep env`, `lockstep demo -h`) run.
Output the README shows must fit the command that prints it. One process, a few seconds:
nothing is launched."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep.launch import cli
from lockstep.training import configfile

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RUNNERS = r"(?:\w+=\S+ )*(?:\.venv/bin/)?(?:lockstep|python|torchrun|make|pip|ray) "
NAMES = {"lockstep run", "lockstep cluster", "lockstep run --elastic"}
"""Spans in the prose that name a command without being one."""


def _lines(text: str) -> Iterator[str]:
    """Each command of a shell text, continuation lines joined, comments dropped."""
    for line in text.replace("\\\n", " ").splitlines():
        if words := shlex.split(line, comments=True):
            yield shlex.join(words)


def readme_commands() -> list[str]:
    """The README's shell blocks line by line, the commands quoted in its prose, and the
    commands in the examples' docstrings."""
    found = [line for block in re.findall(r"```sh\n(.*?)```", README, flags=re.S)
             for line in _lines(block)]
    prose = re.sub(r"```.*?```", "", README, flags=re.S).replace("\n", " ")
    found += [span for span in re.findall(r"`([^`]+)`", prose)
              if re.match(RUNNERS, span + " ") and span.strip() not in NAMES]
    for example in sorted((ROOT / "examples").glob("*.py")):
        doc = re.match(r'"""(.*?)"""', example.read_text(), flags=re.S)
        found += [command for line in (doc.group(1) if doc else "").splitlines()
                  if re.match(RUNNERS, line.strip()) for command in _lines(line)]
    return list(dict.fromkeys(found))


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def script_arguments(script: Path, args: list[str], monkeypatch: pytest.MonkeyPatch
                     ) -> argparse.Namespace:
    """`args` as the script's own parser reads them; the script stops there (nothing runs
    past its `parse_args`)."""
    source = script.read_text()
    assert "parse_args" in source or not args, f"{script.name} takes no arguments: {args}"
    if "parse_args" not in source:
        return argparse.Namespace()
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Parsed(parse(self, *a, **k))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [str(script), *args])
        with pytest.raises(_Parsed) as parsed:
            runpy.run_path(str(script), run_name="__main__")
    return parsed.value.namespace


def check_script(target: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A script of the repository must exist and take these arguments, each `--set` among
    them checked against TrainConfig; `train.py` and the like are the reader's own."""
    if "/" not in target:
        return
    script = ROOT / target
    assert script.is_file(), f"{target}: no such file"
    namespace = script_arguments(script, args, monkeypatch)
    configfile.configure(lockstep.TrainConfig(), None, getattr(namespace, "set", None))


def check_lockstep(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    """`lockstep ARGV` through the real command line; `run` stops before launching, and
    `cluster` before making hosts (its command is checked for each host), and `demo` is
    parsed, not run (tests/test_demo.py runs it: here it trained for 40 s)."""
    if argv[:1] == ["demo"]:
        from lockstep.demo import demo

        try:
            demo.parse(argv[1:])
        except SystemExit as exit:  # -h
            assert exit.code == 0, f"lockstep {shlex.join(argv)}: {capsys.readouterr().err}"
        return
    if argv[:1] == ["cluster"]:
        from lockstep.tools import cluster

        ran: list[list[list[str]]] = []

        class Hosts:
            def __init__(self, hosts: int, bandwidth: str | None, etcd: int = 0) -> None:
                self.hosts = hosts

            def __enter__(self) -> Hosts:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def stream(self, commands: list[list[str]]) -> list[int]:
                ran.append(commands)
                return [0] * self.hosts

        monkeypatch.setattr(cluster, "Cluster", Hosts)
        assert cluster.main(argv[1:]) == 0
        for host, command in enumerate(ran[0]):
            filled = [word.format(host=host, addr=f"10.0.0.{host + 1}", host0="10.0.0.1",
                                  etcd="etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")
                      for word in command]
            check_command(filled, monkeypatch, capsys)
        return
    launched = []

    def launch(spec: Any) -> int:
        launched.append(spec)
        if advice := os.environ.get("LOCKSTEP_ADVISE"):  # as a Trainer's rank 0 would
            Path(advice).write_text("{}")
        return 0

    monkeypatch.setattr(cli, "run", launch)
    monkeypatch.setattr(cli, "refused", lambda *_: False)  # (its train.py: check_script)
    monkeypatch.setattr("lockstep.launch.elastic.run_elastic",
                        lambda spec: launched.append(spec) or 0)
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # --version and -h end here, as they should
        code = exit.code
    assert code in (0, None), f"lockstep {shlex.join(argv)}: exit code {code}: " \
        f"{capsys.readouterr().err}"
    for spec in launched:
        check_script(spec.target, spec.args, monkeypatch)


def check_command(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                  capsys: pytest.CaptureFixture[str]) -> None:
    while argv and re.fullmatch(r"\w+=\S*", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    program, args = Path(argv[0]).name, argv[1:]
    if program == "lockstep":
        check_lockstep(args, monkeypatch, capsys)
    elif program == "python":
        check_script(args[0], args[1:], monkeypatch)
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        check_script(parsed.training_script, parsed.training_script_args, monkeypatch)
    elif program == "make":
        rules = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert all(target in rules for target in args), f"make {args}: targets {rules}"
    elif program == "pip":
        assert configfile.tomllib is not None  # Python 3.11, or tomli
        extras = configfile.tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]
        for local in (a for a in args if a.startswith(".")):
            named = re.fullmatch(r"\.(?:\[([\w,]+)\])?", local)
            assert named, local
            assert set((named.group(1) or "").split(",")) - {""} <= set(extras), local
    elif program == "ray":  # parsed by Ray's own command line (click), not run
        scripts = pytest.importorskip("ray.scripts.scripts", reason="Ray is the [ray] extra")
        scripts.cli.commands[args[0]].make_context(f"ray {args[0]}", args[1:])
    else:
        raise AssertionError(f"no check for {shlex.join(argv)}")


@pytest.mark.parametrize("command", readme_commands(), ids=str)
def test_each_command_the_readme_shows_runs_as_written(
        command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    check_command(shlex.split(command), monkeypatch, capsys)


def test_each_set_in_the_readmes_prose_applies_to_a_trainconfig() -> None:
    prose = re.sub(r"```.*?```", "", README, flags=re.S).replace("\n", " ")
    spans = [span for span in re.findall(r"`([^`]+)`", prose) if span.startswith("--set ")]
    assert spans
    for span in spans:  # the overrides quoted together are given together
        configfile.configure(lockstep.TrainConfig(), None, re.findall(r"--set (\S+)", span))


def test_the_quick_commands_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env"]) == 0
    assert f"lockstep: {lockstep.__version__}" in capsys.readouterr().out
    for argv in (["--version"], ["demo", "-h"]):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 0, argv


def test_the_elastic_examples_output_is_what_its_command_prints(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's elastic output (a worker killed, another joining later, the total step
    count) comes from the command as written: its default epochs, not a flag left out. With
    3 epochs the job ended in 6 s, before anyone could start the second command."""
    from lockstep.demo.data import mnist

    defaults = script_arguments(ROOT / "examples" / "elastic_mnist.py", [], monkeypatch)
    steps = defaults.epochs * (len(mnist()[0]) // defaults.global_batch)
    shown = README[README.index("lockstep run --elastic -n 3"):]
    total = int(re.search(r"test accuracy: [\d.]+ after (\d+) steps", shown).group(1))
    joined = int(re.search(r"joined, state sent .* continuing at step (\d+)", shown).group(1))
    assert steps == total and joined < total, (steps, total, joined)
