"""A config from a file and from the command line, as data: TOML or JSON, never code.

    from lockstep.training import configfile

    parser = argparse.ArgumentParser()
    configfile.add_arguments(parser)          # --config FILE, --set KEY=VALUE
    args = parser.parse_args()
    config = configfile.configure(lockstep.TrainConfig(lr=0.1), args.config, args.set)

    python train.py --config run.toml --set trainer.lr=0.05 --set trainer.epochs=3

A file holds TrainConfig's fields at its top level or under a `[trainer]` table, nested
configs as tables of their own (`[trainer.parallel]` with `mode = "diloco"`); a run's own
`config.json` (written into every run folder) is such a file, so a run can be repeated with
`--config runs/x/config.json`. On the command line a nested field is dotted: `--set
trainer.checkpoint.resume=never`; a mode is named and its fields set in one command, in
any order: `--set trainer.parallel=diloco --set trainer.parallel.sync_every=20`. Later
sources win: the code's defaults, then the file, then each `--set` in order (a mode before
the fields it decides). Every name and every
value's type is checked against the dataclass, so a typo is an error naming the field, not
a silently ignored setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, from PyPI
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ImportError:
        tomllib = None  # type: ignore[assignment]

C = TypeVar("C")
SECTION = "trainer"


class ConfigError(ValueError):
    """A config file or override that does not fit the config it is applied to."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TrainConfig fields from a TOML or JSON file (a run's "
                        "config.json works too)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override one field, e.g. --set trainer.lr=0.1 (repeatable; "
                        "values in TOML syntax: 3, 0.1, true, 'text', [\"a\", \"b\"], none)")


def configure(config: C, file: str | Path | None = None, overrides: list[str] | None = None
              ) -> C:
    """`config` with the file's values, then each override, applied (a new object)."""
    if file is not None:
        config = apply(config, load_file(file), str(file))
    parsed = [(text, *parse_override(text)) for text in overrides or []]
    # A mode decides which fields its config has: `--set trainer.parallel.sync_every=20
    # --set trainer.parallel=local_sgd` means local SGD with 20, whatever the order.
    parsed.sort(key=lambda item: not _names_a_mode(config, item[1], item[2]))
    for text, name, value in parsed:
        config = apply(config, {name: value}, f"--set {text}")
    return config


def _names_a_mode(config: Any, name: str, value: Any) -> bool:
    """Whether an override chooses a nested config's mode (`parallel.mode=diloco`, or
    `parallel=diloco` for short)."""
    if name.endswith(".mode"):
        return True
    hints = typing.get_type_hints(type(config))
    return isinstance(value, str) and name in hints and bool(_config_classes(hints[name]))


def load_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml) or JSON (anything else) file's fields, from `[trainer]` if it has one."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        if tomllib is None:
            raise ConfigError(f"{path}: reading TOML needs Python 3.11+ or `pip install tomli`")
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: {error}") from None
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a table of fields, found {type(values).__name__}")
    section = values.get(SECTION)
    return dict(section) if isinstance(section, dict) else values


def parse_override(text: str) -> tuple[str, Any]:
    """'trainer.lr=0.1' -> ('lr', 0.1). The value is read as TOML; what TOML cannot read
    (a bare word such as cosine) is taken as a string, and none/null as None."""
    name, sep, raw = text.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. trainer.lr=0.1")
    name = name.removeprefix(f"{SECTION}.")
    if raw.lower() in ("none", "null"):
        return name, None
    try:
        if tomllib is not None:
            return name, tomllib.loads(f"v = {raw}")["v"]
        return name, json.loads(raw)
    except ValueError:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        return name, raw


def as_record(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON that `configure` reads back: plain values as they are,
    lists of them as lists, a nested config as a table (with its `mode`, for the parallel
    one), other objects (a compressor) by repr. (dataclasses.asdict would deep-copy a
    compressor, thread and all.)"""
    plain = (int, float, str, bool, type(None))

    def record(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            mode = getattr(type(value), "mode", None)
            return {**({"mode": mode} if mode else {}), **as_record(value)}
        if isinstance(value, (tuple, list)) and all(isinstance(v, plain) for v in value):
            return list(value)
        return value if isinstance(value, plain) else repr(value)

    return {f.name: record(getattr(config, f.name)) for f in dataclasses.fields(config)}


def apply(config: C, values: dict[str, Any], source: str) -> C:
    """`config` with `values` replacing its fields; names and types checked. A nested
    config takes a table (`parallel = {mode = "diloco", sync_every = 20}`) or dotted names
    (`parallel.sync_every=20`)."""
    assert dataclasses.is_dataclass(config) and not isinstance(config, type)
    hints = typing.get_type_hints(type(config))
    names = {f.name for f in dataclasses.fields(config)}
    changes: dict[str, Any] = {}
    for name, value in _undotted(values).items():
        if name not in names:
            raise ConfigError(f"{source}: {type(config).__name__} has no field {name!r}")
        options = _config_classes(hints[name])
        if options and isinstance(value, str):  # `parallel=diloco`: a mode, by its name
            value = {"mode": value}
        if options and isinstance(value, dict):
            changes[name] = _nested(getattr(config, name), value, options, f"{source}: {name}")
        else:
            changes[name] = _coerce(value, hints[name], f"{source}: {name}")
    return dataclasses.replace(config, **changes)


def _undotted(values: dict[str, Any]) -> dict[str, Any]:
    """{"parallel.sync_every": 5} -> {"parallel": {"sync_every": 5}}, merging siblings."""
    tables: dict[str, Any] = {}
    for name, value in values.items():
        head, _, rest = name.partition(".")
        if rest:
            table = tables.setdefault(head, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{name}: {head} is set whole and by field at once")
            table[rest] = value
        else:
            tables[head] = value
    return tables


def _config_classes(hint: Any) -> list[type]:
    """The config dataclasses a field may hold (one, or the members of a union)."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union,
                                                                   types.UnionType) else (hint,)
    return [m for m in members if isinstance(m, type) and dataclasses.is_dataclass(m)]


def _nested(current: Any, values: dict[str, Any], options: list[type], where: str) -> Any:
    """A nested config: the current one with `values` applied, or -- when `values` names
    another `mode` -- that mode's config, from its defaults."""
    values = dict(values)
    mode = values.pop("mode", getattr(type(current), "mode", None))
    chosen = next((c for c in options if _same_mode(getattr(c, "mode", None), mode)), None)
    if chosen is None:
        modes = ", ".join(str(getattr(c, "mode", c.__name__)) for c in options)
        raise ConfigError(f"{where}: mode must be one of {modes}, not {mode!r}")
    _check_fields_of_mode(chosen, values, options, where)
    base = current if type(current) is chosen else chosen()
    return apply(base, values, where)


def _same_mode(known: Any, given: Any) -> bool:
    """'local_sgd' is also 'localsgd' and 'local-sgd'."""
    def plain(mode: Any) -> Any:
        return mode.replace("_", "").replace("-", "").lower() if isinstance(mode, str) else mode
    return bool(plain(known) == plain(given))


def _check_fields_of_mode(chosen: type, values: dict[str, Any], options: list[type],
                          where: str) -> None:
    """A field of another mode is an error that names the modes that have it."""
    names = {f.name for f in dataclasses.fields(chosen)}
    for name in (n.partition(".")[0] for n in values):
        others = [str(getattr(c, "mode", c.__name__)) for c in options
                  if c is not chosen and name in {f.name for f in dataclasses.fields(c)}]
        if name not in names and others:
            field = where.rpartition(": ")[2]
            listed = f" {others[0]}" if len(others) == 1 else \
                f"s {', '.join(others[:-1])} and {others[-1]}"
            raise ConfigError(
                f"{where}: {chosen.__name__} has no field {name!r}; mode{listed} "
                f"{'has' if len(others) == 1 else 'have'} it: choose "
                f"the mode too, e.g. --set trainer.{field}.mode={others[0]} (in any order)")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` as type `hint`, or a ConfigError saying what was expected."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {_name(hint)}, got {value!r}")
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], where) for v in items)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {_name(hint)}, got {value!r}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
