"""Files and flags of ``python -m train``'s configuration: TOML / JSON, types, FSDP and
DeepSpeed names, one command-line flag per field, and the errors that name a key.

Generic over the sections of ``train/sections.py``: a new field gets its type check, its
flag (``--field-name`` and ``--section.field``), its ``--help`` text (the string under the
field) and its place in ``OUT/config.toml`` from here without any code. :class:`ConfigError`
names ``section.field (--flag)``, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import tomllib
import types
import typing
from pathlib import Path

import tomli_w

from train.sections import SECTIONS

__all__ = [
    "ConfigError",
    "add_arguments",
    "at_least",
    "check_type",
    "choice",
    "dumps_toml",
    "field_docs",
    "field_type",
    "flag_of",
    "flat_names",
    "key_of",
    "load_file",
    "translate_aliases",
]

FSDP_STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
"""``torch.distributed.fsdp.ShardingStrategy`` enum values (Accelerate writes these numbers)."""


class ConfigError(ValueError):
    """A bad configuration value. ``key`` is ``section.field`` (or the file path)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------


def load_file(path: str | Path) -> dict:
    """The nested dict of a ``.toml`` (or ``.json``) config file.

    Raises:
      ConfigError: the file is missing, unreadable, or not valid TOML/JSON (with the
        parser's line and column).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(p)!r}", "no such file; give a .toml file (presets: train/configs/*.toml)")
    try:
        text = p.read_bytes()
        if p.suffix == ".json":
            raw = json.loads(text)
        else:
            raw = tomllib.loads(text.decode())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--config {str(p)!r}", f"cannot be read as {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(p)!r}", "must hold a table of sections")
    return raw


def dumps_toml(cfg, header: str = "") -> str:
    """``cfg`` (a :class:`train.config.Config`) as TOML (``tomli_w``), one table per section; ``header`` lines become comments."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + tomli_w.dumps(cfg.to_dict())


def translate_aliases(raw: dict, source: str) -> dict:
    """FSDP / DeepSpeed names -> ours, refusing a field given twice."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    mesh = raw.setdefault("mesh", {})
    if not isinstance(mesh, dict):
        return raw
    if "sharding_strategy" in mesh:
        value = mesh.pop("sharding_strategy")
        if "strategy" in mesh:
            raise ConfigError("mesh.sharding_strategy", f"and mesh.strategy are both set in {source}; keep one")
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in FSDP_STRATEGY_NUMBERS:
                raise ConfigError("mesh.sharding_strategy", f"invalid choice: {value} (FSDP numbers: "
                                  + ", ".join(f"{k} {v}" for k, v in FSDP_STRATEGY_NUMBERS.items()) + ")")
            value = FSDP_STRATEGY_NUMBERS[value]
        if not isinstance(value, str):
            raise ConfigError("mesh.sharding_strategy", f"expected a name such as 'FULL_SHARD', got {value!r}")
        mesh["strategy"] = value
    if "zero_optimization" in raw:
        zo = raw.pop("zero_optimization")
        if not isinstance(zo, dict):
            raise ConfigError("zero_optimization", f"must be a table with 'stage', got {zo!r}")
        for key in zo:
            if key != "stage":
                raise ConfigError(f"zero_optimization.{key}", f"is not supported in {source}; zero_optimization allows: stage")
        if "stage" in zo:
            if "zero_stage" in mesh:
                raise ConfigError("zero_optimization.stage", f"and mesh.zero_stage are both set in {source}; keep one")
            mesh["zero_stage"] = zo["stage"]
    if not mesh:
        raw.pop("mesh")
    return raw


# ----------------------------------------------------------------------------------------
# Types, docs and flags
# ----------------------------------------------------------------------------------------


@functools.cache
def field_type(cls: type, name: str) -> tuple[type, bool]:
    """``(base type, optional)`` of field ``name``: ``int | None`` -> ``(int, True)``."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        base = [a for a in args if a is not type(None)]
        return base[0], True
    return hint, False


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def check_type(key: str, value, kind: tuple[type, bool]):
    base, optional = kind
    if value is None and optional:
        return None
    ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(key_of(key), f"expected {_TYPE_WORDS[base]}{' (or unset)' if optional else ''}, "
                          f"got {value!r} ({type(value).__name__})")
    return value


def _flag_of(cls: type, f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


@functools.cache
def flat_names() -> dict[str, tuple[str, str]]:
    """``{dest: (section, field)}``: each field under its flag's name (``--batch-size`` ->
    ``batch_size``, ``--model`` -> ``model`` for ``model.preset``): the ``dest`` of each flag
    of :func:`add_arguments`."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[_flag_of(cls, f).lstrip("-").replace("-", "_")] = (section, f.name)
    return out


def flag_of(key: str) -> str:
    """The command-line flag of ``section.field`` (``training.seed`` -> ``--seed``)."""
    section, name = key.split(".")
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    return _flag_of(SECTIONS[section], f)


def key_of(key: str) -> str:
    """``section.field (--flag)``: how an error names a field."""
    section, name = key.split(".")
    cls = SECTIONS[section]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f"{key} ({f.metadata.get('flag', '--' + name.replace('_', '-'))})"


def choice(key: str, value, allowed: list) -> None:
    """:class:`ConfigError` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(key_of(key), f"invalid choice: {value!r} (choose from {', '.join(map(str, allowed))})")


def at_least(key: str, value, low, strict: bool = False, fix: str = "") -> None:
    """:class:`ConfigError` unless ``value`` is finite and ``>= low`` (``strict``: ``> low``);
    ``fix``, when given, ends the message (e.g. ``"leave it out for no limit"``)."""
    bad = value <= low if strict else value < low
    if bad or value != value or value == float("inf"):
        raise ConfigError(key_of(key), f"must be {'>' if strict else '>='} {low} and finite, got {value!r}" + (f"; {fix}" if fix else ""))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of dataclass ``cls`` (its documentation)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)
    return docs


def _parse_value(kind: tuple[type, bool]):
    base, optional = kind

    def parse(text: str):
        if optional and text.lower() in ("none", "null", ""):
            return None
        if base is str:
            return text
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_TYPE_WORDS[base]}, got {text!r}") from None

    parse.__name__ = base.__name__  # argparse names the type in its messages
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, in one argument group per section, with ``SUPPRESS`` defaults
    (only flags given on the command line appear in the namespace, under :func:`flat_names`).

    Flag names: ``--field-name`` (``--model``, ``--data``, ``--mesh`` for ``model.preset``,
    ``data.path``, ``mesh.shape``) and ``--section.field``; booleans also take ``--no-...``.
    Optional fields take ``none`` to unset them.
    """
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]", cls.__doc__.split(": ", 1)[-1].replace("``", ""))
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            names = [flag, f"--{section}.{f.name}"]
            kind = field_type(cls, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = docs.get(f.name, "") + ("" if default is None else f" (default: {default})")
            help_text = help_text.replace("%", "%%")
            dest = flag.lstrip("-").replace("-", "_")
            common = dict(dest=dest, default=argparse.SUPPRESS, help=help_text)
            if kind[0] is bool:
                parser_action = argparse.BooleanOptionalAction
                group.add_argument(*names, action=parser_action, **common)
            else:
                metavar = {int: "N", float: "X", str: "TEXT"}[kind[0]]
                group.add_argument(*names, type=_parse_value(kind), metavar=metavar, **common)
