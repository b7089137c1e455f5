"""The tiny pair's corpus: the Python standard library source of the running interpreter.

Files are split by a stable hash of their path relative to ``Lib/``, so every interpreter
version holds out the same names. ``pydoc_data/topics.py`` (documentation prose) is always
held out, as is everything that is not ``*.py`` (e.g. ``LICENSE.txt``), which is never
trained on.

Byte-level tokens: a document is ``[BOS] + bytes + [EOS]``.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

from models.byte_tokenizer import BOS_ID, EOS_ID

HELD_OUT_EVERY = 20  # one file in 20 is held out
ALWAYS_HELD_OUT = ("pydoc_data/topics.py",)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return relative_path in ALWAYS_HELD_OUT or zlib.crc32(relative_path.encode()) % HELD_OUT_EVERY == 0


def python_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(path relative to root, path) of every ``*.py`` outside site-packages, sorted."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        out.append((rel, p))
    return out


def split_files(root: Path | None = None, max_files: int = 0) -> tuple[list[Path], list[Path]]:
    """(train, held_out) file lists; ``max_files`` > 0 keeps only the first that many of each."""
    train, held = [], []
    for rel, p in python_files(root):
        (held if is_held_out(rel) else train).append(p)
    if max_files > 0:
        train, held = train[:max_files], held[:max_files]
    return train, held


def encode_document(data: bytes) -> list[int]:
    return [BOS_ID, *data, EOS_ID]


def token_stream(files: list[Path]) -> torch.Tensor:
    """[num_tokens] int16: the documents of ``files`` concatenated."""
    chunks = []
    for p in files:
        data = p.read_bytes()
        chunks.append(torch.tensor([BOS_ID], dtype=torch.int16))
        if data:
            chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        chunks.append(torch.tensor([EOS_ID], dtype=torch.int16))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int16)


def held_out_prose(root: Path | None = None) -> bytes:
    """Documentation text held out from training: the license and the pydoc topics."""
    root = root or stdlib_root()
    parts = [
        (root / name).read_bytes()
        for name in ("LICENSE.txt", "pydoc_data/topics.py")
        if (root / name).is_file()
    ]
    return b"\n".join(parts)


def random_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] int64 windows at random offsets of ``stream``."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=generator)
    index = starts[:, None] + torch.arange(length)[None, :]
    return stream[index.to(stream.device)].long()
