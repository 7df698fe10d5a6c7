"""The check every rank makes before the first forward: all ranks loaded the same weights
(a hash of the model's files) and split them the same way. A stage whose weights differ
would compute another model's hidden states, silently."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import DistributedError
from .protocol import Link

WORDS = 8  # int32 words of each digest exchanged


def files_digest(path: Path) -> bytes:
    """sha256 over the model's files (a GGUF file, or a folder's weights and config), in
    name order."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.suffix in (".safetensors", ".gguf", ".json", ".npz"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.digest()


def _words(digest: bytes) -> list[int]:
    return np.frombuffer(digest[: 4 * WORDS], dtype=np.int32).tolist()


def check_ranks(link: Link, model_path: Path, settings: dict) -> None:
    """Raise DistributedError on every rank unless all loaded the same files and agree on
    `settings` (the split, the dtype, ...). Rank 0's error names the ranks that differ."""
    weights = files_digest(model_path)
    agreed = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()
    mine = mx.array([_words(weights) + _words(agreed)], dtype=mx.int32)
    everyone = np.array(link.gather(mine, "the weights' hashes"))
    for rank, row in enumerate(everyone):
        if (row[:WORDS] != everyone[0, :WORDS]).any():
            raise DistributedError(
                f"rank {rank} loaded different weights from rank 0 (hash of the model's "
                f"files {bytes(row[:WORDS].astype(np.int32).tobytes()).hex()[:16]} vs "
                f"{weights.hex()[:16]}): every rank needs the same model file")
        if (row[WORDS:] != everyone[0, WORDS:]).any():
            raise DistributedError(
                f"rank {rank} was started with other settings than rank 0 "
                f"({json.dumps(settings, sort_keys=True)} on rank 0): start every rank with "
                "the same command")
