"""Which backend runs a draft: the one place that decides.

Core ML (the Neural Engine) when this machine can run it (platform.coreml_status) and a package
is given (a draft spec ending in .mlpackage) or found beside the draft: `draft.mlpackage`
inside a draft folder, or `X.mlpackage` next to a draft folder or file `X`. The MLX drafter
otherwise, over the same draft: a package given where Core ML cannot run, or that Core ML
fails to load, is replaced by the draft it was exported from (its metadata names it), with a
warning that says why. A device named for the draft (`--draft-device cpu|gpu`) runs it with MLX
there, a package's source included: on a Mac, the CPU cores are a unit of their own beside the
GPU when the Neural Engine is not wanted.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import mlx.core as mx

from ..errors import InvalidParameter, ModelLoadError
from ..models.load import LoadedModel
from ..platform import DRAFT_DEVICES, coreml_can_run, coreml_status, mlx_backend
from .base import Drafter
from .coreml_draft import CoreMLUnavailable, open_package, read_package_spec
from .coreml_package import source_sha256
from .known import AUTO, auto_draft
from .load import SHIPPED_DRAFT, load_draft
from .mlx_draft import MLXDrafter

PACKAGE_SUFFIX = ".mlpackage"


def beside(spec: str | None, target: LoadedModel) -> tuple[Path, Path] | None:
    """(the draft's file or folder, a package exported next to it), if there is one."""
    spec = spec or "default"
    if spec == "default":
        if target.name != "default":
            return None
        spec = str(SHIPPED_DRAFT)
    if spec.startswith("self:"):
        return None
    draft = Path(spec).expanduser()
    for candidate in (draft / f"draft{PACKAGE_SUFFIX}", draft.with_suffix(PACKAGE_SUFFIX)):
        if draft.exists() and candidate.is_dir():
            return draft, candidate
    return None


def mlx_device(name: str | None) -> mx.Device | None:
    """The MLX device a draft is asked to run on: None for "auto" (the choice above)."""
    if name in (None, "auto"):
        return None
    if name not in DRAFT_DEVICES:
        raise InvalidParameter(f"the draft device is one of {', '.join(DRAFT_DEVICES)} "
                               f"(got '{name}')")
    device = mx.Device(mx.cpu if name == "cpu" else mx.gpu)
    if not mx.is_available(device):
        raise InvalidParameter(f"MLX has no {name} on this machine (auto or cpu here)")
    if name == "cpu" and mlx_backend() == "cuda":
        # MLX on CUDA keeps arrays in managed memory, which a discrete GPU and the CPU pass back
        # and forth page by page when both touch them; Apple silicon's memory is one.
        warnings.warn("a draft on the CPU beside a target on a CUDA GPU moves memory pages "
                      "between them at every step (target verification forwards ran 70x "
                      "slower in our measurement); --draft-device gpu is faster there",
                      stacklevel=2)
    return device


def make_drafter(spec: str | None, target: LoadedModel, device: str | None = None) -> Drafter:
    """A drafter for `spec` (see draft/load.py, or a .mlpackage; None: "auto") serving
    `target`; `device` ("cpu" or "gpu") runs it with MLX on that device."""
    on = mlx_device(device)
    if spec in (None, AUTO):
        # Resolved first: the shipped draft it may stand for can have a package beside it.
        spec = auto_draft(target)
    if spec and spec.rstrip("/").endswith(PACKAGE_SUFFIX):
        package = Path(spec).expanduser()
        if not package.is_dir():
            raise ModelLoadError(f"{spec}: no such Core ML package")
        source = read_package_spec(package).source
        if on is None and coreml_can_run():
            return _open_or_mlx(package, target, source)
        why = f"the draft device is {device}" if on is not None \
            else f"Core ML cannot run here ({coreml_status()[1]})"
        if not source:
            raise ModelLoadError(f"{spec}: {why} and the package does not name the draft it "
                                 "was exported from")
        if on is None:
            warnings.warn(f"{why}: running {source}, the draft {package.name} was exported "
                          "from, with MLX", stacklevel=2)
        return MLXDrafter(load_draft(source, target), device=on)
    found = beside(spec, target) if coreml_can_run() and on is None else None
    if found is not None:
        draft, package = found
        if read_package_spec(package).source_sha256 == source_sha256(draft):
            return _open_or_mlx(package, target, str(draft))
        warnings.warn(f"{package} was exported from other files than the draft beside it; "
                      "running the draft with MLX (re-export it with mirror-mlx export-draft)",
                      stacklevel=2)
    return MLXDrafter(load_draft(spec, target), device=on)


def _open_or_mlx(package: Path, target: LoadedModel, source: str | None) -> Drafter:
    try:
        return open_package(package, target)
    except CoreMLUnavailable as e:
        if not source:
            raise ModelLoadError(f"{package}: {e}; the package does not name the draft it was "
                                 "exported from, so there is nothing to run with MLX") from e
        warnings.warn(f"{package}: {e}; running its draft ({source}) with MLX", stacklevel=3)
        return MLXDrafter(load_draft(source, target))
