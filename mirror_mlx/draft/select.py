"""Which backend runs a draft: the one place that decides.

Core ML (the Neural Engine) when this machine can run it (platform.coreml_status) and a package
is given (a draft spec ending in .mlpackage) or found beside the draft: `draft.mlpackage`
inside a draft folder, or `X.mlpackage` next to a draft folder or file `X`. The MLX drafter
otherwise, over the same draft: a package given where Core ML cannot run, or that Core ML
fails to load, is replaced by the draft it was exported from (its metadata names it), with a
warning that says why.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..errors import ModelLoadError
from ..models.load import LoadedModel
from ..platform import coreml_can_run, coreml_status
from .base import Drafter
from .coreml_draft import CoreMLUnavailable, open_package, read_package_spec
from .coreml_package import source_sha256
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


def make_drafter(spec: str | None, target: LoadedModel) -> Drafter:
    """A drafter for `spec` (see draft/load.py, or a .mlpackage) serving `target`."""
    if spec and spec.rstrip("/").endswith(PACKAGE_SUFFIX):
        package = Path(spec).expanduser()
        if not package.is_dir():
            raise ModelLoadError(f"{spec}: no such Core ML package")
        source = read_package_spec(package).source
        if coreml_can_run():
            return _open_or_mlx(package, target, source)
        if not source:
            raise ModelLoadError(f"{spec}: Core ML cannot run here ({coreml_status()[1]}) and "
                                 "the package does not name the draft it was exported from")
        warnings.warn(f"Core ML cannot run here ({coreml_status()[1]}): running {source}, the "
                      f"draft {package.name} was exported from, with MLX", stacklevel=2)
        return MLXDrafter(load_draft(source, target))
    found = beside(spec, target) if coreml_can_run() else None
    if found is not None:
        draft, package = found
        if read_package_spec(package).source_sha256 == source_sha256(draft):
            return _open_or_mlx(package, target, str(draft))
        warnings.warn(f"{package} was exported from other files than the draft beside it; "
                      "running the draft with MLX (re-export it with mirror-mlx export-draft)",
                      stacklevel=2)
    return MLXDrafter(load_draft(spec, target))


def _open_or_mlx(package: Path, target: LoadedModel, source: str | None) -> Drafter:
    try:
        return open_package(package, target)
    except CoreMLUnavailable as e:
        if not source:
            raise ModelLoadError(f"{package}: {e}; the package does not name the draft it was "
                                 "exported from, so there is nothing to run with MLX") from e
        warnings.warn(f"{package}: {e}; running its draft ({source}) with MLX", stacklevel=3)
        return MLXDrafter(load_draft(source, target))
