"""Rendering helm/tandem with the real Helm engine (helm-python-sdk) and reading the result."""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache

import helm_python
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "helm", "tandem")
RELEASE = "demo"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-tandem"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@lru_cache(maxsize=1)
def chart() -> helm_python.Chart:
    helm_python.disable_logging()  # it logs the dashboard's symbolic link at INFO
    return helm_python.Chart.load(CHART)


def render_files(values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template demo helm/tandem -n llm` gives."""
    return chart().render(values=values or {}, name=RELEASE, namespace=NAMESPACE)


def render(values: dict | None = None) -> list[dict]:
    """Every manifest the chart renders (hook tests included), parsed. Shared between callers
    with equal values: read it, do not change it."""
    return _render(json.dumps(values or {}, sort_keys=True))


@lru_cache(maxsize=64)
def _render(values_json: str) -> list[dict]:
    manifests = []
    for path, text in sorted(render_files(json.loads(values_json)).items()):
        if path.endswith(".txt"):
            continue
        manifests += [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]
    return manifests


def one(manifests: list[dict], kind: str, name: str) -> dict:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def names(manifests: list[dict], kind: str) -> list[str]:
    return sorted(m["metadata"]["name"] for m in manifests if m["kind"] == kind)


def deployment(manifests: list[dict], component: str) -> dict:
    return one(manifests, "Deployment", f"{FULLNAME}-{component}")


def container(manifests: list[dict], component: str) -> dict:
    (main,) = deployment(manifests, component)["spec"]["template"]["spec"]["containers"]
    return main


def config(manifests: list[dict]) -> dict[str, str]:
    return one(manifests, "ConfigMap", f"{FULLNAME}-config")["data"]


def effective_args(manifests: list[dict], component: str) -> list[str]:
    """The container's args with $(VAR) expanded the way the kubelet does: from its env values
    and the ConfigMaps it loads. Variables from the downward API (POD_IP, POD_NAME) stay."""
    c = container(manifests, component)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(one(manifests, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return [_REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in c["args"]]


def flag(args: list[str], name: str) -> str | None:
    """The value after ``name`` in ``args`` (None when absent); a flag given twice fails."""
    positions = [i for i, a in enumerate(args) if a == name]
    assert len(positions) <= 1, f"{name} given {len(positions)} times: {args}"
    return args[positions[0] + 1] if positions else None


def render_refusal(values: dict) -> str:
    """The message of a template `fail` that ``values`` make the chart raise (fails if none)."""
    with pytest.raises(helm_python.HelmRenderError) as e:
        render(values)
    return str(e.value)


def schema_refusal(values: dict) -> str:
    """The message of values.schema.json's refusal of ``values`` (fails if none)."""
    with pytest.raises(helm_python.HelmValuesError) as e:
        render(values)
    return str(e.value)
