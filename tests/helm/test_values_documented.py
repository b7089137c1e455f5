"""docs/deploy.md's values table names every value of helm/tandem/values.yaml."""

from __future__ import annotations

import os
import re

import yaml

from tests.helm.chart import CHART, ROOT

WORKER_ROLES = ("prefill", "decode", "aggregated")
COMPONENTS = ("router", *WORKER_ROLES)
PLACEHOLDERS = {"<role>": COMPONENTS, "<worker>": WORKER_ROLES}
# Maps whose keys are the user's (labels, resources, a volume source...): documented as one value.
FREE_FORM = {
    "env",
    "resources",
    "nodeSelector",
    "affinity",
    "podAnnotations",
    "labels",
    "annotations",
    "volume",
    "selector",
}


def leaves(values: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in FREE_FORM:
            found += leaves(value, f"{name}.")
        else:
            found.append(name)
    return found


def documented() -> set[str]:
    """Every value a row of the values table names: `a.b.c`, `.d` (a sibling of the name before
    it), `<role>.x` (x of every component), `<worker>.x` (of every worker role)."""
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        text = f.read()
    table = text[text.index("| value |", text.index("### Values")) :]
    table = table[: table.index("\n\n")]
    names: set[str] = set()
    for row in table.splitlines()[2:]:
        previous = ""
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if name.startswith(".") and previous:
                name = previous.rsplit(".", 1)[0] + name
            previous = name
            placeholder = name.split(".", 1)[0]
            roles = PLACEHOLDERS.get(placeholder, (placeholder,))
            names |= {name.replace(placeholder, r, 1) for r in roles}
    return names


def test_every_value_is_in_the_values_table():
    with open(os.path.join(CHART, "values.yaml")) as f:
        values = yaml.safe_load(f)
    assert sorted(set(leaves(values)) - documented()) == []
