"""The value rules of deploy/options.py: one field's (``Rule``s, types, choices) and the
engine options' rules between fields. Every refusal names the option first; no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Rule = Callable[[Any], str]  # "" when the value is fine, else what is wrong with it
NO_DRAFTER = ("", "none")


def at_least(low: int) -> Rule:
    return lambda value: "" if value >= low else f"must be >= {low}, got {value}"


def positive(value: float) -> str:
    return "" if value > 0 else f"must be > 0, got {value}"


def fraction_or_zero(value: float) -> str:
    """A fraction in (0, 1], or 0 for "the default"."""
    return "" if 0 <= value <= 1 else f"must be in (0, 1], or 0 for the default, got {value}"


def rule_problem(value: Any, metadata) -> str:
    choices = metadata["choices"]
    if choices and value not in choices:
        return f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}"
    return metadata["rule"](value) if metadata["rule"] else ""


def type_problem(value: Any, default: Any) -> str:
    """What is wrong with ``value``'s type for a field defaulting to ``default`` ("" if nothing);
    an int may stand for a float, a bool never for a number."""
    want = type(default)
    ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
    if want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return "" if ok else f"must be {names[want]}, got {value!r}"


def is_cuda(device: str) -> bool:
    """Whether a torch device string names a CUDA device (``cuda``, ``cuda:1``)."""
    return device == "cuda" or device.startswith("cuda:")
