"""Makes sure the tandem.v1 Python modules exist before tests import them.

They are generated, never committed: this runs the same protoc command as
``make proto`` for each .proto whose ``_pb2.py`` is missing or older.
"""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = REPO_ROOT / "proto" / "tandem" / "v1"


def protoc(proto_paths: list[Path], out_dir: Path) -> subprocess.CompletedProcess:
    """Runs grpc_tools.protoc on ``proto_paths`` (relative to the repo root) into ``out_dir``."""
    outputs = [f"--{kind}_out={out_dir}" for kind in ("python", "grpc_python", "pyi")]
    relative = [str(p.relative_to(REPO_ROOT)) for p in proto_paths]
    return subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", *outputs, *relative],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )


def _is_stale(proto: Path) -> bool:
    generated = proto.with_name(f"{proto.stem}_pb2.py")
    return not generated.exists() or generated.stat().st_mtime < proto.stat().st_mtime


_stale = [p for p in sorted(PROTO_DIR.glob("*.proto")) if _is_stale(p)]
if _stale:
    _result = protoc(_stale, REPO_ROOT)
    assert _result.returncode == 0, _result.stderr
