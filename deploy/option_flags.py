"""Options dataclasses as command-line flags: one flag per field of an options dataclass of
deploy/options.py (its metadata: help, rule, choices, flags), the namespace back into the
dataclass, and the flags that give a value again. Loads no torch."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from deploy.option_rules import Rule, at_least, positive

METAVARS = {int: "N", float: "F"}  # --max-model-len N, --gpu-memory-utilization F


def add_args(parser: argparse.ArgumentParser, kind: type, names: Iterable[str] | None = None) -> None:
    """One flag per field of the options dataclass ``kind`` (or of the fields ``names``)."""
    chosen = set(names) if names is not None else None
    for f in dataclasses.fields(kind):
        if chosen is None or f.name in chosen:
            parser.add_argument(*_flags(f), dest=f.name, help=f.metadata["help"], **_parsing(f))


def from_args(kind: type, args: argparse.Namespace):
    """The ``kind`` options (a dataclass above) parsed into ``args``."""
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind)})


def to_argv(options, names: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that give ``options`` (its fields ``names``, but not ``exclude``) again:
    only the values other than the defaults."""
    argv: list[str] = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if (names is not None and f.name not in names) or f.name in exclude or value == f.default:
            continue
        flag = _flags(f)[-1]
        argv += [flag] if isinstance(f.default, bool) else [flag, str(value)]
    return argv


def positive_float(text: str) -> float:
    """An argparse type: a float > 0."""
    return _parsed(float, positive)(text)


def non_negative_float(text: str) -> float:
    """An argparse type: a float >= 0."""
    return _parsed(float, at_least(0))(text)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _parsed(int, at_least(0))(text)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _parsed(int, at_least(1))(text)


# ---------------------------------------------------------------------- internals


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def _parsing(f: dataclasses.Field) -> dict:
    """add_argument's keywords for a field: a switch for a bool, else a checked type."""
    if isinstance(f.default, bool):
        return {"action": "store_false" if f.default else "store_true", "default": f.default}
    kind, rule, choices = type(f.default), f.metadata["rule"], f.metadata["choices"]
    parsing = {"type": _parsed(kind, rule) if rule else kind, "default": f.default}
    parsing["choices"] = choices or None
    if kind in METAVARS:
        parsing["metavar"] = METAVARS[kind]
    return parsing


def _parsed(kind: type, rule: Rule) -> Callable[[str], Any]:
    def parse(text: str):
        value = kind(text)
        problem = rule(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse
