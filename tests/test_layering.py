"""Light imports: the router, the text package and the launchers' option schema load no
torch. Each module is imported in a fresh interpreter, so
nothing this test process already loaded can hide a heavy import.

The layer contracts themselves (who may import whom) are import-linter's, in pyproject.toml,
checked by ``make lint``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIGHT = [
    "services.router.server",
    "services.router.openai_api",
    "services.router.main",
    "services.tokenization.tokenizer",
    "services.tokenization.detokenizer",
    "deploy.options",
    "deploy.cli",
    "deploy.ray_launcher.config",
]


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


@pytest.mark.parametrize("module", LIGHT)
def test_importing_it_loads_no_torch(module):
    assert "torch" not in _loaded_after_import(module)


def test_the_engine_package_exports_lazily():
    loaded = _loaded_after_import("services.engine")
    assert "torch" not in loaded and "services.engine.engine" not in loaded
