"""The chart's image values point at what deploy/docker/Dockerfile builds (no Docker here: the
Dockerfile is read, not built)."""

from __future__ import annotations

import json
import os
import re
import tomllib

from tests.helm.chart import ROOT, chart, config, container, render

DOCKER = os.path.join(ROOT, "deploy", "docker")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    with open(os.path.join(DOCKER, name)) as f:
        text = re.sub(r"\\\n", " ", f.read())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_entrypoint_is_the_tandem_cli():
    found = dict(instructions("Dockerfile"))
    assert json.loads(found["ENTRYPOINT"]) == ["tandem"]
    assert found["USER"] == "10001"


def test_chart_image_is_the_tag_the_documented_build_command_gives():
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        (tag,) = re.findall(r"docker build -f deploy/docker/Dockerfile -t (\S+) \.", f.read())
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert tag == f"tandem:{version}"
    assert chart().metadata["appVersion"] == version
    assert container(render(), "decode")["image"] == tag


def test_every_copied_folder_exists_and_is_in_the_build_context():
    with open(os.path.join(DOCKER, "Dockerfile.dockerignore")) as f:
        allowed = {line[1:] for line in f.read().splitlines() if line.startswith("!")}
    copies = [args.split() for op, args in instructions("Dockerfile") if op == "COPY"]
    assert [src for src, _ in copies] == [
        "pyproject.toml",
        "kvcore",
        "services",
        "proto",
        "deploy",
        "bench",
        "models",
    ]
    for src, _ in copies:
        assert os.path.exists(os.path.join(ROOT, src)), src
        assert src in allowed, src


def test_bundled_models_are_where_the_chart_looks():
    workdir = dict(instructions("Dockerfile"))["WORKDIR"]
    data = config(render())
    assert data["TANDEM_MODEL"] == f"{workdir}/models/tiny-target"
    assert data["TANDEM_DRAFTER"] == f"{workdir}/models/tiny-drafter"
    for folder in ("tiny-target", "tiny-drafter"):
        assert os.path.exists(os.path.join(ROOT, "models", folder, "config.json"))
